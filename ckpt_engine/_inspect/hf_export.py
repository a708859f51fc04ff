"""``ckpt-engine convert CKPT OUT_DIR --to hf``: a Hugging Face safetensors folder from a component.

The folder holds ``model.safetensors`` (everything fits one shard) or
``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``
(``metadata.total_size``, ``weight_map``), as ``transformers``' ``save_pretrained`` writes it;
every file carries ``{"format": "pt"}`` metadata. It loads with the ``safetensors`` package,
with ``transformers``, and back into a model through ``load_path``.

* **Consolidated:** each tensor is assembled from all ranks' shards (any world size).
* **Bounded memory:** shard headers are computed from the checkpoint's metadata; tensors are then
  read a batch at a time (``--budget``, default 64 MiB, or one tensor if larger) and appended.
* **Nothing half-written:** the folder is built under a temporary name next to ``OUT_DIR`` and
  renamed into place; every file is fsynced first. Each header is read back and checked.
* **Replacing** (``replace=True``): the previous folder is moved aside, the new one renamed in,
  the old one removed; if the rename fails the previous folder is put back. ``OUT_DIR`` a symbolic
  link to a folder: the folder it points to is replaced and the link kept (see :func:`_destination`).
* Non-tensor values (safetensors holds tensors only) are skipped and listed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._format.safetensors import DTYPE_CODES, INDEX_FILE, SINGLE_FILE, encode_header, read_header
from .reader import DEFAULT_BUDGET, ComponentReader

__all__ = ["DTYPE_ALIASES", "HFExport", "export_hf", "parse_shard_size"]

#: Short dtype names accepted by ``--dtype`` besides torch's own (``bfloat16``).
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "f16": "float16", "fp32": "float32", "f32": "float32"}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS |= {"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}


def parse_shard_size(text: str) -> int:
    """``5GB`` (10**9, as Hugging Face counts), ``500MiB`` (2**20), ``64K``/``64M`` (2**10/2**20) or bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _UNITS or float(m.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class HFExport:
    out_dir: str
    files: tuple[str, ...]
    total_size: int
    written: int
    left_out: tuple[str, ...]


def _shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Keys split greedily, in order, into shards of at most ``max_shard_size`` bytes (a tensor
    larger than that gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for key, nbytes in sizes:
        if shards[-1] and filled + nbytes > max_shard_size:
            shards.append([])
            filled = 0
        shards[-1].append(key)
        filled += nbytes
    return shards


def export_hf(
    reader: ComponentReader,
    keys: Sequence[str],
    out_dir: str,
    *,
    max_shard_size: int,
    cast: torch.dtype | None = None,
    progress: Callable[[int], None] | None = None,
    budget: int = DEFAULT_BUDGET,
    replace: bool = False,
) -> HFExport:
    """Write ``keys`` of ``reader``'s component as an HF safetensors folder at ``out_dir``."""
    tensors = [k for k in keys if reader.keys[k].is_tensor]
    left_out = tuple(k for k in keys if not reader.keys[k].is_tensor)
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
    for key in tensors:
        info = reader.keys[key]
        assert info.dtype is not None
        dtype = cast if cast is not None and info.dtype.is_floating_point else info.dtype
        if dtype not in DTYPE_CODES:
            raise ValueError(f"{key}: dtype {info.dtype_name} has no safetensors equivalent; use --to torch")
        specs[key] = (dtype, tuple(info.shape))
    sizes = [(k, math.prod(shape) * dtype.itemsize) for k, (dtype, shape) in specs.items()]
    shards = _shards(sizes, max_shard_size)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    dest = _destination(out_dir)
    if os.path.lexists(dest) and not replace:
        raise FileExistsError(f"{out_dir} exists; pass --force to replace it")
    tmp = f"{dest}.tmp.{os.getpid()}"
    os.makedirs(tmp)
    try:
        for name, shard in zip(names, shards, strict=True):
            _write_shard(reader, os.path.join(tmp, name), {k: specs[k] for k in shard}, progress, budget)
        if n > 1:
            index = {
                "metadata": {"total_size": sum(s for _, s in sizes)},
                "weight_map": {k: name for name, shard in zip(names, shards, strict=True) for k in shard},
            }
            _write_file(os.path.join(tmp, INDEX_FILE), json.dumps(index, indent=2, sort_keys=True).encode() + b"\n")
        _fsync_dir(tmp)
        _move_into_place(tmp, dest, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return HFExport(out_dir, tuple(names), sum(s for _, s in sizes), len(tensors), left_out)


def _write_shard(
    reader: ComponentReader,
    path: str,
    specs: dict[str, tuple[torch.dtype, tuple[int, ...]]],
    progress: Callable[[int], None] | None,
    budget: int,
) -> None:
    with open(path, "wb") as f:
        f.write(encode_header(specs, {"format": "pt"}))
        for key, value in reader.iter_values(list(specs), budget):
            t = value.to(specs[key][0]).contiguous().reshape(-1)
            del value
            if t.numel():
                f.write(t.view(torch.uint8).numpy().data)
            if progress is not None:
                progress(t.numel() * t.element_size())
            del t
        f.flush()
        os.fsync(f.fileno())
    found = read_header(path).tensors  # read back: the header we wrote parses and names them all
    if list(found) != list(specs) or any((found[k].dtype, found[k].shape) != specs[k] for k in specs):
        raise ValueError(f"{path}: the written header does not match what was meant to be written")


def _write_file(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _destination(out_dir: str) -> str:
    """The folder to build: ``out_dir``, or the folder it points to when it is a symbolic link.

    A link to a folder is kept and its target replaced: a link named as the output usually puts a
    large export on another disk, and a careful user expects ``--force`` to refresh the export
    where the link points, not to swap the link for a folder on the link's own disk (nor to fail
    after writing, as ``rmtree`` on a link does). The new folder is built next to the target, on
    its filesystem, so the final rename stays atomic. A link that points nowhere, or to a file,
    is refused: what it should become is not for the export to guess.
    """
    path = os.path.normpath(out_dir)
    if not os.path.islink(path):
        return path
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise ValueError(
            f"{out_dir} is a symbolic link to {real}, which is not a folder; point the link at a folder "
            "(or remove the link) and convert again"
        )
    return real


def _move_into_place(tmp: str, dest: str, replace: bool) -> None:
    old = None
    if os.path.lexists(dest):
        if not replace:
            raise FileExistsError(f"{dest} exists; pass --force to replace it")
        if os.path.islink(dest) or not os.path.isdir(dest):
            raise ValueError(f"{dest} is not a folder; --to hf replaces only a folder")
        old = f"{dest}.old.{os.getpid()}"
        os.rename(dest, old)
    try:
        os.rename(tmp, dest)
    except BaseException:
        if old is not None:
            os.rename(old, dest)  # the previous export back where it was
        raise
    _fsync_dir(os.path.dirname(os.path.abspath(dest)))
    if old is not None:
        try:
            shutil.rmtree(old)
        except OSError as err:
            raise ValueError(
                f"wrote {dest}, but could not remove the previous export, moved to {old}: {err}; remove it by hand"
            ) from err
