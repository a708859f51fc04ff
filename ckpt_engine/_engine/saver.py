"""The save side of the engine: preparing a save (state dicts, ``remap_keys``, clearing, ``stage``,
the ranks' agreement), the write, the hand-off to the saves in flight, the commit through the
save target, the :class:`~ckpt_engine.types.SaveResult` of every outcome, and retention.

:class:`Saver` owns it; :meth:`CheckpointEngine.save <ckpt_engine.CheckpointEngine.save>` checks
its arguments, builds the training objects and hands them over. The commit protocol itself is
:func:`~ckpt_engine._engine.commit.run_commit`; what committing means is the
:class:`~ckpt_engine._engine.targets.SaveTarget`'s. Every outcome, from a refusal before
anything was written to a commit finished on the commit thread, is recorded by the one builder
:meth:`Saver._report`, which also tells the target, logs and calls ``on_save_done``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from .._dcpio import dist as _dist
from .._dcpio.fast_save import drop_plan_caches
from .._dcpio.planner import EngineSavePlanner, flat_keys
from .._dcpio.watch import phase as publish_phase
from .._format.layout import SaveDirLock, cleanup_leftovers, disk_full_hint, find_leftovers
from .._format.retention import apply_retention
from ..config import EngineConfig
from ..errors import (
    CheckpointExistsError,
    CheckpointSaveError,
    CkptEngineError,
    CollectiveError,
    SaveDirLockedError,
    described,
)
from ..pipeline import Pipeline
from ..types import PendingSnapshot, RemapContext, SaveContext, SaveResult, WriteContext, WriteResult
from .collectives import watch_group
from .commit import CommitPhase, run_commit
from .consensus import agree, unwrap
from .incremental import CarryBase, carry_base, stable_keys
from .pending import SaveHandle, SaveQueue
from .resave import refuse_resave
from .state import TrainingObjects, component_state_dict
from .targets import SavePaths, SaveTarget

__all__ = ["Saver"]

logger = logging.getLogger("ckpt_engine")

Outcomes = list[WriteResult | Future[WriteResult]]
#: How the log line of a save names the way its unchanged files were carried over.
_CARRIED = {"link": "hard-linked", "copy": "copied in the store", "write": "written: carrying over refused"}


@dataclass
class _Clock:
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


class Saver:
    """Saves training objects into the checkpoints of one engine's configuration and target."""

    def __init__(
        self,
        config: EngineConfig,
        pipeline: Pipeline,
        target: SaveTarget,
        queue: SaveQueue,
        *,
        plan_prefix: str,
        checksum: str | None,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        #: The storage mode, chosen once: staging folder, commit, uploads, cleanup, retention.
        self.target = target
        #: The saves in flight: their handles, the commit thread, failures nobody asked about.
        self.queue = queue
        #: Names the save-plan caches (``fast_save``) of this saver: one per component.
        self.plan_prefix = plan_prefix
        #: The manifest's checksum algorithm (``None``: ``save_checksums`` is off, sizes only).
        self.checksum = checksum
        #: Held by rank 0 from the first save until close(): a second engine saving into the
        #: same folder gets SaveDirLockedError instead of interleaving checkpoints. (An object
        #: store has no lock: the local staging folder is what is locked there.)
        self.lock = SaveDirLock(target.staging_root)

    def remove_leftovers_at_start(self) -> None:
        """Rank 0 removes the hidden folders a crashed save or deletion left in ``save_dir``.

        Only under the save_dir lock (taken briefly), so the folders of another engine that is
        saving there right now are never touched. Where there is nothing to remove, nothing is
        opened or written: an engine that only loads leaves the folder as it found it.
        """
        if _dist.initialized():
            rank = _dist.rank()
        else:  # constructed before init_process_group: torchrun's RANK still says who is rank 0
            try:
                rank = int(os.environ.get("RANK", "0"))
            except ValueError:
                rank = 0
        if rank != 0:
            return
        leftovers = find_leftovers(self.target.staging_root)
        if not leftovers:
            return
        holder = self.lock.try_hold_briefly()
        if holder is None:
            logger.info(
                "%s holds %d leftover temporary folder(s), but another engine holds its lock (or it cannot "
                "be locked); leaving them",
                self.target.staging_root,
                len(leftovers),
            )
            return
        try:
            for line in cleanup_leftovers(self.target.staging_root, leftovers):
                logger.warning("%s", line)
        finally:
            holder.release()

    def close(self) -> None:
        """Drop this saver's plan caches and release the save_dir lock (after every save ended)."""
        drop_plan_caches(self.plan_prefix)
        self.lock.release()

    # -- one save ---------------------------------------------------------------------------

    def save(self, iteration: int, objs: TrainingObjects) -> SaveHandle:
        """Save ``objs`` as ``iteration`` (see :meth:`CheckpointEngine.save`): prepare, write,
        then commit now or hand the save to the commit thread."""
        # One save in flight (more only where the stage provider says so): never re-stage while
        # a write may still read the buffers.
        self.queue.wait(keep=self.queue.may_keep(iteration, self.pipeline.max_saves_in_flight()), raise_errors=False)

        clock = _Clock(time.perf_counter())
        paths = self.target.paths(iteration)
        components = tuple(objs.available())
        try:
            staged, key_maps, stable = self._prepare(objs, paths, components, clock)
        except Exception as err:
            failure = self._failed_before_write(paths, components, err, clock)
            if failure is err:
                raise
            raise failure from err
        carry = None
        if self.config.incremental and self.checksum is not None:
            carry = carry_base(self.target, self.config, self.checksum, iteration)
            paths = dataclasses.replace(paths, carry_chain=carry.chain, carry_from=carry.folder)
        outcomes = self._write(paths, components, staged, key_maps, clock, carry, stable)
        clock.snapshot = staged.snapshot
        clock.blocked = time.perf_counter() - clock.t0
        return self._hand_off(paths, components, outcomes, clock)

    def _prepare(
        self, objs: TrainingObjects, paths: SavePaths, components: tuple[str, ...], clock: _Clock
    ) -> tuple[Any, dict[str, dict[str, str]], frozenset[str]]:
        """Build state dicts, run ``remap_keys`` and ``stage``; every rank agrees on success.
        Also returns, for ``incremental``, the model's storage keys worth comparing."""
        rank, world = _dist.rank(), _dist.world_size()
        staged: Any = None
        key_maps: dict[str, dict[str, str]] = {}
        stable: frozenset[str] = frozenset()
        staging = 0.0
        try:
            publish_phase("prepare")
            state = {name: component_state_dict(objs, name, paths.iteration) for name in components}
            publish_phase("remap_keys")
            for name, sd in state.items():
                ctx = RemapContext(
                    component=name,
                    direction="save",
                    storage_keys=None,
                    checkpoint_path=paths.final,
                    rank=rank,
                    world_size=world,
                )
                key_maps[name] = self.pipeline.remap_keys(ctx, flat_keys(sd))
            if self.config.incremental and "model" in state:
                stable = stable_keys(objs.modules, state["model"], key_maps["model"])
            self._clear_for_save(paths, rank, world)
            t_stage = time.perf_counter()
            publish_phase("stage")
            ctx_stage = SaveContext(
                iteration=paths.iteration,
                checkpoint_path=paths.final,
                components=components,
                rank=rank,
                world_size=world,
                optimizers=tuple(objs.optimizers),
            )
            staged = self.pipeline.stage(ctx_stage, state)
            if staged.completion is not None:
                staged.completion.result()
            staging = time.perf_counter() - t_stage
        except Exception as exc:
            if world == 1:
                raise
            local_err: Exception | None = exc
        else:
            local_err = None
        # Consensus (also the barrier after rank 0 cleared the partial folder): a failure on
        # one rank fails the save on all ranks before anyone enters DCP's collectives.
        failed = agree(local_err, fallback=CheckpointSaveError, step="prepare").first
        if failed is not None:
            # The same message on every rank; the failing rank keeps its traceback as the cause.
            raise CheckpointSaveError(
                f"rank {failed.rank} failed while preparing the save: {failed.text}"
            ) from local_err
        clock.staging = staging
        return staged, key_maps, stable

    def _clear_for_save(self, paths: SavePaths, rank: int, world: int) -> None:
        """Before staging: rank 0 refuses a committed iteration (``allow_overwrite``), takes the
        save_dir lock (the first save also clears what a crash left) and lets the target clear
        this iteration's leftovers; the other ranks clear what only they can see."""
        if rank != 0:
            self.target.clear_own_files(paths, rank, world)
            return
        refuse_resave(paths.iteration, self.target.resave_targets(paths), self.config.allow_overwrite)
        os.makedirs(self.target.staging_root, exist_ok=True)
        if self.lock.acquire():
            for line in cleanup_leftovers(self.target.staging_root):
                logger.warning("%s", line)
        self.target.clear_for_save(paths)

    def _failed_before_write(
        self, paths: SavePaths, components: tuple[str, ...], err: Exception, clock: _Clock
    ) -> Exception:
        """Report a save that failed before any write, and return the error ``save()`` raises:
        refusals and timeouts as they are, anything else as a :class:`CheckpointSaveError`."""
        self._report(paths, components, clock, err, cleanup=False)
        if isinstance(err, CollectiveError):
            err.committed = False
        if isinstance(err, (SaveDirLockedError, CheckpointExistsError, CollectiveError)):
            return err
        detail = str(err) if isinstance(err, CkptEngineError) else described(err)
        return CheckpointSaveError(f"saving iteration {paths.iteration} to {paths.final} failed: {detail}")

    def _write(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        staged: Any,
        key_maps: dict[str, dict[str, str]],
        clock: _Clock,
        carry: CarryBase | None,
        stable: frozenset[str],
    ) -> Outcomes:
        """Hand each component to the ``write`` provider (with what it may carry over, where
        ``incremental``); the live state (no staged copy) is written before this returns. A
        failure is reported and raised on every rank."""
        clock.write_start = time.perf_counter()
        rank, world = _dist.rank(), _dist.world_size()
        outcomes: Outcomes = []
        try:
            for name in components:
                planner = EngineSavePlanner(key_maps[name], cache_key=self.plan_prefix + name, checksum=self.checksum)
                ctx = WriteContext(
                    component=name,
                    iteration=paths.iteration,
                    path=os.path.join(paths.partial, name),
                    rank=rank,
                    world_size=world,
                    planner=planner,
                    staged_copy=staged.is_copy,
                    thread_count=self.config.thread_count,
                    sync_files=self.config.sync_files,
                    process_group=watch_group(),
                    collective_timeout_s=self.config.collective_timeout_s,
                    carry_over=None
                    if carry is None
                    else carry.for_component(name, stable if name == "model" else frozenset()),
                )
                out = self.pipeline.write(ctx, staged.components[name])
                if isinstance(out, Future) and not staged.is_copy:
                    out = out.result()  # the live state: must be written before save() returns
                outcomes.append(out)
        except (Exception, CheckpointException) as exc:
            cause, ranks = unwrap(exc)
            failure = self._failed_write(paths, components, cause, ranks, clock)
            if isinstance(cause, CollectiveError):
                cause.committed = False
                raise cause from None
            raise failure from cause
        return outcomes

    def _failed_write(
        self, paths: SavePaths, components: tuple[str, ...], err: BaseException, ranks: list[int], clock: _Clock
    ) -> CheckpointSaveError:
        """Report a failed write and return the error to raise."""
        hint = disk_full_hint(self.target.staging_root, err)  # before the partial folder frees its space
        self._report(paths, components, clock, err, cleanup=True)
        where = f" on rank(s) {ranks}" if _dist.world_size() > 1 else ""
        return CheckpointSaveError(
            f"saving iteration {paths.iteration} to {paths.final} failed{where}: {described(err)}{hint}; "
            "the previous checkpoint is untouched"
        )

    # -- hand-off and commit ----------------------------------------------------------------

    def _hand_off(self, paths: SavePaths, components: tuple[str, ...], outcomes: Outcomes, clock: _Clock) -> SaveHandle:
        """Commit now where every write is done (synchronous providers), else from the commit
        thread; a two-tier upload always continues in the background."""
        future: Future[SaveResult] = Future()
        handle = SaveHandle(paths.iteration, paths.final, future, clock.snapshot)
        if not all(isinstance(o, WriteResult) for o in outcomes):
            # Background writes: commit from the engine's commit thread (no collectives there;
            # the last DCP write of every component already synchronised all ranks).
            self.queue.submit(handle, self._commit_background, future, paths, components, outcomes, clock)
            return handle
        if self.target.after_commit_in_background:
            phase = self._run_commit(paths, components, outcomes, collective=True)
            if phase.error is None:
                self.queue.submit(handle, self._after_commit_background, future, paths, components, phase, clock)
                return handle
            result = self._report(paths, components, clock, phase, cleanup=True)
        else:
            result = self._commit(paths, components, outcomes, clock, collective=True)
        future.set_result(result)
        if isinstance(result.error, CollectiveError):
            raise result.error
        if not result.succeeded:
            raise CheckpointSaveError(
                f"saving iteration {paths.iteration} to {paths.final} failed: {result.error}"
            ) from result.error
        return handle

    def _commit(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        outcomes: Sequence[Any],
        clock: _Clock,
        *,
        collective: bool,
    ) -> SaveResult:
        """The commit (:func:`.commit.run_commit`) and what follows it, then the report."""
        phase = self._run_commit(paths, components, outcomes, collective=collective)
        if phase.error is None and _dist.rank() == 0:
            phase.error = self.target.after_commit(paths)
        return self._report(paths, components, clock, phase, cleanup=phase.error is not None, collective=collective)

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
        components: tuple[str, ...],
        phase: CommitPhase,
        clock: _Clock,
    ) -> None:
        try:
            if _dist.rank() == 0:
                phase.error = self.target.after_commit(paths)
            result = self._report(paths, components, clock, phase, cleanup=False, collective=False)
            future.set_result(result)
        except BaseException as exc:  # an observer raised: surface it through the handle
            future.set_exception(exc)

    def _commit_background(self, future: Future[SaveResult], *args: Any) -> None:
        try:
            future.set_result(self._commit(*args, collective=False))
        except BaseException as exc:  # an observer raised: surface it through the handle
            future.set_exception(exc)

    # -- the outcome ------------------------------------------------------------------------

    def _report(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        clock: _Clock,
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
        logged, and ``on_save_done`` observers get the result."""
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
        )
        self._finish(result, paths, cleanup=cleanup)
        return result

    def _finish(self, result: SaveResult, paths: SavePaths, *, cleanup: bool) -> None:
        self.target.finish(paths, _dist.rank(), _dist.world_size(), cleanup=cleanup, succeeded=result.succeeded)
        if result.succeeded:
            if _dist.rank() == 0:
                _log_saved(result)
                self._apply_retention()
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
