"""Peer replicas: after each local-tier commit, a background thread copies every rank's new
checkpoint to the ranks that hold its replicas, sending only what they do not already hold;
after a rebuild, the replicas its holders lost are sent again.

One *round* per save, on every rank, in save order (the engine announces each round with
:meth:`Replicator.expect` at the same point of every rank's save and resolves it once the rank's
local commit ended). For each ``k = 1 .. peer_replicas``, every rank is at once the source of
its ``k``-th holder and the holder of its ``k``-th source (:class:`~.topology.Topology`):

1. a bounded barrier on replication's own gloo group (every rank reached this round within
   ``collective_timeout_s``, or the error names the ranks that did not);
2. each rank sends its new manifest to its holder (JSON; an empty message when its local commit
   failed, and there is no replica this round);
3. the holder links into a hidden folder every file it already has with the same size and
   checksum, untouched since its commit: in its own checkpoint of this step (data-parallel
   replicas hold the same bytes, so they cost nothing), or in the replica it holds of the
   source's previous step (what did not change). It sends back the list of the files it still
   needs;
4. the source streams those files (:func:`~.transfer.exchange_files`, throttled by
   ``peer_bandwidth_mb_s``); the holder checks every checksum as it writes, and commits the copy
   (manifest, rename, ``latest``, retention) only if all match.

A round never blocks ``save()``: the training thread only hands it the committed manifest. A
failure of one copy (a bad checksum, a full disk) is recorded and the next round tries afresh; a
failure of the process group (a rank died or stopped) ends replication for this engine, since
the group cannot be trusted any more. Both are raised by :meth:`Replicator.wait`.

After a resume that rebuilt a node from its peers, :func:`restore_replicas` sends again, at once,
the replicas of the resumed step that the placement asks for and their holders lost (the rebuilt
node's copies of its peers, and its own ranks' copies on nodes lost with it), so a second
failure before the next save still finds every rank's part.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._dcpio import dist as _dist
from .._format import bounded_json
from .._format.manifest import MAX_MANIFEST_BYTES, Manifest, parse_manifest
from .._format.names import iter_dirname
from ..errors import CkptEngineError, ReplicationError, clip
from .folders import (
    abandon_copy,
    commit_copy,
    held_checkpoints,
    link_local_files,
    local_sources,
    rank_folder,
    start_copy,
)
from .topology import Topology
from .transfer import Incoming, Outgoing, Throttle, TransferOutcome, exchange_bytes, exchange_files

__all__ = ["Replicator", "missing_replicas", "restore_replicas"]

logger = logging.getLogger("ckpt_engine")

#: A holder's list of needed files is JSON of at most this many bytes.
_MAX_NEEDS_BYTES = 16 << 20
#: Failures kept for :meth:`Replicator.wait` (the oldest are dropped beyond this).
_MAX_ERRORS = 16


@dataclass(frozen=True)
class _Round:
    iteration: int
    committed: Future[Manifest | None]


@dataclass
class _Copy:
    """The replica this rank assembles in one round: rank ``manifest.rank``'s checkpoint."""

    manifest: Manifest
    partial: str
    #: ``rel`` -> (size, checksum) of the files still needed from the source.
    needed: dict[str, tuple[int, str]]


class Replicator:
    """Keeps this rank's replicas and its peers' copies of its checkpoints current, one round per save."""

    def __init__(
        self,
        *,
        local_dir: str,
        topology: Topology,
        rank: int,
        group: Any,
        timeout_s: float,
        keep_last: int,
        bandwidth_mb_s: float | None,
        sync_files: bool,
        max_in_flight: int | None = None,
        when_behind: str = "skip",
    ) -> None:
        self._local_dir = local_dir
        self._topology = topology
        self._rank = rank
        #: Replication's own gloo group, created with ``timeout_s``: it bounds every send and receive,
        #: and the barrier that opens each round names the ranks that did not arrive. (No c10d
        #: store traffic: the training thread's collectives use the store client at the same time.)
        self._group = group
        self._timeout = timedelta(seconds=timeout_s)
        self._keep_last = keep_last
        self._bandwidth = bandwidth_mb_s
        self._sync = sync_files
        self._queue: queue.Queue[_Round | None] = queue.Queue()
        self._cond = threading.Condition()
        #: The iterations of the announced rounds that have not finished, oldest first.
        self._rounds: list[int] = []
        self._errors: list[str] = []
        #: Why replication stopped for good (the process group failed), once it did.
        self._broken: str | None = None
        #: Rounds in flight past which a new one waits (``"wait"``) or sends nothing (``"skip"``).
        self._max_in_flight, self._when_behind = max_in_flight, when_behind
        #: Announced rounds that send nothing: they keep the rounds in step, but pin no step.
        self._skipped: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="ckpt-engine-replication", daemon=True)
        self._thread.start()

    # -- the engine's side ----------------------------------------------------------------------

    def expect(self, iteration: int) -> Future[Manifest | None]:
        """Announce the round of ``iteration`` (every rank, same order); resolve the returned future
        with the committed local manifest, or ``None`` if the local commit failed. It must be
        resolved in every case: the peers wait for this rank's round."""
        committed: Future[Manifest | None] = Future()
        with self._cond:
            limit = self._max_in_flight
            if limit is not None and len(self._pinned()) >= limit:
                if self._when_behind == "wait":  # back-pressure: each rank waits on its own rounds
                    self._cond.wait_for(lambda: len(self._pinned()) < limit)
                else:  # sends nothing this round (its peers see a failed commit): every rank decides alone
                    self._skipped.add(iteration)
                    logger.warning(
                        "rank %d: iteration %d is not replicated: %d replication round(s) are still in flight "
                        "(replication_max_in_flight; peer_bandwidth_mb_s or the link is slower than the saves)",
                        self._rank,
                        iteration,
                        limit,
                    )
            self._rounds.append(iteration)
        self._queue.put(_Round(iteration, committed))
        return committed

    def _pinned(self) -> list[int]:
        return [i for i in self._rounds if i not in self._skipped]

    def in_flight(self) -> frozenset[int]:
        """The iterations whose rounds have not finished and send files: this rank may still send them."""
        with self._cond:
            return frozenset(self._pinned())

    def wait(self, timeout: float | None = None) -> None:
        """Block until every announced round has finished; raise :class:`ReplicationError` for the
        failures since the last call (or when rounds are still running after ``timeout``)."""
        with self._cond:
            done = self._cond.wait_for(lambda: not self._rounds, timeout)
            errors, self._errors = self._errors, []
            running = len(self._rounds)
        if not done:
            errors.append(f"{running} replication round(s) still running after {timeout}s")
        if errors:
            shown = "; ".join(errors[:4]) + (f"; and {len(errors) - 4} more" if len(errors) > 4 else "")
            raise ReplicationError(f"rank {self._rank}: peer replication failed: {shown}")

    def close(self, timeout: float) -> None:
        """Finish the announced rounds (at most ``timeout`` seconds), then stop the thread and
        release the process group."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("peer replication did not finish within %.0fs of close(); leaving it", timeout)
            return
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(self._group)

    # -- the thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                manifest = job.committed.result()
                if job.iteration in self._skipped:
                    manifest = None
                if self._broken is None:
                    self._round(job.iteration, manifest)
            except Exception as err:  # the group failed, or a peer broke the protocol: stop for good
                self._broken = f"iteration {job.iteration}: {type(err).__name__}: {clip(str(err), 300)}"
                logger.error("peer replication stopped on rank %d: %s", self._rank, self._broken)
                self._record(f"replication stopped at {self._broken}")
            finally:
                with self._cond:
                    self._rounds.remove(job.iteration)
                    self._skipped.discard(job.iteration)
                    self._cond.notify_all()

    def _record(self, error: str) -> None:
        with self._cond:
            self._errors = [*self._errors[-(_MAX_ERRORS - 1) :], error]

    def _round(self, iteration: int, manifest: Manifest | None) -> None:
        group = self._group
        raw = manifest.to_json().encode("utf-8") if manifest is not None else b""
        for holder, source in zip(self._topology.holders(self._rank), self._topology.sources(self._rank), strict=True):
            try:
                dist.monitored_barrier(group, timeout=self._timeout, wait_all_ranks=True)
            except RuntimeError as err:
                raise ReplicationError(
                    f"not every rank reached the replication of iteration {iteration}: {clip(str(err), 300)}"
                ) from err
            theirs = exchange_bytes(group, holder, raw, source, MAX_MANIFEST_BYTES)
            copy = self._prepare_copy(source, iteration, theirs or b"")
            needs = json.dumps(sorted(copy.needed) if copy is not None else []).encode()
            asked = exchange_bytes(group, source, needs, holder, _MAX_NEEDS_BYTES)
            out = self._outgoing(manifest, asked or b"", holder)
            inc = None
            if copy is not None and copy.needed:
                files = [(rel, size, checksum) for rel, (size, checksum) in sorted(copy.needed.items())]
                assert copy.manifest.algorithm is not None
                inc = Incoming(source, copy.partial, files, copy.manifest.algorithm, self._sync)
            outcome = exchange_files(group, out, inc, Throttle(self._bandwidth))
            if outcome.unsent:
                self._record(f"iteration {iteration}: could not send {_files(outcome.unsent)} to rank {holder}")
            if copy is not None:
                self._finish(copy, outcome, source)

    def _prepare_copy(self, source: int, iteration: int, raw: bytes) -> _Copy | None:
        """Parse the source's manifest, start its copy with what this node already holds; ``None``
        when there is nothing to copy (the source's commit failed) or it cannot be (recorded)."""
        if not raw:
            return None
        try:
            return _start_replica(self._local_dir, self._rank, self._topology.world, source, iteration, raw)
        except (OSError, CkptEngineError) as err:
            self._record(f"iteration {iteration}: replica of rank {source} not started: {clip(str(err), 200)}")
            return None

    def _outgoing(self, manifest: Manifest | None, asked: bytes, holder: int) -> Outgoing | None:
        return _asked_files(self._local_dir, self._rank, manifest, asked, holder)

    def _finish(self, copy: _Copy, outcome: TransferOutcome, source: int) -> None:
        iteration = copy.manifest.iteration
        if outcome.bad:
            abandon_copy(copy.partial)
            self._record(f"iteration {iteration}: replica of rank {source} refused: {_files(outcome.bad)}")
            return
        try:
            commit_copy(self._local_dir, copy.manifest, copy.partial, self._keep_last)
        except (OSError, CkptEngineError) as err:
            abandon_copy(copy.partial)
            self._record(f"iteration {iteration}: replica of rank {source} not committed: {clip(str(err), 200)}")


def restore_replicas(
    local_dir: str,
    topology: Topology,
    iteration: int,
    save_id: str | None,
    held: set[tuple[int, int]],
    *,
    group: Any,
    keep_last: int,
    sync: bool,
) -> int:
    """Every rank, after a resume from the local tier put every rank's part of ``iteration`` (save
    ``save_id``) on its own node: each replica of that step the placement asks for and its holder
    lacks (``held``: the ``(holder, owner)`` pairs that hold it) is sent by its owner, pair by pair
    in ``(owner, holder)`` order (each rank waits only in its own pairs), so a second failure
    before the next save still finds a copy. Returns the bytes this rank received. A copy that
    fails is logged, not raised (the next save's round replicates afresh); a process group that
    fails raises."""
    rank = _dist.rank()
    missing = missing_replicas(topology, held)
    received = 0
    for owner, holder in missing:
        if rank == owner:
            _restore_send(local_dir, topology.world, iteration, holder, group)
        elif rank == holder:
            received += _restore_receive(local_dir, topology.world, owner, iteration, save_id, group, keep_last, sync)
    if missing and rank == 0:
        logger.info("local tier: %d replica(s) of iteration %d sent again to their holders", len(missing), iteration)
    return received


def missing_replicas(topology: Topology, held: set[tuple[int, int]]) -> list[tuple[int, int]]:
    """The ``(owner, holder)`` pairs the placement asks for that ``held`` (``(holder, owner)``
    pairs) lacks, in ``(owner, holder)`` order: the same list on every rank."""
    return sorted((o, h) for o in range(topology.world) for h in topology.holders(o) if (h, o) not in held)


def _restore_send(local_dir: str, world: int, iteration: int, holder: int, group: Any) -> None:
    rank = _dist.rank()
    own = [h for h in held_checkpoints(local_dir, rank, world, since=iteration) if h.iteration == iteration]
    manifest = own[0].manifest if own else None
    exchange_bytes(group, holder, manifest.to_json().encode("utf-8") if manifest else b"", None, 0)
    asked = exchange_bytes(group, None, b"", holder, _MAX_NEEDS_BYTES) or b""
    outcome = exchange_files(group, _asked_files(local_dir, rank, manifest, asked, holder), None)
    if outcome.unsent:
        logger.warning("local tier: could not send %s to rank %d", _files(outcome.unsent), holder)


def _restore_receive(
    local_dir: str, world: int, owner: int, iteration: int, save_id: str | None, group: Any, keep_last: int, sync: bool
) -> int:
    """Receive rank ``owner``'s ``iteration`` as a replica and commit it; the bytes received."""
    raw = exchange_bytes(group, None, b"", owner, MAX_MANIFEST_BYTES) or b""
    try:
        copy = _start_replica(local_dir, _dist.rank(), world, owner, iteration, raw)
        sent = None if copy.manifest.lineage is None else copy.manifest.lineage.save_id
        if sent != save_id:
            abandon_copy(copy.partial)
            raise ReplicationError(f"rank {owner} sent save {sent} of iteration {iteration}, not {save_id}")
    except (OSError, CkptEngineError) as err:
        logger.warning("local tier: the replica of rank %d is not restored: %s", owner, clip(str(err), 300))
        exchange_bytes(group, owner, b"[]", None, 0)
        return 0
    exchange_bytes(group, owner, json.dumps(sorted(copy.needed)).encode(), None, 0)
    files = [(rel, size, checksum) for rel, (size, checksum) in sorted(copy.needed.items())]
    assert copy.manifest.algorithm is not None
    inc = Incoming(owner, copy.partial, files, copy.manifest.algorithm, sync) if files else None
    outcome = exchange_files(group, None, inc)
    try:
        if outcome.bad:
            raise ReplicationError(f"files refused: {_files(outcome.bad)}")
        commit_copy(local_dir, copy.manifest, copy.partial, keep_last)
    except (OSError, CkptEngineError) as err:
        abandon_copy(copy.partial)
        logger.warning("local tier: the replica of rank %d is not restored: %s", owner, clip(str(err), 300))
    return outcome.bytes_received


def _start_replica(local_dir: str, rank: int, world: int, source: int, iteration: int, raw: bytes) -> _Copy:
    """Parse the manifest rank ``source`` sent of its ``iteration`` and start this rank's copy of
    it with what this node already holds (this rank's own checkpoint of that step or later, the
    source's previous replica): the files still needed from the source are the copy's
    ``needed``. Raises what is wrong (nothing left behind)."""
    partial = ""
    try:
        manifest = parse_manifest(raw, f"the manifest rank {source} sent for iteration {iteration}")
        if manifest.rank != source or manifest.iteration != iteration or manifest.algorithm is None:
            raise ReplicationError(
                f"rank {source} sent the manifest of rank {manifest.rank}, iteration {manifest.iteration}"
            )
        if manifest.world_size != world:
            raise ReplicationError(f"rank {source} sent a manifest of {manifest.world_size} ranks")
        near = [*held_checkpoints(local_dir, rank, world, since=iteration)[:1]]
        near += held_checkpoints(local_dir, source, world)[:1]
        partial = start_copy(local_dir, source, iteration)
        rest = link_local_files(partial, manifest.files, local_sources(near))
        return _Copy(manifest, partial, {rel: (e.size, e.checksum or "") for rel, e in rest.items()})
    except BaseException:
        if partial:
            abandon_copy(partial)
        raise


def _asked_files(local_dir: str, rank: int, manifest: Manifest | None, asked: bytes, holder: int) -> Outgoing | None:
    """What the holder asked for, checked against this rank's manifest (anything else is a
    broken protocol: raised, which ends replication)."""
    try:
        names = bounded_json.loads(asked, max_depth=2, max_int_digits=20) if asked else []
    except bounded_json.JSONRefused as err:
        raise ReplicationError(f"rank {holder} sent a list of needed files that is refused: {err}") from None
    if not isinstance(names, list) or (names and manifest is None):
        raise ReplicationError(f"rank {holder} asked for files of a checkpoint this rank did not send")
    if not names:
        return None
    assert manifest is not None
    unknown = [n for n in names if not isinstance(n, str) or n not in manifest.files]
    if unknown:
        raise ReplicationError(f"rank {holder} asked for {clip(repr(unknown[:3]), 200)}, not in the manifest")
    root = os.path.join(rank_folder(local_dir, rank), iter_dirname(manifest.iteration))
    return Outgoing(holder, root, [(rel, manifest.files[rel].size) for rel in sorted(names)])


def _files(problems: dict[str, str]) -> str:
    items = sorted(problems.items())
    shown = ", ".join(f"{rel} ({why})" for rel, why in items[:3])
    return shown + (f" and {len(items) - 3} more" if len(items) > 3 else "")
