"""Values of a DCP component folder, read through DCP: tensors assembled from every shard, other
values with ``torch.load(weights_only=True)``.

Metadata is read with :func:`ckpt_engine._format.metadata.read_metadata` (parsed without pickle,
then validated): inspecting an untrusted checkpoint never runs code from it (unless the user passes
``--trust``, for a checkpoint they trust). Tensors are read a batch at a time (a batch holds at most
``budget`` bytes, or one tensor when a tensor is larger), so memory is bounded by the largest
tensor, not by the checkpoint. The key tables and paths the commands share without torch are
:mod:`.keys`, :mod:`.target` and :mod:`.files` (re-exported here).
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import ReadItem

from .._dcpio.dist import quiet_dcp
from .._dcpio.fast_read import FastFileSystemReader
from .._dcpio.object_read import ObjectStoreReader, reader_for
from .._dcpio.unsafe import blocked_global, refine_unsafe
from .._format.layout import check_component_files
from .._format.manifest import lookup_manifest
from .._format.metadata import read_metadata
from .._format.metadata_read import is_rank_local
from .._format.names import METADATA_FILE
from .._format.verify import FileBlocks, component_blocks
from .._storage.fscheck import require_regular_file
from .._storage.store import open_store
from ..errors import (
    CkptEngineError,
    CorruptCheckpointError,
    PartialCheckpointError,
    UnsafeCheckpointError,
    clip,
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
from .keys import DEFAULT_BUDGET as DEFAULT_BUDGET
from .keys import KeyInfo as KeyInfo
from .keys import Unreadable as Unreadable
from .keys import batches as batches
from .keys import key_infos as key_infos
from .keys import match_keys as match_keys
from .keys import prefix_of as prefix_of
from .keys import refused_value as refused_value
from .keys import summarize_value as summarize_value
from .parts import Part, checkpoint_of, other_parts, part_of, partial_read_error, require_not_per_rank
from .target import Target as Target
from .target import is_save_dir as is_save_dir
from .target import resolve as resolve

# -- reading values -------------------------------------------------------------------------


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
    #: What the component holds when it is one rank's part (a rank-local checkpoint), else ``None``.
    part: Part | None = field(init=False, default=None)
    #: The per-block digests the checkpoint's manifest records for the component's data files:
    #: every byte a read takes is checked, as a load checks it (none without a manifest).
    blocks: dict[str, FileBlocks] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        store = open_store(self.path)
        if store.capabilities.local_files:
            require_regular_file(os.path.join(self.path, METADATA_FILE), "DCP metadata")
        self.metadata = read_metadata(self.path)
        # Every tensor covered exactly by chunks whose bytes exist, before anything is allocated.
        check_component_files(self.path, self.metadata, store)
        self.keys = key_infos(self.metadata)
        self.part = part_of(self.path, is_rank_local(self.metadata), self.keys)
        checkpoint, name = checkpoint_of(self.path)
        manifest = lookup_manifest(checkpoint, store).manifest if checkpoint else None
        if manifest is not None:
            self.blocks = component_blocks(manifest, name, self.path, store.join)

    def require_whole(self, keys: Sequence[str]) -> None:
        """Raise :class:`~ckpt_engine.errors.PartialCheckpointError` for the first tensor of ``keys``
        the component holds only part of (one rank's shards): no read fills the rest in."""
        partial = [key for key in keys if self.keys[key].held is not None]
        if partial:
            chunks = self.metadata.state_dict_metadata[partial[0]].chunks  # type: ignore[union-attr]
            boxes = ((tuple(c.offsets), tuple(c.sizes)) for c in chunks)
            raise partial_read_error(self.path, self.keys[partial[0]], boxes, self.part, len(partial))

    def require_the_jobs(self) -> str | None:
        """For one rank's part of a job of several ranks (the node-local tier's), raise
        :class:`~ckpt_engine.errors.PartialCheckpointError` where it is not the job's whole
        component: it holds state saved per rank, or another rank's part on this node holds other
        keys (pipeline stages, experts held per rank). Returns a note where no other rank's part
        is here to compare with (``None`` otherwise)."""
        part = self.part
        if part is None or part.rank is None or (part.world_size or 1) < 2:
            return None
        require_not_per_rank(part)
        mine, compared = set(self.metadata.state_dict_metadata), 0
        for rank, folder in other_parts(part):
            theirs = set(read_metadata(folder).state_dict_metadata)
            if theirs != mine:
                differ = sorted(theirs ^ mine)
                raise PartialCheckpointError(
                    f"{self.path} is {part.who}, and rank {rank}'s part of the same step holds other keys (they "
                    f"differ in {len(differ)}, e.g. {clip(differ[0])}): the ranks held different parts of the model "
                    "(pipeline stages, experts). Convert save_dir's checkpoint of this step, which holds them all"
                )
            compared += 1
        if compared:
            return None
        return (
            "the other ranks' parts are not on this node, so it cannot be told whether they hold other keys "
            "(a data-parallel job's part holds the whole model; a pipeline stage's does not)"
        )

    def read(self, keys: Sequence[str]) -> dict[str, Any]:
        """Full values of ``keys`` (tensors assembled from all their shards), in one read; a tensor
        the component holds only part of is refused (:meth:`require_whole`)."""
        self.require_whole(keys)
        template: dict[str, Any] = {}
        for key in keys:
            info = self.keys[key]
            template[key] = torch.zeros(info.shape, dtype=info.dtype) if info.is_tensor else None
        if not template:
            return {}
        store = open_store(self.path)
        reader = reader_for(self.path, store, self.metadata, FastFileSystemReader)
        if isinstance(reader, (FastFileSystemReader, ObjectStoreReader)):
            reader.blocks = self.blocks
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
