"""The safetensors file format, read and written without the ``safetensors`` package.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON, then the data. The
JSON maps each tensor name to ``{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}``
(offsets relative to the start of the data) plus an optional ``"__metadata__"`` of strings.
Tensors are C-contiguous and little-endian. Hugging Face folders hold one file
(``model.safetensors``) or shards listed in ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``).

Headers come from files users download, so everything is checked before it is used: that the file
is a regular one (a FIFO would block the reader), the header size, the JSON itself (nesting, integer
sizes, keys named twice), every dtype, shape and offset range, and, as the reference reader does,
that the ranges tile the data section exactly. Messages show at most ``SHOWN_CHARS`` characters of
any value read from the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

import torch

from .._storage.fscheck import open_regular as fscheck_open_regular
from .._storage.fscheck import require_regular_file
from ..errors import SHOWN_CHARS, CorruptCheckpointError, clip
from . import bounded_json

__all__ = [
    "DTYPE_CODES",
    "INDEX_FILE",
    "MAX_HEADER_BYTES",
    "MAX_INDEX_BYTES",
    "SINGLE_FILE",
    "SafetensorsHeader",
    "TensorEntry",
    "encode_header",
    "open_regular",
    "parse_json",
    "read_header",
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

DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
CODE_DTYPES: dict[str, torch.dtype] = {code: dtype for dtype, code in DTYPE_CODES.items()}


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are (absolute file offsets)."""

    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    tensors: dict[str, TensorEntry]
    metadata: dict[str, str]


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


def read_header(path: str) -> SafetensorsHeader:
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
    return SafetensorsHeader(path, tensors, meta)


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


def _entry(path: str, name: str, spec: Any, data_start: int, data_size: int) -> TensorEntry:
    if not isinstance(spec, dict):
        raise _bad(path, f"tensor {clip(name)} has no dtype/shape/data_offsets record")
    code, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    dtype = CODE_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CorruptCheckpointError(
            f"{path}: tensor {clip(name)} has dtype {_show(code)}, which torch cannot load here "
            f"(known: {', '.join(sorted(CODE_DTYPES))})"
        )
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _bad(path, f"tensor {clip(name)} has shape {_show(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise _bad(path, f"tensor {clip(name)} has data_offsets {_show(offsets)}")
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if not (0 <= begin <= end <= data_size) or end - begin != expected:
        raise _bad(
            path,
            f"tensor {clip(name)} ({code} of shape {_show(shape)}, {expected} bytes) has data_offsets "
            f"[{begin}, {end}] in a data section of {data_size} bytes",
        )
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, data_start + end)


def _check_layout(path: str, tensors: Mapping[str, TensorEntry], data_start: int, data_size: int) -> None:
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


def encode_header(tensors: Mapping[str, tuple[torch.dtype, tuple[int, ...]]], metadata: Mapping[str, str]) -> bytes:
    """The header (length prefix included) for ``tensors`` laid out in the given order."""
    header: dict[str, Any] = {"__metadata__": dict(metadata)}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the reference writer does
    return struct.pack("<Q", len(blob)) + blob
