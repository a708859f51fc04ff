"""The safetensors file format, read and written without the ``safetensors`` package.

A file is an 8-byte little-endian header length ``N``, ``N`` bytes of JSON, then the data. The
JSON maps each tensor name to ``{"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}``
(offsets relative to the start of the data) plus an optional ``"__metadata__"`` of strings.
Tensors are C-contiguous and little-endian. Hugging Face folders hold one file
(``model.safetensors``) or shards listed in ``model.safetensors.index.json``
(``{"metadata": {"total_size": N}, "weight_map": {name: file}}``).

Headers come from files users download, so everything is checked before it is used: the header
size, every dtype, shape and offset range, and that the ranges lie inside the file.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CorruptCheckpointError

__all__ = [
    "DTYPE_CODES",
    "INDEX_FILE",
    "SINGLE_FILE",
    "SafetensorsHeader",
    "TensorEntry",
    "encode_header",
    "read_header",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: The reference implementation refuses larger headers too.
MAX_HEADER_BYTES = 100 * 1024 * 1024

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


def read_header(path: str) -> SafetensorsHeader:
    """Parse and check the header of the safetensors file ``path`` (no tensor data is read)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _bad(path, f"the file has {size} bytes, fewer than the 8 of the header length")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise _bad(path, f"header length {n} does not fit the file ({size} bytes)")
            raw = f.read(n)
    except OSError as err:
        raise CorruptCheckpointError(f"{path}: cannot read it: {err}") from err
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _bad(path, f"its header is not JSON ({err})") from None
    if not isinstance(header, dict):
        raise _bad(path, "its header is not a JSON object")
    data_start, data_size = 8 + n, size - 8 - n
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _bad(path, "its __metadata__ is not a mapping of strings")
    tensors = {name: _entry(path, name, spec, data_start, data_size) for name, spec in header.items()}
    return SafetensorsHeader(path, tensors, meta)


def _entry(path: str, name: str, spec: Any, data_start: int, data_size: int) -> TensorEntry:
    if not isinstance(spec, dict):
        raise _bad(path, f"tensor {name!r} has no dtype/shape/data_offsets record")
    code, shape, offsets = spec.get("dtype"), spec.get("shape"), spec.get("data_offsets")
    dtype = CODE_DTYPES.get(code) if isinstance(code, str) else None
    if dtype is None:
        raise CorruptCheckpointError(
            f"{path}: tensor {name!r} has dtype {code!r}, which torch cannot load here "
            f"(known: {', '.join(sorted(CODE_DTYPES))})"
        )
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise _bad(path, f"tensor {name!r} has shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise _bad(path, f"tensor {name!r} has data_offsets {offsets!r}")
    begin, end = offsets
    expected = math.prod(shape) * dtype.itemsize
    if not (0 <= begin <= end <= data_size) or end - begin != expected:
        raise _bad(
            path,
            f"tensor {name!r} ({code}{shape}, {expected} bytes) has data_offsets [{begin}, {end}] in a data "
            f"section of {data_size} bytes",
        )
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, data_start + end)


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
