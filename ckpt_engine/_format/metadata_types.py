"""The classes the safe ``.metadata`` reader builds: DCP's own, or stand-ins for readers that only
look at fields (``ckpt-engine ls``) and so need not import ``torch.distributed.checkpoint``.

DCP's ``Metadata`` and its records live in ``torch.distributed.checkpoint``, whose import costs
about a second (its package imports the planners, DTensor and more). The parser takes its
classes from a :class:`RecordTypes`: :func:`dcp_types` (the default; imported on first use) or
:func:`plain_types`, dataclasses with the same names, fields and equality, defined here. Code that
hands metadata to DCP always gets DCP's classes; :func:`records_without_dcp` is for callers that
read fields and never pass the result to DCP.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

__all__ = ["RecordTypes", "current_types", "dcp_types", "plain_types", "records_without_dcp"]


class RecordTypes(NamedTuple):
    """The eight classes a DCP ``.metadata`` is made of."""

    Metadata: Any
    TensorStorageMetadata: Any
    BytesStorageMetadata: Any
    ChunkStorageMetadata: Any
    TensorProperties: Any
    MetadataIndex: Any
    StorageMeta: Any
    StorageInfo: Any


_DCP: list[RecordTypes] = []


def dcp_types() -> RecordTypes:
    """DCP's classes (imports ``torch.distributed.checkpoint`` the first time)."""
    if not _DCP:
        from torch.distributed.checkpoint import metadata as m

        from .._dcpio.torch_private import storage_info

        _DCP.append(
            RecordTypes(
                m.Metadata,
                m.TensorStorageMetadata,
                m.BytesStorageMetadata,
                m.ChunkStorageMetadata,
                m.TensorProperties,
                m.MetadataIndex,
                m.StorageMeta,
                type(storage_info("", 0, 0)),
            )
        )
    return _DCP[0]


# The stand-ins: DCP's field names, order, defaults and equality (MetadataIndex hashes as DCP's does).


@dataclass
class Metadata:
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: str | None = None


@dataclass
class TensorProperties:
    dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    layout: torch.layout = torch.strided
    requires_grad: bool = False
    memory_format: torch.memory_format = torch.contiguous_format
    pin_memory: bool = False


@dataclass
class ChunkStorageMetadata:
    offsets: torch.Size
    sizes: torch.Size


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: torch.Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: torch.Size | None = None
    index: int | None = field(hash=False, compare=False, default=None)


@dataclass
class StorageMeta:
    checkpoint_id: str | os.PathLike[str] | None = None
    save_id: str | None = None
    load_id: str | None = None
    modules: list[str] = field(default_factory=list)


@dataclass
class StorageInfo:
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


_PLAIN = RecordTypes(
    Metadata,
    TensorStorageMetadata,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorProperties,
    MetadataIndex,
    StorageMeta,
    StorageInfo,
)

_WITHOUT_DCP: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpt_engine_records_without_dcp", default=False)


def plain_types() -> RecordTypes:
    """The stand-in classes (no DCP import)."""
    return _PLAIN


def current_types() -> RecordTypes:
    """The classes :func:`~ckpt_engine._format.metadata.read_metadata` builds in this context."""
    return _PLAIN if _WITHOUT_DCP.get() else dcp_types()


@contextlib.contextmanager
def records_without_dcp() -> Iterator[None]:
    """Within the block, ``.metadata`` files are read into the stand-in classes (same fields), so
    reading one does not import ``torch.distributed.checkpoint``. Only for callers that read
    fields and never hand the metadata to DCP (listing a save folder)."""
    token = _WITHOUT_DCP.set(True)
    try:
        yield
    finally:
        _WITHOUT_DCP.reset(token)
