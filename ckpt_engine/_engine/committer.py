"""The end of a save: its commit in each tier (now, or on the commit thread) and the one builder
of the :class:`~ckpt_engine.types.SaveResult` of every outcome, with what follows a commit.

The :class:`~.saver.Saver` prepares and writes a save, then hands it to :class:`SaveCommitter`:
a synchronous save is committed before ``save()`` returns (in each tier of the
:class:`~.tiers.TierStack` it went to, the nearer tiers first and the durable tier last), a save
written in the background from the engine's commit thread. Every outcome, from a refusal before
anything was written to a commit finished on the commit thread, is recorded by
:meth:`SaveCommitter.report`, which also tells the target, logs, runs retention and calls
``on_save_done``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass

from .._dcpio import dist as _dist
from .._format.retention import apply_retention
from ..config import EngineConfig
from ..errors import CheckpointSaveError, CollectiveError
from ..pipeline import Pipeline
from ..types import PendingSnapshot, SaveResult, WriteResult
from .pending import SaveHandle, SaveQueue
from .targets import SavePaths
from .tiers import CommitPhase, DurableTier, Outcomes, TierSave, TierStack

__all__ = ["SaveClock", "SaveCommitter", "SaveWrites"]

logger = logging.getLogger("ckpt_engine")

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
    """One save's parts in the tiers it goes to (:meth:`TierStack.saves`), in write order: the
    durable tier's first where the save is durable."""

    saves: list[TierSave]

    @property
    def durable(self) -> bool:
        """Whether this save goes to the durable tier (``save_dir``)."""
        return any(isinstance(s.tier, DurableTier) for s in self.saves)

    @property
    def main(self) -> TierSave:
        """The part its :class:`SaveResult` names: the durable tier's, else the nearest tier's."""
        return self.saves[0]

    @property
    def nearer(self) -> list[TierSave]:
        """The parts in the tiers nearer than the durable one (committed first)."""
        return [s for s in self.saves if not isinstance(s.tier, DurableTier)]

    def all(self) -> Outcomes:
        return [o for s in self.saves for o in s.outcomes]

    def abandon(self, *, cleanup: bool) -> None:
        """A save that failed before its commit: every after-commit round resolved with nothing,
        and (``cleanup``) what it staged in each tier removed."""
        for part in self.saves:
            if part.round is not None:
                part.round.set_result(None)
            if cleanup:
                part.tier.finish(part.paths, cleanup=True)


class SaveCommitter:
    """Commits the saves of one engine, in every tier, and reports each one's outcome."""

    def __init__(
        self, config: EngineConfig, pipeline: Pipeline, tiers: TierStack, queue: SaveQueue, checksum: str | None
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        #: The tiers a save is committed to; the durable tier's target reports, cleans up and
        #: runs retention.
        self.tiers = tiers
        self.target = tiers.durable.target
        self.queue = queue
        self.checksum = checksum

    def hand_off(self, writes: SaveWrites, components: tuple[str, ...], clock: SaveClock) -> SaveHandle:
        """Commit now where every write is done (synchronous providers), else from the commit
        thread; a two-tier upload always continues in the background. The nearer tiers commit
        first: a durable save is in every tier, or it failed."""
        lineage = self.tiers.lineage()  # the manifests record it
        for part in writes.saves:
            part.paths = dataclasses.replace(part.paths, lineage=lineage)
        paths = writes.main.paths
        future: Future[SaveResult] = Future()
        handle = SaveHandle(paths.iteration, paths.final, future, clock.snapshot)
        if not all(isinstance(o, WriteResult) for o in writes.all()):
            # Background writes: commit from the engine's commit thread (no collectives there;
            # the last DCP write of every component already synchronised all ranks).
            self.queue.submit(handle, self._commit_background, future, paths, writes, components, clock)
            return handle
        local = self._commit_nearer(writes, components, collective=True)
        if not writes.durable:
            result = self.report(paths, writes, components, clock, local, cleanup=False)
        elif self.target.after_commit_in_background:
            phase = self._commit_durable(writes.main, components, collective=True)
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

    def _commit_nearer(self, writes: SaveWrites, components: tuple[str, ...], *, collective: bool) -> CommitPhase:
        """This rank's commit in each nearer tier (the node-local tier's: in a synchronous save the
        ranks agree before it and after it), as one outcome."""
        phase = CommitPhase()
        for part in writes.nearer:
            done = part.tier.commit(part.paths, components, part.outcomes, part.round, collective=collective)
            phase = phase.plus(done)
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
        """The durable tier's commit (:func:`~.tiers.run_commit`) and what follows it, then the
        report of every tier (``local``: the nearer tiers' commits)."""
        phase = self._commit_durable(writes.main, components, collective=collective)
        if phase.error is None and _dist.rank() == 0:
            phase.error = self.target.after_commit(paths)
        cleanup = phase.error is not None
        return self.report(paths, writes, components, clock, phase.plus(local), cleanup=cleanup, collective=collective)

    def _commit_durable(self, part: TierSave, components: tuple[str, ...], *, collective: bool) -> CommitPhase:
        """The durable tier's commit; once it held, the saves after it descend from it."""
        phase = part.tier.commit(part.paths, components, part.outcomes, part.round, collective=collective)
        if phase.error is None:
            self.tiers.durable_committed(part.paths)
        return phase

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
            local = self._commit_nearer(writes, components, collective=False)
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
