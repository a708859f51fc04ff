"""The on-disk format: names, the ``latest`` pointer, completeness, commit, lock, retention, the
manifest and the safe ``.metadata`` reader.

Internal: the public entry points are :func:`ckpt_engine.integrity.verify_checkpoint` and the
engine itself.
"""
