"""The safetensors header and a Hugging Face folder's index, read and checked without torch.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON, then the data. The
JSON maps each tensor name to ``{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}``
(offsets relative to the start of the data) plus an optional ``"__metadata__"`` of strings.
Tensors are C-contiguous and little-endian. Hugging Face folders hold one file
(``model.safetensors``) or shards listed in ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``).

Headers come from files users download, so everything is checked before it is used: that the file
is a regular one (a FIFO would block the reader), the header size, the JSON itself (nesting, integer
sizes, keys named twice), every dtype, shape and offset range, and, as the reference reader does,
that the ranges tile the data section exactly (so a truncated file is refused). Messages show at
most ``SHOWN_CHARS`` characters of any value read from the file. Dtypes are kept as the format's
codes with torch's names and item sizes; :mod:`.safetensors` gives them as torch dtypes.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from .._storage.fscheck import open_regular as fscheck_open_regular
from .._storage.fscheck import read_regular, require_regular_file
from ..errors import SHOWN_CHARS, CorruptCheckpointError, IncompleteCheckpointError, clip
from . import bounded_json

__all__ = [
    "CODE_DTYPE_NAMES",
    "INDEX_FILE",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "SINGLE_FILE",
    "RawEntry",
    "RawHeader",
    "WeightsFolder",
    "is_weights_folder",
    "open_regular",
    "parse_json",
    "read_raw_header",
    "read_weights_folder",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: The reference implementation refuses larger headers too.
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: Largest ``model.safetensors.index.json`` read: the index of a 1T-parameter model is a few MB.
MAX_INDEX_BYTES = 64 * 1024 * 1024
#: Deepest nesting of arrays and objects in a header or index. Writers nest 3 deep
#: (``{name: {"shape": [..]}}``); the reference reader stops at 128.
MAX_JSON_DEPTH = 32
#: Most digits of an integer in a header or index (2**64 has 20).
MAX_INT_DIGITS = 20

#: The dtype codes torch can load: code -> (torch's name, bytes per element).
CODE_DTYPE_NAMES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "U16": ("uint16", 2),
    "U32": ("uint32", 4),
    "U64": ("uint64", 8),
}
#: Shard files a message lists by name (the rest are counted).
_LISTED = 3


@dataclass(frozen=True, slots=True)
class RawEntry:
    """One tensor of a safetensors file: its dtype code, shape, and where its bytes are (absolute
    file offsets)."""

    file: str
    code: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def dtype_name(self) -> str:
        """torch's name of the dtype (``float32``)."""
        return CODE_DTYPE_NAMES[self.code][0]


@dataclass(frozen=True)
class RawHeader:
    path: str
    tensors: dict[str, RawEntry]
    metadata: dict[str, str]
    #: The file's size: the header describes every byte of it.
    file_size: int = 0


def _bad(path: str, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path}: {what}; this is not a valid safetensors file (truncated download?): fetch it again"
    )


def open_regular(path: str, what: str = "a safetensors file") -> BinaryIO:
    """``path`` opened for binary reading, refused unless it is a regular file: checked before the
    open (a folder is refused as one too) and as opened (:func:`~ckpt_engine._storage.fscheck.open_regular`).
    Raises :class:`CorruptCheckpointError` naming ``path``."""
    require_regular_file(path, what)
    return fscheck_open_regular(path, what)


def read_raw_header(path: str) -> RawHeader:
    """Parse and check the header of the safetensors file ``path`` (no tensor data is read)."""
    raw, data_start, data_size = _raw_header(path)
    header = parse_json(path, raw)
    if not isinstance(header, dict):
        raise _bad(path, "its header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad(path, "its __metadata__ is not a mapping of strings")
    tensors = {name: _entry(path, name, spec, data_start, data_size) for name, spec in header.items()}
    _check_layout(path, tensors, data_start, data_size)
    return RawHeader(path, tensors, meta, data_start + data_size)


def _raw_header(path: str) -> tuple[bytes, int, int]:
    """The header's JSON bytes, and where the data section starts and how long it is."""
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"the file has {size} bytes, fewer than the 8 of the header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise _bad(path, f"header length {n} does not fit the file ({size} bytes)")
            raw = f.read(n)
    except OSError as err:
        raise CorruptCheckpointError(f"{path}: cannot read it: {err}") from err
    return raw, 8 + n, size - 8 - n


def parse_json(path: str, raw: bytes) -> Any:
    """``raw`` (a header or index read from ``path``) parsed as JSON, refusing what no writer
    produces: text that is not UTF-8, nesting deeper than :data:`MAX_JSON_DEPTH`, integers of more
    than :data:`MAX_INT_DIGITS` digits, ``NaN``/``Infinity``, a key twice in one object.
    Raises :class:`CorruptCheckpointError` naming ``path``."""
    try:
        return bounded_json.loads(
            raw, max_depth=MAX_JSON_DEPTH, max_int_digits=MAX_INT_DIGITS, constants=False, unique_keys=True
        )
    except bounded_json.JSONRefused as err:
        raise CorruptCheckpointError(f"{path}: {err}") from None


def _show(value: Any) -> str:
    """A JSON value read from a file as a message shows it: at most about ``SHOWN_CHARS`` characters."""
    if isinstance(value, str):
        return clip(value)
    if isinstance(value, dict) or (
        isinstance(value, list) and (len(value) > 8 or not all(v is None or isinstance(v, int | float) for v in value))
    ):
        return f"a JSON {'object' if isinstance(value, dict) else 'array'} of {len(value)} items"
    return repr(value)[:SHOWN_CHARS]  # a number, null, or a few numbers of at most MAX_INT_DIGITS digits


def _entry(path: str, name: str, spec: Any, data_start: int, data_size: int) -> RawEntry:
    if not isinstance(spec, dict):
        raise _bad(path, f"tensor {clip(name)} has no dtype/shape/data_offsets record")
    code, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    known = CODE_DTYPE_NAMES.get(code) if isinstance(code, str) else None
    if known is None:
        raise CorruptCheckpointError(
            f"{path}: tensor {clip(name)} has dtype {_show(code)}, which torch cannot load here "
            f"(known: {', '.join(sorted(CODE_DTYPE_NAMES))})"
        )
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _bad(path, f"tensor {clip(name)} has shape {_show(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise _bad(path, f"tensor {clip(name)} has data_offsets {_show(offsets)}")
    begin, end = offsets
    expected = math.prod(shape) * known[1]
    if not (0 <= begin <= end <= data_size) or end - begin != expected:
        raise _bad(
            path,
            f"tensor {clip(name)} ({code} of shape {_show(shape)}, {expected} bytes) has data_offsets "
            f"[{begin}, {end}] in a data section of {data_size} bytes",
        )
    assert isinstance(code, str)
    return RawEntry(path, code, tuple(shape), data_start + begin, data_start + end)


def _check_layout(path: str, tensors: Mapping[str, RawEntry], data_start: int, data_size: int) -> None:
    """The reference reader's rule: sorted by offset, the tensors' byte ranges follow one another
    with no gap and no overlap, from the start of the data section to its end."""
    end, previous = data_start, None
    for name, entry in sorted(tensors.items(), key=lambda item: (item[1].begin, item[1].end)):
        if entry.begin != end:
            before = "the data section starts" if previous is None else f"tensor {clip(previous)} ends"
            raise _bad(
                path,
                f"tensor {clip(name)} starts at data byte {entry.begin - data_start}, but {before} at byte "
                f"{end - data_start} (tensors may neither overlap nor leave gaps)",
            )
        end, previous = entry.end, name
    if end != data_start + data_size:
        raise _bad(path, f"its tensors end at data byte {end - data_start} of a data section of {data_size} bytes")


# -- Hugging Face folders ---------------------------------------------------------------------


def is_weights_folder(path: str) -> bool:
    """Whether the local folder ``path`` holds Hugging Face safetensors weights (the index or the
    single file)."""
    return os.path.lexists(os.path.join(path, INDEX_FILE)) or os.path.lexists(os.path.join(path, SINGLE_FILE))


@dataclass(frozen=True)
class WeightsFolder:
    """Every tensor of a safetensors file or a Hugging Face folder, by name, with each file's header."""

    path: str
    headers: tuple[RawHeader, ...]
    tensors: dict[str, RawEntry]
    #: The index file, when the folder has one.
    index: str | None = None
    #: ``(file, tensor)`` a shard holds but the index does not name: no loader reads them.
    unlisted: tuple[tuple[str, str], ...] = ()


def read_weights_folder(path: str, *, index_first: bool = False) -> WeightsFolder:
    """The headers of ``path``: one ``.safetensors`` file, or a folder holding ``model.safetensors`` or
    shards plus ``model.safetensors.index.json``. The index must name files of the folder that
    exist and hold the tensors it puts in them; a shard's tensor the index does not name is left
    out, as loaders leave it, and listed in ``unlisted``. Raises typed errors naming the file.

    A folder with both ``model.safetensors`` and the index is read through ``model.safetensors``,
    the file ``transformers``' ``from_pretrained`` reads there (it looks for the single file
    first), so the engine, the command line and ``from_pretrained`` load the same weights;
    ``index_first`` (the index was named itself) reads the index instead."""
    if not os.path.isdir(path):
        header = read_raw_header(path)
        return WeightsFolder(path, (header,), dict(header.tensors))
    index_file = os.path.join(path, INDEX_FILE)
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.lexists(index_file) or (os.path.isfile(single) and not index_first):
        header = read_raw_header(single)
        return WeightsFolder(path, (header,), dict(header.tensors))
    by_file: dict[str, list[str]] = {}
    for name, file in read_weight_map(index_file).items():
        by_file.setdefault(file, []).append(name)
    absent = sorted(f for f in by_file if not os.path.exists(os.path.join(path, f)))  # a dangling link too
    if absent:
        listed = "; ".join(
            f"{clip(f)} ({len(by_file[f])} tensors, e.g. {clip(by_file[f][0])})" for f in absent[:_LISTED]
        ) + ("; ..." if len(absent) > _LISTED else "")
        raise IncompleteCheckpointError(
            f"{index_file} names {len(absent)} shard file(s) that {path} does not have: {listed}. Download the "
            "missing shard(s) again (or the whole folder)"
        )
    headers: list[RawHeader] = []
    found: dict[str, RawEntry] = {}
    unlisted: list[tuple[str, str]] = []
    for file, names in sorted(by_file.items()):
        header = read_raw_header(os.path.join(path, file))
        lacking = [n for n in names if n not in header.tensors]
        if lacking:
            raise CorruptCheckpointError(
                f"{index_file} puts {len(lacking)} tensor(s) in {clip(file)} (e.g. {clip(lacking[0])}), but that file "
                "does not hold them; the folder mixes files of different versions: download it again"
            )
        headers.append(header)
        found.update({n: header.tensors[n] for n in names})
        named = set(names)
        unlisted += [(file, n) for n in header.tensors if n not in named]
    # In the order the bytes were written (shard by shard, by offset): a writer's model order,
    # where the index lists names sorted.
    tensors = dict(sorted(found.items(), key=lambda item: (item[1].file, item[1].begin)))
    return WeightsFolder(path, tuple(headers), tensors, index_file, tuple(unlisted))


def read_weight_map(index_file: str) -> dict[str, str]:
    """``weight_map`` of an index: tensor name -> a file name in the index's folder."""
    index = parse_json(index_file, _read_index_file(index_file))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise CorruptCheckpointError(f"{index_file}: no `weight_map` mapping tensor names to file names")
    for file in set(weight_map.values()):
        if os.path.basename(file) != file or file in ("", ".", "..") or "\0" in file:
            raise CorruptCheckpointError(
                f"{index_file}: weight_map names {clip(file)}, which is not a file name in the folder"
            )
    return weight_map


def _read_index_file(index_file: str) -> bytes:
    """The bytes of the index: a regular file of at most :data:`MAX_INDEX_BYTES`."""
    what = "a safetensors index (JSON)"
    too_large = (
        f"{index_file} is larger than {MAX_INDEX_BYTES} bytes, far more than any model's index; download it again"
    )
    try:
        require_regular_file(index_file, what)
        if os.path.getsize(index_file) > MAX_INDEX_BYTES:
            raise CorruptCheckpointError(too_large)
        data = read_regular(index_file, MAX_INDEX_BYTES, what)
    except OSError as err:
        raise CorruptCheckpointError(f"{index_file}: cannot read it: {err.strerror or err}") from err
    if len(data) > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(too_large)
    return data
