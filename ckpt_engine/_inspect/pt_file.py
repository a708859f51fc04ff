"""``torch.save`` files (``.pt``, ``.pth``, ``.bin``) read without torch and without unpickling:
their keys, dtypes, shapes and plain values, their records checked, their tensors' bytes located.

A ``torch.save`` file is an uncompressed zip: ``<prefix>/data.pkl`` pickles the saved object and
``<prefix>/data/<key>`` holds each storage's raw bytes. The zip's central directory is read with
:mod:`zipfile` (records only, nothing extracted), ``data.pkl`` with the closed-vocabulary
interpreter :mod:`ckpt_engine._format.safe_pickle`: no code from the file runs and torch is not
imported. The saved object is flattened to keys as DCP flattens a state dict (``a.b.0.c``): mappings
by key, lists and tuples that hold a tensor by index; every other value is one key.

The same reader decodes the non-tensor values of DCP checkpoints (each one is a ``torch.save``
archive of the value) for ``ckpt-engine inspect``.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from .._format import safe_pickle
from .._format.hashing import hash_stream, new_hasher
from .._format.metadata_parser import PickleMalformed, PickleRefused
from .._format.safe_pickle import Opaque, TensorRef
from .._storage.fscheck import open_regular, require_regular_file
from ..errors import CorruptCheckpointError, UnsafeCheckpointError, clip
from .keys import KeyInfo

__all__ = ["PtArchive", "PtFile", "decode_value", "flatten", "open_pt_file", "read_pt_file"]

#: Largest ``data.pkl`` read (a pickle of tens of bytes per tensor: millions of tensors).
MAX_PICKLE_BYTES = 1 << 30
#: Deepest key path a flattened object may have (``safe_pickle.MAX_DEPTH`` bounds the value too).
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")


@dataclass(frozen=True, slots=True)
class Record:
    """One stored (uncompressed) zip record: where its bytes lie in the archive, and its CRC-32."""

    name: str
    offset: int
    size: int
    crc: int


@dataclass
class PtArchive:
    """The records of a ``torch.save`` archive and its decoded ``data.pkl``."""

    path: str
    size: int
    prefix: str
    records: dict[str, Record]
    root: Any
    byteorder: str = "little"

    def storage_record(self, key: str) -> Record | None:
        return self.records.get(f"{self.prefix}/data/{key}")


def _bad(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"{path}: {what}; it is not a valid torch.save file (truncated or damaged?)")


def open_pt_file(path: str) -> PtArchive:
    """The archive of the local ``torch.save`` file ``path``, its ``data.pkl`` decoded safely."""
    require_regular_file(path, "a torch.save file")
    with open_regular(path, "a torch.save file") as f:
        size = os.fstat(f.fileno()).st_size
        return _archive(path, f, size)


def _archive(path: str, f: IO[bytes], size: int) -> PtArchive:
    archive, pkl = _records(path, f, size)
    archive.root = _decode(path, pkl)
    return archive


def _records(path: str, f: IO[bytes], size: int) -> tuple[PtArchive, bytes]:
    """The archive's records (its ``root`` not decoded yet) and the bytes of its ``data.pkl``."""
    head = f.read(4)
    f.seek(0)
    try:
        with zipfile.ZipFile(f) as zf:
            records = {i.filename: _record(path, f, i, size) for i in zf.infolist()}
    except CorruptCheckpointError:
        raise
    except _ZIP_ERRORS as err:  # what zipfile raises for damage, as it finds it
        if head[:1] == b"\x80":
            raise CorruptCheckpointError(
                f"{path} is a torch.save file in the legacy format (before torch 1.6), which only torch.load "
                "reads; load it and save it again with a current torch"
            ) from None
        raise _bad(path, f"no readable zip archive ({type(err).__name__}: {clip(str(err))})") from None
    pickles = [name for name in records if name.endswith("/data.pkl") and name.count("/") == 1]
    if len(pickles) != 1:
        raise _bad(path, f"{len(pickles)} data.pkl records (torch.save writes one)")
    prefix = pickles[0].split("/", 1)[0]
    pkl = records[pickles[0]]
    if pkl.size > MAX_PICKLE_BYTES:
        raise _bad(path, f"a data.pkl of {pkl.size} bytes")
    order = records.get(f"{prefix}/byteorder")
    byteorder = _pread(f, order.offset, order.size).decode("ascii", "replace") if order and order.size < 16 else ""
    return PtArchive(path, size, prefix, records, None, byteorder or "little"), _pread(f, pkl.offset, pkl.size)


#: What :mod:`zipfile` raises on a damaged archive (a bad magic number, a version it does not know,
#: an offset past the file or too large to seek to).
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    ValueError,
    OSError,
    EOFError,
    NotImplementedError,
    OverflowError,
    struct.error,
)


def _record(path: str, f: IO[bytes], info: zipfile.ZipInfo, size: int) -> Record:
    """Where the record's bytes start: after its local header, which must agree with the directory."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1:
        raise _bad(path, f"record {clip(info.filename)} is compressed or encrypted (torch.save stores records)")
    if not 0 <= info.header_offset < size:
        raise _bad(path, f"record {clip(info.filename)} starts at byte {info.header_offset} of {size}")
    f.seek(info.header_offset)
    raw = f.read(_LOCAL_HEADER.size)
    if len(raw) < _LOCAL_HEADER.size or raw[:4] != b"PK\x03\x04":
        raise _bad(path, f"record {clip(info.filename)} has no local header at byte {info.header_offset}")
    fields = _LOCAL_HEADER.unpack(raw)
    offset = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if offset + info.file_size > size:
        raise _bad(path, f"record {clip(info.filename)} ends at byte {offset + info.file_size} of {size}")
    return Record(info.filename, offset, info.file_size, info.CRC)


def _pread(f: IO[bytes], offset: int, n: int) -> bytes:
    f.seek(offset)
    return f.read(n)


def _decode(path: str, data: bytes) -> Any:
    try:
        return safe_pickle.load(data)
    except PickleRefused as err:
        raise UnsafeCheckpointError(f"{path}: its data.pkl {err}; nothing was executed") from None
    except PickleMalformed as err:
        raise _bad(path, f"its data.pkl is not a well-formed pickle ({err})") from None


# -- keys ---------------------------------------------------------------------------------------


def flatten(obj: Any, is_tensor: Callable[[Any], bool], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(key, leaf)`` of ``obj`` flattened as DCP flattens a state dict: mappings by key, lists and
    tuples holding a tensor by index, anything else a leaf. ``obj`` is a tree (no cycles)."""
    if isinstance(obj, Mapping) and obj:
        items: Iterator[tuple[Any, Any]] = iter(obj.items())
    elif isinstance(obj, (list, tuple)) and any(is_tensor(v) or _holds_tensor(v, is_tensor) for v in obj):
        items = enumerate(obj)
    else:
        yield prefix, obj
        return
    for k, v in items:
        yield from flatten(v, is_tensor, f"{prefix}.{k}" if prefix else str(k))


def _holds_tensor(obj: Any, is_tensor: Callable[[Any], bool]) -> bool:
    if isinstance(obj, Mapping):
        return any(is_tensor(v) or _holds_tensor(v, is_tensor) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(is_tensor(v) or _holds_tensor(v, is_tensor) for v in obj)
    return False


def _is_ref(value: Any) -> bool:
    return type(value) is TensorRef


@dataclass
class PtFile:
    """A ``torch.save`` file as a component: its keys, tensors and plain values."""

    archive: PtArchive
    keys: dict[str, KeyInfo] = field(default_factory=dict)
    tensors: dict[str, TensorRef] = field(default_factory=dict)
    #: Non-tensor leaves: plain values, or :class:`~ckpt_engine._format.safe_pickle.Opaque` objects.
    values: dict[str, Any] = field(default_factory=dict)


def read_pt_file(path: str) -> PtFile:
    """The keys of the ``torch.save`` file ``path`` (no tensor data is read)."""
    archive = open_pt_file(path)
    out = PtFile(archive)
    for key, leaf in flatten(archive.root, _is_ref):
        if key in out.keys:
            raise CorruptCheckpointError(f"{path}: two values flatten to the key {clip(key)}")
        if type(leaf) is TensorRef:
            record = archive.storage_record(leaf.storage.key)
            out.tensors[key] = leaf
            out.keys[key] = KeyInfo(
                key=key,
                is_tensor=True,
                dtype_name=leaf.dtype.name,
                itemsize=leaf.dtype.itemsize,
                shape=leaf.shape,
                stored_bytes=leaf.nbytes if record is None else min(leaf.nbytes, record.size),
            )
        else:
            out.values[key] = leaf
            out.keys[key] = KeyInfo(key=key, is_tensor=False)
    return out


def tensor_problems(pt: PtFile) -> list[str]:
    """Each tensor's storage record exists, holds the storage and the bytes the tensor reaches."""
    problems: list[str] = []
    for key, ref in pt.tensors.items():
        record = pt.archive.storage_record(ref.storage.key)
        where = f"{pt.archive.path}: tensor {clip(key)}"
        if record is None:
            problems.append(f"{where}: its storage record data/{clip(ref.storage.key)} is missing")
        elif record.size < ref.storage.nbytes:
            problems.append(
                f"{where}: data/{clip(ref.storage.key)} has {record.size} bytes, its storage needs {ref.storage.nbytes}"
            )
        elif ref.extent_bytes() > ref.storage.nbytes:
            problems.append(f"{where} reaches byte {ref.extent_bytes()} of a storage of {ref.storage.nbytes}")
    return problems


def crc_problems(archive: PtArchive, progress: Callable[[int], None] | None = None) -> list[str]:
    """Every record's CRC-32 against the zip's central directory (reads every byte)."""
    problems = []
    with open_regular(archive.path, "a torch.save file") as f:
        for record in archive.records.values():
            f.seek(record.offset)
            crc = new_hasher("crc32")
            assert crc is not None
            read = hash_stream(f, crc, limit=record.size, progress=progress)
            if read < record.size or crc.hexdigest() != f"{record.crc:08x}":
                problems.append(
                    f"{archive.path}: record {clip(record.name)} fails its CRC-32 check: the file is corrupt"
                )
    return problems


# -- one value of a DCP checkpoint -----------------------------------------------------------------


def decode_value(data: bytes) -> tuple[bool, Any]:
    """``(True, value)`` for the ``torch.save`` archive ``data`` of a plain value (numbers, strings,
    containers of them); ``(False, reason)`` when it needs torch to read (a tensor, an object of
    another class) or is not an archive this reader takes, for ``torch.load`` to judge. A value nested
    or shared beyond what its size can describe raises :class:`UnsafeCheckpointError`: that one is
    never handed on."""
    try:
        _, pkl = _records("a stored value", io.BytesIO(data), len(data))
        root = safe_pickle.load(pkl)
    except safe_pickle.PickleTooLarge as err:
        raise UnsafeCheckpointError(f"a stored value {err}; nothing was executed") from None
    except (CorruptCheckpointError, PickleRefused, PickleMalformed) as err:
        return False, str(err)
    needs = _needs_torch(root, 0)
    return (False, needs) if needs else (True, root)


def _needs_torch(value: Any, depth: int) -> str | None:
    if type(value) in (TensorRef, Opaque):
        return repr(value)
    if depth > safe_pickle.MAX_DEPTH:
        return "nested"
    if isinstance(value, Mapping):
        return next((r for v in value.values() if (r := _needs_torch(v, depth + 1))), None)
    if isinstance(value, (list, tuple, set, frozenset)):
        return next((r for v in value if (r := _needs_torch(v, depth + 1))), None)
    return None
