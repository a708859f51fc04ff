"""The ``torch.save`` archive of one tensor: where its bytes lie, read without ``torch.load``.

DCP's ``FileSystemWriter`` writes every tensor item of a ``.distcp`` file as one ``torch.save``
archive. The engine's fast load path (``fast_read``, ``object_read``) reads tensor bytes straight
into the destination with :func:`parse_torch_save_tensor_at` instead of ``torch.load`` and a copy.
An archive in a data file is read by its two ends (:class:`ArchiveItem`), small ones whole, in
runs (:func:`read_small_items`) and in windows of bounded memory (:func:`windows`); its layout is
parsed once per tensor shape (:class:`LayoutCache`); :func:`contiguous_region` says which stored
elements a read item needs, where they are one run. The plain values are read with the same zip
parser (``plain_values``). The writer of the same archives is :mod:`.archive_write`. This is a
file format, not an API: the one private torch name it needs (the rebuild functions the archive
refers to) comes from :mod:`.torch_private`, and ``tests/dcpio/test_torch_private.py`` pins the
format against ``torch.save``/``torch.load``.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import io
import math
import os
import pickle
import struct
import sys
import warnings
import zipfile
import zlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, BinaryIO

import torch

# -- the torch.save zip layout of one DCP ``.distcp`` item ------------------------------------
#
# DCP's ``FileSystemWriter`` (TORCH_SAVE serialization) writes every tensor item as one
# ``torch.save`` archive: an uncompressed zip whose ``<prefix>/data.pkl`` pickles a call to
# ``torch._utils._rebuild_tensor_v2(storage, storage_offset, size, stride, requires_grad,
# backward_hooks)`` (``_rebuild_tensor_v3`` with an ``UntypedStorage`` and a trailing dtype for
# dtypes without a legacy storage class), with the storage given by the persistent id
# ``("storage", storage_type, key, location, numel)`` and its raw bytes in the record
# ``<prefix>/data/<key>``, in the byte order named by ``<prefix>/byteorder``. None of this is
# public API. :func:`parse_torch_save_tensor` reads exactly that shape and returns ``None`` for
# anything else, so the caller can fall back to ``torch.load``.


@dataclasses.dataclass(frozen=True, slots=True)
class SavedTensorLayout:
    """Where the raw bytes of a tensor saved by ``torch.save`` lie inside its archive."""

    dtype: torch.dtype
    size: tuple[int, ...]
    #: Offset of the first data byte from the start of the archive.
    data_offset: int
    #: ``numel * element_size``: the data record holds exactly this many bytes.
    nbytes: int


class _Storage:
    __slots__ = ("dtype", "key", "location", "numel")

    def __init__(self, dtype: torch.dtype | None, key: str, location: str, numel: int) -> None:
        self.dtype, self.key, self.location, self.numel = dtype, key, location, numel


class _Rebuilt:
    __slots__ = ("args", "version")

    def __init__(self, version: int, args: tuple[Any, ...]) -> None:
        self.version, self.args = version, args


_UNTYPED = object()


def _rebuild_v2(*args: Any) -> _Rebuilt:
    return _Rebuilt(2, args)


def _rebuild_v3(*args: Any) -> _Rebuilt:
    return _Rebuilt(3, args)


@functools.cache
def _legacy_storage_dtypes() -> dict[str, torch.dtype]:
    """``{"FloatStorage": torch.float32, ...}``: the storage classes torch.save names."""
    out: dict[str, torch.dtype] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage is deprecated
        for name in dir(torch):
            cls = getattr(torch, name, None)
            if name.endswith("Storage") and isinstance(cls, type) and issubclass(cls, torch.storage.TypedStorage):
                dtype = getattr(cls, "dtype", None)
                if isinstance(dtype, torch.dtype):
                    out[name] = dtype
    return out


class _LayoutUnpickler(pickle.Unpickler):
    """Unpickles ``data.pkl`` of a one-tensor archive into plain records, constructing nothing."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name == "_rebuild_tensor_v2":
            return _rebuild_v2
        if module == "torch._utils" and name == "_rebuild_tensor_v3":
            return _rebuild_v3
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch.storage" and name == "UntypedStorage":
            return _UNTYPED
        if module == "torch":
            legacy = _legacy_storage_dtypes().get(name)
            if legacy is not None:
                return legacy
            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise pickle.UnpicklingError(f"unexpected global {module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, storage_type, key, location, numel = pid
        if not (isinstance(key, str) and isinstance(location, str) and type(numel) is int):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        if storage_type is _UNTYPED:
            return _Storage(None, key, location, numel)
        if isinstance(storage_type, torch.dtype):
            return _Storage(storage_type, key, location, numel)
        raise pickle.UnpicklingError(f"unexpected storage type {storage_type!r}")


def _is_contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    """``torch.Tensor.is_contiguous`` from a size and stride (an empty tensor always is)."""
    if 0 in size:
        return True
    expected = 1
    for n, st in zip(reversed(size), reversed(stride), strict=True):
        if n != 1 and st != expected:
            return False
        expected *= n
    return True


@dataclasses.dataclass(frozen=True, slots=True)
class _PickledTensor:
    dtype: torch.dtype
    size: tuple[int, ...]
    storage_key: str
    #: Bytes the storage holds, by its persistent id.
    storage_nbytes: int


@functools.lru_cache(maxsize=4096)
def _parse_data_pkl(raw: bytes) -> _PickledTensor | None:
    """The tensor ``data.pkl`` describes, if it is one dense, contiguous, zero-offset CPU tensor.

    Cached by content: a model's many same-shaped tensors pickle to identical bytes.
    """
    try:
        rebuilt = _LayoutUnpickler(io.BytesIO(raw)).load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError):
        return None
    if not isinstance(rebuilt, _Rebuilt):
        return None
    args = rebuilt.args
    if rebuilt.version == 2 and len(args) in (6, 7):
        storage, storage_offset, size, stride, _requires_grad, hooks, *meta = args
        dtype = storage.dtype if isinstance(storage, _Storage) else None
        count_bytes = None if dtype is None else dtype.itemsize  # a typed storage counts elements
    elif rebuilt.version == 3 and len(args) in (7, 8):
        storage, storage_offset, size, stride, _requires_grad, hooks, dtype, *meta = args
        count_bytes = 1  # an UntypedStorage counts bytes
        if not isinstance(storage, _Storage) or storage.dtype is not None:
            return None
    else:
        return None
    if (
        not isinstance(storage, _Storage)
        or not isinstance(dtype, torch.dtype)
        or count_bytes is None
        or storage.location != "cpu"
        or storage_offset != 0
        or hooks
        or any(meta)
        or not isinstance(size, tuple)
        or not isinstance(stride, tuple)
        or len(size) != len(stride)
        or not all(type(n) is int and n >= 0 for n in size)
        or not all(type(st) is int for st in stride)
        or not _is_contiguous(size, stride)
    ):
        return None
    return _PickledTensor(dtype, size, storage.key, storage.numel * count_bytes)


#: A central-directory entry of an uncompressed, unencrypted record: (crc, size, header offset).
_Entry = tuple[int, int, int]
#: ``pread(offset, n)``: ``n`` bytes at ``offset`` of the archive (fewer at its end).
PRead = Callable[[int, int], bytes]

_EOCD = struct.Struct("<4sHHHHIIH")
_EOCD_MAGIC = b"PK\x05\x06"
_EOCD64_LOCATOR = struct.Struct("<4sIQI")
_EOCD64_LOCATOR_MAGIC = b"PK\x06\x07"
_EOCD64 = struct.Struct("<4sQHHIIQQQQ")
_EOCD64_MAGIC = b"PK\x06\x06"
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_CENTRAL_MAGIC = b"PK\x01\x02"
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_LOCAL_MAGIC = b"PK\x03\x04"
_MAX_ENTRIES = 64  # a one-tensor archive has about 7


def _central_directory(pread: PRead, length: int, crc_at: dict[bytes, int] | None = None) -> dict[bytes, _Entry] | None:
    """The archive's records by name, read with ``struct`` (the common case: fast).

    ``None`` for anything but a plain archive without a comment whose entries need no zip64
    extra field; :func:`_central_directory_zipfile` handles those (huge items). ``crc_at``, if
    given, receives the archive offset of each entry's CRC field.
    """
    if length < _EOCD.size:
        return None
    eocd = pread(length - _EOCD.size, _EOCD.size)
    if len(eocd) != _EOCD.size:
        return None
    magic, _disk, _cd_disk, _n_disk, count, cd_size, cd_offset, comment_len = _EOCD.unpack(eocd)
    if magic != _EOCD_MAGIC or comment_len:
        return None
    if count == 0xFFFF or cd_size == 0xFFFFFFFF or cd_offset == 0xFFFFFFFF:
        loc_at = length - _EOCD.size - _EOCD64_LOCATOR.size
        loc = pread(loc_at, _EOCD64_LOCATOR.size) if loc_at >= 0 else b""
        if len(loc) != _EOCD64_LOCATOR.size:
            return None
        magic, _disk, eocd64_at, _disks = _EOCD64_LOCATOR.unpack(loc)
        rec = pread(eocd64_at, _EOCD64.size) if magic == _EOCD64_LOCATOR_MAGIC and eocd64_at < length else b""
        if len(rec) != _EOCD64.size:
            return None
        magic, _size, _made, _need, _disk, _cd_disk, _n_disk, count, cd_size, cd_offset = _EOCD64.unpack(rec)
        if magic != _EOCD64_MAGIC:
            return None
    if count > _MAX_ENTRIES or cd_offset + cd_size > length:
        return None
    cd = pread(cd_offset, cd_size)
    if len(cd) != cd_size:
        return None
    entries: dict[bytes, _Entry] = {}
    pos = 0
    unpack = _CENTRAL.unpack_from
    for _ in range(count):
        if pos + _CENTRAL.size > cd_size:
            return None
        (magic, _made, _need, flags, method, _time, _date, crc, csize, usize, name_len, extra_len, comment_len,
         _disk, _iattr, _eattr, header_offset) = unpack(cd, pos)  # fmt: skip
        if magic != _CENTRAL_MAGIC or 0xFFFFFFFF in (csize, usize, header_offset):
            return None  # zip64 sizes or offsets: leave them to zipfile
        start = pos + _CENTRAL.size
        pos = start + name_len + extra_len + comment_len
        if method == zipfile.ZIP_STORED and not flags & 0x1 and csize == usize:
            entries[cd[start : start + name_len]] = (crc, usize, header_offset)
            if crc_at is not None:
                crc_at[cd[start : start + name_len]] = cd_offset + start - _CENTRAL.size + 16
    return entries if pos == cd_size else None


class _PReadFile(io.RawIOBase):
    """A seekable file over ``pread`` for the stdlib ``zipfile``."""

    def __init__(self, pread: PRead, length: int) -> None:
        self._pread, self._length, self._pos = pread, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        if base + offset < 0:
            raise OSError("seek before the start of the archive")
        self._pos = base + offset
        return self._pos

    def read(self, n: int | None = -1) -> bytes:
        end = self._length if n is None or n < 0 else min(self._length, self._pos + n)
        data = self._pread(self._pos, max(0, end - self._pos)) if end > self._pos else b""
        self._pos += len(data)
        return data


def _central_directory_zipfile(pread: PRead, length: int) -> dict[bytes, _Entry] | None:
    """The same as :func:`_central_directory`, by the stdlib ``zipfile`` (zip64 included)."""
    with zipfile.ZipFile(_PReadFile(pread, length)) as zf:
        infos = zf.infolist()
    if len(infos) > _MAX_ENTRIES:
        return None
    return {
        i.filename.encode(): (i.CRC, i.file_size, i.header_offset)
        for i in infos
        if i.compress_type == zipfile.ZIP_STORED and not i.flag_bits & 0x1 and i.compress_size == i.file_size
    }


def _record_offset(pread: PRead, name: bytes, entry: _Entry, length: int) -> int | None:
    """Offset of an uncompressed record's first byte, from its local header; checks the name."""
    _crc, size, at = entry
    header = pread(at, _LOCAL_HEADER.size + len(name))
    if len(header) != _LOCAL_HEADER.size + len(name):
        return None
    magic, *_, name_len, extra_len = _LOCAL_HEADER.unpack_from(header)
    if magic != _LOCAL_MAGIC or name_len != len(name) or header[_LOCAL_HEADER.size :] != name:
        return None
    start: int = at + _LOCAL_HEADER.size + name_len + extra_len
    return start if start + size <= length else None


def _read_record(pread: PRead, name: bytes, entry: _Entry, length: int, limit: int = 1 << 20) -> bytes | None:
    crc, size, _at = entry
    start = _record_offset(pread, name, entry, length) if size <= limit else None
    data = None if start is None else pread(start, size)
    if data is None or len(data) != size or (crc and zlib.crc32(data) != crc):
        return None  # a CRC of 0 is "not recorded" (torch.save with crc32 options off)
    return data


_BYTEORDER = sys.byteorder.encode()


def parse_torch_save_tensor(f: BinaryIO, *, use_zipfile: bool = False) -> SavedTensorLayout | None:
    """The layout of the one tensor a ``torch.save`` archive holds, or ``None`` if unsure.

    ``f`` is a seekable binary file whose offset 0 is the archive's first byte and whose end is
    the archive's end. See :func:`parse_torch_save_tensor_at`.
    """

    def pread(offset: int, n: int) -> bytes:
        f.seek(offset)
        return f.read(n)

    try:
        length = f.seek(0, io.SEEK_END)
    except (OSError, ValueError):
        return None
    return parse_torch_save_tensor_at(pread, length, use_zipfile=use_zipfile)


def parse_torch_save_tensor_at(
    pread: PRead, length: int, *, use_zipfile: bool = False, unused: list[int] | None = None
) -> SavedTensorLayout | None:
    """The layout of the one tensor a ``torch.save`` archive of ``length`` bytes holds.

    Returns a layout only for an archive holding one dense, contiguous, zero-offset,
    native-byte-order CPU tensor whose uncompressed data record is exactly
    ``numel * element_size`` bytes. Anything else, including any parse error, gives ``None``.
    The central directory is read with ``struct``, or with the stdlib ``zipfile`` where that
    cannot (zip64 entries) or when ``use_zipfile`` is set; both give the same answer.

    ``unused``, if given, receives the offsets of the 4-byte CRC fields the answer does not
    depend on (those of records other than ``byteorder`` and ``data.pkl``, whose CRC is never
    checked here): the per-archive serialisation id and the tensor data differ from archive to
    archive, and their CRCs with them (see :class:`LayoutCache`).
    """
    try:
        crc_at: dict[bytes, int] | None = None if unused is None else {}
        entries = None if use_zipfile else _central_directory(pread, length, crc_at)
        if entries is None:
            crc_at = None
            entries = _central_directory_zipfile(pread, length)
        if entries is None:
            return None
        pkl_name = next((n for n in entries if n.endswith(b"/data.pkl") and n.count(b"/") == 1), None)
        if pkl_name is None:
            return None
        prefix = pkl_name[: -len(b"data.pkl")]
        byteorder_entry = entries.get(prefix + b"byteorder")
        if byteorder_entry is None:
            return None  # archives from before torch 2.1 record none; leave them to torch.load
        if _read_record(pread, prefix + b"byteorder", byteorder_entry, length) != _BYTEORDER:
            return None
        raw = _read_record(pread, pkl_name, entries[pkl_name], length)
        tensor = None if raw is None else _parse_data_pkl(raw)
        if tensor is None:
            return None
        nbytes = math.prod(tensor.size) * tensor.dtype.itemsize
        data_name = prefix + b"data/" + tensor.storage_key.encode()
        data_entry = entries.get(data_name)
        if data_entry is None or data_entry[1] != nbytes or tensor.storage_nbytes != nbytes:
            return None
        start = _record_offset(pread, data_name, data_entry, length)
        if start is None:
            return None
        if unused is not None and crc_at:  # the struct path: the zipfile path reports none
            checked = (prefix + b"byteorder", pkl_name)
            unused += [at for name, at in crc_at.items() if name not in checked]
        return SavedTensorLayout(dtype=tensor.dtype, size=tensor.size, data_offset=start, nbytes=nbytes)
    except (zipfile.BadZipFile, struct.error, EOFError, ValueError, OSError, UnicodeError, KeyError):
        return None


def contiguous_region(size: Sequence[int], offsets: Sequence[int], lengths: Sequence[int]) -> tuple[int, int] | None:
    """``(first element, element count)`` of a box inside a C-contiguous array, if contiguous.

    The box ``offsets``/``lengths`` of an array of shape ``size`` is one contiguous run of
    elements when, from the outermost dimension in, it spans single indices, then one partial
    dimension, then only full dimensions. ``None`` otherwise (or if the box is out of range).
    """
    if not (len(size) == len(offsets) == len(lengths)):
        return None
    if tuple(lengths) == tuple(size) and not any(offsets) and min(size, default=0) >= 0:  # the whole array
        return 0, math.prod(size)
    for n, o, ln in zip(size, offsets, lengths, strict=True):
        if o < 0 or ln < 0 or o + ln > n:
            return None
    count = math.prod(lengths)
    if count == 0:
        return 0, 0
    # innermost dimension that is not taken whole
    k = len(size) - 1
    while k >= 0 and offsets[k] == 0 and lengths[k] == size[k]:
        k -= 1
    if any(lengths[i] != 1 for i in range(k)):
        return None
    first, stride = 0, 1
    for i in range(len(size) - 1, -1, -1):
        first += offsets[i] * stride
        stride *= size[i]
    return first, count


# -- an archive in a data file, and its layout parsed once per shape ----------------------------

#: Bytes read ahead from each end of an item: the archive's local headers and ``data.pkl`` sit
#: at its start, the central directory at its end. Items up to twice this size are read whole.
PREFETCH = 4096
#: Small items (read whole) that follow each other in a file are read with one ``pread`` of at
#: most this many bytes: 50,000 tiny tensors cost 50,000 system calls otherwise.
_RUN_MAX = 8 << 20


class ArchiveItem:
    """An archive of ``length`` bytes whose first and last :data:`PREFETCH` bytes were read up
    front (``head``, ``tail``): parsing its headers costs no further read. Other ranges go to
    ``read(offset, n)`` (offsets from the item's start). A small item is read whole (``head``)."""

    __slots__ = ("head", "length", "read", "tail", "tail_start")

    def __init__(self, head: bytes, tail: bytes, length: int, read: Callable[[int, int], bytes]) -> None:
        self.head, self.tail, self.length, self.read = head, tail, length, read
        self.tail_start = length - len(tail)

    @classmethod
    def from_fd(cls, fd: int, base: int, length: int, whole: bytes | None = None) -> ArchiveItem:
        """The item at ``base`` of ``fd``: two ``pread`` calls, one for a small item, none for a
        small item whose bytes were read already (``whole``, see :func:`read_small_items`)."""

        def read(offset: int, n: int) -> bytes:
            return os.pread(fd, n, base + offset)

        if length <= 2 * PREFETCH:
            head = tail = whole if whole is not None and len(whole) == length else read(0, length)
        else:
            head, tail = read(0, PREFETCH), read(length - PREFETCH, PREFETCH)
        return cls(head, tail, length, read)

    @property
    def whole(self) -> bool:
        return len(self.head) == self.length

    @property
    def prefetched(self) -> int:
        """Bytes read up front (``head`` and ``tail``)."""
        return len(self.head) if self.whole else len(self.head) + len(self.tail)

    def pread(self, offset: int, n: int) -> bytes:
        end = min(self.length, offset + n)
        if end <= len(self.head):
            return self.head[offset:end]
        if offset >= self.tail_start:
            return self.tail[offset - self.tail_start : end - self.tail_start]
        return self.read(offset, max(0, end - offset))


def read_small_items(fd: int, spans: list[tuple[int, int]]) -> dict[int, bytes]:
    """The bytes of every small item in ``spans`` (``(offset, length)``, in offset order) by its
    offset, read with one ``pread`` per run of items that follow each other in the file. An item
    a short read (a truncated file) cut is left out: it is read on its own, and fails there."""
    out: dict[int, bytes] = {}
    i = 0
    while i < len(spans):
        start = end = spans[i][0]
        j = i
        while j < len(spans) and spans[j][1] <= 2 * PREFETCH and spans[j][0] == end and end - start < _RUN_MAX:
            end += spans[j][1]
            j += 1
        if j == i:  # a large item, or one that does not follow the previous: read on its own
            i += 1
            continue
        try:
            run = os.pread(fd, end - start, start)
        except OSError:
            run = b""
        for offset, length in spans[i:j]:
            if offset + length - start <= len(run):
                out[offset] = run[offset - start : offset - start + length]
        i = j
    return out


#: A file's tensor items are read, checked and handed on in windows of about this many bytes
#: held in memory (:func:`windows`; twice that while a window's run is cut into its items): the
#: archives of 50,000 small tensors are 20x their data, and holding all of them until the file
#: was done was a third of such a load's peak memory. 2 MiB: 1.39x safetensors' peak for that
#: load, 1.49x with 8 MiB, at the same speed (two windows of the blocks' 1 MiB each, or so).
_WINDOW = 2 << 20


def windows(entries: list[tuple[Any, Any]], starts: Sequence[int] | None) -> Iterator[list[tuple[Any, Any]]]:
    """A data file's read ``entries`` (``(storage info, read item)``, in offset order) in
    consecutive windows holding about :data:`_WINDOW` bytes of items read whole (a larger item
    counts its prefetched ends: its data goes straight to its destination). A window ends where
    a block starts (``starts``, the file's; so no block is read for two windows) or at twice the
    size, and never between two entries of one stored item."""
    at_block = frozenset(starts or ())
    first, held = 0, 0
    for k, (info, _) in enumerate(entries):
        if (
            held >= _WINDOW
            and info.offset != entries[k - 1][0].offset
            and (starts is None or info.offset in at_block or held >= 2 * _WINDOW)
        ):
            yield entries[first:k]
            first, held = k, 0
        held += min(info.length, 2 * PREFETCH)
    yield entries[first:]


class LayoutCache:
    """Archive layouts by the bytes their parse read.

    The parse (:func:`parse_torch_save_tensor_at`) is a function of the archive's length and of
    the bytes it reads, and which bytes it reads next depends only on those it has read. So an
    archive of the same length whose bytes at the ranges one parse read equal that parse's
    bytes takes the same path and has the same layout. The parse reads the zip records and
    headers, not the tensor data nor the per-archive serialisation id, so every tensor of one
    dtype and shape the engine's writer wrote matches one template: a file of many small
    tensors parses once per shape instead of once per tensor. The cache holds bytes, not
    assumptions about files: every archive is compared byte for byte, so nothing is stale when
    a file changes or another checkpoint is read, and an archive that differs anywhere the
    parse looked (another shape, a CRC ``torch.save`` wrote, a crafted header) is parsed in full.
    """

    #: Templates kept per archive length (the newest first).
    PER_LENGTH = 4

    def __init__(self) -> None:
        self._by_length: dict[int, list[_Template]] = {}
        #: How many archives were parsed in full and how many matched a template (for tests).
        self.parsed = 0
        self.reused = 0

    def layout(self, item: ArchiveItem) -> SavedTensorLayout | None:
        templates = self._by_length.setdefault(item.length, [])
        for t in templates:
            if t.matches(item):
                self.reused += 1
                return t.layout
        read: list[tuple[int, int]] = []

        def pread(offset: int, n: int) -> bytes:
            data = item.pread(offset, n)
            read.append((offset, offset + len(data)))
            return data

        self.parsed += 1
        unused: list[int] = []
        layout = parse_torch_save_tensor_at(pread, item.length, unused=unused)
        template = _Template(tuple(read), unused, layout)
        template.set_bytes(item)
        templates.insert(0, template)
        del templates[self.PER_LENGTH :]
        return layout


class _Template:
    """One parse of :class:`LayoutCache`: the ranges it read, less the CRC fields the answer
    does not depend on, with their bytes, and the answer."""

    __slots__ = ("layout", "parts", "spans")

    def __init__(
        self, ranges: tuple[tuple[int, int], ...], unused: list[int], layout: SavedTensorLayout | None
    ) -> None:
        self.layout = layout
        #: ``ranges`` less the unused CRC fields, as ``(start, end)`` in the archive.
        spans: list[tuple[int, int]] = []
        for a, b in ranges:
            for at in sorted(at for at in unused if a <= at and at + 4 <= b):
                spans.append((a, at))
                a = at + 4
            spans.append((a, b))
        self.spans = [(a, b) for a, b in spans if b > a]
        #: Each span with its bytes, once :meth:`set_bytes` ran.
        self.parts: list[tuple[int, int, bytes]] = []

    def set_bytes(self, item: ArchiveItem) -> None:
        """Take ``item``'s bytes where the parse looked as the template's."""
        self.parts = [(a, b, item.pread(a, b - a)) for a, b in self.spans]

    def matches(self, item: ArchiveItem) -> bool:
        """Whether ``item`` holds the template's bytes wherever its parse looked (part by part:
        from the item's head for an archive held whole, else through its prefetched ends)."""
        if item.whole:
            head = item.head
            return all(head[a:b] == want for a, b, want in self.parts)
        return all(item.pread(a, b - a) == want for a, b, want in self.parts)
