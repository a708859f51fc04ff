"""Reads that several ranks share: each stored byte read once, striped across those ranks, then broadcast.

Where several ranks need the same stored items (a module replicated on every rank, HSDP
replicas, a checkpoint saved by fewer ranks than load it), :class:`SharedReads` has each of them
read a share of those items from storage and hands every item to the others by broadcast.

Which ranks share is found without a central plan, in one fixed-size message per rank: each
rank takes the stored items its plan reads (a data file's byte range, ``(file, offset,
length)``; not items under stream transforms, nor large tensor items it needs less than half of,
which the readers fetch by row range), splits them into those read into DTensors and the rest,
and sends a 16-byte digest of each sorted list in an all-gather. Ranks with the same digest
need the same items: they form a group (one per class), and since every member holds the same
list, each works out the same split of it, with no further message. The items, in file order,
are cut into one run of about equal bytes per member, so that a member reads adjacent byte
ranges (fetched together); it reads them in batches of at most :data:`BATCH_BYTES`. Round
``k``: every member reads its ``k``-th batch (the members read in parallel), then the members
broadcast their batches in turn over a gloo group of the group's ranks (created once per set of
ranks and kept), each followed by one status byte; every member fills its destinations from
each batch as it arrives. A rank holds at most its own batch and one received batch at a time.
Ranks whose digest no one else sends (and every item outside the shared set) read as before.

Failures:

* a read or decoding error of one member (a truncated file, a corrupt archive) is that member's
  error: it still takes part in every broadcast (its status byte says the batch is bad, and the
  others skip it), and the load's closing agreement raises it on every rank;
* a member that dies or stops during the broadcasts: the gloo group of the members waits at
  most half of ``collective_timeout_s``; a member whose broadcast fails holds a
  :class:`~ckpt_engine.errors.ProcessGroupError` and goes on to the load's closing agreement,
  whose bounded barrier names the rank that does not arrive
  (:class:`~ckpt_engine.errors.CollectiveTimeoutError`, with the phase it last published), on
  every rank alive. That barrier waits only for what is left of ``collective_timeout_s`` since
  the failed broadcast began (:meth:`~ckpt_engine._dcpio.watch.CollectiveWatch.expect_by`), so
  the lost rank is named within ``collective_timeout_s`` of it. Ranks give up at different
  moments; the first records whom it found missing with its verdict, so one that arrives after it
  (even after a stopped rank woke and arrived too) names the same rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor

from ..errors import ProcessGroupError, clip
from .fast_read import FastFileSystemReader, gc_paused
from .object_read import ObjectStoreReader, fill_item, mostly_unneeded
from .watch import c10d_failure, phase

__all__ = ["BATCH_BYTES", "SharedReads", "dedup_wanted", "stripe"]

#: Largest batch one member reads and broadcasts at a time (a larger item is a batch of its own).
BATCH_BYTES = 64 << 20
#: ``(data file, offset, length)`` of one stored item.
ItemKey = tuple[str, int, int]

_groups: dict[tuple[int, tuple[int, ...]], Any] = {}
_lock = threading.Lock()
#: The ``_groups.get`` default of a set whose group was not made yet (on a rank outside a made
#: group, the value kept is what torch's ``new_group`` returns there, not a group).
_NOT_MADE = object()


def dedup_wanted(mode: str, reader: Any, world: int) -> bool:
    """Whether a load with ``dedup_reads=mode`` through ``reader`` shares its reads.

    ``auto``: on for an object store (every byte costs a request and egress), and for local
    files when the job's ranks span several hosts (``WORLD_SIZE`` above ``LOCAL_WORLD_SIZE``: a
    shared filesystem read over the network); off on one host, where every rank reads the page
    cache the first reader filled, faster than a broadcast over loopback
    (benchmarks/RESULTS.md). The inputs are the same on every rank, so every rank decides alike."""
    if world < 2 or mode == "off" or not isinstance(reader, (FastFileSystemReader, ObjectStoreReader)):
        return False
    if mode == "on" or isinstance(reader, ObjectStoreReader):
        return True
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    return bool(local) and world > local


@dataclass
class _Batch:
    keys: list[ItemKey] = field(default_factory=list)
    nbytes: int = 0


def stripe(keys: list[ItemKey], members: int) -> list[list[_Batch]]:
    """Each member's batches of ``keys``: the items in file order cut into ``members`` runs of
    about equal bytes (an item goes to the member whose share its first byte falls in), so each
    member reads adjacent ranges, fetched together; each run cut at :data:`BATCH_BYTES`. The same
    ``keys`` give the same answer on every rank."""
    ordered = sorted(keys)
    total = sum(k[2] for k in ordered)
    owned: list[list[ItemKey]] = [[] for _ in range(members)]
    at = 0
    for key in ordered:
        owned[min(members - 1, at * members // total) if total else 0].append(key)
        at += key[2]
    out: list[list[_Batch]] = []
    for mine in owned:
        batches: list[_Batch] = []
        for key in mine:
            if not batches or (batches[-1].nbytes and batches[-1].nbytes + key[2] > BATCH_BYTES):
                batches.append(_Batch())
            batches[-1].keys.append(key)
            batches[-1].nbytes += key[2]
        out.append(batches)
    return out


def _broadcast(tensor: torch.Tensor, src: int, group: Any) -> None:
    """One broadcast of a batch (a module function: fault-injection tests wrap it)."""
    dist.broadcast(tensor, src=src, group=group)


def _subgroup(members: tuple[int, ...], timeout_s: float, *, everyone: bool) -> Any:
    """The gloo group of the global ranks ``members``, kept for later loads (a group is named by
    its ranks, so one set of ranks has one group).

    ``everyone``: every rank of the default group calls this for the same ``members`` in the same
    order, and the group is made collectively, under torch's counted name. Otherwise only the
    members call it (``use_local_synchronization``), and torch names the group by its ranks and
    by how many groups the calling rank already has: members that joined different sharing groups
    before would name it differently and wait for each other under different store keys."""
    key = (id(dist.group.WORLD), members)
    with _lock:
        group = _groups.get(key, _NOT_MADE)
    if group is _NOT_MADE:
        group = dist.new_group(
            ranks=list(members),
            backend="gloo",
            timeout=timedelta(seconds=timeout_s),
            use_local_synchronization=not everyone,
        )
        with _lock:
            _groups[key] = group
    return group


def sharing_sets(table: list[tuple[bytes, ...]]) -> list[tuple[int, ...]]:
    """Every set of two or more ranks that share one class of items, from the all-gathered
    digests (``table[rank][class]``; empty: the rank has none of that class), in one order that
    every rank computes alike."""
    sets: list[tuple[int, ...]] = []
    for c in range(len(table[0]) if table else 0):
        by_digest: dict[bytes, list[int]] = {}
        for rank, digests in enumerate(table):
            if digests[c]:
                by_digest.setdefault(digests[c], []).append(rank)
        for ranks in by_digest.values():
            if len(ranks) >= 2 and tuple(ranks) not in sets:
                sets.append(tuple(ranks))
    return sets


def _drop_subgroup(members: tuple[int, ...]) -> None:
    with _lock:
        group = _groups.pop((id(dist.group.WORLD), members), None)
    if group is not None:
        with contextlib.suppress(Exception):  # a broken group may refuse; it is dropped either way
            dist.destroy_process_group(group)


class SharedReads:
    """The shared reads of one load on one rank (``enabled``: decided by :func:`dedup_wanted`)."""

    def __init__(self, comm: Any, reader: Any, enabled: bool) -> None:
        self.comm = comm
        self.reader = reader
        self.enabled = enabled and comm.watch is not None and comm.world > 1
        #: Bytes this rank read from storage for the group, and bytes it received from the others.
        self.bytes_read = 0
        self.bytes_received = 0
        #: The ranks this rank shared its reads with (``()``: none).
        self.members: tuple[int, ...] = ()
        #: ``time.monotonic()`` when this rank's latest broadcast began.
        self._since = 0.0

    def _items(self, plan: LoadPlan, metadata: Any) -> dict[ItemKey, list[ReadItem]]:
        items: dict[ItemKey, list[ReadItem]] = {}
        data = self.reader.storage_data
        for req in plan.items:
            info = data[req.storage_index]
            if info.transform_descriptors:
                continue
            items.setdefault((str(info.relative_path), int(info.offset), int(info.length)), []).append(req)
        return {k: v for k, v in items.items() if not (k[2] >= 1 << 20 and mostly_unneeded(metadata, v))}

    def read(self, plan: LoadPlan, planner: LoadPlanner) -> LoadPlan:
        """Read the items of ``plan`` this rank shares; returns the plan of what it reads alone.
        Collective over the load's ranks when enabled (every rank calls it).

        Items go in two classes, each with its own digest and its own group: those whose
        destination is a DTensor (ranks share them with the ranks holding the same shards, e.g.
        HSDP replicas) and the rest (plain tensors and values, which every rank that has the
        key holds whole: optimizer steps and hyperparameters, a DDP module, the trainer state)."""
        if not self.enabled:
            return plan
        try:
            items = self._items(plan, getattr(planner, "metadata", None))
            sharded = {k for k, reqs in items.items() if any(_is_dtensor(planner, r) for r in reqs)}
        except Exception:  # a malformed plan: the reader reports it, item by item
            items, sharded = {}, set()
        classes = [sorted(k for k in items if k not in sharded), sorted(sharded)]
        digests = tuple(_digest(keys) for keys in classes)
        phase("read (find shared items)")
        table = self.comm.all_gather("read (shared items)", digests)
        everyone = dist.is_initialized() and self.comm.world == dist.get_world_size()
        if everyone:  # the groups of every sharing set, made on every rank in one order
            for ranks in sharing_sets(table):
                _subgroup(tuple(self.comm._global(r) for r in ranks), self.comm.watch.timeout_s / 2, everyone=True)
        shared: set[ItemKey] = set()
        for c, keys in enumerate(classes):
            members = tuple(self.comm._global(r) for r, d in enumerate(table) if digests[c] and d[c] == digests[c])
            if len(members) >= 2:
                self._share(keys, members, items, planner, everyone=everyone)
                shared.update(keys)
        if not shared:
            return plan
        return dataclasses.replace(plan, items=[r for r in plan.items if _key(self.reader, r) not in shared])

    def _share(
        self,
        keys: list[ItemKey],
        members: tuple[int, ...],
        items: dict[ItemKey, list[ReadItem]],
        planner: LoadPlanner,
        *,
        everyone: bool,
    ) -> None:
        self.members = tuple(sorted({*self.members, *members}))
        group = _subgroup(members, self.comm.watch.timeout_s / 2, everyone=everyone)
        index = members.index(self.comm._global(self.comm.rank))
        try:
            with gc_paused():
                self._rounds(
                    stripe(keys, len(members)),
                    members,
                    index,
                    group,
                    lambda k, d: fill_item(planner, items[k], d, k[0]),
                )
        except Exception as err:
            if not c10d_failure(err):
                raise
            _drop_subgroup(members)
            self.comm.watch.expect_by(self._since + self.comm.watch.timeout_s)
            raise ProcessGroupError(
                f"rank {members[index]}: a broadcast of the reads shared by ranks {list(members)} failed in "
                f"torch.distributed ({type(err).__name__}: {clip(str(err), 200)}): one of them died or stopped",
                step="read (shared)",
            ) from err

    def _rounds(
        self,
        batches: list[list[_Batch]],
        members: tuple[int, ...],
        index: int,
        group: Any,
        fill: Callable[[ItemKey, memoryview], None],
    ) -> None:
        rounds = max(len(b) for b in batches)
        error: BaseException | None = None
        for k in range(rounds):
            phase(f"read (shared {k + 1}/{rounds})")
            own = batches[index][k] if k < len(batches[index]) else None
            buf: torch.Tensor | None = None
            if own is not None:
                buf = torch.empty(own.nbytes + 1, dtype=torch.uint8)
                view = buf.numpy().data.cast("B")
                try:
                    self.reader.read_stored(own.keys, view[: own.nbytes])
                    view[own.nbytes] = 0
                except Exception as err:
                    error = error or err
                    view[own.nbytes] = 1
                self.bytes_read += own.nbytes
            phase(f"read (shared {k + 1}/{rounds}, broadcast)")
            for m, theirs in enumerate(batches):
                batch = theirs[k] if k < len(theirs) else None
                if batch is None:
                    continue
                data = buf if m == index else torch.empty(batch.nbytes + 1, dtype=torch.uint8)
                assert data is not None
                self._since = time.monotonic()
                _broadcast(data, members[m], group)
                if m != index:
                    self.bytes_received += batch.nbytes
                mv = data.numpy().data.cast("B")
                if mv[batch.nbytes] or error is not None:
                    continue  # a member's bad batch: its own error fails the load on every rank
                at = 0
                try:
                    for key in batch.keys:
                        fill(key, mv[at : at + key[2]])
                        at += key[2]
                except Exception as err:
                    error = err
        if error is not None:
            raise error


def _digest(keys: list[ItemKey]) -> bytes:
    return hashlib.blake2b(repr(keys).encode(), digest_size=16).digest() if keys else b""


def _is_dtensor(planner: Any, req: ReadItem) -> bool:
    return isinstance(getattr(planner, "state_dict", {}).get(req.dest_index.fqn), DTensor)


def _key(reader: Any, req: ReadItem) -> ItemKey:
    info = reader.storage_data[req.storage_index]
    return (str(info.relative_path), int(info.offset), int(info.length))
