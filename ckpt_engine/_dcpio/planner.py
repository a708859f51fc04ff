"""DCP planners that run the engine's hooks inside DCP's own phases.

Load: :class:`EngineLoadPlanner` runs ``remap_keys`` and ``pre_load_plan`` in
``create_local_plan`` (DCP's "plan" step), so an error on one rank is raised on every rank as a
``CheckpointException`` instead of leaving the others waiting in a collective. Read items are
stock DCP read items whose ``storage_index`` names the storage key and whose ``dest_index``
names the destination key: DCP reads by the former and places by the latter. A storage key that
feeds several destinations is read once; :meth:`commit_tensor` and :meth:`load_bytes` copy it to
the other destinations.

Save: :class:`EngineSavePlanner` renames flattened keys by a precomputed key map. It holds only
plain data, so it can be pickled to a background writer process.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import pickle
from collections.abc import Collection, Mapping
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from .._format.metadata_read import is_rank_local
from .._format.names import resolve_per_rank
from ..errors import LoadStrictnessError, RankLocalCoverageError, UnsafeCheckpointError, clip
from ..pipeline import Pipeline
from ..report import ComponentReport, OverlapRecord, SkipRecord
from ..staging import TensorKey, local_tensor, memory_key
from ..types import Decision, LoadContext, PlanEntry, RemapContext, ValueSpec
from .archive_write import archive_settings, value_archive
from .coordination import PlanDigest, plan_digest
from .local_plan import plain_write_items
from .plain_values import plain_value
from .torch_private import local_chunks
from .unsafe import unsafe_value_error, weights_only_reason

__all__ = ["EngineLoadPlanner", "EngineSavePlanner", "already_flat", "flat_keys", "target_spec"]


@functools.lru_cache(maxsize=4096)
def _tensor_spec(shape: tuple[int, ...], dtype: torch.dtype) -> ValueSpec:
    """One spec object per shape and dtype (immutable): 50,000 parameters of one shape hold one,
    not 100,000 for their targets and stored tensors (about 12 MB of such a load's peak)."""
    return ValueSpec(is_tensor=True, shape=shape, dtype=dtype)


def target_spec(value: Any) -> ValueSpec:
    if isinstance(value, torch.Tensor):  # DTensor included: .shape is the global shape
        return _tensor_spec(tuple(value.shape), value.dtype)
    return _VALUE_SPECS.get(type(value)) or ValueSpec(is_tensor=False, type_name=type(value).__name__)


def stored_spec(md: TensorStorageMetadata | BytesStorageMetadata | None) -> ValueSpec | None:
    if md is None:
        return None
    if isinstance(md, TensorStorageMetadata):
        return _tensor_spec(tuple(md.size), md.properties.dtype)
    return _VALUE_SPECS[bytes]  # the spec of every stored value


def _redirect(item: ReadItem, dest: str) -> ReadItem:
    if item.dest_index.fqn == dest:
        return item
    return dataclasses.replace(item, dest_index=dataclasses.replace(item.dest_index, fqn=dest))


def already_flat(state_dict: Mapping[Any, Any]) -> bool:
    """Whether DCP's flattening leaves ``state_dict`` as it is: every key a string, no value a
    mapping or a list (DCP walks into those; a tuple is a leaf to it), every tensor a plain one or
    a DTensor not on the meta device (so ``_flatten_sharded_tensors``, which rewrites only
    ``ShardedTensor`` s, and the load's meta-tensor initialisation change nothing). Then
    ``flatten_state_dict`` maps every key to the path ``(key,)``, and both planners set up
    without DCP's generic walk, about 3 microseconds a value on every save and load of a model
    or flattened optimizer state dict; ``tests/dcpio/test_fast_paths.py`` pins the set-up against DCP's."""
    for k, v in state_dict.items():
        if type(k) is not str:
            return False
        t = type(v)
        if t is torch.Tensor or t is DTensor:
            if v.is_meta:
                return False
        elif t not in _LEAVES and isinstance(v, (Mapping, list, torch.Tensor)):  # a subclass of one
            return False
    return True


#: Value types DCP's flattening leaves as they are, checked before the slower ``isinstance`` (a
#: flattened AdamW state dict holds about three of these a tensor).
_LEAVES: frozenset[type] = frozenset({bool, int, float, complex, str, bytes, tuple, type(None)})
#: One spec per plain-value type (immutable: shared by an optimizer's thousands of hyper-parameters).
_VALUE_SPECS = {t: ValueSpec(is_tensor=False, type_name=t.__name__) for t in _LEAVES}


def _same_layout(a: Any, b: Any) -> bool:
    """Whether one read of a storage key can be copied verbatim from destination ``a`` to ``b``."""
    if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
        return False
    if not isinstance(a, torch.Tensor):
        return True
    if a.shape != b.shape or isinstance(a, DTensor) != isinstance(b, DTensor):
        return False
    return [(c.offsets, c.sizes) for c in local_chunks(a)] == [(c.offsets, c.sizes) for c in local_chunks(b)]


def _set_path(root: Any, path: tuple[Any, ...], value: Any) -> None:
    cur = root
    for part in path[:-1]:
        cur = cur[part]
    cur[path[-1]] = value


#: The origin of an array of each number of dimensions (``torch.Size`` is immutable: shared).
_ZEROS = tuple(torch.Size([0] * n) for n in range(9))
_BYTE_ORIGIN = torch.Size((0,))


def _whole_tensor_read(storage: str, dest: str, value: Any, md: Any) -> ReadItem | None:
    """The one read item DCP's planner makes for a plain tensor (0-d included) stored whole as one
    chunk of its shape (``create_read_items_for_chunk_list`` with one local and one saved chunk)
    or for a stored value (``BytesStorageMetadata``), built directly: DCP's general sweep costs
    about 35 microseconds a tensor, 15 a value. ``None`` for anything else (DTensor, several
    chunks, an empty tensor, another shape): DCP plans those. ``test_load_speed.py`` pins it."""
    if type(md) is BytesStorageMetadata:  # DCP's _create_read_item_for_byteio: offsets, length 0
        o, d, s = _BYTE_ORIGIN, MetadataIndex(dest), MetadataIndex(storage)
        return None if isinstance(value, DTensor) else ReadItem(LoadItemType.BYTE_IO, d, o, s, o, o)
    if type(value) is not torch.Tensor or type(md) is not TensorStorageMetadata or len(md.chunks) != 1:
        return None
    shape, chunk = value.shape, md.chunks[0]
    if shape != md.size or chunk.sizes != shape or any(chunk.offsets) or not all(shape):
        return None
    zeros = _ZEROS[len(shape)] if len(shape) < len(_ZEROS) else torch.Size([0] * len(shape))
    dest_index = MetadataIndex(dest, zeros, 0)
    # The same key read into the same place: one index object serves both (they are immutable),
    # one object less a tensor at 50,000 tensors; the shape is a ``torch.Size`` already.
    same = storage == dest and chunk.offsets == zeros
    return ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=dest_index,
        dest_offsets=zeros,
        storage_index=dest_index if same else MetadataIndex(storage, chunk.offsets, 0),
        storage_offsets=zeros,
        lengths=shape if type(shape) is torch.Size else torch.Size(shape),
    )


class EngineLoadPlanner(DefaultLoadPlanner):
    """Load planner for one component. After ``dcp.load``, :attr:`report` holds what happened."""

    def __init__(
        self,
        *,
        component: str,
        checkpoint_dir: str,
        pipeline: Pipeline,
        strict: bool,
        strict_unexpected: bool = False,
        trust_checkpoint: bool = False,
        ignore_unexpected_prefixes: tuple[str, ...] = (),
        rank: int = 0,
        world_size: int = 1,
        repartitions: bool = False,
        unread: Collection[str] = (),  # keys the object never uses (load_template): not read, never unexpected
        warm_start: bool = False,  # RemapContext.warm_start
    ) -> None:
        super().__init__(flatten_state_dict=True, flatten_sharded_tensors=True, allow_partial_load=False)
        self.component = component
        self.checkpoint_dir = checkpoint_dir
        self.pipeline = pipeline
        self.strict = strict
        self.strict_unexpected = strict_unexpected
        self.trust_checkpoint = trust_checkpoint
        self.ignore_unexpected_prefixes = ignore_unexpected_prefixes
        self.rank = rank
        self.world_size = world_size
        self.repartitions = repartitions  # the object re-partitions state saved per rank
        self.unread = list(unread)
        self.warm_start = warm_start
        self.report: ComponentReport | None = None
        #: Top-level keys of the original state dict whose value was not (fully) replaced.
        self.untouched_roots: set[Any] = set()
        self._aliases: dict[str, list[str]] = {}
        #: Primaries whose aliases differ from them in dtype: read into a buffer of the stored
        #: dtype, then cast into every destination from it (never through the primary's dtype).
        self._staged: set[str] = set()
        #: This rank's plan digest and rows (:func:`~.coordination.plan_digest`), set by
        #: :meth:`create_local_plan` in a job of several ranks: the ranks that read the same
        #: stored keys must have planned them alike.
        self.digest: PlanDigest | None = None
        self.plan_rows: list[str] = []

    # -- planning ---------------------------------------------------------------------------

    def set_up_planner(
        self, state_dict: dict[str, Any], metadata: Metadata | None = None, is_coordinator: bool = False
    ) -> None:
        if not already_flat(state_dict):
            super().set_up_planner(state_dict, metadata, is_coordinator)
            return
        self.original_state_dict = state_dict
        self.state_dict = dict(state_dict)
        self.mappings = {k: (k,) for k in state_dict}
        self.metadata = metadata
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set by set_up_planner; DCP always passes it on load
        saved = self.metadata.state_dict_metadata
        storage_keys = frozenset(saved)
        dest_keys = list(self.state_dict)

        remap_ctx = RemapContext(
            component=self.component,
            direction="load",
            storage_keys=storage_keys,
            checkpoint_path=self.checkpoint_dir,
            rank=self.rank,
            world_size=self.world_size,
            warm_start=self.warm_start,
        )
        mapped = self.pipeline.remap_keys(remap_ctx, dest_keys + self.unread)
        key_map, copies = resolve_per_rank(mapped, storage_keys, self)
        entries = tuple(self._initial_entry(dest, key_map[dest], saved) for dest in dest_keys)
        entries = self.pipeline.pre_load_plan(
            LoadContext(
                component=self.component,
                checkpoint_path=self.checkpoint_dir,
                strict=self.strict,
                rank=self.rank,
                world_size=self.world_size,
                storage_keys=storage_keys,
            ),
            entries,
        )
        claimed = {e.storage_key for e in entries if e.stored is not None} | copies | {key_map[k] for k in self.unread}
        unexpected = sorted(k for k in storage_keys - claimed if not k.startswith(self.ignore_unexpected_prefixes))
        tied = self._ties(entries)
        self._apply_strictness(entries, unexpected, tied)
        items = self._read_items(entries)
        if is_rank_local(self.metadata):  # one rank's shards: what this rank needs must be there
            _require_cover(items, entries, self.state_dict, self._aliases, self.checkpoint_dir)
        elif self.world_size > 1:  # (rank-local parts share nothing: each rank reads its own)
            self.digest, self.plan_rows = plan_digest(entries, mapped, key_map)
        report = self._build_report(entries, unexpected, tied)
        self.report = dataclasses.replace(report, notes=tuple(remap_ctx.notes), tied=tied)
        return LoadPlan(items)

    def _ties(self, entries: tuple[PlanEntry, ...]) -> dict[str, str]:
        """Missing destination keys that are the same memory as a destination key that loads (a
        tie in the model: Hugging Face's ``save_pretrained`` writes ``lm_head.weight`` tied to
        ``embed_tokens.weight`` once), each with that twin: loading the twin fills them."""
        missing = [e.dest_key for e in entries if e.decision is Decision.MISSING]
        if not missing:
            return {}  # nothing to fill: no memory keys (a few microseconds a tensor) are needed
        loads: dict[TensorKey, str] = {}
        for e in entries:
            if e.decision is Decision.LOAD and (key := _memory(self.state_dict[e.dest_key])) is not None:
                loads.setdefault(key, e.dest_key)
        tied: dict[str, str] = {}
        for dest in missing:
            if (key := _memory(self.state_dict[dest])) in loads:
                tied[dest] = loads[key]
        return tied

    def _initial_entry(self, dest: str, storage: str, saved: Mapping[str, Any]) -> PlanEntry:
        target = target_spec(self.state_dict[dest])
        stored = stored_spec(saved.get(storage))
        entry = PlanEntry(dest_key=dest, storage_key=storage, target=target, stored=stored, decision=Decision.LOAD)
        if stored is None:
            return dataclasses.replace(entry, decision=Decision.MISSING)
        if entry.shape_mismatch:
            return dataclasses.replace(entry, decision=Decision.MISMATCH)
        return entry

    def _apply_strictness(self, entries: tuple[PlanEntry, ...], unexpected: list[str], tied: dict[str, str]) -> None:
        missing = [
            e.dest_key + (f" (reads {e.storage_key})" if e.storage_key != e.dest_key else "")
            for e in entries
            if e.decision is Decision.MISSING and e.dest_key not in tied
        ]
        mismatched = [
            f"{e.dest_key}: stored {e.stored}, target {e.target}" for e in entries if e.decision is Decision.MISMATCH
        ]
        bad_unexpected = unexpected if self.strict_unexpected else []
        if (self.strict and (missing or mismatched)) or bad_unexpected:
            raise LoadStrictnessError(
                self.component,
                missing if self.strict else [],
                mismatched if self.strict else [],
                bad_unexpected,
            )

    def _read_items(self, entries: tuple[PlanEntry, ...]) -> list[ReadItem]:
        assert self.metadata is not None
        saved = self.metadata.state_dict_metadata
        # Group full loads by storage key: the first destination is read, compatible others are
        # filled from it (one read per storage key); incompatible ones get a read of their own.
        rounds: list[dict[str, str]] = []
        primaries: dict[str, list[str]] = {}
        for e in entries:
            if e.decision is not Decision.LOAD:
                continue
            target = self.state_dict[e.dest_key]
            placed = False
            for primary in primaries.get(e.storage_key, ()):
                if _same_layout(self.state_dict[primary], target):
                    self._aliases.setdefault(primary, []).append(e.dest_key)
                    placed = True
                    break
            if placed:
                continue
            level = len(primaries.setdefault(e.storage_key, []))
            primaries[e.storage_key].append(e.dest_key)
            if level == len(rounds):
                rounds.append({})
            rounds[level][e.storage_key] = e.dest_key

        for primary, aliases in self._aliases.items():
            value = self.state_dict[primary]
            if isinstance(value, torch.Tensor) and any(self.state_dict[a].dtype != value.dtype for a in aliases):
                self._staged.add(primary)

        items: list[ReadItem] = []
        for round_ in rounds:
            for storage, dest in round_.items():
                value = self.state_dict[dest]
                whole = _whole_tensor_read(storage, dest, value, saved[storage])
                if whole is not None:
                    items.append(whole)
                    continue
                plan = create_default_local_load_plan({storage: value}, self.metadata, strict=True)
                items += [_redirect(it, dest) for it in plan.items]
        for e in entries:
            if e.decision is Decision.OVERLAP:
                md = saved[e.storage_key]
                assert isinstance(md, TensorStorageMetadata)
                chunks = local_chunks(self.state_dict[e.dest_key])
                items += [
                    _redirect(it, e.dest_key) for it in create_read_items_for_chunk_list(e.storage_key, md, chunks)
                ]
        return items

    def _build_report(
        self, entries: tuple[PlanEntry, ...], unexpected: list[str], tied: dict[str, str]
    ) -> ComponentReport:
        loaded, missing = [], []
        skipped: dict[str, SkipRecord] = {}
        overlap: dict[str, OverlapRecord] = {}
        renamed: dict[str, str] = {}
        cast: dict[str, tuple[str, str]] = {}
        for e in entries:
            if e.storage_key != e.dest_key:
                renamed[e.dest_key] = e.storage_key
            d = e.decision
            if d is Decision.LOAD:
                loaded.append(e.dest_key)
                if e.dtype_mismatch:
                    cast[e.dest_key] = (_dtype_name(e.stored), _dtype_name(e.target))
            elif d is Decision.OVERLAP:
                assert e.stored is not None
                overlap[e.dest_key] = OverlapRecord(
                    saved_shape=tuple(e.stored.shape or ()),
                    target_shape=tuple(e.target.shape or ()),
                    plugin=e.decided_by,
                    reason=e.reason,
                )
                if e.dtype_mismatch:
                    cast[e.dest_key] = (_dtype_name(e.stored), _dtype_name(e.target))
            elif d is Decision.SKIP:
                skipped[e.dest_key] = SkipRecord(reason=e.reason, plugin=e.decided_by)
            elif d is Decision.MISSING and e.dest_key in tied:
                continue  # filled through its twin: touched as much as the twin is
            elif d is Decision.MISSING:
                missing.append(e.dest_key)
            else:  # unresolved mismatch in non-strict mode
                skipped[e.dest_key] = SkipRecord(
                    reason=f"mismatch: stored {e.stored}, target {e.target} (strict=False)", plugin=None
                )
            if d not in (Decision.LOAD, Decision.OVERLAP):
                self.untouched_roots.add(self.mappings[e.dest_key][0] if self.mappings else e.dest_key)
        return ComponentReport(
            component=self.component,
            checkpoint_dir=self.checkpoint_dir,
            loaded=tuple(loaded),
            missing=tuple(missing),
            unexpected=tuple(unexpected),
            skipped=skipped,
            overlap=overlap,
            renamed=renamed,
            cast=cast,
        )

    # -- reading ----------------------------------------------------------------------------

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        if read_item.dest_index.fqn in self._staged:
            assert self.metadata is not None
            md = self.metadata.state_dict_metadata[read_item.storage_index.fqn]
            assert isinstance(md, TensorStorageMetadata)
            return torch.empty(tuple(read_item.lengths), dtype=md.properties.dtype)
        offset = read_item.dest_index.offset
        if (offset is None or not any(offset)) and not any(read_item.dest_offsets):
            # A whole plain tensor (the read items of _whole_tensor_read): DCP's lookup and
            # narrowing would return it as it is, after about 3 microseconds of searching.
            whole = self.state_dict.get(read_item.dest_index.fqn)
            if type(whole) is torch.Tensor and whole.shape == read_item.lengths:
                return whole
        target: torch.Tensor = super().resolve_tensor(read_item)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        dest = read_item.dest_index.fqn
        if dest in self._staged:  # ``tensor`` is the stored-dtype buffer from resolve_tensor
            super().resolve_tensor(read_item).detach().copy_(tensor)
        super().commit_tensor(read_item, tensor)
        for alias in self._aliases.get(dest, ()):
            super().resolve_tensor(_redirect(read_item, alias)).detach().copy_(tensor)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        dest = read_item.dest_index.fqn
        obj = self._unpickle(dest, read_item.storage_index.fqn, value)
        for i, key in enumerate([dest, *self._aliases.get(dest, ())]):
            v = obj if i == 0 else copy.deepcopy(obj)
            if self.flatten_state_dict:
                _set_path(self.original_state_dict, tuple(self.mappings[key]), v)
            else:
                self.state_dict[key] = v

    def _unpickle(self, dest: str, storage: str, value: io.BytesIO) -> Any:
        plain, obj = plain_value(value.getbuffer())
        if plain:  # a number, a string, a tuple of them...: no torch.load (plain_values.py)
            return obj
        if self.trust_checkpoint:
            return torch.load(value, weights_only=False)
        try:
            return torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            where = f"component {self.component!r}, key {storage!r} (into {dest!r}) in {self.checkpoint_dir}"
            hostile = unsafe_value_error(where, err)
            if hostile is not None:  # a refused global: crafted, and never "trust it" advice
                raise hostile from None
            raise UnsafeCheckpointError(
                f"{where}: the stored value needs more than weights_only=True unpickling allows "
                f"({weights_only_reason(err)}); it was not loaded. If you trust this checkpoint, set "
                "trust_checkpoint=True"
            ) from None


def _dtype_name(spec: ValueSpec | None) -> str:
    return str(spec.dtype).removeprefix("torch.") if spec is not None else "?"


class EngineSavePlanner(DefaultSavePlanner):
    """Save planner that writes replicated data once and renames keys by a key map.

    ``cache_key`` names the plan cache of this component (see ``fast_save``; ``None``: plan
    every save). ``checksum`` is the algorithm the engine's storage writer hashes the files with
    as it writes them (``None``: sizes only).
    """

    #: Its global plan is DCP's own (replicas kept on the lowest rank), so each rank may finish
    #: its plan alone where the layout allows (``local_plan``). Read from this class only.
    plans_alone: ClassVar[bool] = True

    def __init__(
        self, key_map: Mapping[str, str] | None = None, *, cache_key: str | None = None, checksum: str | None = None
    ) -> None:
        super().__init__(dedup_save_to_lowest_rank=True)
        self.key_map = {k: v for k, v in (key_map or {}).items() if k != v}
        self.cache_key = cache_key
        self.checksum = checksum
        self._archive_settings: tuple[bool, int] | None = None

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        self._archive_settings = archive_settings()  # torch.save's settings, as they are for this save
        if already_flat(state_dict):
            self.state_dict, self.mappings = dict(state_dict), {k: (k,) for k in state_dict}
            self.is_coordinator = is_coordinator
        else:
            super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if not self.key_map:
            return
        self.state_dict = {self.key_map.get(k, k): v for k, v in self.state_dict.items()}
        if self.mappings:
            self.mappings = {
                self.key_map.get(k, k): ((self.key_map[k],) if k in self.key_map else path)
                for k, path in self.mappings.items()
            }

    def create_local_plan(self) -> SavePlan:
        # DCP's items, built once per distinct tensor description (see plain_write_items);
        # anything but plain tensors and values takes DCP's own path.
        items = plain_write_items(self.state_dict)
        if items is None:
            return super().create_local_plan()
        plan = SavePlan(items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        # A plain tensor is written as it is: one dictionary lookup instead of DCP's generic
        # shard search per item; everything else (values, DTensor shards) takes DCP's path.
        if write_item.type != WriteItemType.BYTE_IO and write_item.index.offset is not None:
            obj = self.state_dict.get(write_item.index.fqn)
            if type(obj) is torch.Tensor and not any(write_item.index.offset):
                return obj
        return super().resolve_data(write_item)

    def transform_object(self, write_item: WriteItem, object: Any) -> Any:
        # A value without tensors gets its torch.save archive from a cache of archives by pickle
        # (about 10 instead of 100 microseconds); anything else is torch.save'd as DCP does.
        if write_item.type == WriteItemType.BYTE_IO:
            data = value_archive(object, self._archive_settings)
            if data is not None:
                return io.BytesIO(data)
        return super().transform_object(write_item, object)


def _require_cover(
    items: list[ReadItem],
    entries: tuple[PlanEntry, ...],
    state_dict: Mapping[str, Any],
    aliases: Mapping[str, list[str]],
    where: str,
) -> None:
    """Every tensor a load of a rank-local checkpoint reads gets every element of its local part
    from the items: a checkpoint saved with another sharding holds other elements, and the rest
    would keep their initial values silently. Raises :class:`RankLocalCoverageError`."""
    read: dict[str, int] = {}
    for item in items:
        if item.type != LoadItemType.BYTE_IO:
            read[item.dest_index.fqn] = read.get(item.dest_index.fqn, 0) + int(torch.Size(item.lengths).numel())
    filled = {a for targets in aliases.values() for a in targets}
    for e in entries:
        value = state_dict[e.dest_key]
        if e.decision is not Decision.LOAD or e.dest_key in filled or not isinstance(value, torch.Tensor):
            continue
        needed = sum(int(torch.Size(c.sizes).numel()) for c in local_chunks(value))
        if read.get(e.dest_key, 0) != needed:
            raise RankLocalCoverageError(
                f"{where}: this rank's checkpoint of the local tier holds {read.get(e.dest_key, 0)} of the {needed} "
                f"elements of {clip(e.dest_key)} this rank needs: it was saved with another sharding"
            )


def flat_keys(state_dict: dict[str, Any]) -> list[str]:
    """The flattened keys DCP will save ``state_dict`` under (no data is copied).

    A state dict DCP leaves as it is (:func:`already_flat`: every model and flattened optimizer
    state dict) is its own flattening, so the walk over it is skipped (``save()`` calls this per
    component on every save; ``tests/dcpio/test_planner_properties.py`` pins the equivalence)."""
    if already_flat(state_dict):
        return list(state_dict)
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, None, False)
    return list(planner.state_dict)


def _memory(value: Any) -> TensorKey | None:
    """What identifies ``value``'s memory, or ``None`` for a non-tensor or an empty tensor (whose
    data pointers say nothing)."""
    if not isinstance(value, torch.Tensor) or local_tensor(value).numel() == 0:
        return None
    return memory_key(value)
