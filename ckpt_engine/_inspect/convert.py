"""``ckpt-engine convert``: one consolidated file from a (sharded) DCP component, streamed.

Memory stays bounded by the largest tensor (plus a read batch), never the whole checkpoint:

* **safetensors**: the header is computed from the metadata, then each tensor is read and its
  bytes appended; the format needs nothing else. The reference ``safetensors`` package then
  opens the file to check it.
* **torch** (``torch.save`` format, loadable with ``torch.load(weights_only=True)``): each tensor
  is read and written to its own file in a scratch folder next to the output; ``torch.save``
  then writes tensors memory-mapped from those files (``torch.from_file``), so the data is paged
  through the page cache instead of held in memory.

Both write to a temporary name and rename into place, so a failed conversion leaves no file.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._format.safetensors import DTYPE_CODES
from .optim_layout import NotOptimizerStateError, nest_optimizer_state
from .reader import DEFAULT_BUDGET, ComponentReader, KeyInfo, Unreadable

__all__ = ["SAFETENSORS_DTYPES", "convert_component", "require_safetensors"]

#: The safetensors dtype codes (one table, in the format's module).
SAFETENSORS_DTYPES: dict[torch.dtype, str] = DTYPE_CODES


class ConvertError(Exception):
    """The conversion cannot be done as asked (a value the format cannot hold, a missing package)."""


def require_safetensors() -> Any:
    try:
        import safetensors
    except ImportError as err:
        raise ConvertError(
            "--to safetensors needs the safetensors package: pip install safetensors "
            "(or pip install 'ckpt-engine[safetensors]')"
        ) from err
    return safetensors


def _out_dtype(info: KeyInfo, cast: torch.dtype | None) -> torch.dtype:
    assert info.dtype is not None
    if cast is not None and info.dtype.is_floating_point:
        return cast
    return info.dtype


def _raw_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


def convert_component(
    reader: ComponentReader,
    keys: Sequence[str],
    out: str,
    fmt: str,
    cast: torch.dtype | None = None,
    progress: Callable[[int], None] | None = None,
    budget: int = DEFAULT_BUDGET,
    nested: bool = False,
) -> tuple[int, list[str]]:
    """Write ``keys`` of ``reader``'s component to ``out``; returns (values written, keys left out).

    ``progress(nbytes)`` is called after each value with the bytes it added. ``nested`` (torch
    only, for ``optim``): the nested form ``optimizer.load_state_dict`` takes, not flat keys.
    """
    tmp = f"{out}.tmp.{os.getpid()}"
    try:
        if fmt == "safetensors":
            result = _write_safetensors(reader, keys, tmp, cast, progress, budget)
        elif fmt == "torch":
            result = _write_torch(reader, keys, tmp, out, cast, progress, budget, nested)
        else:
            raise ConvertError(f"unknown format {fmt!r}; use torch or safetensors")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    if fmt == "safetensors":
        _check_safetensors(out, result[0])
    return result


def _write_safetensors(
    reader: ComponentReader,
    keys: Sequence[str],
    tmp: str,
    cast: torch.dtype | None,
    progress: Callable[[int], None] | None,
    budget: int,
) -> tuple[int, list[str]]:
    tensors = [k for k in keys if reader.keys[k].is_tensor]
    left_out = [k for k in keys if not reader.keys[k].is_tensor]
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "ckpt-engine convert"}}
    offset = 0
    for key in tensors:
        info = reader.keys[key]
        dtype = _out_dtype(info, cast)
        code = SAFETENSORS_DTYPES.get(dtype)
        if code is None:
            raise ConvertError(f"{key}: dtype {info.dtype_name} has no safetensors equivalent; use --to torch")
        size = info.numel * dtype.itemsize
        header[key] = {"dtype": code, "shape": list(info.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the reference writer does
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, value in reader.iter_values(tensors, budget):
            t = value.to(_out_dtype(reader.keys[key], cast))
            data = _raw_bytes(t)
            f.write(data)
            if progress is not None:
                progress(len(data))
        f.flush()
        os.fsync(f.fileno())
    return len(tensors), left_out


def _check_safetensors(path: str, expected: int) -> None:
    require_safetensors()
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        found = len(list(f.keys()))
    if found != expected:
        raise ConvertError(f"{path}: safetensors reads {found} tensors, {expected} were written")


def _write_torch(
    reader: ComponentReader,
    keys: Sequence[str],
    tmp: str,
    out: str,
    cast: torch.dtype | None,
    progress: Callable[[int], None] | None,
    budget: int,
    nested: bool = False,
) -> tuple[int, list[str]]:
    scratch = f"{out}.parts.{os.getpid()}"
    os.makedirs(scratch)
    try:
        result: dict[str, Any] = {}
        left_out: list[str] = []
        for i, (key, value) in enumerate(reader.iter_values(keys, budget)):
            if isinstance(value, Unreadable):
                left_out.append(key)
                continue
            if not isinstance(value, torch.Tensor):
                result[key] = value
                continue
            t = value.to(_out_dtype(reader.keys[key], cast))
            del value
            if t.numel() == 0:
                result[key] = t
                continue
            part = os.path.join(scratch, f"{i}.bin")
            with open(part, "wb") as f:
                f.write(_raw_bytes(t))
            if progress is not None:
                progress(t.numel() * t.element_size())
            shape, dtype = tuple(t.shape), t.dtype
            del t
            result[key] = torch.from_file(part, shared=False, size=_numel(shape), dtype=dtype).view(shape)
        written = len(result)
        if nested:
            try:
                result = nest_optimizer_state(result)
            except NotOptimizerStateError as err:
                raise ConvertError(f"--nested is for an optimizer component: {err}") from err
        torch.save(result, tmp)
        return written, left_out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
