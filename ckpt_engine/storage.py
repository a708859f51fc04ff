"""The DCP storage classes the engine itself uses, for write providers that run DCP themselves.

A background ``write`` provider (such as ``pinned_staging``) should write with
:class:`EngineFileSystemWriter` so an async save produces the same files, as fast, as the
engine's synchronous one. Both classes read and write DCP's own on-disk format: every checkpoint
stays loadable by plain ``torch.distributed.checkpoint.load``.
"""

from ._dcpio.fast_read import FastFileSystemReader as EngineFileSystemReader
from ._dcpio.fast_write import FastFileSystemWriter as EngineFileSystemWriter

__all__ = ["EngineFileSystemReader", "EngineFileSystemWriter"]
