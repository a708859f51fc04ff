"""DCP input/output: the engine's planners, storage readers and writers, and the one seam to
private torch behaviour.

Internal; the public names are in :mod:`ckpt_engine.storage`.
"""
