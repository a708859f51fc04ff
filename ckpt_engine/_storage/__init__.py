"""Where checkpoints live: the local filesystem and fsspec object stores, behind one ``Store``.

Internal; configure storage with :class:`ckpt_engine.config.StorageOptions`.
"""
