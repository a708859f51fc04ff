"""The safetensors file format with torch dtypes: headers as :class:`TensorEntry` records, and the
header the converters write.

The format and its checks are :mod:`.safetensors_header` (torch-free, so that ``ckpt-engine
inspect`` of a safetensors file imports no torch); this module gives its dtype codes as torch
dtypes. A file is an 8-byte little-endian header length, the JSON header, then the data.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .safetensors_header import CODE_DTYPE_NAMES, RawEntry, read_raw_header
from .safetensors_header import INDEX_FILE as INDEX_FILE
from .safetensors_header import MAX_HEADER_BYTES as MAX_HEADER_BYTES
from .safetensors_header import MAX_INDEX_BYTES as MAX_INDEX_BYTES
from .safetensors_header import MAX_INT_DIGITS as MAX_INT_DIGITS
from .safetensors_header import MAX_JSON_DEPTH as MAX_JSON_DEPTH
from .safetensors_header import SINGLE_FILE as SINGLE_FILE
from .safetensors_header import open_regular as open_regular
from .safetensors_header import parse_json as parse_json

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
    "torch_entries",
]

#: The format's dtype codes as torch dtypes (one table: :data:`.safetensors_header.CODE_DTYPE_NAMES`).
CODE_DTYPES: dict[str, torch.dtype] = {code: getattr(torch, name) for code, (name, _) in CODE_DTYPE_NAMES.items()}
DTYPE_CODES: dict[torch.dtype, str] = {dtype: code for code, dtype in CODE_DTYPES.items()}


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


def torch_entries(tensors: Mapping[str, RawEntry]) -> dict[str, TensorEntry]:
    """Header entries with their dtype codes as torch dtypes."""
    return {name: TensorEntry(e.file, CODE_DTYPES[e.code], e.shape, e.begin, e.end) for name, e in tensors.items()}


def read_header(path: str) -> SafetensorsHeader:
    """Parse and check the header of the safetensors file ``path`` (no tensor data is read)."""
    raw = read_raw_header(path)
    return SafetensorsHeader(path, torch_entries(raw.tensors), raw.metadata)


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
