"""``torch.save`` archives without a ``torch.save`` call: a tensor's around its bytes, a plain value's from a cache.

The fast writer (``fast_write``) emits every item of a ``.distcp`` file as the archive DCP's
writer would get from ``torch.save``, without calling it: :func:`tensor_archive` lays out the
archive of one dense tensor around its data (no serialisation copy, no CRC pass over the
data), and :func:`value_archive` gives ``torch.save``'s own archive of a value without tensors
(a learning rate, betas, a step count) from a cache keyed by its pickle (a few microseconds
against ``torch.save``'s 100; an AdamW state dict of 42 parameters has 463 such values,
per-parameter hyper-parameters that do not change between saves). This is a
file format, not an API: its reader is :mod:`.torch_save_archive`, the one private torch name
it needs comes from :mod:`.torch_private`, and ``tests/dcpio/test_torch_private.py`` pins both
archives against ``torch.save``/``torch.load``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import itertools
import math
import os
import pickle
import struct
import sys
import threading
import warnings
import zlib
from typing import Any

import torch

from .torch_private import rebuild_tensor_functions
from .torch_save_archive import (
    _CENTRAL,
    _CENTRAL_MAGIC,
    _EOCD,
    _EOCD64,
    _EOCD64_LOCATOR,
    _EOCD64_LOCATOR_MAGIC,
    _EOCD64_MAGIC,
    _EOCD_MAGIC,
    _LOCAL_HEADER,
    _LOCAL_MAGIC,
    _legacy_storage_dtypes,
)

__all__ = ["ARCHIVE_DTYPES", "ArchiveParts", "archive_settings", "tensor_archive", "tensor_data_pkl", "value_archive"]


# -- writing the same archive without torch.save ----------------------------------------------
#
# ``tensor_archive`` lays out a ``torch.save`` archive of one dense contiguous CPU tensor around
# its data, so a writer can emit ``head``, then the tensor's own bytes, then ``tail``: no
# serialisation copy and no CRC pass over the data. The result is what ``torch.save`` writes
# with ``torch.serialization.set_crc32_options(False)`` (a public torch option): the same record
# names and contents, records 64-byte aligned, the data record's CRC field 0 (torch.load does
# not check it; the small records carry real CRCs). ``tests/dcpio/test_torch_private.py`` checks the
# pickle byte for byte against torch.save and loads every archive with torch.load.

#: dtypes whose ``data.pkl`` this module reproduces (pinned against torch.save per dtype).
ARCHIVE_DTYPES: frozenset[torch.dtype] = frozenset(
    {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.complex64,
        torch.complex128,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
)
_ALIGN = 64
#: Records at least this large (or at this offset) get zip64 fields; a module constant so the
#: zip64 path can be tested with small archives.
_ZIP64_LIMIT = 0xFFFFFFFF
_PREFIX = "archive/"


@dataclasses.dataclass(frozen=True, slots=True)
class ArchiveParts:
    """``head + <the tensor's nbytes> + tail`` is a torch.save archive of the tensor."""

    head: bytes
    tail: bytes
    nbytes: int

    @property
    def length(self) -> int:
        return len(self.head) + self.nbytes + len(self.tail)


class _StorageRef:
    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _TensorRef:
    __slots__ = ("args", "fn")

    def __init__(self, fn: Any, args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, self.args


class _ArchivePickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if isinstance(obj, _StorageRef) else None


@functools.cache
def _legacy_storage_classes() -> dict[torch.dtype, type]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {dtype: getattr(torch, name) for name, dtype in _legacy_storage_dtypes().items()}


@functools.lru_cache(maxsize=4096)
def tensor_data_pkl(dtype: torch.dtype, size: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` torch.save writes for a contiguous, detached CPU tensor of this kind."""
    stride: list[int] = []
    acc = 1
    for n in reversed(size):
        stride.append(acc)
        acc *= max(n, 1)  # as torch computes contiguous strides
    numel = math.prod(size)
    legacy = _legacy_storage_classes().get(dtype)
    if legacy is not None:
        pid = ("storage", legacy, "0", "cpu", numel)
        args: tuple[Any, ...] = (_StorageRef(pid), 0, size, tuple(reversed(stride)), False, collections.OrderedDict())
        fn: Any = rebuild_tensor_functions()[0]
    else:
        pid = ("storage", torch.storage.UntypedStorage, "0", "cpu", numel * dtype.itemsize)
        args = (_StorageRef(pid), 0, size, tuple(reversed(stride)), False, collections.OrderedDict(), dtype)
        fn = rebuild_tensor_functions()[1]
    buf = io.BytesIO()
    _ArchivePickler(buf, protocol=2).dump(_TensorRef(fn, args))
    return buf.getvalue()


_serial = itertools.count(int.from_bytes(os.urandom(8), "little") % 10**19 * 10**20)


_SERIAL_RECORD = ".data/serialization_id"
_SERIAL_LEN = 40


@dataclasses.dataclass(frozen=True, slots=True)
class _Template:
    head: bytes
    tail: bytes
    nbytes: int
    #: where, in ``tail``, the serialization id and the two copies of its CRC are
    id_at: int
    crc_at: tuple[int, int]


_Zip = tuple[bytearray, int, int, tuple[int, int]]


def _zip_records(records: list[tuple[str, bytes | None]], nbytes: int, zip64_limit: int) -> _Zip:
    """The archive torch.save writes for ``records`` (one ``None``: a record of ``nbytes`` the
    caller writes), as one buffer without that record's bytes, the offset in it where they go,
    and where the serialization id and the two copies of its CRC are in the buffer. Records of
    ``zip64_limit`` bytes or more get zip64 fields."""
    out = bytearray()
    split = 0
    pos = 0
    central: list[bytes] = []
    id_at, crc_local_at, crc_central_at = -1, -1, -1
    for name, data in records:
        raw_name = (_PREFIX + name).encode()
        size_ = nbytes if data is None else len(data)
        crc = 0 if data is None else zlib.crc32(data)
        zip64 = size_ >= zip64_limit or pos >= zip64_limit
        local_extra = struct.pack("<HHQQ", 1, 16, size_, size_) if zip64 else b""
        unpadded = pos + _LOCAL_HEADER.size + len(raw_name) + len(local_extra) + 4
        local_extra += struct.pack("<HH", 0x4246, -unpadded % _ALIGN) + b"Z" * (-unpadded % _ALIGN)  # "FB" padding
        short = 0xFFFFFFFF if zip64 else size_
        version = 45 if zip64 else 20
        if name == _SERIAL_RECORD:
            crc_local_at = len(out) + 14  # the CRC field of a local header
        out += _LOCAL_HEADER.pack(
            _LOCAL_MAGIC, version, 0x800, 0, 0, 0, crc, short, short, len(raw_name), len(local_extra)
        )
        out += raw_name + local_extra
        if name == _SERIAL_RECORD:
            id_at = len(out)
            crc_central_at = sum(len(c) for c in central) + 16  # the CRC field of a central entry
        cd_extra = struct.pack("<HHQQQ", 1, 24, size_, size_, pos) if zip64 else b""
        cd_fields = (crc, short, short, len(raw_name), len(cd_extra), 0, 0, 0, 0, 0xFFFFFFFF if zip64 else pos)
        cd_header = _CENTRAL.pack(_CENTRAL_MAGIC, version, version, 0x800, 0, 0, 0, *cd_fields)
        central.append(cd_header + raw_name + cd_extra)
        pos += _LOCAL_HEADER.size + len(raw_name) + len(local_extra)
        if data is None:
            split = len(out)  # the caller writes the record's bytes here
        else:
            out += data
        pos += size_
    cd_offset = pos
    crc_central_at += len(out)
    cd = b"".join(central)
    out += cd
    pos += len(cd)
    count = len(records)
    out += _EOCD64.pack(_EOCD64_MAGIC, _EOCD64.size - 12, 45, 45, 0, 0, count, count, len(cd), cd_offset)
    out += _EOCD64_LOCATOR.pack(_EOCD64_LOCATOR_MAGIC, 0, pos, 1)
    big = cd_offset >= zip64_limit or len(cd) >= zip64_limit
    out += _EOCD.pack(
        _EOCD_MAGIC, 0, 0, count, count, 0xFFFFFFFF if big else len(cd), 0xFFFFFFFF if big else cd_offset, 0
    )
    return out, split, id_at, (crc_local_at, crc_central_at)


def _torch_save_records(data_pkl: bytes) -> list[tuple[str, bytes | None]]:
    """torch.save's records, in its order: the pickle, three constants, the one storage's data
    (a tensor's archive), the version, the serialization id (zeros here, patched per archive)."""
    return [
        ("data.pkl", data_pkl),
        (".format_version", b"1"),
        (".storage_alignment", str(_ALIGN).encode()),
        ("byteorder", sys.byteorder.encode()),
        ("data/0", None),  # the tensor's bytes
        ("version", b"3\n"),
        (_SERIAL_RECORD, b"0" * _SERIAL_LEN),
    ]


@functools.lru_cache(maxsize=4096)
def _archive_template(dtype: torch.dtype, size: tuple[int, ...], zip64_limit: int) -> _Template:
    nbytes = math.prod(size) * dtype.itemsize
    records = _torch_save_records(tensor_data_pkl(dtype, size))
    out, split, id_at, (crc_local, crc_central) = _zip_records(records, nbytes, zip64_limit)
    crc_at = (crc_local - split, crc_central - split)
    return _Template(bytes(out[:split]), bytes(out[split:]), nbytes, id_at - split, crc_at)


def _new_serial() -> bytes:
    """A fresh serialization id (40 ASCII digits), as torch.save gives every archive."""
    return f"{next(_serial):040d}"[-_SERIAL_LEN:].encode()


def _patch_serial(buf: bytearray, id_at: int, crc_at: tuple[int, int], serial: bytes) -> None:
    """Write ``serial`` into an archive built by :func:`_zip_records`, and its CRC in both places."""
    crc = struct.pack("<I", zlib.crc32(serial))
    buf[id_at : id_at + _SERIAL_LEN] = serial
    for at in crc_at:
        buf[at : at + 4] = crc


def tensor_archive(dtype: torch.dtype, size: tuple[int, ...], serial: bytes | None = None) -> ArchiveParts | None:
    """The archive around the data of a tensor of this dtype and size; ``None`` if unsupported.

    Layouts are cached per dtype and size; each call gets a fresh serialization id, as
    ``torch.save`` gives every archive one, unless ``serial`` (40 ASCII digits) gives it: an
    incremental save derives it from the content, so equal content gives equal bytes. (The id
    is only logged by ``torch.load``; nothing reads it back.) ``serial=b""``: the head only is
    meant, the tail's id is left as zeros.
    """
    if dtype not in ARCHIVE_DTYPES:
        return None
    t = _archive_template(dtype, tuple(size), _ZIP64_LIMIT)
    if serial == b"":
        return ArchiveParts(head=t.head, tail=t.tail, nbytes=t.nbytes)
    if serial is None:
        serial = _new_serial()
    elif len(serial) != _SERIAL_LEN or not serial.isdigit():
        raise ValueError("a serialization id is 40 ASCII digits")
    tail = bytearray(t.tail)
    _patch_serial(tail, t.id_at, t.crc_at, serial)
    return ArchiveParts(head=t.head, tail=bytes(tail), nbytes=t.nbytes)


# -- a value without tensors --------------------------------------------------------------------
#
# ``torch.save`` of a value that holds no storage writes bytes that depend on its pickle alone
# (the serialization id is derived from the content: equal values give equal archives in any
# process), so its output for one pickle is its output for every value with that pickle. The
# cache keys on the pickle and on the two settings that change the archive (CRC32 on or off, the
# storage alignment), and holds exactly what torch.save returned.


class _HasStorage(Exception):
    """Raised by :class:`_ValuePickler` at the first storage: the value is torch.save's to write."""


class _ValuePickler(pickle.Pickler):
    """torch.save's pickler for a value without storages: the same class of pickler, the same
    protocol, and every object but a storage pickled as torch.save pickles it."""

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj):
            raise _HasStorage
        return None


#: Archives of pickles up to this size are cached (1,024 of them: about 1.3 MiB at most);
#: a larger value goes to torch.save every time.
_CACHED_PICKLE_MAX = 4096
_cache: collections.OrderedDict[tuple[bytes, bool, int], bytes] = collections.OrderedDict()
_CACHE_ENTRIES = 1024
_cache_lock = threading.Lock()  # the writer's threads resolve items concurrently


def archive_settings() -> tuple[bool, int]:
    """The two ``torch.save`` settings that change a value's archive: CRC32 records on or off,
    the storage alignment (torch's config lookups: read once per save, not once per value)."""
    return torch.serialization.get_crc32_options(), torch.utils.serialization.config.save.storage_alignment


def value_archive(obj: Any, settings: tuple[bool, int] | None = None) -> bytes | None:
    """``torch.save(obj)``'s bytes for a value that holds no tensor or storage (a learning rate,
    betas, a step count, a config dict), from a cache keyed by its pickle; ``None`` for one that
    holds a storage or pickles to more than 4 KiB: the caller then runs ``torch.save``.
    ``settings``: :func:`archive_settings` as the caller read them for this save (else read now)."""
    buf = io.BytesIO()
    try:
        _ValuePickler(buf, protocol=2).dump(obj)  # torch.save's pickle protocol (DEFAULT_PROTOCOL)
    except _HasStorage:
        return None
    data_pkl = buf.getvalue()
    if len(data_pkl) > _CACHED_PICKLE_MAX:
        return None
    key = (data_pkl, *(settings or archive_settings()))
    with _cache_lock:
        archive = _cache.get(key)
    if archive is None:
        out = io.BytesIO()
        torch.save(obj, out)
        archive = out.getvalue()
        with _cache_lock:
            _cache[key] = archive
            if len(_cache) > _CACHE_ENTRIES:
                _cache.popitem(last=False)
    return archive
