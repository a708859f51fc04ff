"""What a path given on the command line names, resolved without torch: an engine checkpoint (a
checkpoint folder, one component folder, or a save folder's latest), a DCP folder the engine did
not write, a safetensors file, a Hugging Face folder, or a ``torch.save`` file.

The last four hold one state dict each (a *single* target): they have one component, named
``model`` unless the command asks for another name (``diff CKPT model.pt --component optim``
compares the file with ``optim``).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from .._format.layout import component_dirs
from .._format.names import LATEST_FILE, LEFTOVER_RE, MANIFEST_FILE, METADATA_FILE, parse_iteration
from .._format.pointer import diagnose_not_checkpoint, list_checkpoints, read_latest
from .._format.safetensors_header import is_weights_folder
from .._storage.store import store_for
from .._storage.urls import is_url
from ..errors import CheckpointNotFoundError, UsageError
from ..types import STANDARD_COMPONENTS
from .files import exists, is_component_dir, isdir, isfile, normalize

__all__ = ["FILE_KINDS", "KIND_NAMES", "Target", "inside_checkpoint", "is_save_dir", "resolve", "sniff_file"]

#: What a single target is, as the commands name it.
KIND_NAMES = {
    "dcp": "a DCP checkpoint folder",
    "safetensors": "a safetensors file",
    "hf": "a Hugging Face safetensors folder",
    "torch": "a torch.save file",
}
_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
#: The kinds that are files.
FILE_KINDS = ("safetensors", "torch")


@dataclass(frozen=True)
class Target:
    """A path given on the command line, resolved to a checkpoint and its components."""

    given: str
    checkpoint: str
    #: component name -> its folder (an engine or DCP checkpoint) or file/folder (the other formats).
    components: dict[str, str]
    #: How ``given`` was resolved: ``checkpoint``, ``component``, ``latest`` (a save folder: its latest),
    #: or a single target's kind: ``dcp``, ``safetensors``, ``hf``, ``torch``.
    via: str = "checkpoint"

    @property
    def kind(self) -> str:
        """``engine`` for a checkpoint the engine's layout describes, else the single target's kind."""
        return self.via if self.single else "engine"

    @property
    def single(self) -> bool:
        """One state dict, not a checkpoint of components."""
        return self.via in KIND_NAMES

    def describe(self) -> str:
        if self.via == "latest":
            return f"{self.checkpoint} (named by {os.path.join(self.given, LATEST_FILE)})"
        if self.via == "component":
            return f"{self.checkpoint} (component {next(iter(self.components))!r})"
        if self.single:
            return f"{self.checkpoint} ({KIND_NAMES[self.via]})"
        return self.checkpoint


def is_save_dir(path: str) -> bool:
    """A folder with ``latest_checkpoint.txt`` or ``iter_*`` checkpoint folders in it."""
    return isfile(os.path.join(path, LATEST_FILE)) or bool(list_checkpoints(path))


def sniff_file(path: str) -> str | None:
    """``safetensors`` or ``torch`` by the file's first bytes (a header length followed by a JSON
    object, or a ``torch.save`` zip), ``torch`` for a legacy ``torch.save`` pickle, else ``None``.

    The safetensors rule is checked first: its 8-byte little-endian header length may start with
    any byte, ``0x80`` (a pickle's first byte) among them, one valid file in 256."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open: its reader refuses it, naming it
            return (
                "safetensors" if path.endswith(".safetensors") else "torch" if path.endswith(_TORCH_SUFFIXES) else None
            )
        with open(path, "rb") as f:
            head = f.read(9)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return None
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= size - 8:
        return "safetensors"
    if head[:4] == b"PK\x03\x04" or head[:1] == b"\x80":
        return "torch"
    if path.endswith(".safetensors"):
        return "safetensors"  # damaged: its reader says how
    if path.endswith(_TORCH_SUFFIXES):
        return "torch"
    return None


def resolve(path: str, components: Sequence[str] = (), *, files: bool = True) -> Target:
    """Resolve ``path``: a checkpoint folder, one component folder, a save folder (its latest), or
    (``files``) a DCP folder the engine did not write, a safetensors file, a Hugging Face folder or a
    ``torch.save`` file. ``components`` selects components; an unknown one is an error naming the rest."""
    path = normalize(path)
    if not exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not isdir(path):
        return _single(path, _file_kind(path, files), components)
    if is_component_dir(path):
        if not inside_checkpoint(path):
            return _single(path, _folder_kind(path, "dcp", files), components)
        checkpoint = os.path.dirname(path) or "."
        return _select(Target(path, checkpoint, {os.path.basename(path): path}, "component"), components)
    if not is_url(path) and is_weights_folder(path) and not component_dirs(path):
        return _single(path, _folder_kind(path, "hf", files), components)
    return _select(_engine_checkpoint(path), components)


def _file_kind(path: str, files: bool) -> str:
    kind = None if is_url(path) else sniff_file(path)
    if kind is None or not files:
        what = KIND_NAMES[kind] if kind else "a file"
        fix = "; `ckpt-engine inspect`, `verify` and `diff` read it" if kind else ""
        raise CheckpointNotFoundError(f"{path} is {what}, not a checkpoint folder{fix}")
    return kind


def _folder_kind(path: str, kind: str, files: bool) -> str:
    if not files:
        raise CheckpointNotFoundError(
            f"{path} is {KIND_NAMES[kind]}, not an engine checkpoint; `ckpt-engine inspect`, `verify` and `diff` "
            "read it"
        )
    if kind == "hf" and is_url(path):
        raise UsageError(f"{path}: Hugging Face folders are read from a local folder; download it first")
    return kind


def inside_checkpoint(component: str) -> bool:
    """Whether the DCP folder ``component`` is a component of an engine checkpoint (its parent has
    the engine's manifest or a checkpoint's name, or it has a component's name), not a DCP
    checkpoint of its own (``dcp.save(state, checkpoint_id=...)``)."""
    parent = os.path.dirname(component) or "."
    name = os.path.basename(parent)
    if os.path.basename(component) in STANDARD_COMPONENTS:
        return True
    if parse_iteration(name) is not None or LEFTOVER_RE.match(name):
        return True
    return isfile(os.path.join(parent, MANIFEST_FILE))


def _single(path: str, kind: str, components: Sequence[str]) -> Target:
    if len(components) > 1:
        raise UsageError(f"{path} is {KIND_NAMES[kind]}: one state dict, so at most one --component")
    name = components[0] if components else "model"
    return Target(given=path, checkpoint=path, components={name: path}, via=kind)


def _engine_checkpoint(path: str) -> Target:
    checkpoint, via = path, "checkpoint"
    if isfile(os.path.join(path, LATEST_FILE)):
        name = read_latest(path)
        assert name is not None
        checkpoint, via = os.path.join(path, name), "latest"
        if not isdir(checkpoint):
            raise CheckpointNotFoundError(
                f"{os.path.join(path, LATEST_FILE)} names {name!r}, but {checkpoint} does not exist"
            )
    elif list_checkpoints(path):
        names = ", ".join(os.path.basename(p) for _, p in list_checkpoints(path)[-3:])
        raise CheckpointNotFoundError(
            f"{path} is a save folder without {LATEST_FILE}; name one of its checkpoints, e.g. "
            f"{os.path.join(path, os.path.basename(list_checkpoints(path)[-1][1]))} (newest: {names})"
        )
    found = {name: os.path.join(checkpoint, name) for name in component_dirs(checkpoint)}
    if not found:
        raise CheckpointNotFoundError(
            f"{checkpoint} is not a checkpoint: it has no component folders (model/, optim/, ...) and no "
            f"{METADATA_FILE}, safetensors or torch.save files"
        )
    # A plain folder with sub-folders is no interrupted save: say what it is, as verify and plan do.
    not_one = diagnose_not_checkpoint(checkpoint, list(found), store_for(checkpoint))
    if not_one is not None:
        raise not_one
    return Target(given=path, checkpoint=checkpoint, components=found, via=via)


def _select(target: Target, components: Sequence[str]) -> Target:
    if not components:
        return Target(target.given, target.checkpoint, dict(sorted(target.components.items())), target.via)
    unknown = [c for c in components if c not in target.components]
    if unknown:
        names, present = ", ".join(map(repr, unknown)), ", ".join(target.components)
        raise CheckpointNotFoundError(f"{target.checkpoint} has no component {names}; it has: {present}")
    return Target(target.given, target.checkpoint, {c: target.components[c] for c in sorted(components)}, target.via)
