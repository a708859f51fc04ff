"""The end of a save: its commit in each tier (now, or on the commit thread) and the one builder
of the :class:`~ckpt_engine.types.SaveResult` of every outcome, with what follows a commit.

The :class:`~.saver.Saver` prepares and writes a save, then hands it to :class:`SaveCommitter`:
a synchronous save is committed before ``save()`` returns (the node-local tier first, then
``save_dir`` through the :class:`~.targets.SaveTarget` and :func:`~.commit.run_commit`), a save
written in the background from the engine's commit thread. Every outcome, from a refusal before
anything was written to a commit finished on the commit thread, is recorded by
:meth:`SaveCommitter.report`, which also tells the target, logs, runs retention and calls
``on_save_done``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from .._dcpio import dist as _dist
from .._format.retention import apply_retention
from ..config import EngineConfig
from ..errors import CheckpointSaveError, CollectiveError
from ..pipeline import Pipeline
from ..types import PendingSnapshot, SaveResult, WriteResult
from .commit import CommitPhase, run_commit
from .consensus import agree
from .local_tier import LocalTier
from .pending import SaveHandle, SaveQueue
from .targets import SavePaths, SaveTarget

__all__ = ["SaveClock", "SaveCommitter", "SaveWrites"]

logger = logging.getLogger("ckpt_engine")

Outcomes = list[WriteResult | Future[WriteResult]]
Round = Future[Any] | None
#: How the log line of a save names the way its unchanged files were carried over.
_CARRIED = {"link": "hard-linked", "copy": "copied in the store", "write": "written: carrying over refused"}


@dataclass
class SaveClock:
    """When the phases of one save began (``time.perf_counter``), for its :class:`SaveResult`.

    A phase is recorded once it completed: a save that failed before it reports 0 for it."""

    t0: float
    #: Seconds staging took, once every rank agreed that preparing the save worked.
    staging: float = 0.0
    write_start: float = 0.0
    #: How long ``save()`` blocked the caller (set when it returns for a background commit).
    blocked: float = 0.0
    #: A copy that continues after ``save()`` returned (``StagedState.snapshot``).
    snapshot: PendingSnapshot | None = None


@dataclass
class SaveWrites:
    """One save's writes: to ``save_dir`` (a durable save) and to the node-local tier."""

    durable: bool
    outcomes: Outcomes
    #: This rank's local-tier paths (``None``: no local tier), and its writes there.
    local: SavePaths | None = None
    local_outcomes: Outcomes | None = None
    #: The replication round that follows the local commit (several ranks with peer replicas).
    round: Round = None

    def all(self) -> Outcomes:
        return [*self.outcomes, *(self.local_outcomes or [])]


class SaveCommitter:
    """Commits the saves of one engine, in every tier, and reports each one's outcome."""

    def __init__(
        self,
        config: EngineConfig,
        pipeline: Pipeline,
        target: SaveTarget,
        queue: SaveQueue,
        local: LocalTier | None,
        checksum: str | None,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        self.target = target
        self.queue = queue
        self.local = local
        self.checksum = checksum

    def hand_off(
        self, paths: SavePaths, writes: SaveWrites, components: tuple[str, ...], clock: SaveClock
    ) -> SaveHandle:
        """Commit now where every write is done (synchronous providers), else from the commit
        thread; a two-tier upload always continues in the background. The local tier commits
        first: a durable save is in both tiers, or it failed."""
        if self.local is not None and self.local.current is not None:  # the manifests record it
            paths = dataclasses.replace(paths, lineage=self.local.current)
            if writes.local is not None:
                writes.local = dataclasses.replace(writes.local, lineage=self.local.current)
        future: Future[SaveResult] = Future()
        handle = SaveHandle(paths.iteration, paths.final, future, clock.snapshot)
        if not all(isinstance(o, WriteResult) for o in writes.all()):
            # Background writes: commit from the engine's commit thread (no collectives there;
            # the last DCP write of every component already synchronised all ranks).
            self.queue.submit(handle, self._commit_background, future, paths, writes, components, clock)
            return handle
        local = self._commit_local(writes, components, collective=True)
        if not writes.durable:
            result = self.report(paths, writes, components, clock, local, cleanup=False)
        elif self.target.after_commit_in_background:
            phase = self._run_commit(paths, components, writes.outcomes, collective=True)
            self._durable_committed(paths, phase)
            if phase.error is None and local.error is None:
                phase = phase.plus(local)
                self.queue.submit(
                    handle, self._after_commit_background, future, paths, writes, components, phase, clock
                )
                return handle
            result = self.report(paths, writes, components, clock, phase.plus(local), cleanup=True)
        else:
            result = self._commit(paths, writes, components, clock, local, collective=True)
        future.set_result(result)
        if isinstance(result.error, CollectiveError):
            raise result.error
        if not result.succeeded:
            raise CheckpointSaveError(
                f"saving iteration {paths.iteration} to {paths.final} failed: {result.error}"
            ) from result.error
        return handle

    def _commit_local(self, writes: SaveWrites, components: tuple[str, ...], *, collective: bool) -> CommitPhase:
        """This rank's local-tier commit (nothing without a local tier). In a synchronous save the
        ranks agree before it (a rank whose write failed, a full disk, fails the save on every
        rank, and no rank commits: never two saves of one step in the tier) and after it."""
        if self.local is None or writes.local is None:
            return CommitPhase()
        assert self.checksum is not None
        phase = self.local.check(self.pipeline, writes.local, writes.local_outcomes or [], self.checksum)
        together = collective and _dist.world_size() > 1
        if together:
            _agree_local(phase, "write", "local writes")
        wrote = phase.error is None  # the same on every rank, once agreed
        phase = self.local.commit(writes.local, components, self.checksum, phase, writes.round)
        if together and wrote:
            _agree_local(phase, "commit", "local commit")
        return phase

    def _commit(
        self,
        paths: SavePaths,
        writes: SaveWrites,
        components: tuple[str, ...],
        clock: SaveClock,
        local: CommitPhase,
        *,
        collective: bool,
    ) -> SaveResult:
        """The durable commit (:func:`.commit.run_commit`) and what follows it, then the report
        of both tiers (``local``: the local tier's commit)."""
        phase = self._run_commit(paths, components, writes.outcomes, collective=collective)
        self._durable_committed(paths, phase)
        if phase.error is None and _dist.rank() == 0:
            phase.error = self.target.after_commit(paths)
        cleanup = phase.error is not None
        return self.report(paths, writes, components, clock, phase.plus(local), cleanup=cleanup, collective=collective)

    def _durable_committed(self, paths: SavePaths, phase: CommitPhase) -> None:
        """The saves after a committed durable one descend from it (their lineage's parent)."""
        if phase.error is None and self.local is not None:
            self.local.durable_committed(paths.lineage, paths.iteration)

    def _run_commit(
        self, paths: SavePaths, components: tuple[str, ...], outcomes: Sequence[Any], *, collective: bool
    ) -> CommitPhase:
        return run_commit(
            self.target, self.pipeline, paths, components, outcomes, collective=collective, algorithm=self.checksum
        )

    def _after_commit_background(
        self,
        future: Future[SaveResult],
        paths: SavePaths,
        writes: SaveWrites,
        components: tuple[str, ...],
        phase: CommitPhase,
        clock: SaveClock,
    ) -> None:
        try:
            if _dist.rank() == 0:
                phase.error = self.target.after_commit(paths)
            result = self.report(paths, writes, components, clock, phase, cleanup=False, collective=False)
            future.set_result(result)
        except BaseException as exc:  # an observer raised: surface it through the handle
            future.set_exception(exc)

    def _commit_background(
        self,
        future: Future[SaveResult],
        paths: SavePaths,
        writes: SaveWrites,
        components: tuple[str, ...],
        clock: SaveClock,
    ) -> None:
        try:
            local = self._commit_local(writes, components, collective=False)
            if writes.durable:
                result = self._commit(paths, writes, components, clock, local, collective=False)
            else:
                result = self.report(paths, writes, components, clock, local, cleanup=False, collective=False)
            future.set_result(result)
        except BaseException as exc:  # an observer raised: surface it through the handle
            future.set_exception(exc)

    # -- the outcome ------------------------------------------------------------------------

    def report(
        self,
        paths: SavePaths,
        writes: SaveWrites,
        components: tuple[str, ...],
        clock: SaveClock,
        outcome: CommitPhase | BaseException,
        *,
        cleanup: bool,
        collective: bool = True,
    ) -> SaveResult:
        """The one builder of a save's :class:`SaveResult`, for every outcome.

        ``outcome`` is the commit's :class:`CommitPhase` (its error, bytes and the end of the
        writes), or the error of a save that failed before it reached a commit (0 bytes; the
        writes, if they began, end now). The times come from ``clock``: a phase the save did not
        complete counts 0. ``collective``: the caller of ``save()`` is still blocked (else the
        commit thread reports). Then :meth:`_finish`: the target finishes the save (``cleanup``:
        remove what it staged), a success is logged and retention runs (rank 0), a failure is
        logged where nobody is blocked to receive it (the commit thread's; ``save()`` raises the
        others, so their text is printed once), and ``on_save_done`` observers get the result."""
        now = time.perf_counter()
        phase, error = (outcome, outcome.error) if isinstance(outcome, CommitPhase) else (None, outcome)
        write_end = phase.write_end if phase is not None else now
        snapshot = clock.snapshot
        result = SaveResult(
            iteration=paths.iteration,
            path=paths.final,
            succeeded=error is None,
            error=error,
            components=components,
            bytes_written=phase.nbytes if phase is not None else 0,
            bytes_reused=phase.reused if phase is not None else 0,
            carried_by=phase.carried_by if phase is not None else "off",
            # A synchronous save blocks the caller through the commit too.
            blocked_seconds=now - clock.t0 if collective else clock.blocked,
            staging_seconds=clock.staging,
            write_seconds=write_end - clock.write_start if clock.write_start else 0.0,
            total_seconds=now - clock.t0,
            step_wait_seconds=snapshot.step_wait_seconds if snapshot is not None else 0.0,
            background_copy_seconds=snapshot.copy_seconds if snapshot is not None else 0.0,
            tier="durable" if writes.durable else "local",
        )
        self._finish(result, paths, cleanup=cleanup, raised=collective)
        return result

    def _finish(self, result: SaveResult, paths: SavePaths, *, cleanup: bool, raised: bool) -> None:
        if result.tier == "durable":
            self.target.finish(paths, _dist.rank(), _dist.world_size(), cleanup=cleanup, succeeded=result.succeeded)
        if result.succeeded:
            if _dist.rank() == 0 and result.tier == "durable":
                _log_saved(result)
                self._apply_retention()
        elif raised:
            logger.debug("save of iteration %d failed (raised to the caller): %s", result.iteration, result.error)
        else:
            logger.error("save of iteration %d failed: %s", result.iteration, result.error)
        self.pipeline.on_save_done(result)

    def _apply_retention(self) -> None:
        """Rank 0, after a commit: the target's retention jobs (``keep_last`` / ``keep_every``,
        and two-tier ``local_keep_last``). A best-effort side job: a failure is logged and
        retried after the next commit, never raised into training."""
        for job in self.target.retention_jobs():
            try:
                apply_retention(job.folder, job.keep_last, job.keep_every, job.store)
            except Exception:
                logger.warning("retention in %s failed; retrying after the next commit", job.folder, exc_info=True)


def _agree_local(phase: CommitPhase, what: str, step: str) -> None:
    """Every rank's outcome of a local-tier step: the first failure, as one typed error naming
    its rank and cause, on every rank (the failing one included)."""
    try:
        failed = agree(phase.error, fallback=CheckpointSaveError, step=step).first
    except CollectiveError as err:
        phase.error = err
        return
    if failed is not None and not isinstance(phase.error, CollectiveError):
        error = CheckpointSaveError(f"rank {failed.rank} failed to {what} its local-tier checkpoint: {failed.text}")
        error.__cause__ = phase.error
        phase.error = error


def _log_saved(result: SaveResult) -> None:
    """Rank 0's log line of a committed save (with what an incremental save carried over)."""
    carried = ""
    if result.carried_by != "off":
        carried = f", {result.bytes_reused / 1e6:.1f} MB unchanged ({_CARRIED[result.carried_by]})"
    logger.info(
        "saved iteration %d to %s (%.1f MB written%s, blocked %.3fs, total %.3fs)",
        result.iteration,
        result.path,
        result.bytes_written / 1e6,
        carried,
        result.blocked_seconds,
        result.total_seconds,
    )
