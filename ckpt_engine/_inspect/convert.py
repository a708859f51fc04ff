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

:func:`check_output` refuses, before anything is written, an output that would overwrite or
(with ``--force``) remove what is being converted, or any checkpoint or save folder.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._format.names import LATEST_FILE, LEFTOVER_RE, MANIFEST_FILE, METADATA_FILE
from .._format.safetensors import DTYPE_CODES
from .._storage.urls import is_url, local_path
from ..errors import UsageError
from .keys import ValueReader
from .optim_layout import NotOptimizerStateError, nest_optimizer_state
from .reader import DEFAULT_BUDGET, KeyInfo, Target, Unreadable, is_save_dir

__all__ = ["SAFETENSORS_DTYPES", "check_output", "convert_component", "require_safetensors"]

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


def check_output(out: str, target: Target) -> None:
    """Refuse ``out`` (a :class:`~ckpt_engine.errors.UsageError` naming the path and the fix)
    when writing it, or replacing it with ``--force``, could destroy a checkpoint:

    * ``out`` is, is inside, or contains the input: the folder given, the checkpoint it resolves
      to, its component folders, and the save folder that checkpoint is in (``iter_*`` folders
      and ``latest_checkpoint.txt``), compared by resolved real path (symbolic links followed)
      and by device and inode (bind mounts, case-insensitive filesystems);
    * ``out`` is a save folder, a checkpoint folder or a component folder (of any run);
    * ``out`` is the current folder or holds it (``convert SRC . --force``).

    Called before anything is written; nothing is changed when it raises.
    """
    out_real = os.path.realpath(local_path(out))
    inputs = _input_folders(target)
    for folder in inputs:
        if _is_within(out_real, folder):
            what = "is" if _same(out_real, folder) else "is inside"
            raise UsageError(
                f"OUT {out} {what} {folder}, which is being converted (a checkpoint or its save folder); "
                "writing there would overwrite the checkpoints and --force would remove them. Write the "
                f"export outside it, e.g. {os.path.join(os.path.dirname(inputs[0]), 'hf_model')}"
            )
        if _is_within(folder, out_real):
            raise UsageError(
                f"OUT {out} contains {folder}, which is being converted; --force would remove the "
                f"checkpoints with it. Name a new folder for the export, e.g. {os.path.join(out, 'hf_model')}"
            )
    cwd = os.path.realpath(os.getcwd())
    if _is_within(cwd, out_real):
        what = "the current folder" if _same(cwd, out_real) else "a folder that holds the current folder"
        raise UsageError(
            f"OUT {out} is {what}; it cannot be replaced (--force) or written as an export from inside it. "
            f"Name a new folder for the export, e.g. {os.path.join(out, 'hf_model')}"
        )
    holds = _holds_checkpoints(out_real)
    if holds is not None:
        raise UsageError(
            f"OUT {out} is {holds}; convert never replaces checkpoints, not even with --force. Name another "
            "OUT (remove the folder yourself first if its checkpoints are really no longer needed)"
        )


def _input_folders(target: Target) -> list[str]:
    """The real paths of the folders ``target`` reads, outermost first: the save folder the
    checkpoint is in (when it is in one), the checkpoint, its component folders, the path given."""
    if is_url(target.given):
        return []  # an object store: nothing local to overlap with
    given, checkpoint = local_path(target.given), local_path(target.checkpoint)
    read = [checkpoint, *map(local_path, target.components.values()), given]
    found = [os.path.realpath(p) for p in read]
    for parent in (os.path.dirname(os.path.abspath(checkpoint)), os.path.dirname(os.path.realpath(checkpoint))):
        if is_save_dir(parent):  # an iter_ folder of a run: the run is protected too
            found.append(os.path.realpath(parent))
    return sorted(dict.fromkeys(found), key=lambda p: (p.count(os.sep), p))


def _ancestry(path: str) -> list[str]:
    """``path`` and every folder above it."""
    chain = [path]
    while os.path.dirname(chain[-1]) != chain[-1]:
        chain.append(os.path.dirname(chain[-1]))
    return chain


def _same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _is_within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or anywhere inside it (both real paths)."""
    return any(_same(p, folder) for p in _ancestry(path))


def _holds_checkpoints(path: str) -> str | None:
    """What ``path`` is when it is a save folder, a checkpoint or a component folder; else None."""
    try:
        with os.scandir(path) as it:
            entries = [(e.name, e.is_dir()) for e in it]
    except OSError:  # not there, not a folder: nothing to protect
        return None
    names = {name for name, _ in entries}
    if LATEST_FILE in names:
        return f"a save folder (it holds {LATEST_FILE})"
    runs = sorted(n for n, is_dir in entries if is_dir and (n.startswith("iter_") or LEFTOVER_RE.match(n)))
    if runs:
        return f"a save folder (it holds {runs[0]}{', ...' if len(runs) > 1 else ''})"
    if METADATA_FILE in names:
        return f"a checkpoint component folder (it holds {METADATA_FILE})"
    if MANIFEST_FILE in names or any(
        is_dir and os.path.isfile(os.path.join(path, n, METADATA_FILE)) for n, is_dir in entries
    ):
        return "a checkpoint folder (it holds component folders)"
    return None


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
    reader: ValueReader,
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
    reader: ValueReader,
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
    reader: ValueReader,
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
