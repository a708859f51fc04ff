"""The engine's DCP save: DCP's own save protocol, planned once per state-dict structure.

``dcp.save`` runs the planner and storage-writer protocol (``set_up_planner``,
``create_local_plan``, ``create_global_plan``, ``finish_plan``, ``write_data``, ``finish``),
which is public API. Around it, it costs per item: a runtime-checkable ``Stateful`` check per
top-level key, a debug log record per step, a full local and global plan on every save (a write
item, a ``TensorProperties`` and a ``dataclasses.replace`` per tensor) and a ``.metadata``
pickle in which every entry carries its own copies of the same dtype, size and chunk objects.
At 50,000 small tensors that is most of a save (benchmarks/RESULTS.md, "Many small tensors").

:func:`save_state_dict` runs the same protocol with the same planner and storage writer, and:

* **plans once per structure.** A :class:`SavePlanCache` keeps the final local plan (and, on
  the coordinator, the global metadata) of the last save of a component, keyed by a signature
  of the flattened state dict: every key, every tensor's type, dtype, shape, ``requires_grad``,
  pinning and local chunks (DTensor), the key mapping (``remap_keys``, so plugins), the rank,
  the world size and the writer's class and options. A save whose signature equals the cached
  one on every rank skips planning and sends nothing but a digest of it (16 bytes per rank, all
  gathered; the ranks' digests differ, as the rank is in the signature, so the cache keeps every
  rank's digest of the save it planned); any change of keys, shapes, dtypes, sharding or plugins
  plans again.
* **plans a new structure without a central step where the layout allows**
  (:mod:`~ckpt_engine._dcpio.local_plan`): the plan check's all-gather also says whether every
  rank can finish DCP's plan alone (FSDP2, HSDP, replicated modules); then no plan goes through
  rank 0, each rank sends its final items by columns with its write results, and rank 0 builds
  and validates the ``Metadata`` DCP's global plan would have built. Otherwise DCP's
  ``create_global_plan`` runs on rank 0 over the gathered plans, as ``dcp.save`` does.
* **sends write results by columns** (:class:`CompactResults`): what each rank's writer
  returns is gathered to the coordinator as a few flat lists (keys, offsets, sizes, files, byte
  ranges) instead of one pickled DCP object graph per item, and rebuilt there into the same
  ``WriteResult`` objects: at 1,024 ranks x 200 tensors, a fraction of the unpickling time and
  memory on rank 0 (benchmarks/coord_sim_bench.py).
* **writes an unchanged ``.metadata`` without pickling it** (:func:`write_metadata`): when the
  plan came from the cache and every rank's write results equal the last save's (compared by
  their columns, never rebuilt), the coordinator writes the last save's bytes with this save's
  ``storage_meta`` (:class:`~ckpt_engine._dcpio.fast_write.MetadataFile`); it keeps those bytes
  per component, the size of one ``.metadata``.
* **shares equal metadata objects** (:func:`compact_metadata`): entries with the same
  properties, size and chunks point at one object, so the pickle memoizes them. The file is the
  same ``Metadata`` for ``dcp.load``; it is about half the size and pickles an order of
  magnitude faster.

Collectives go through :mod:`ckpt_engine._dcpio.coordination`: bounded by the engine's collective
timeout, failures of any rank raised on every rank as DCP's ``CheckpointException``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import pickle
import threading
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.distributed.tensor import DTensor

from . import coordination as _coordination
from .local_plan import PlanColumns, build_metadata, finish_alone, replicated_digest
from .torch_private import is_storage_info, local_chunks, storage_info
from .watch import phase

__all__ = [
    "CompactResults",
    "SaveOutcome",
    "SavePlanCache",
    "compact_metadata",
    "gathered_results",
    "plan_cache",
    "save_state_dict",
    "write_metadata",
]

_PLAIN = (torch.Tensor, int, float, str, bool, bytes, type(None), dict, list, tuple)


@dataclasses.dataclass(frozen=True)
class SaveOutcome:
    """What :func:`save_state_dict` returns on every rank."""

    #: The global metadata written to ``.metadata``; ``None`` except on the coordinator.
    metadata: Metadata | None
    #: Bytes written by all ranks together.
    total_bytes: int


@dataclasses.dataclass
class SavePlanCache:
    """What the last save of one component planned (per process, per cache key)."""

    signature: tuple[Any, ...] | None = None
    #: Every rank's signature digest when this plan was made, in rank order.
    digests: tuple[bytes, ...] = ()
    final_plan: SavePlan | None = None
    metadata: Metadata | None = None
    #: On the coordinator: every rank's write-result columns of the last save and the
    #: ``.metadata`` written for them (a ``fast_write.MetadataFile``), which a save with the
    #: same plan and results writes again with its own ``storage_meta`` instead of pickling.
    written: tuple[list[Any], Any] | None = None
    hits: int = 0
    misses: int = 0
    #: Saves whose ``.metadata`` was the last one's bytes with a new ``storage_meta``.
    metadata_reused: int = 0

    def clear(self) -> None:
        self.signature, self.digests, self.final_plan, self.metadata, self.written = None, (), None, None, None

    def remember(
        self, signature: tuple[Any, ...], digests: tuple[bytes, ...], final_plan: SavePlan, metadata: Metadata | None
    ) -> None:
        """A miss: keep the plan just made (``metadata`` on the coordinator only)."""
        self.misses += 1
        self.signature, self.digests, self.final_plan, self.metadata = signature, digests, final_plan, metadata


_CACHES: OrderedDict[str, SavePlanCache] = OrderedDict()
#: Every ``Metadata`` :func:`compact_metadata` made compact (by id, while it lives).
_COMPACT: weakref.WeakValueDictionary[int, Metadata] = weakref.WeakValueDictionary()
_CACHES_LOCK = threading.Lock()
_MAX_CACHES = 64


def plan_cache(key: str) -> SavePlanCache:
    """The process's plan cache for ``key`` (a component of one engine); the least recently used
    of more than 64 is dropped."""
    with _CACHES_LOCK:
        cache = _CACHES.pop(key, None) or SavePlanCache()
        _CACHES[key] = cache
        while len(_CACHES) > _MAX_CACHES:
            _CACHES.popitem(last=False)
        return cache


def drop_plan_caches(prefix: str) -> None:
    """Forget the caches whose key starts with ``prefix`` (an engine that closes)."""
    with _CACHES_LOCK:
        for key in [k for k in _CACHES if k.startswith(prefix)]:
            del _CACHES[key]


def _tensor_signature(value: torch.Tensor) -> tuple[Any, ...]:
    base = (value.dtype, value.shape, value.requires_grad, value.layout)
    if isinstance(value, DTensor):
        chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in local_chunks(value))
        return ("D", *base, chunks, value.device_mesh.get_coordinate() is not None)
    if type(value) is torch.Tensor:
        return ("T", *base, value.device.type == "cpu" and value.is_pinned())
    return ("S", type(value).__qualname__, *base)


def structure_signature(flat: Mapping[str, Any], mappings: Any, extra: tuple[Any, ...]) -> tuple[Any, ...]:
    """Everything a save plan depends on, for the flattened state dict ``flat``: a change here
    means a new plan, an equal signature means the cached plan is the plan DCP would make."""
    # Equal tensor signatures share one tuple, so the pickle that digests the signature (every
    # save) writes each distinct one once instead of once per tensor.
    shared: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    items = tuple(
        (k, shared.setdefault(sig := _tensor_signature(v), sig) if isinstance(v, torch.Tensor) else None)
        for k, v in flat.items()
    )
    maps = tuple(sorted((k, tuple(v)) for k, v in mappings.items())) if mappings else ()
    return (extra, items, maps)


def _writer_signature(writer: StorageWriter) -> tuple[Any, ...]:
    opts = tuple(
        getattr(writer, name, None) for name in ("single_file_per_rank", "thread_count", "serialization_format")
    )
    extensions = tuple(type(e).__qualname__ for e in getattr(getattr(writer, "transforms", None), "extensions", ()))
    return (type(writer).__qualname__, opts, extensions)


def compact_metadata(metadata: Metadata) -> Metadata:
    """Make entries with equal properties, size and chunks share one object (in place).

    ``pickle`` memoizes shared objects, so ``.metadata`` holds each distinct tensor description
    once and every other entry refers to it: the same ``Metadata`` for any reader, a fraction of
    the pickling and unpickling work. Nothing in DCP mutates these objects after planning, so a
    ``Metadata`` made compact once is not walked again (the planner and the writer both ask).
    """
    if _COMPACT.get(id(metadata)) is metadata:
        return metadata
    sizes: dict[tuple[int, ...], torch.Size] = {}
    props: dict[Any, Any] = {}
    shared: dict[Any, TensorStorageMetadata] = {}

    def size(s: torch.Size) -> torch.Size:
        key = tuple(s)
        return sizes.setdefault(key, s if type(s) is torch.Size else torch.Size(key))

    sdm = metadata.state_dict_metadata
    for fqn, md in sdm.items():
        if not isinstance(md, TensorStorageMetadata):
            continue
        p = md.properties
        pkey = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory)
        chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
        key = (pkey, tuple(md.size), chunks)
        found = shared.get(key)
        if found is None:
            found = TensorStorageMetadata(
                properties=props.setdefault(pkey, p),
                size=size(md.size),
                chunks=[ChunkStorageMetadata(offsets=size(c.offsets), sizes=size(c.sizes)) for c in md.chunks],
            )
            shared[key] = found
        sdm[fqn] = found
    for index in list(metadata.storage_data or {}):
        if index.offset is not None and type(index.offset) is torch.Size:
            object.__setattr__(index, "offset", size(index.offset))
    _COMPACT[id(metadata)] = metadata
    return metadata


class CompactResults:
    """One rank's write results on their way to the coordinator, pickled by columns.

    The pickle holds each distinct key offset and file name once and every result as a few
    integers (:meth:`columns`); unpickling keeps the columns and rebuilds the same
    ``WriteResult`` / ``MetadataIndex`` / ``_StorageInfo`` objects only when :attr:`results`
    is asked for, so a coordinator that finds every rank's columns equal to the last save's
    never builds them (see :class:`~ckpt_engine._dcpio.fast_write.MetadataFile`). Results of
    another shape (a writer whose ``storage_data`` is not DCP's ``_StorageInfo``) travel as
    they are."""

    __slots__ = ("_columns", "_results")

    def __init__(self, results: list[WriteResult]) -> None:
        self._results: list[WriteResult] | None = results
        self._columns: tuple[Any, ...] | None = None

    @classmethod
    def from_columns(cls, offsets: list[Any], files: list[Any], cols: tuple[list[Any], ...]) -> CompactResults:
        out = cls.__new__(cls)
        out._results, out._columns = None, (offsets, files, cols)
        return out

    @property
    def results(self) -> list[WriteResult]:
        if self._results is None:
            assert self._columns is not None
            self._results = _rebuild_results(*self._columns)
        return self._results

    def columns(self) -> tuple[Any, ...] | None:
        """``(key offsets, files, columns)``: equal columns are equal results. ``None`` for
        results of another shape."""
        if self._columns is None:
            rs = self.results
            if not all(is_storage_info(r.storage_data) and type(r.index) is MetadataIndex for r in rs):
                return None
            offsets: dict[Any, int] = {}
            files: dict[Any, int] = {}
            cols = (
                [r.index.fqn for r in rs],
                [offsets.setdefault(_offset_key(r.index), len(offsets)) for r in rs],
                [r.index.index for r in rs],
                [r.size_in_bytes for r in rs],
                [files.setdefault(_file_key(r.storage_data), len(files)) for r in rs],
                [r.storage_data.offset for r in rs],
                [r.storage_data.length for r in rs],
            )
            self._columns = (list(offsets), list(files), cols)
        return self._columns

    def total_bytes(self) -> int:
        columns = self.columns()
        return sum(columns[2][3]) if columns is not None else sum(r.size_in_bytes for r in self.results)

    def __reduce__(self) -> Any:
        columns = self.columns()
        if columns is None:
            return (CompactResults, (self.results,))
        return (CompactResults.from_columns, columns)


def _offset_key(index: MetadataIndex) -> tuple[int, ...] | None:
    return None if index.offset is None else tuple(index.offset)


def _file_key(info: Any) -> tuple[str, Any]:
    td = info.transform_descriptors
    return info.relative_path, None if td is None else tuple(td)


def _rebuild_results(offsets: list[Any], files: list[Any], cols: tuple[list[Any], ...]) -> list[WriteResult]:
    """The ``WriteResult`` s of :meth:`CompactResults.columns`."""
    sizes = [None if o is None else torch.Size(o) for o in offsets]
    # Both are frozen dataclasses without slots: filling their __dict__ (in field order, as
    # before) is what their __init__ does, at a fraction of the cost for 200,000 results.
    new = object.__new__
    out = []
    for fqn, oi, ix, nbytes, fi, off, length in zip(*cols, strict=True):
        index = new(MetadataIndex)
        fields = index.__dict__
        fields["fqn"] = fqn
        fields["index"] = ix
        if sizes[oi] is not None:
            fields["offset"] = sizes[oi]
        rel, td = files[fi]
        result = new(WriteResult)
        fields = result.__dict__
        fields["index"] = index
        fields["size_in_bytes"] = nbytes
        fields["storage_data"] = storage_info(rel, off, length, None if td is None else list(td))
        out.append(result)
    return out


def write_metadata(
    storage_writer: StorageWriter, metadata: Metadata, gathered: list[CompactResults], cache: SavePlanCache | None
) -> int:
    """The coordinator's ``finish`` of a save (``.metadata``); the bytes all ranks wrote.

    ``cache``: the component's plan cache (``None``: none). Where it holds the ``.metadata`` the
    last save wrote for the same results of every rank (a cached plan: a new one clears it, so
    its ``metadata`` is this one), a writer that can (``finish_reused``, fast_write's ``MetadataFile``) writes
    those bytes again with this save's ``storage_meta``, and nothing is rebuilt or pickled."""
    columns = [g.columns() for g in gathered]
    total = sum(g.total_bytes() for g in gathered)
    finish_reused = getattr(storage_writer, "finish_reused", None)
    previous = cache.written if cache is not None else None
    if previous is not None and previous[0] == columns and finish_reused and finish_reused(metadata, previous[1]):
        assert cache is not None
        cache.metadata_reused += 1
        cache.written = (columns, storage_writer.last_metadata)  # type: ignore[attr-defined]
        return total
    storage_writer.finish(metadata=metadata, results=gathered_results(gathered))
    if cache is not None:
        last = getattr(storage_writer, "last_metadata", None)
        cache.written = None if last is None or None in columns else (columns, last)
    return total


def gathered_results(values: list[Any]) -> list[list[WriteResult]]:
    """Every rank's write results as ``finish`` takes them (a rank's own may still be compact)."""
    return [v.results if isinstance(v, CompactResults) else v for v in values]


def _to_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    """DCP's ``Stateful`` expansion of top-level values, without its per-key protocol check for
    values that cannot be ``Stateful`` (tensors, plain containers and scalars)."""
    out = {}
    for key, value in state_dict.items():
        if not isinstance(value, _PLAIN) and isinstance(value, Stateful):
            value = value.state_dict()
        out[key] = value
    return out


def _local_step(
    state_dict: dict[str, Any],
    planner: SavePlanner,
    storage_writer: StorageWriter,
    comm: _coordination.Comm,
    cache: SavePlanCache | None,
) -> tuple[tuple[Any, ...], SavePlan | None, bytes | None]:
    """This rank's part of planning: set up, the structure's signature and, unless ``cache``
    holds a plan for it, the local plan and its digest for finishing alone (else ``None``s)."""
    phase("plan")
    rank, coordinator = comm.rank, comm.rank == 0
    planner.set_up_planner(state_dict, storage_writer.storage_meta(), coordinator)
    storage_writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
    flat = getattr(planner, "state_dict", {})
    extra = (rank, comm.world, _writer_signature(storage_writer))
    sig = structure_signature(flat, getattr(planner, "mappings", None), extra)
    if cache is not None and cache.signature == sig and cache.final_plan is not None:
        storage_writer.prepare_local_plan(SavePlan([]))  # the folder, the overwrite check
        return sig, None, None
    plan = storage_writer.prepare_local_plan(planner.create_local_plan())
    return sig, plan, replicated_digest(planner, storage_writer, plan, comm.world)


def _agree_on_plan(
    comm: _coordination.Comm, cache: SavePlanCache | None, hit: bool, digest: bytes, alone_digest: bytes | None
) -> tuple[tuple[bytes, ...], bool, bool]:
    """``(digests, cached, alone)``: every rank's structure digest, whether every rank may take
    the cached plan, and else whether every rank can finish a new plan alone (local_plan's module
    docstring). Every rank must hit, with the signatures all ranks had when the plan was made: one
    small all-gather, whose result (hence the verdict) is the same on every rank."""
    hits = comm.all_gather("plan_check", (hit, digest, alone_digest))
    digests = tuple(d for _, d, _ in hits)
    cached = cache is not None and all(h for h, _, _ in hits) and digests == cache.digests
    alone = not cached and hits[0][2] is not None and all(a == hits[0][2] for _, _, a in hits)
    return digests, cached, alone


def _plan_centrally(
    comm: _coordination.Comm, planner: SavePlanner, storage_writer: StorageWriter, local_plan: SavePlan | None
) -> tuple[SavePlan, Metadata | None]:
    """DCP's central plan: the local plans gathered, the global plan made on the coordinator and
    scattered; the final plan and (on the coordinator) the metadata. ``local_plan`` ``None``: this
    rank hit the cache but another did not, so it plans after all."""
    if local_plan is None:
        local_plan = comm.step("plan", lambda: storage_writer.prepare_local_plan(planner.create_local_plan()))
    metadata: Metadata | None = None

    def global_step(plans: list[SavePlan]) -> list[SavePlan]:
        nonlocal metadata
        plans, metadata = planner.create_global_plan(plans)
        return storage_writer.prepare_global_plan(plans)

    central = comm.gather_scatter("plan", local_plan, global_step)
    final_plan = planner.finish_plan(central)
    if metadata is not None:
        compact_metadata(metadata)
    return final_plan, metadata


def save_state_dict(
    state_dict: dict[str, Any],
    *,
    storage_writer: StorageWriter,
    planner: SavePlanner,
    process_group: Any = None,
    cache: SavePlanCache | None = None,
) -> SaveOutcome:
    """``dcp.save(state_dict, storage_writer=..., planner=..., process_group=...)``, with the plan
    of an unchanged structure taken from ``cache``. Same files, same ``.metadata``; a failure on
    any rank raises ``CheckpointException`` on every rank, as DCP does. Unlike ``dcp.save``,
    only the coordinator gets the global metadata back (no broadcast of it): every rank gets the
    total bytes written."""
    comm = _coordination.Comm(process_group)
    rank, coordinator = comm.rank, comm.rank == 0
    state_dict = _to_state_dict(state_dict)

    stepped = comm.step("plan", lambda: _local_step(state_dict, planner, storage_writer, comm, cache))
    sig, local_plan, alone_digest = stepped if stepped is not None else ((), SavePlan([]), None)
    digest = hashlib.blake2b(pickle.dumps(sig, protocol=pickle.HIGHEST_PROTOCOL), digest_size=16).digest()
    digests, cached, alone = _agree_on_plan(comm, cache, local_plan is None, digest, alone_digest)
    final_plan: SavePlan | None = None
    columns: PlanColumns | None = None
    metadata: Metadata | None = None
    if cache is not None and cached:
        assert cache.final_plan is not None
        final_plan = planner.finish_plan(cache.final_plan)
        metadata = cache.metadata
        cache.hits += 1
    elif alone:  # finished in the write step (whose errors every rank raises), metadata at the end
        assert local_plan is not None
        if cache is not None:
            cache.clear()
    else:
        final_plan, metadata = _plan_centrally(comm, planner, storage_writer, local_plan)
        if cache is not None:
            cache.remember(sig, digests, final_plan, metadata if coordinator else None)
            cache.written = None

    def write_step() -> CompactResults | tuple[CompactResults, PlanColumns]:
        nonlocal final_plan, columns
        if final_plan is None:
            assert local_plan is not None
            final_plan = planner.finish_plan(finish_alone(planner, storage_writer, local_plan, rank))
            columns = PlanColumns.of(final_plan)
        phase("write")
        fut = storage_writer.write_data(final_plan, planner)
        fut.wait()
        results = CompactResults(fut.value())
        return results if columns is None else (results, columns)

    def finish_step(gathered: list[Any]) -> int:
        nonlocal metadata
        phase("metadata")
        if alone:  # every rank's final items came with its results: the metadata DCP would build
            metadata = compact_metadata(build_metadata([cols for _, cols in gathered]))
            gathered = [results for results, _ in gathered]
        assert metadata is not None
        return write_metadata(storage_writer, metadata, gathered, cache)

    try:
        total = comm.gather_finish("write", write_step, finish_step)
    except CheckpointException:
        if cache is not None:
            cache.clear()
        raise
    if alone and cache is not None:
        assert final_plan is not None
        cache.remember(sig, digests, final_plan, metadata if coordinator else None)
    return SaveOutcome(metadata=metadata if coordinator else None, total_bytes=total)
