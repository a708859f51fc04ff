"""What the command line reads from checkpoints: paths, key tables, values, streamed tensors.

Everything here reads metadata with :func:`ckpt_engine._format.metadata.read_metadata` (parsed without
pickle, then validated) and values with ``torch.load(weights_only=True)``: inspecting an untrusted checkpoint
never runs code from it (unless the user passes ``--trust``, for a checkpoint they trust).
Tensors are read a batch at a time (a batch holds at most ``budget``
bytes, or one tensor when a tensor is larger), so memory is bounded by the largest tensor, not
by the checkpoint.
"""

from __future__ import annotations

import fnmatch
import io
import os
import pickle
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import ReadItem

from .._dcpio.dist import quiet_dcp
from .._dcpio.object_read import reader_for
from .._dcpio.unsafe import blocked_global, refine_unsafe
from .._format.layout import check_component_files, component_dirs
from .._format.metadata import SafeFileSystemReader, read_metadata
from .._format.names import LATEST_FILE, METADATA_FILE
from .._format.not_checkpoint import diagnose_not_checkpoint
from .._format.pointer import list_checkpoints, read_latest
from .._storage.fscheck import require_regular_file
from .._storage.store import open_store, store_for
from ..errors import (
    CheckpointNotFoundError,
    CkptEngineError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    first_failure,
)
from .files import disk_usage as disk_usage  # re-exported: the helpers lived here
from .files import exists as exists
from .files import human_bytes as human_bytes
from .files import is_component_dir as is_component_dir
from .files import isdir as isdir
from .files import isfile as isfile
from .files import normalize as normalize
from .files import table as table
from .files import uncommitted_dirs as uncommitted_dirs

#: Default bytes of tensor data read per batch (a single larger tensor is read on its own).
DEFAULT_BUDGET = 64 << 20


@dataclass(frozen=True)
class Target:
    """A path given on the command line, resolved to a checkpoint and its component folders."""

    given: str
    checkpoint: str
    #: component name -> component folder, sorted by name.
    components: dict[str, str]
    #: How ``given`` was resolved: ``checkpoint``, ``component`` or ``latest`` (a save folder).
    via: str = "checkpoint"

    def describe(self) -> str:
        if self.via == "latest":
            return f"{self.checkpoint} (named by {os.path.join(self.given, LATEST_FILE)})"
        if self.via == "component":
            return f"{self.checkpoint} (component {next(iter(self.components))!r})"
        return self.checkpoint


def is_save_dir(path: str) -> bool:
    """A folder with ``latest_checkpoint.txt`` or ``iter_*`` checkpoint folders in it."""
    return isfile(os.path.join(path, LATEST_FILE)) or bool(list_checkpoints(path))


def resolve(path: str, components: Sequence[str] = ()) -> Target:
    """Resolve ``path``: a checkpoint folder, one component folder, or a save folder (its latest).

    ``components`` (optional) selects components; an unknown one is an error naming the rest.
    """
    path = normalize(path)
    if not exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not isdir(path):
        raise CheckpointNotFoundError(f"{path} is a file, not a checkpoint folder")
    via = "checkpoint"
    if is_component_dir(path):
        found = {os.path.basename(path): path}
        checkpoint, via = os.path.dirname(path) or ".", "component"
    else:
        checkpoint = path
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
                f"{checkpoint} is not a checkpoint: it has no component folders (model/, optim/, ...)"
            )
        # A plain folder with sub-folders is no interrupted save: say what it is, as verify and plan do.
        not_one = diagnose_not_checkpoint(checkpoint, list(found), store_for(checkpoint))
        if not_one is not None:
            raise not_one
    if components:
        unknown = [c for c in components if c not in found]
        if unknown:
            raise CheckpointNotFoundError(
                f"{checkpoint} has no component {', '.join(map(repr, unknown))}; it has: {', '.join(found)}"
            )
        found = {c: found[c] for c in components}
    return Target(given=path, checkpoint=checkpoint, components=dict(sorted(found.items())), via=via)


# -- keys -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyInfo:
    """One storage key of a component, from its metadata."""

    key: str
    is_tensor: bool
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()
    #: Chunks the tensor is stored in (one per saved shard); 1 for a non-tensor value.
    shards: int = 1
    #: Bytes the key occupies in the data files.
    stored_bytes: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor in memory (0 for a non-tensor value)."""
        if not self.is_tensor or self.dtype is None:
            return 0
        return self.numel * self.dtype.itemsize

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.") if self.dtype is not None else "-"

    def spec(self) -> str:
        return f"{self.dtype_name}{list(self.shape)}" if self.is_tensor else "<value>"


def key_infos(md: Metadata) -> dict[str, KeyInfo]:
    """Every key of a component's metadata, in metadata order."""
    stored: dict[str, int] = {}
    for index, info in (md.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(getattr(info, "length", 0))
    out: dict[str, KeyInfo] = {}
    for key, item in md.state_dict_metadata.items():
        if isinstance(item, TensorStorageMetadata):
            out[key] = KeyInfo(
                key=key,
                is_tensor=True,
                dtype=item.properties.dtype,
                shape=tuple(item.size),
                shards=len(item.chunks),
                stored_bytes=stored.get(key, 0),
            )
        else:
            assert isinstance(item, BytesStorageMetadata)
            out[key] = KeyInfo(key=key, is_tensor=False, stored_bytes=stored.get(key, 0))
    return out


def match_keys(keys: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """Keys matching any of the ``fnmatch`` ``patterns`` (all keys when there are none)."""
    if not patterns:
        return list(keys)
    return [k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)]


def prefix_of(key: str) -> str:
    return key.split(".", 1)[0]


# -- reading values -------------------------------------------------------------------------


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class Unreadable:
    """A non-tensor value that ``weights_only=True`` unpickling refuses (it needs arbitrary code),
    or that a damaged data file does not hold."""

    #: What refused it, short: the global the unpickler refused (``_io.BytesIO``), or an error line.
    reason: str
    #: Whether ``--trust`` (``weights_only=False``) would read it; false for a damaged file.
    needs_trust: bool = True

    def __str__(self) -> str:
        if self.needs_trust:
            return f"<not readable with weights_only: {self.reason}; --trust reads it>"
        return f"<unreadable: {self.reason}>"


def refused_value(err: BaseException) -> Unreadable:
    """The short placeholder for a value ``weights_only`` refused: torch's message is paragraphs
    long, with terminal escape codes; what matters is the global it refused."""
    text = _ANSI_RE.sub("", str(err))
    found = _GLOBAL_RE.search(text)
    if found:
        return Unreadable(found.group(1))
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return Unreadable(first[:80])


class _ReadPlanner(DefaultLoadPlanner):
    """Reads the requested flat storage keys; non-tensor values with ``weights_only=True`` unless
    ``trust``. Keeps each value's stored bytes, so values compare even when they cannot be read."""

    def __init__(self, trust: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.trust = trust
        self.stored: dict[str, bytes] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        key = read_item.dest_index.fqn
        self.stored[key] = value.getvalue()
        try:
            obj: Any = torch.load(value, weights_only=not self.trust)
        except pickle.UnpicklingError as err:
            hostile = blocked_global(err, blocked_only=True)
            if hostile is not None:  # crafted, not merely unreadable: refuse, naming the global
                raise UnsafeCheckpointError(
                    f"value {read_item.storage_index.fqn!r} references the global {hostile}, which "
                    "weights_only=True unpickling refuses to construct: the checkpoint was crafted or tampered with"
                ) from None
            obj = refused_value(err)
        # Not flattened: the keys are the flat storage keys of the dict handed to dcp.load.
        self.original_state_dict[key] = obj


@dataclass
class ComponentReader:
    """Reads values of one component folder, safely and a batch at a time."""

    path: str
    #: Read non-tensor values with ``weights_only=False``: runs any code the checkpoint holds.
    trust: bool = False
    metadata: Metadata = field(init=False)
    keys: dict[str, KeyInfo] = field(init=False)
    #: The stored (pickled) bytes of the non-tensor values of the last :meth:`read`.
    stored: dict[str, bytes] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        store = open_store(self.path)
        if store.capabilities.local_files:
            require_regular_file(os.path.join(self.path, METADATA_FILE), "DCP metadata")
        self.metadata = read_metadata(self.path)
        # Every tensor covered exactly by chunks whose bytes exist, before anything is allocated.
        check_component_files(self.path, self.metadata, store)
        self.keys = key_infos(self.metadata)

    def read(self, keys: Sequence[str]) -> dict[str, Any]:
        """Full values of ``keys`` (tensors assembled from all their shards), in one read."""
        template: dict[str, Any] = {}
        for key in keys:
            info = self.keys[key]
            template[key] = torch.zeros(info.shape, dtype=info.dtype) if info.is_tensor else None
        if not template:
            return {}
        store = open_store(self.path)
        reader = reader_for(self.path, store, self.metadata, SafeFileSystemReader)
        planner = _ReadPlanner(self.trust)
        try:
            with quiet_dcp():
                dcp.load(template, storage_reader=reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as exc:
            err = first_failure(exc)[0]
            if isinstance(err, CkptEngineError):
                raise refine_unsafe(err, self.path) from None
            what = keys[0] if len(keys) == 1 else f"{len(keys)} keys from {keys[0]!r}"
            raise CorruptCheckpointError(
                f"{self.path}: cannot read {what}: {type(err).__name__}: {str(err).strip().splitlines()[0]}"
                " (the data file is corrupt or truncated; `ckpt-engine verify` checks it)"
                if str(err).strip()
                else f"{self.path}: cannot read {what}: {type(err).__name__}"
            ) from err
        self.stored = planner.stored
        return template

    def iter_values(self, keys: Sequence[str], budget: int = DEFAULT_BUDGET) -> Iterator[tuple[str, Any]]:
        """``(key, value)`` for ``keys`` in order, read in batches of at most ``budget`` tensor bytes."""
        for batch in batches(keys, self.keys, budget):
            values = self.read(batch)
            for key in batch:
                yield key, values.pop(key)


def batches(keys: Sequence[str], infos: dict[str, KeyInfo], budget: int) -> Iterator[list[str]]:
    """Consecutive groups of ``keys`` whose tensors total at most ``budget`` bytes (or one tensor)."""
    batch: list[str] = []
    size = 0
    for key in keys:
        n = infos[key].nbytes
        if batch and size + n > budget:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch


# -- formatting -----------------------------------------------------------------------------


def summarize_value(value: Any, limit: int = 60) -> str:
    if isinstance(value, Unreadable):
        return str(value)
    if isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
