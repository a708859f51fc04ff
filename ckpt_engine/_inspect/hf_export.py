"""``ckpt-engine convert CKPT OUT_DIR --to hf``: a Hugging Face safetensors folder from a component.

The folder holds ``model.safetensors`` (everything fits one shard) or
``model-00001-of-0000N.safetensors`` shards plus ``model.safetensors.index.json``
(``metadata.total_size``, ``weight_map``), as ``transformers``' ``save_pretrained`` writes it;
every file carries ``{"format": "pt"}`` metadata. It loads with the ``safetensors`` package and
back into a model through ``load_path``; with the model's config (below), with ``transformers``'
``from_pretrained`` too.

* **Consolidated:** each tensor is assembled from all ranks' shards (any world size).
* **Bounded memory:** shard headers are computed from the checkpoint's metadata; tensors are then
  read a batch at a time (``--budget``, default 64 MiB, or one tensor if larger) and appended.
* **Nothing half-written:** the folder is built under a temporary name next to ``OUT_DIR`` and
  renamed into place; every file is fsynced first. Each header is read back and checked.
* **Replacing** (``replace=True``): the previous folder is moved aside, the new one renamed in,
  the old one removed; if the rename fails the previous folder is put back. ``OUT_DIR`` a symbolic
  link to a folder: the folder it points to is replaced and the link kept (see :func:`_destination`).
* Non-tensor values (safetensors holds tensors only) are skipped and listed.
* **A model's config** (``hf_config``, ``--hf-config DIR``): ``config.json`` (and
  ``generation_config.json`` when the folder has one) of a Hugging Face folder of the same
  architecture are validated (:func:`read_hf_config`) and copied in, so ``from_pretrained`` of
  the folder works. With ``--dtype`` the config's ``dtype``/``torch_dtype`` is set to it.
* **Tied weights written once**, as ``save_pretrained`` does. An engine checkpoint stores a
  tied tensor under each of its keys (``state_dict()`` lists both); when the config ties word
  embeddings (``tie_word_embeddings`` true, at the top or in ``text_config``), the tensors of
  shape ``[vocab_size, ...]`` whose dtype, shape and bytes are equal are one tensor: the first
  in the checkpoint's key order (the model's ``state_dict()`` order: the input embedding) is
  written, the others are left out and listed (:func:`find_ties`). Nothing else is merged:
  equal bytes alone (two LayerNorm weights still at ones) are not a tie.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .._format import bounded_json
from .._format.safetensors import DTYPE_CODES, INDEX_FILE, SINGLE_FILE, encode_header, read_header
from .._storage.fscheck import read_regular
from ..errors import CkptEngineError, UsageError
from .keys import ValueReader
from .reader import DEFAULT_BUDGET

__all__ = [
    "DTYPE_ALIASES",
    "HFConfig",
    "HFConfigError",
    "HFExport",
    "export_hf",
    "find_ties",
    "parse_shard_size",
    "read_hf_config",
]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"

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


class HFConfigError(UsageError):
    """``--hf-config`` names no usable Hugging Face config: no folder, no ``config.json``, JSON
    that does not parse, or a config without ``model_type``."""


@dataclass(frozen=True)
class HFConfig:
    """The config files of a Hugging Face folder, read and validated by :func:`read_hf_config`."""

    source: str
    config: dict[str, Any]
    config_bytes: bytes
    #: ``generation_config.json``'s bytes, when the folder has one.
    generation_bytes: bytes | None = None

    def _text(self, field_name: str) -> Any:
        """A field of the config, else of its ``text_config`` (multimodal models nest the LM's)."""
        if field_name in self.config:
            return self.config[field_name]
        text = self.config.get("text_config")
        return text.get(field_name) if isinstance(text, dict) else None

    @property
    def ties_word_embeddings(self) -> bool:
        return self._text("tie_word_embeddings") is True

    @property
    def vocab_size(self) -> int | None:
        size = self._text("vocab_size")
        return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None

    @property
    def architecture(self) -> str | None:
        """The model class ``save_pretrained`` recorded (``architectures[0]``), if any."""
        names = self.config.get("architectures")
        if isinstance(names, list) and names and isinstance(names[0], str) and names[0].isidentifier():
            return names[0]
        return None

    def files(self, cast: torch.dtype | None) -> dict[str, bytes]:
        """What to write into the export: ``config.json`` (its ``dtype``/``torch_dtype`` set to
        ``cast`` when given; else the bytes as they were), ``generation_config.json`` if any."""
        data = self.config_bytes
        if cast is not None and ({"dtype", "torch_dtype"} & self.config.keys()):
            name = str(cast).removeprefix("torch.")
            changed = {k: (name if k in ("dtype", "torch_dtype") else v) for k, v in self.config.items()}
            data = (json.dumps(changed, indent=2, sort_keys=True) + "\n").encode()
        out = {CONFIG_FILE: data}
        if self.generation_bytes is not None:
            out[GENERATION_CONFIG_FILE] = self.generation_bytes
        return out


#: Largest config file read (a config is a few KiB), deepest JSON nesting in it (transformers'
#: configs nest a handful of levels: ``text_config.rope_scaling``) and most digits of an integer.
MAX_CONFIG_BYTES = 16 << 20
MAX_CONFIG_DEPTH = 64
MAX_CONFIG_INT_DIGITS = 100


def _read_json_object(path: str, what: str) -> tuple[dict[str, Any], bytes]:
    """The JSON object in the config file ``path``: a regular file (a FIFO is refused, not waited
    on), at most :data:`MAX_CONFIG_BYTES`, its nesting and integers bounded before they are parsed."""
    try:
        data = read_regular(path, MAX_CONFIG_BYTES, "a JSON config file")
    except CkptEngineError as err:
        raise HFConfigError(f"{err}; {what}") from None
    except OSError as err:
        raise HFConfigError(f"cannot read {path}: {err.strerror or err}; {what}") from err
    if len(data) > MAX_CONFIG_BYTES:
        raise HFConfigError(f"{path} is over {MAX_CONFIG_BYTES >> 20} MiB, too large for a config file; {what}")
    try:
        value = bounded_json.loads(data, max_depth=MAX_CONFIG_DEPTH, max_int_digits=MAX_CONFIG_INT_DIGITS)
    except bounded_json.JSONRefused as err:
        raise HFConfigError(f"{path}: {err}; {what}") from None
    if not isinstance(value, dict):
        raise HFConfigError(f"{path} holds a JSON {type(value).__name__}, not an object; {what}")
    return value, data


def read_hf_config(path: str) -> HFConfig:
    """The config of the Hugging Face folder ``path`` (or of the ``config.json`` file ``path``),
    validated: :class:`HFConfigError` naming the file and the fix when it is not usable."""
    fix = "give the folder that transformers' save_pretrained wrote for this model (it holds config.json)"
    if os.path.isfile(path) and os.path.basename(path) == CONFIG_FILE:
        path = os.path.dirname(path) or "."
    if not os.path.exists(path):
        raise HFConfigError(f"--hf-config {path} does not exist; {fix}")
    if not os.path.isdir(path):
        raise HFConfigError(f"--hf-config {path} is a file, not a folder; {fix}")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.lexists(config_path):
        raise HFConfigError(f"--hf-config {path} has no {CONFIG_FILE}; {fix}")
    config, data = _read_json_object(config_path, fix)
    if not isinstance(config.get("model_type"), str) or not config["model_type"]:
        raise HFConfigError(
            f'{config_path} has no model_type (a string such as "llama"): transformers cannot tell the '
            f"model class from it; {fix}"
        )
    generation = None
    generation_path = os.path.join(path, GENERATION_CONFIG_FILE)
    if os.path.lexists(generation_path):
        _, generation = _read_json_object(
            generation_path, f"fix or remove it (it is optional; from_pretrained reads it when present), or {fix}"
        )
    return HFConfig(source=path, config=config, config_bytes=data, generation_bytes=generation)


def find_ties(reader: ValueReader, keys: Sequence[str], config: HFConfig | None) -> dict[str, str]:
    """``{left-out key: written key}`` for the tied word embeddings among ``keys`` (see the module
    docstring): empty without a config that ties them or names ``vocab_size``. Reads the
    candidates one at a time, holding at most one tensor per distinct value besides it."""
    if config is None or not config.ties_word_embeddings or config.vocab_size is None:
        return {}
    groups: dict[tuple[torch.dtype, tuple[int, ...]], list[str]] = {}
    for key in keys:
        info = reader.keys[key]
        if info.is_tensor and info.dtype is not None and len(info.shape) >= 2 and info.shape[0] == config.vocab_size:
            groups.setdefault((info.dtype, tuple(info.shape)), []).append(key)
    ties: dict[str, str] = {}
    for group in groups.values():
        if len(group) < 2:
            continue
        kept: list[tuple[str, torch.Tensor]] = []
        for key, value in reader.iter_values(group, budget=1):  # one tensor per read
            data = value.detach().contiguous().reshape(-1).view(torch.uint8)
            twin = next((k for k, seen in kept if torch.equal(seen, data)), None)
            if twin is None:
                kept.append((key, data))
            else:
                ties[key] = twin
        del kept
    return ties


@dataclass(frozen=True)
class HFExport:
    out_dir: str
    files: tuple[str, ...]
    total_size: int
    written: int
    left_out: tuple[str, ...]
    #: Tied keys written once: ``{left-out key: the key written}``.
    tied: dict[str, str] = field(default_factory=dict)
    #: The config files copied in (``config.json``, ``generation_config.json``).
    config_files: tuple[str, ...] = ()


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
    reader: ValueReader,
    keys: Sequence[str],
    out_dir: str,
    *,
    max_shard_size: int,
    cast: torch.dtype | None = None,
    progress: Callable[[int], None] | None = None,
    budget: int = DEFAULT_BUDGET,
    replace: bool = False,
    hf_config: HFConfig | None = None,
) -> HFExport:
    """Write ``keys`` of ``reader``'s component as an HF safetensors folder at ``out_dir``, with
    ``hf_config``'s files and its tied weights once (see the module docstring)."""
    ties = find_ties(reader, keys, hf_config)
    tensors = [k for k in keys if reader.keys[k].is_tensor and k not in ties]
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
        config_files = hf_config.files(cast) if hf_config is not None else {}
        for name, data in config_files.items():
            _write_file(os.path.join(tmp, name), data)
        _fsync_dir(tmp)
        _move_into_place(tmp, dest, replace)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return HFExport(out_dir, tuple(names), sum(s for _, s in sizes), len(tensors), left_out, ties, tuple(config_files))


def _write_shard(
    reader: ValueReader,
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
