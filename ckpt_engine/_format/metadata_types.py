"""The classes the safe ``.metadata`` reader builds: DCP's own, or stand-ins for readers that only
look at fields (``ckpt-engine ls``) and so need not import ``torch.distributed.checkpoint``.

DCP's ``Metadata`` and its records live in ``torch.distributed.checkpoint``, whose import costs
about a second (its package imports the planners, DTensor and more). The parser takes its
classes from a :class:`RecordTypes`: :func:`dcp_types` (the default; imported on first use) or
:func:`plain_types`, dataclasses with the same names, fields and equality, defined here. Code that
hands metadata to DCP always gets DCP's classes; :func:`records_without_dcp` is for callers that
read fields and never pass the result to DCP.

The torch values in a ``.metadata`` (dtypes, layouts, memory formats, ``torch.Size``) come from the
same choice, as a :class:`Vocabulary`: torch's own with DCP's classes, or stand-ins with torch's
names, item sizes and string forms with the plain classes, so that reading fields imports no
torch at all (``ckpt-engine ls``, ``inspect``, ``verify --level sizes``). The stand-ins' table of
dtypes is pinned against torch's by ``tests/format/test_metadata_vocabulary.py``; a name the
table lacks (a dtype of a newer torch) is looked up in torch itself, so no ``.metadata`` a torch
can write reads as damaged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "DTYPE_ITEMSIZES",
    "PlainDtype",
    "PlainLayout",
    "PlainMemoryFormat",
    "RecordTypes",
    "Size",
    "Vocabulary",
    "current_types",
    "dcp_types",
    "plain_dtype",
    "plain_types",
    "records_without_dcp",
    "types_of",
]


class Vocabulary(NamedTuple):
    """The torch values a ``.metadata`` holds, as one kind of reader builds them."""

    #: ``torch.Size`` or :class:`Size`: built by ``REDUCE``, and what a shape field must be.
    size_type: Any
    dtype_type: Any
    layout_type: Any
    #: ``torch.<name>`` globals that are values (dtypes and layouts) -> the value, or ``None``.
    value: Callable[[str], Any]
    #: DCP's ``_MEM_FORMAT_ENCODING`` (``TensorProperties.__getstate__``): code -> memory format.
    memory_formats: Mapping[int, Any]
    strided: Any
    contiguous_format: Any

    def layout(self, qualified: str) -> Any:
        """The layout ``torch.serialization._get_layout`` returns for ``"torch.<name>"``, or ``None``."""
        if not qualified.startswith("torch."):
            return None
        found = self.value(qualified[len("torch.") :])
        return found if isinstance(found, self.layout_type) else None


class RecordTypes(NamedTuple):
    """The eight classes a DCP ``.metadata`` is made of, and the torch values in it."""

    Metadata: Any
    TensorStorageMetadata: Any
    BytesStorageMetadata: Any
    ChunkStorageMetadata: Any
    TensorProperties: Any
    MetadataIndex: Any
    StorageMeta: Any
    StorageInfo: Any
    vocab: Vocabulary


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
                _torch_vocabulary(),
            )
        )
    return _DCP[0]


def _torch_vocabulary() -> Vocabulary:
    import torch

    kinds = (torch.dtype, torch.layout)
    values = {name: value for name in dir(torch) if isinstance(value := getattr(torch, name, None), kinds)}
    return Vocabulary(
        size_type=torch.Size,
        dtype_type=torch.dtype,
        layout_type=torch.layout,
        value=values.get,
        memory_formats={0: torch.contiguous_format, 1: torch.channels_last, 2: torch.preserve_format},
        strided=torch.strided,
        contiguous_format=torch.contiguous_format,
    )


# -- torch values without torch ------------------------------------------------------------------


class Size(tuple[int, ...]):
    """``torch.Size``'s stand-in: a tuple of ints, equal to and hashing as that tuple (``torch.Size``
    checks nothing more when it is built; ``validate_metadata`` checks the values)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"


class _Named:
    """A torch value known by its name: ``str()`` and ``repr()`` as torch's (``torch.<name>``).

    The classes below are named as torch's own (``type(x).__name__`` is ``dtype``, ``layout``,
    ``memory_format``), so that every message naming a value's type reads the same either way."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __str__(self) -> str:
        return f"torch.{self.name}"

    __repr__ = __str__

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.name == self.name

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.name))


class dtype(_Named):
    """A torch dtype by name, with torch's ``itemsize``, ``is_floating_point`` and ``is_complex``."""

    __slots__ = ("is_complex", "is_floating_point", "itemsize")

    def __init__(self, name: str, itemsize: int, is_floating_point: bool = False, is_complex: bool = False) -> None:
        super().__init__(name)
        self.itemsize, self.is_floating_point, self.is_complex = itemsize, is_floating_point, is_complex


class layout(_Named):
    """A torch layout by name (``torch.strided``)."""

    __slots__ = ()


class memory_format(_Named):
    """A torch memory format by name (``torch.contiguous_format``)."""

    __slots__ = ()


#: The stand-ins by readable names.
PlainDtype = dtype
PlainLayout = layout
PlainMemoryFormat = memory_format

#: Every dtype torch names, canonical name -> bytes per element (as ``torch.<name>.itemsize``).
DTYPE_ITEMSIZES: dict[str, int] = {
    "bool": 1,
    **{f"float{b}": b // 8 for b in (16, 32, 64)},
    "bfloat16": 2,
    **{f"float8_{k}": 1 for k in ("e4m3fn", "e4m3fnuz", "e5m2", "e5m2fnuz", "e8m0fnu")},
    "float4_e2m1fn_x2": 1,
    **{f"complex{b}": b // 8 for b in (32, 64, 128)},
    **{f"int{b}": b // 8 for b in (8, 16, 32, 64)},
    **{f"uint{b}": b // 8 for b in (8, 16, 32, 64)},
    **{f"int{b}": 1 for b in range(1, 8)},
    **{f"uint{b}": 1 for b in range(1, 8)},
    **{f"bits{k}": 1 for k in ("1x8", "2x4", "4x2", "8")},
    "bits16": 2,
    "qint8": 1,
    "qint32": 4,
    "quint8": 1,
    "quint4x2": 1,
    "quint2x4": 1,
}
#: torch's other names for those dtypes.
DTYPE_ALIASES = {
    "bit": "uint1",
    "half": "float16",
    "float": "float32",
    "double": "float64",
    "chalf": "complex32",
    "cfloat": "complex64",
    "cdouble": "complex128",
    "short": "int16",
    "int": "int32",
    "long": "int64",
}
_LAYOUT_NAMES = ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "_mkldnn", "jagged")


@functools.cache
def plain_dtype(name: str) -> PlainDtype | None:
    """The stand-in of ``torch.<name>`` (an alias gives the canonical dtype), or ``None`` for a
    name that is no dtype. A name the table lacks is asked of torch (a newer torch's dtype)."""
    canonical = DTYPE_ALIASES.get(name, name)
    size = DTYPE_ITEMSIZES.get(canonical)
    if size is not None:
        return dtype(canonical, size, canonical.startswith(("float", "bfloat")), canonical.startswith("complex"))
    found = _ask_torch(name)
    if found is None or type(found).__name__ != "dtype":
        return None
    return dtype(str(found).removeprefix("torch."), found.itemsize, found.is_floating_point, found.is_complex)


@functools.cache
def _plain_value(name: str) -> PlainDtype | PlainLayout | None:
    return layout(name) if name in _LAYOUT_NAMES else plain_dtype(name)


#: What a dtype torch might add is named like (``float6_e3m2fn``); only such names are asked of torch.
_DTYPE_LIKE = re.compile(r"(b?float|complex|q?u?int|bits)[0-9a-z_]{0,32}")


def _ask_torch(name: str) -> Any:
    """``torch.<name>``, for a dtype the table does not know: imports torch (only then)."""
    if not _DTYPE_LIKE.fullmatch(name):
        return None
    import torch

    return getattr(torch, name, None)


_PLAIN_VOCABULARY = Vocabulary(
    size_type=Size,
    dtype_type=dtype,
    layout_type=layout,
    value=_plain_value,
    memory_formats={
        0: memory_format("contiguous_format"),
        1: memory_format("channels_last"),
        2: memory_format("preserve_format"),
    },
    strided=layout("strided"),
    contiguous_format=memory_format("contiguous_format"),
)


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
    dtype: PlainDtype = field(default_factory=lambda: PlainDtype("float32", 4, True))
    layout: PlainLayout = field(default_factory=lambda: PlainLayout("strided"))
    requires_grad: bool = False
    memory_format: PlainMemoryFormat = field(default_factory=lambda: PlainMemoryFormat("contiguous_format"))
    pin_memory: bool = False


@dataclass
class ChunkStorageMetadata:
    offsets: Size
    sizes: Size


@dataclass
class TensorStorageMetadata:
    properties: TensorProperties
    size: Size
    chunks: list[ChunkStorageMetadata]


@dataclass
class BytesStorageMetadata:
    pass


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str
    offset: Size | None = None
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
    _PLAIN_VOCABULARY,
)

_WITHOUT_DCP: contextvars.ContextVar[bool] = contextvars.ContextVar("ckpt_engine_records_without_dcp", default=False)


def plain_types() -> RecordTypes:
    """The stand-in classes (no DCP import)."""
    return _PLAIN


def types_of(md: Any) -> RecordTypes:
    """The classes ``md`` (a ``Metadata``) is built of: the stand-ins or DCP's."""
    return _PLAIN if type(md) is _PLAIN.Metadata else dcp_types()


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
