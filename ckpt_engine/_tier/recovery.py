"""The recovery planner: which step a resume takes from the node-local tier, and where each rank's
part comes from (its own node, else a peer's replica).

Run by every rank inside a load, before anything is read:

1. each rank lists what it holds from ``durable`` on (its own folder, and the replicas it keeps:
   committed, the manifest naming the rank and this world size, every file of its size);
2. one all-gather of one payload on every rank: what it holds, with its view of ``save_dir``'s
   latest step (views that differ raise :class:`~ckpt_engine.errors.CheckpointDisagreementError`
   on every rank); the copies that are not of ``save_dir``'s run or do not descend from its
   latest are set aside (:mod:`.lineage`, one log line); every rank then computes the same plan:
   the newest save that *every* rank's checkpoint is held for somewhere (a step only some ranks
   hold, a replica still in flight, or parts of two saves of one step never count), each rank's
   part taken from the rank itself if it holds it, else from the first holder of a replica
   (:meth:`.Topology.holders` order);
3. with ``verify: checksums``, each rank reads its own copy and compares its checksums before
   anything is loaded (with ``sizes``, the default, the sizes were checked in step 1, as a load
   from ``save_dir`` checks them); a damaged one is dropped from the plan on every rank and the
   plan is made again (step 2);
4. each rank that lacks its part receives it from its source over the process group
   (:mod:`.transfer`: JSON manifest, raw bytes, every checksum checked on arrival whatever
   ``verify`` says, nothing unpickled), into its own node's folder, so the node's tier is
   rebuilt; a transfer that fails (a damaged replica among them) drops that source and the plan
   is made again;
5. the replicas of the step that their holders lack (those lost with a node, damaged or never
   committed) are sent again by their owners (:func:`~.replication.restore_replicas`).

It returns ``None`` when no step at least as new as ``durable`` is complete in the local tier, or
``save_dir`` has none (the load then reads ``save_dir``, or starts fresh). Every collective is
bounded by ``collective_timeout_s`` (the engine's watch is active), so a rank that is gone is
named, not waited for.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .._dcpio import dist as _dist
from .._dcpio.watch import active_watch
from .._format import bounded_json
from .._format.manifest import MAX_MANIFEST_BYTES, parse_manifest
from .._format.names import iter_dirname
from ..errors import CheckpointDisagreementError, CkptEngineError, clip
from .folders import (
    Held,
    abandon_copy,
    commit_copy,
    held_checkpoints,
    link_local_files,
    local_sources,
    rank_folder,
    start_copy,
    verify_held,
)
from .lineage import Announced, Committed, Durable, admissible, describe_set_aside, node_committed
from .replication import restore_replicas
from .topology import Topology
from .transfer import Incoming, Outgoing, exchange_bytes, exchange_files

if TYPE_CHECKING:
    from .reshard_read import Exchange

__all__ = ["Recovered", "recover"]

logger = logging.getLogger("ckpt_engine")

#: ``(holder, owner, iteration)``: rank ``holder``'s copy of rank ``owner``'s checkpoint.
Copy = tuple[int, int, int]


@dataclass(frozen=True)
class Recovered:
    """Where this rank's part of the recovered step is, and how it got there."""

    iteration: int
    #: This rank's own committed folder of that step (received into it when ``source`` is a peer).
    path: str
    #: The rank this rank's part came from (itself: it was on its own node).
    source: int
    #: Bytes of its files received from ``source`` (0 when it was on its own node).
    bytes_received: int = 0
    #: Bytes of its files that were on its own node already (linked) when it came from a peer.
    bytes_linked: int = 0
    #: A step saved by a job of another shape (:mod:`.reshard`): ``path`` is this rank's resharded
    #: folder, read through this exchange's readers (``None``: a step of this job's shape).
    reshard: Exchange | None = None


@dataclass(frozen=True)
class _Plan:
    iteration: int
    #: owner -> the rank whose copy it takes.
    source: dict[int, int]
    #: The save of ``iteration`` every part comes from (``None``: copies without a lineage).
    save_id: str | None = None


def recover(
    local_dir: str, topology: Topology, durable: Durable | None, *, keep_last: int, sync: bool, checksums: bool
) -> Recovered | None:
    """The step this rank resumes from the local tier and its folder, or ``None`` (see the module)."""
    rank = _dist.rank()
    mine = _holdings(local_dir, topology, rank, durable)
    mine_announced = [Announced(rank, o, it, h.manifest.lineage) for o, held in mine.items() for it, h in held.items()]
    # One payload of one kind on every rank, whatever it sees: a rank that disagrees about
    # save_dir finds out in the same collective as every other rank.
    gathered: list[tuple[Durable | None, list[Announced], list[Committed]]] = _dist.all_gather_object(
        (durable, mine_announced, node_committed(local_dir)), step="local tier: holdings"
    )
    _require_one_view([view for view, _, _ in gathered])
    copies = [c for _, held, _ in gathered for c in held]
    kept, aside = admissible(durable, copies, [c for _, _, committed in gathered for c in committed])
    if aside and rank == 0:
        logger.warning("local tier: copies set aside, not resumed: %s", describe_set_aside(aside))
    refused: set[Copy] = set()
    for _ in range(1 + len(kept)):
        plan = _plan(kept, refused, topology)
        if plan is None:
            return None
        own = checksums and plan.source[rank] == rank
        bad = [(rank, rank, plan.iteration)] if own and _damaged(mine[rank][plan.iteration]) else []
        newly = _everyone(bad, "local tier: checks")
        if newly:
            refused |= newly
            continue
        received, linked, failed = _transfers(local_dir, plan, mine, rank, keep_last=keep_last, sync=sync)
        newly = _everyone(failed, "local tier: transfers")
        if newly:
            refused |= newly
            continue
        _restore(local_dir, topology, plan, kept, refused, keep_last=keep_last, sync=sync)
        path = os.path.join(rank_folder(local_dir, rank), iter_dirname(plan.iteration))
        return Recovered(plan.iteration, path, plan.source[rank], received, linked)
    return None


def _require_one_view(views: list[Durable | None]) -> None:
    """Every rank must see the same latest step in ``save_dir`` (raised on every rank alike)."""
    if all(v == views[0] for v in views):
        return
    shown = ", ".join(
        f"rank {r}: " + ("none" if v is None or v.iteration is None else f"iteration {v.iteration}")
        for r, v in enumerate(views[:8])
    )
    raise CheckpointDisagreementError(
        f"the ranks see different latest checkpoints in save_dir ({shown}); every rank must see the same "
        "save_dir (a shared filesystem with consistent views): fix the storage or latest_checkpoint.txt"
    )


def _holdings(local_dir: str, topology: Topology, rank: int, durable: Durable | None) -> dict[int, dict[int, Held]]:
    """What this rank holds from ``durable`` on: its own checkpoints and its replicas, by owner."""
    out = {}
    since = None if durable is None else durable.iteration
    for owner in (rank, *topology.sources(rank)):
        held = held_checkpoints(local_dir, owner, topology.world, since=since)
        if held:
            out[owner] = {h.iteration: h for h in held}
    return out


def _plan(kept: list[Announced], refused: set[Copy], topology: Topology) -> _Plan | None:
    """The newest save every rank's part is held for (``refused`` copies left out; one save of a
    step, never a mix of two), and the source of each part; the same on every rank, computed from
    the same gathered holdings."""
    saves: dict[tuple[int, str], dict[int, set[int]]] = {}
    for c in kept:
        if (c.holder, c.owner, c.iteration) not in refused:
            saves.setdefault((c.iteration, c.save_id or ""), {}).setdefault(c.owner, set()).add(c.holder)
    for (iteration, save_id), holders in sorted(saves.items(), reverse=True):
        source = {}
        for owner in range(topology.world):
            have = holders.get(owner, set())  # its own node, its replicas in order, else the lowest rank
            holder = next((h for h in (owner, *topology.holders(owner)) if h in have), min(have, default=None))
            if holder is None:
                break
            source[owner] = holder
        else:
            return _Plan(iteration, source, save_id or None)
    return None


def _restore(
    local_dir: str,
    topology: Topology,
    plan: _Plan,
    kept: list[Announced],
    refused: set[Copy],
    *,
    keep_last: int,
    sync: bool,
) -> None:
    """Every rank holds its part now: the replicas of the step their holders lack are sent again
    (:func:`~.replication.restore_replicas`)."""
    held = {
        (c.holder, c.owner)
        for c in kept
        if c.iteration == plan.iteration
        and (c.save_id or None) == plan.save_id
        and (c.holder, c.owner, c.iteration) not in refused
    }
    watch = active_watch()
    group = watch.group if watch is not None else None
    restore_replicas(
        local_dir, topology, plan.iteration, plan.save_id, held, group=group, keep_last=keep_last, sync=sync
    )


def _damaged(held: Held) -> bool:
    problems = verify_held(held)
    if problems:
        logger.warning("local tier: %s is damaged, another copy is used: %s", held.path, "; ".join(problems[:3]))
    return bool(problems)


def _everyone(copies: list[Copy], step: str) -> set[Copy]:
    """Every rank's list of refused copies, merged (one all-gather)."""
    return {(c[0], c[1], c[2]) for part in _dist.all_gather_object(copies, step=step) for c in part}


def _transfers(
    local_dir: str, plan: _Plan, mine: dict[int, dict[int, Held]], rank: int, *, keep_last: int, sync: bool
) -> tuple[int, int, list[Copy]]:
    """Every part that is not on its owner's node, sent by its source: pair by pair in owner order
    (each rank waits only in its own pairs). Returns the bytes this rank received and linked from
    its own node, and the copies that failed here."""
    watch = active_watch()
    group = watch.group if watch is not None else None
    if watch is not None:
        watch.barrier("local tier: transfers")
    received, linked, failed = 0, 0, []
    for owner, holder in sorted(plan.source.items()):
        if holder == owner or rank not in (owner, holder):
            continue
        if rank == holder:
            _send(group, mine[owner][plan.iteration], owner)
            continue
        got, kept, ok = _receive(group, local_dir, holder, plan, keep_last=keep_last, sync=sync)
        received, linked = received + got, linked + kept
        if not ok:
            failed.append((holder, owner, plan.iteration))
    return received, linked, failed


def _send(group: Any, held: Held, owner: int) -> None:
    exchange_bytes(group, owner, held.manifest.to_json().encode("utf-8"), None, 0)
    asked = exchange_bytes(group, None, b"", owner, 16 << 20) or b""
    try:
        asked_for = bounded_json.loads(asked, max_depth=2, max_int_digits=20)
    except bounded_json.JSONRefused as err:
        raise CkptEngineError(f"rank {owner} sent a list of needed files that is refused: {err}") from None
    if not isinstance(asked_for, list) or not all(isinstance(n, str) and n in held.manifest.files for n in asked_for):
        raise CkptEngineError(f"rank {owner} asked for files {clip(repr(asked_for), 200)} that {held.path} lacks")
    names = sorted(asked_for)
    outcome = exchange_files(group, Outgoing(owner, held.path, [(n, held.manifest.files[n].size) for n in names]), None)
    if outcome.unsent:
        logger.warning("local tier: could not send %s of %s to rank %d", sorted(outcome.unsent)[:3], held.path, owner)


def _receive(
    group: Any, local_dir: str, holder: int, plan: _Plan, *, keep_last: int, sync: bool
) -> tuple[int, int, bool]:
    """Receive this rank's part of the planned step from ``holder`` into its own folder and commit
    it; returns the bytes received, the bytes linked from its own node, and whether it is committed."""
    rank, iteration = _dist.rank(), plan.iteration
    raw = exchange_bytes(group, None, b"", holder, MAX_MANIFEST_BYTES) or b""
    partial, needed = "", {}
    try:
        manifest = parse_manifest(raw, f"the manifest rank {holder} sent of rank {rank}'s iteration {iteration}")
        if manifest.rank != rank or manifest.iteration != iteration or manifest.algorithm is None:
            raise CkptEngineError(f"rank {holder} sent rank {manifest.rank}'s iteration {manifest.iteration}")
        sent_save = None if manifest.lineage is None else manifest.lineage.save_id
        if sent_save != plan.save_id:
            raise CkptEngineError(f"rank {holder} sent save {sent_save} of iteration {iteration}, not {plan.save_id}")
        own = held_checkpoints(local_dir, rank, manifest.world_size)
        partial = start_copy(local_dir, rank, iteration)
        needed = link_local_files(partial, manifest.files, local_sources(own[:1]))
    except (OSError, CkptEngineError) as err:
        logger.warning("local tier: rank %d cannot take its part from rank %d: %s", rank, holder, clip(str(err), 300))
        if partial:
            abandon_copy(partial)
        exchange_bytes(group, holder, b"[]", None, 0)
        return 0, 0, False
    exchange_bytes(group, holder, json.dumps(sorted(needed)).encode(), None, 0)
    files = [(rel, e.size, e.checksum or "") for rel, e in sorted(needed.items())]
    outcome = exchange_files(group, None, Incoming(holder, partial, files, manifest.algorithm, sync))
    try:
        if outcome.bad:
            raise CkptEngineError(f"files refused: {sorted(outcome.bad.items())[:3]}")
        commit_copy(local_dir, manifest, partial, keep_last)
    except (OSError, CkptEngineError) as err:
        logger.warning("local tier: the part rank %d sent of rank %d is refused: %s", holder, rank, clip(str(err), 300))
        abandon_copy(partial)
        return outcome.bytes_received, 0, False
    logger.info(
        "local tier: rank %d rebuilt its iteration %d from rank %d's replica (%.1f MB received, %d file(s) linked)",
        rank,
        iteration,
        holder,
        outcome.bytes_received / 1e6,
        len(manifest.files) - len(needed),
    )
    linked = sum(e.size for rel, e in manifest.files.items() if rel not in needed)
    return outcome.bytes_received, linked, True
