"""A save plan every rank finishes alone, and the ``.metadata`` the coordinator builds from what
the ranks report with their write results: a first save without DCP's central plan.

DCP's save gathers every rank's local plan to rank 0, which removes the items several ranks
hold (``dedup_save_plans``; the engine's planner keeps each on the lowest rank that has it),
numbers every tensor's chunks, builds the global ``Metadata``, validates it, and scatters the
plans back: at 1,024 ranks x 200 tensors, 37 MiB of DCP objects through rank 0 and seconds of
Python there (benchmarks/RESULTS.md, "Coordination at 1,024 ranks"). Every one of those
decisions can be made by each rank on its own when the layout says who holds what:

* **a DTensor shard** on a mesh of every rank, with ``Shard`` and ``Replicate`` placements only
  (FSDP2, HSDP, TP over the whole job): the ranks holding the same chunk are those with the same
  coordinates on the ``Shard`` dimensions of the mesh; the lowest of them writes it, and a
  writer's chunk number is how many writers of that mesh and placements come before it;
* **a plain tensor** that every rank holds under the same key and offset (a DDP or replicated
  module, an optimizer's ``step``): rank 0 writes it, chunk 0. Whether every rank holds the same
  plain tensors and values is the one thing a rank cannot see alone: each sends a 16-byte digest
  of its plain items in the all-gather every save makes anyway, and a difference plans centrally;
* **a non-tensor value**: every rank's local plan has it, as it has a plain tensor; rank 0
  writes it (its index as the local plan made it, as DCP leaves it);
* **a key of this rank's own** (a plain tensor or a value): its copy of a key saved per rank,
  ``<key>@rank<r>`` (``_format/names.py``), or the ``rng`` component's ``rank<r>.<...>``, ``r``
  this rank: no other rank saves it, so this rank writes it (chunk 0, as DCP numbers a tensor
  one rank saves). The digest holds such a key with its rank number blanked, so the ranks agree
  only when each holds its own copy of the same keys; a rank holding another's (every rank
  saving ``rank0.<...>``) differs from that rank, and plans centrally.

That is exactly DCP's plan (same items on the same ranks, same chunk numbers, same files), as
``tests/engine/test_local_plan.py`` checks against DCP's central plan for several layouts. Anything
else (another planner or storage writer class, a process group of part of the job, a DTensor
on a smaller mesh or with other placements, an empty shard, ranks holding different plain
tensors) plans centrally as before.

Each rank then sends, with its write results, its final items by columns
(:class:`PlanColumns`: keys, offsets, chunk sizes and each distinct tensor description once),
and the coordinator builds the ``Metadata`` DCP's ``create_global_plan`` would have built
(:func:`build_metadata`), and validates it as DCP does (bounds, overlaps, coverage) before it
writes ``.metadata``. A save that fails validation fails on every rank, uncommitted, as a save
whose write failed; DCP would refuse it before writing.

The local plan's items themselves, for a state dict of plain tensors and values, are built
directly (:func:`plain_write_items`), equal to DCP's ``create_default_local_save_plan`` item for item.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import sys
from bisect import bisect_right, insort
from collections import ChainMap
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._format.names import RANK_MARK, split_per_rank

__all__ = ["PlanColumns", "build_metadata", "finish_alone", "own_key", "plain_write_items", "replicated_digest"]

_BYTES, _TENSOR, _SHARD = 0, 1, 2
_KIND = {WriteItemType.BYTE_IO: _BYTES, WriteItemType.TENSOR: _TENSOR, WriteItemType.SHARD: _SHARD}


def _can_plan_alone(planner: SavePlanner, storage_writer: StorageWriter, world: int) -> bool:
    """Whether this planner and writer plan exactly as the rules of the module docstring say: a
    planner class that declares ``plans_alone`` itself (the engine's: DCP's global planning,
    keeping replicas on the lowest rank; a subclass must declare it again), a writer with
    FileSystemWriter's rank prefixes, and a process group of every rank."""
    return (
        isinstance(planner, DefaultSavePlanner)
        and type(planner).__dict__.get("plans_alone") is True
        and planner.dedup_save_to_lowest_rank
        and type(storage_writer).prepare_global_plan is FileSystemWriter.prepare_global_plan
        and (world == 1 or (dist.is_initialized() and dist.get_world_size() == world))
    )


def replicated_digest(planner: SavePlanner, storage_writer: StorageWriter, plan: SavePlan, world: int) -> bytes | None:
    """What this rank sends in the plan check: a digest of its plain tensor items (equal on
    every rank: every rank holds the same replicated tensors), or ``None`` when its plan cannot
    be finished alone."""
    if not _can_plan_alone(planner, storage_writer, world):
        return None
    state = getattr(planner, "state_dict", None)
    if not isinstance(state, Mapping):
        return None
    me = _global_rank()
    plain: list[tuple[Any, ...]] = []
    for item in plan.items:
        fqn = item.index.fqn
        value = None if item.type == WriteItemType.BYTE_IO else state.get(fqn)
        if isinstance(value, DTensor):
            if not _alone_layout(value, world) or own_key(fqn, me) is not None:
                return None  # a DTensor under a rank's own key is no one tensor of the mesh
            continue
        if item.type != WriteItemType.BYTE_IO and not (
            type(value) is torch.Tensor and item.type == WriteItemType.TENSOR
        ):
            return None  # a tensor subclass, a ShardedTensor: DCP's own planning
        offset = None if item.type == WriteItemType.BYTE_IO else tuple(item.index.offset or ())
        neutral = own_key(fqn, me)
        plain.append((fqn, offset) if neutral is None else ("own", neutral, offset))
    return hashlib.blake2b(pickle.dumps(plain, protocol=pickle.HIGHEST_PROTOCOL), digest_size=16).digest()


def own_key(fqn: str, rank: int) -> str | None:
    """``fqn`` with its rank number blanked if it names a key only ``rank`` saves (its copy of
    a per-rank key, ``<key>@rank<rank>``, or the ``rng`` component's ``rank<rank>.<...>``), else
    ``None``."""
    parsed = split_per_rank(fqn)
    if parsed is not None:
        return f"{parsed[0]}{RANK_MARK}*" if parsed[1] == rank else None
    prefix = f"rank{rank}."
    return "rank*." + fqn[len(prefix) :] if fqn.startswith(prefix) else None


def _global_rank() -> int:
    """The rank that ``@rank<r>`` keys and the ``rng`` component's keys name (the default group's)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _alone_layout(value: DTensor, world: int) -> bool:
    mesh = value.device_mesh
    if mesh.size() != world or mesh.get_coordinate() is None or value.to_local().numel() == 0:
        return False
    return all(type(p) in (Shard, Replicate) for p in value.placements)


class _Writers:
    """Per mesh and placements: whether this rank writes its chunk, and the chunk's number."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._known: dict[tuple[int, tuple[Any, ...]], tuple[bool, int]] = {}
        self._keep: list[Any] = []  # the meshes: their ids stay their own

    def of(self, value: DTensor) -> tuple[bool, int]:
        mesh, placements = value.device_mesh, tuple(value.placements)
        key = (id(mesh), placements)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = self._work_out(mesh, placements)
            self._keep.append(mesh)
        return known

    def _work_out(self, mesh: Any, placements: tuple[Any, ...]) -> tuple[bool, int]:
        ranks = mesh.mesh  # rebuilt on each access in torch 2.13: once per mesh and placements
        shard_dims = [d for d, p in enumerate(placements) if type(p) is Shard]
        if len(shard_dims) == ranks.dim():  # every rank its own chunk, numbered by rank
            return True, self.rank
        # The lowest rank of each group of ranks equal on the Shard dimensions writes.
        replicate_dims = [d for d in range(ranks.dim()) if d not in shard_dims]
        grouped = ranks.permute(*shard_dims, *replicate_dims).reshape(math.prod(ranks.shape[d] for d in shard_dims), -1)
        writers = sorted(int(r) for r in grouped.min(dim=1).values.tolist())
        return self.rank in writers, bisect_right(writers, self.rank) - 1


def _hinted(item: WriteItem, index: int) -> WriteItem:
    return WriteItem(
        index=MetadataIndex(item.index.fqn, item.index.offset, index),
        type=item.type,
        bytes_io_data=item.bytes_io_data,
        tensor_data=item.tensor_data,
    )


def finish_alone(planner: SavePlanner, storage_writer: StorageWriter, plan: SavePlan, rank: int) -> SavePlan:
    """This rank's final plan, as DCP's central plan would hand it back (module docstring): the
    items it writes with their chunk numbers, and its file prefix from the storage writer."""
    state: Mapping[str, Any] = planner.state_dict  # type: ignore[attr-defined]
    writers = _Writers(rank)
    me = _global_rank()
    items: list[WriteItem] = []
    for item in plan.items:
        if item.type == WriteItemType.BYTE_IO:
            if rank == 0 or own_key(item.index.fqn, me) is not None:
                items.append(item)  # DCP keeps a value's index as the local plan made it
            continue
        value = state[item.index.fqn]
        if isinstance(value, DTensor):
            writes, number = writers.of(value)
            if writes:
                items.append(_hinted(item, number))
        elif rank == 0 or own_key(item.index.fqn, me) is not None:
            items.append(item if item.index.index == 0 else _hinted(item, 0))
    final = SavePlan(items, storage_data=plan.storage_data, planner_data=plan.planner_data, usable=plan.usable)
    # The writer's own prefix for this rank (FileSystemWriter's numbers the plans by rank).
    return storage_writer.prepare_global_plan([final] * (rank + 1))[rank]


class PlanColumns:
    """One rank's final write items, by columns, on their way to the coordinator's ``.metadata``.

    Each distinct offset, chunk size and tensor description (properties and global size) is
    pickled once; every item is a few integers. ``mappings`` are the planner's flattening
    mappings (DCP merges every rank's into ``planner_data``), sent as the list of keys when each
    key maps to itself (a flat state dict's)."""

    __slots__ = ("descriptions", "distinct", "extra_keys", "items", "keys", "mappings")

    def __init__(
        self,
        keys: list[str],
        items: list[tuple[int, int, int, int]],
        distinct: list[tuple[int, ...]],
        descriptions: list[tuple[TensorProperties, int]],
        mappings: dict[str, Any] | None,
        extra_keys: list[str],
    ) -> None:
        self.keys, self.items, self.distinct, self.descriptions = keys, items, distinct, descriptions
        self.mappings, self.extra_keys = mappings, extra_keys

    @classmethod
    def of(cls, plan: SavePlan) -> PlanColumns:
        shapes: dict[tuple[int, ...], int] = {}
        described: dict[tuple[Any, ...], int] = {}
        descriptions: list[tuple[TensorProperties, int]] = []
        keys: list[str] = []
        items: list[tuple[int, int, int, int]] = []
        for item in plan.items:
            keys.append(item.index.fqn)
            kind = _KIND[item.type]
            data = item.tensor_data
            if kind == _BYTES or data is None or data.chunk is None:
                items.append((kind, -1, -1, -1))
                continue
            p = data.properties
            size = shapes.setdefault(tuple(data.size), len(shapes))
            dkey = (p.dtype, p.layout, p.requires_grad, p.memory_format, p.pin_memory, size)
            desc = described.get(dkey)
            if desc is None:
                desc = described[dkey] = len(descriptions)
                descriptions.append((p, size))
            offsets = shapes.setdefault(tuple(data.chunk.offsets), len(shapes))
            sizes = shapes.setdefault(tuple(data.chunk.sizes), len(shapes))
            items.append((kind, desc, offsets, sizes))
        raw = plan.planner_data
        mappings: dict[str, Any] | None = None
        extra: list[str] = []
        if isinstance(raw, Mapping) and all(type(v) is tuple and v == (k,) for k, v in raw.items()):
            written = set(keys)
            extra = [k for k in raw if k not in written]
        elif raw is not None:
            mappings = dict(raw)
        return cls(keys, items, list(shapes), descriptions, mappings, extra)

    def planner_data(self) -> dict[str, Any]:
        if self.mappings is not None:
            return self.mappings
        return {k: (k,) for k in (*self.keys, *self.extra_keys)}

    def __reduce__(self) -> Any:
        return (PlanColumns, (self.keys, self.items, self.distinct, self.descriptions, self.mappings, self.extra_keys))


def build_metadata(columns: Sequence[PlanColumns]) -> Metadata:
    """The ``Metadata`` DCP's ``create_global_plan`` builds from these final plans (in rank
    order), equal objects shared; raises ``ValueError`` where DCP's validation would."""
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    sizes: dict[tuple[int, ...], torch.Size] = {}

    def size(t: tuple[int, ...]) -> torch.Size:
        found = sizes.get(t)
        if found is None:
            found = sizes[t] = torch.Size(t)
        return found

    for cols in columns:
        chunk_of: dict[tuple[int, int], ChunkStorageMetadata] = {}
        for fqn, (kind, desc, offsets, chunk_sizes) in zip(cols.keys, cols.items, strict=True):
            if kind != _SHARD and fqn in md:
                raise ValueError(f"Failed to validate global plan: {_clip(fqn)} is saved by more than one rank")
            if kind == _BYTES:
                md[fqn] = BytesStorageMetadata()
                continue
            found = md.get(fqn)
            if found is None:
                props, global_size = cols.descriptions[desc]
                found = md[fqn] = TensorStorageMetadata(props, size(cols.distinct[global_size]), [])
            elif not isinstance(found, TensorStorageMetadata):
                raise ValueError(f"Failed to validate global plan: {_clip(fqn)} is both a value and a tensor")
            chunk = chunk_of.get((offsets, chunk_sizes))
            if chunk is None:
                chunk = chunk_of[(offsets, chunk_sizes)] = ChunkStorageMetadata(
                    size(cols.distinct[offsets]), size(cols.distinct[chunk_sizes])
                )
            found.chunks.append(chunk)
    planner_data = dict(ChainMap(*(c.planner_data() for c in columns)))
    metadata = Metadata(state_dict_metadata=md, planner_data=planner_data)
    errors = validate(metadata, several_plans=len(columns) > 1)
    if errors:
        summary = "; ".join(errors)
        if len(summary) > 500:
            summary = summary[:500] + "... (truncated)"
        raise ValueError(f"Failed to validate global plan: {summary}")
    return metadata


def validate(metadata: Metadata, *, several_plans: bool) -> list[str]:
    """DCP's checks of a global save plan: every chunk inside its tensor, no two overlapping,
    and (with several plans) the chunks covering the tensor; at most 16 messages.

    A tensor of many chunks (1,024 at 1,024 ranks) is checked as arrays first: in bounds, and
    disjoint along the longest dimension, which proves no two overlap. Only a tensor that fails
    either, or has few chunks, is walked chunk by chunk as DCP walks it."""
    errors: list[str] = []
    for key, value in metadata.state_dict_metadata.items():
        if not isinstance(value, TensorStorageMetadata) or len(value.size) == 0:
            continue
        if len(errors) >= 16:
            break
        chunks, total = value.chunks, math.prod(value.size)
        volume = _checked_as_arrays(value) if len(chunks) >= _ARRAY_CHECK else None
        if volume is None:
            volume = 0
            for chunk in chunks:
                if any(
                    o < 0 or s < 0 or o + s > t for o, s, t in zip(chunk.offsets, chunk.sizes, value.size, strict=True)
                ):
                    errors.append(f"key:{_clip(key)} has out of bounds chunk: tensor-size:{value.size} chunk: {chunk}")
                volume += math.prod(chunk.sizes)
            if len(chunks) > 1:
                errors += _overlaps(key, value, len(value.size))
        if several_plans and volume != total:
            errors.append(f"key:{_clip(key)} invalid fill tensor-volume: {total} chunks-volume: {volume}")
    return errors[:16]


#: From this many chunks a tensor is checked as arrays first (below, numpy's fixed cost loses).
_ARRAY_CHECK = 16


def _checked_as_arrays(value: TensorStorageMetadata) -> int | None:
    """The chunks' volume if they are all in bounds and disjoint along the longest dimension
    (then no two overlap); ``None`` if not, for the walk that names the faults."""
    dims, chunks = len(value.size), value.chunks
    offsets = np.array([tuple(c.offsets) for c in chunks], dtype=np.int64).reshape(len(chunks), dims)
    sizes = np.array([tuple(c.sizes) for c in chunks], dtype=np.int64).reshape(len(chunks), dims)
    if not bool((offsets >= 0).all() and (sizes >= 0).all() and (offsets + sizes <= np.array(value.size)).all()):
        return None
    sweep = max(range(dims), key=lambda d: value.size[d])
    order = np.argsort(offsets[:, sweep], kind="stable")
    starts, ends = offsets[order, sweep], offsets[order, sweep] + sizes[order, sweep]
    if not bool((starts[1:] >= np.maximum.accumulate(ends)[:-1]).all()):
        return None
    return int(sizes.prod(axis=1).sum())


def _overlaps(key: str, value: TensorStorageMetadata, dims: int) -> list[str]:
    """DCP's sweep along the longest dimension: each chunk against those still open there."""
    chunks = value.chunks
    sweep = max(range(dims), key=lambda d: value.size[d])
    order = sorted(range(len(chunks)), key=lambda i: (chunks[i].offsets[sweep], *chunks[i].offsets))
    active: list[tuple[int, int]] = []
    errors: list[str] = []
    for i in order:
        current = chunks[i]
        start = current.offsets[sweep]
        del active[: bisect_right(active, (start, sys.maxsize))]  # the chunks that end before it starts
        for _, j in active:
            other = chunks[j]
            if all(
                a_off < b_off + b_size and b_off < a_off + a_size
                for a_off, a_size, b_off, b_size in zip(
                    current.offsets, current.sizes, other.offsets, other.sizes, strict=True
                )
            ):
                errors.append(f"key:{_clip(key)} has overlapping chunks: {current} {other}")
                if len(errors) >= 16:
                    return errors
        insort(active, (start + current.sizes[sweep], i))
    return errors


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def plain_write_items(state_dict: Mapping[str, Any]) -> list[WriteItem] | None:
    """DCP's local save plan items (``create_default_local_save_plan``) for a state dict of
    plain tensors and values, equal item for item; ``None`` for anything else (a DTensor, a
    ``ShardedTensor``, a tensor subclass, an object with its own write items).

    DCP builds a ``TensorProperties`` per tensor (``is_pinned`` and five attributes), a zero
    offset and a chunk each: a tensor's items cost about 7 microseconds on the first save of a
    structure, and a new engine's first save of 50,000 small tensors spends a tenth of its time
    there. Here tensors of one dtype, ``requires_grad`` and pinning share one properties object,
    and tensors of one rank one zero offset (as ``compact_metadata`` later shares them anyway).
    Each tensor's index already carries the chunk number 0 that DCP's global plan (or
    ``local_plan.finish_alone``) gives a plain tensor: the number is not part of an index's
    equality or hash, and the final plan can keep the item as it is."""
    items: list[WriteItem] = []
    props: dict[tuple[Any, ...], TensorProperties] = {}
    zeros: dict[int, torch.Size] = {}
    for fqn, value in state_dict.items():
        if type(value) is torch.Tensor:
            if value.layout != torch.strided:
                return None
            key = (value.dtype, value.requires_grad, value.is_pinned())
            p = props.get(key)
            if p is None:
                p = props[key] = TensorProperties(
                    dtype=key[0],
                    layout=torch.strided,
                    requires_grad=key[1],
                    memory_format=torch.contiguous_format,
                    pin_memory=key[2],
                )
            size = value.size()
            zero = zeros.get(len(size))
            if zero is None:
                zero = zeros[len(size)] = torch.Size([0] * len(size))
            data = TensorWriteData(chunk=ChunkStorageMetadata(offsets=zero, sizes=size), properties=p, size=size)
            items.append(WriteItem(index=MetadataIndex(fqn, zero, 0), type=WriteItemType.TENSOR, tensor_data=data))
        elif isinstance(value, torch.Tensor) or hasattr(value, "__create_write_items__"):
            return None
        else:
            items.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
    return items
