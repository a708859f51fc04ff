"""``CheckpointEngine``: save and restore the full training state as DCP checkpoints."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from .._dcpio import dist as _dist
from .._dcpio.fast_read import gc_paused
from .._dcpio.fast_save import drop_plan_caches
from .._dcpio.planner import EngineSavePlanner, flat_keys
from .._dcpio.watch import phase as publish_phase
from .._format.layout import (
    SaveDirLock,
    cleanup_leftovers,
    disk_full_hint,
    find_leftovers,
)
from .._format.manifest import (
    DEFAULT_ALGORITHM,
)
from .._format.retention import apply_retention
from ..config import EngineConfig
from ..errors import (
    CheckpointExistsError,
    CheckpointSaveError,
    CkptEngineError,
    CollectiveError,
    InvalidArgumentError,
    SaveDirLockedError,
)
from ..pipeline import Pipeline
from ..plugin_manager import build_plugin_manager
from ..types import (
    LoadResult,
    PendingSnapshot,
    RemapContext,
    SaveContext,
    SaveResult,
    WriteContext,
    WriteResult,
)
from .collectives import bounded, close_watch, watch_group
from .commit import CommitPhase, run_commit
from .consensus import agree, unwrap
from .loader import Loader
from .pending import SaveHandle, SaveQueue
from .preemption import PreemptionSaver
from .resave import refuse_resave
from .rng import with_rng
from .state import TrainingObjects, component_state_dict
from .targets import SavePaths, open_target

__all__ = ["CheckpointEngine", "SaveHandle"]

logger = logging.getLogger("ckpt_engine")


@dataclass
class _Clock:
    """When the phases of one save began (``time.perf_counter``), for its :class:`SaveResult`."""

    t0: float
    staging: float = 0.0
    write_start: float = 0.0
    #: How long ``save()`` blocked the caller (set when it returns for a background commit).
    blocked: float = 0.0
    #: A copy that continues after ``save()`` returned (``StagedState.snapshot``).
    snapshot: PendingSnapshot | None = None


class CheckpointEngine:
    """Saves and restores model, optimizer, scheduler, grad scaler, iteration and extra state.

    ``config`` is an :class:`EngineConfig`, a mapping of its fields, or a path to a YAML, TOML
    or JSON file. ``plugins`` are plugin objects registered in addition to the configured ones.
    Works in one process without a process group and on every rank under ``torchrun``.
    """

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
        *,
        plugins: Sequence[Any] = (),
    ) -> None:
        self.config = EngineConfig.coerce(config)
        self._plugins = build_plugin_manager(self.config, plugins)
        self.pipeline = Pipeline(self._plugins)
        #: The saves in flight: their handles, the commit thread, failures nobody asked about.
        self._queue = SaveQueue()
        self._closed = False
        self._watch: Any = None  # the CollectiveWatch of collective_timeout_s (collectives.py)
        #: Names this engine's save-plan caches (``fast_save``): one per component.
        self._plan_prefix = f"engine-{os.getpid()}-{id(self):x}:"
        #: The storage mode, chosen once: staging folder, commit, uploads, cleanup, retention.
        self._target = open_target(self.config)
        #: Held by rank 0 from the first save until close(): a second engine saving into the
        #: same folder gets SaveDirLockedError instead of interleaving checkpoints. (An object
        #: store has no lock: the local staging folder is what is locked there.)
        self._save_lock = SaveDirLock(self._target.staging_root)
        self._loader = Loader(self.config, self.pipeline, self.save_dir, self._target.local_dir)
        self._remove_leftovers_at_start()

    def _remove_leftovers_at_start(self) -> None:
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
        leftovers = find_leftovers(self._target.staging_root)
        if not leftovers:
            return
        holder = self._save_lock.try_hold_briefly()
        if holder is None:
            logger.info(
                "%s holds %d leftover temporary folder(s), but another engine holds its lock (or it cannot "
                "be locked); leaving them",
                self._target.staging_root,
                len(leftovers),
            )
            return
        try:
            for line in cleanup_leftovers(self._target.staging_root, leftovers):
                logger.warning("%s", line)
        finally:
            holder.release()

    # -- context manager --------------------------------------------------------------------

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:
            try:
                self.close()
            except CkptEngineError:
                logger.exception("closing the checkpoint engine failed while handling another error")

    @property
    def save_dir(self) -> str:
        return self.config.save_dir

    @property
    def plugin_names(self) -> tuple[str, ...]:
        """Registered plugins, in fold order."""
        return self._plugins.order

    # -- save -------------------------------------------------------------------------------

    @bounded
    @gc_paused()
    def save(
        self,
        iteration: int,
        *,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        grad_scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> SaveHandle:
        """Save the training state as ``<save_dir>/iter_{iteration:09}/``.

        Returns once the checkpoint's content is fixed: later in-place updates never leak into
        it. With the default (synchronous) providers the checkpoint is also committed; with a
        background writer, ``handle.result()`` or :meth:`wait` waits for the commit.
        """
        self._check_open()
        extra = with_rng(extra, self.config.rng)
        if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
            raise InvalidArgumentError(f"iteration must be a non-negative int, got {iteration!r}")
        objs = TrainingObjects.from_args(model, optimizer, scheduler, grad_scaler, extra)
        if not objs.modules:
            raise InvalidArgumentError("save() needs model=: a module or a list of modules")
        # One save in flight (more only where the stage provider says so): never re-stage while
        # a write may still read the buffers.
        self._queue.wait(keep=self._queue.may_keep(iteration, self.pipeline.max_saves_in_flight()), raise_errors=False)

        clock = _Clock(time.perf_counter())
        rank, world = _dist.rank(), _dist.world_size()
        paths = self._target.paths(iteration)
        components = tuple(objs.available())
        try:
            staged, key_maps = self._prepare_save(objs, paths, components, rank, world, clock)
        except Exception as err:
            failure = self._failed_before_write(paths, components, err, clock)
            if failure is err:
                raise
            raise failure from err
        clock.snapshot = staged.snapshot
        outcomes = self._write(paths, components, staged, key_maps, clock)
        clock.blocked = time.perf_counter() - clock.t0
        return self._hand_off(paths, components, outcomes, clock)

    def _failed_before_write(
        self, paths: SavePaths, components: tuple[str, ...], err: Exception, clock: _Clock
    ) -> Exception:
        """Report a save that failed before any write, and return the error ``save()`` raises:
        refusals and timeouts as they are, anything else as a :class:`CheckpointSaveError`."""
        elapsed = time.perf_counter() - clock.t0
        result = SaveResult(
            iteration=paths.iteration,
            path=paths.final,
            succeeded=False,
            error=err,
            components=components,
            blocked_seconds=elapsed,
            total_seconds=elapsed,
        )
        self._finish(result, paths, cleanup=False)
        if isinstance(err, CollectiveError):
            err.committed = False
        if isinstance(err, (SaveDirLockedError, CheckpointExistsError, CollectiveError)):
            return err
        detail = str(err) if isinstance(err, CkptEngineError) else f"{type(err).__name__}: {err}"
        return CheckpointSaveError(f"saving iteration {paths.iteration} to {paths.final} failed: {detail}")

    def _write(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        staged: Any,
        key_maps: dict[str, dict[str, str]],
        clock: _Clock,
    ) -> list[WriteResult | Future[WriteResult]]:
        """Hand each component to the ``write`` provider; the live state (no staged copy) is
        written before this returns. A failure is reported and raised on every rank."""
        clock.write_start = time.perf_counter()
        rank, world = _dist.rank(), _dist.world_size()
        checksum = DEFAULT_ALGORITHM if self.config.save_checksums else None
        outcomes: list[WriteResult | Future[WriteResult]] = []
        try:
            for name in components:
                ctx = WriteContext(
                    component=name,
                    iteration=paths.iteration,
                    path=os.path.join(paths.partial, name),
                    rank=rank,
                    world_size=world,
                    planner=EngineSavePlanner(key_maps[name], cache_key=self._plan_prefix + name, checksum=checksum),
                    staged_copy=staged.is_copy,
                    thread_count=self.config.thread_count,
                    sync_files=self.config.sync_files,
                    process_group=watch_group(),
                    collective_timeout_s=self.config.collective_timeout_s,
                )
                out = self.pipeline.write(ctx, staged.components[name])
                if isinstance(out, Future) and not staged.is_copy:
                    out = out.result()  # the live state: must be written before save() returns
                outcomes.append(out)
        except (Exception, CheckpointException) as exc:
            cause, ranks = unwrap(exc)
            failure = self._fail_sync(paths, components, cause, ranks, clock)
            if isinstance(cause, CollectiveError):
                cause.committed = False
                raise cause from None
            raise failure from cause
        return outcomes

    def _hand_off(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        outcomes: list[WriteResult | Future[WriteResult]],
        clock: _Clock,
    ) -> SaveHandle:
        """Commit now where every write is done (synchronous providers), else from the commit
        thread; a two-tier upload always continues in the background."""
        future: Future[SaveResult] = Future()
        handle = SaveHandle(paths.iteration, paths.final, future, clock.snapshot)
        if not all(isinstance(o, WriteResult) for o in outcomes):
            # Background writes: commit from the engine's commit thread (no collectives there;
            # the last DCP write of every component already synchronised all ranks).
            self._queue.submit(handle, self._commit_background, future, paths, components, outcomes, clock)
            return handle
        if self._target.after_commit_in_background:
            phase = self._run_commit(paths, components, outcomes, collective=True)
            if phase.error is None:
                self._queue.submit(handle, self._after_commit_background, future, paths, components, phase, clock)
                return handle
            result = self._result(paths, components, phase, clock, collective=True)
            self._finish(result, paths, cleanup=True)
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

    def _prepare_save(
        self,
        objs: TrainingObjects,
        paths: SavePaths,
        components: tuple[str, ...],
        rank: int,
        world: int,
        clock: _Clock,
    ) -> tuple[Any, dict[str, dict[str, str]]]:
        """Build state dicts, run ``remap_keys`` and ``stage``; every rank agrees on success."""
        staged: Any = None
        key_maps: dict[str, dict[str, str]] = {}
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
            clock.staging = time.perf_counter() - t_stage
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
        return staged, key_maps

    def _clear_for_save(self, paths: SavePaths, rank: int, world: int) -> None:
        """Before staging: rank 0 refuses a committed iteration (``allow_overwrite``), takes the
        save_dir lock (the first save also clears what a crash left) and lets the target clear
        this iteration's leftovers; the other ranks clear what only they can see."""
        if rank != 0:
            self._target.clear_own_files(paths, rank, world)
            return
        refuse_resave(paths.iteration, self._target.resave_targets(paths), self.config.allow_overwrite)
        os.makedirs(self._target.staging_root, exist_ok=True)
        if self._save_lock.acquire():
            for line in cleanup_leftovers(self._target.staging_root):
                logger.warning("%s", line)
        self._target.clear_for_save(paths)

    def _fail_sync(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        err: BaseException,
        ranks: list[int],
        clock: _Clock,
    ) -> CheckpointSaveError:
        """Report a failed write and return the error to raise."""
        now = time.perf_counter()
        result = SaveResult(
            iteration=paths.iteration,
            path=paths.final,
            succeeded=False,
            error=err,
            components=components,
            blocked_seconds=now - clock.t0,
            staging_seconds=clock.staging,
            write_seconds=now - clock.write_start,
            total_seconds=now - clock.t0,
        )
        hint = disk_full_hint(self._target.staging_root, err)  # before the partial folder frees its space
        self._finish(result, paths, cleanup=True)
        where = f" on rank(s) {ranks}" if _dist.world_size() > 1 else ""
        return CheckpointSaveError(
            f"saving iteration {paths.iteration} to {paths.final} failed{where}: {type(err).__name__}: {err}{hint}; "
            "the previous checkpoint is untouched"
        )

    def _commit(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        outcomes: Sequence[Any],
        clock: _Clock,
        *,
        collective: bool,
    ) -> SaveResult:
        """The commit (:func:`.commit.run_commit`) and what follows it, then ``_finish``."""
        phase = self._run_commit(paths, components, outcomes, collective=collective)
        if phase.error is None and _dist.rank() == 0:
            phase.error = self._target.after_commit(paths)
        result = self._result(paths, components, phase, clock, collective=collective)
        self._finish(result, paths, cleanup=phase.error is not None)
        return result

    def _run_commit(
        self, paths: SavePaths, components: tuple[str, ...], outcomes: Sequence[Any], *, collective: bool
    ) -> CommitPhase:
        algorithm = DEFAULT_ALGORITHM if self.config.save_checksums else None
        return run_commit(
            self._target, self.pipeline, paths, components, outcomes, collective=collective, algorithm=algorithm
        )

    def _result(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        phase: CommitPhase,
        clock: _Clock,
        *,
        collective: bool,
    ) -> SaveResult:
        now = time.perf_counter()
        return SaveResult(
            iteration=paths.iteration,
            path=paths.final,
            succeeded=phase.error is None,
            error=phase.error,
            components=components,
            bytes_written=phase.nbytes,
            # A synchronous save blocks the caller through the commit too.
            blocked_seconds=now - clock.t0 if collective else clock.blocked,
            staging_seconds=clock.staging,
            write_seconds=phase.write_end - clock.write_start,
            total_seconds=now - clock.t0,
            step_wait_seconds=clock.snapshot.step_wait_seconds if clock.snapshot is not None else 0.0,
            background_copy_seconds=clock.snapshot.copy_seconds if clock.snapshot is not None else 0.0,
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
                phase.error = self._target.after_commit(paths)
            result = self._result(paths, components, phase, clock, collective=False)
            self._finish(result, paths, cleanup=False)
            future.set_result(result)
        except BaseException as exc:  # an observer raised: surface it through the handle
            future.set_exception(exc)

    def _commit_background(self, future: Future[SaveResult], *args: Any) -> None:
        try:
            future.set_result(self._commit(*args, collective=False))
        except BaseException as exc:  # an observer raised: surface it through the handle
            future.set_exception(exc)

    def _finish(self, result: SaveResult, paths: SavePaths, *, cleanup: bool) -> None:
        self._target.finish(paths, _dist.rank(), _dist.world_size(), cleanup=cleanup, succeeded=result.succeeded)
        if result.succeeded:
            if _dist.rank() == 0:
                logger.info(
                    "saved iteration %d to %s (%.1f MB, blocked %.3fs, total %.3fs)",
                    result.iteration,
                    result.path,
                    result.bytes_written / 1e6,
                    result.blocked_seconds,
                    result.total_seconds,
                )
                self._apply_retention()
        else:
            logger.error("save of iteration %d failed: %s", result.iteration, result.error)
        self.pipeline.on_save_done(result)

    def _apply_retention(self) -> None:
        """Rank 0, after a commit: the target's retention jobs (``keep_last`` / ``keep_every``,
        and two-tier ``local_keep_last``). A best-effort side job: a failure is logged and
        retried after the next commit, never raised into training."""
        for job in self._target.retention_jobs():
            try:
                apply_retention(job.folder, job.keep_last, job.keep_every, job.store)
            except Exception:
                logger.warning("retention in %s failed; retrying after the next commit", job.folder, exc_info=True)

    def save_on_preemption(self, *, every: int | None = None, exit_code: int = 0) -> PreemptionSaver:
        """A context manager turning SIGTERM into a save at the next ``step_done()`` and a clean
        exit; also saves every ``every`` steps (see :mod:`ckpt_engine.preemption`)."""
        return PreemptionSaver(self, every=every, exit_code=exit_code)

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until plugins that start in the background (``pinned_staging``'s writer process)
        are ready; returns their start-up seconds. Never needed for correctness: saves queue until
        then. Useful to keep start-up out of a measurement."""
        return self.pipeline.wait_ready(timeout)

    def wait(self) -> None:
        """Block until every pending save is committed; raise if one failed."""
        self._queue.wait()

    def close(self) -> None:
        """Wait for pending saves, then release workers and plugin resources. Idempotent.

        Plugins take part through the protocols of :mod:`ckpt_engine.lifecycle`: ``begin_close()``
        first, before the wait, so that a plugin can bound how long its in-flight work may still
        take; ``close()`` once, in reverse fold order, after every pending save finished.
        """
        if self._closed:
            return
        self.pipeline.begin_close()  # lets a plugin bound the wait below (pinned_staging: close_timeout_s)
        try:
            self._queue.wait()
        finally:
            self._closed = True
            drop_plan_caches(self._plan_prefix)
            close_watch(self)
            self._queue.shutdown()
            self._save_lock.release()
            self.pipeline.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CkptEngineError("this CheckpointEngine is closed; create a new one")

    # -- load -------------------------------------------------------------------------------

    @bounded
    def load(
        self,
        *,
        model: nn.Module | Sequence[nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        grad_scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> LoadResult:
        """Resume by the rules of DESIGN section 4; returns the iteration, path and report.

        1. ``latest_checkpoint.txt`` in the load directory: every component passed in.
        2. else ``load_path`` is a checkpoint folder: ``model`` (all with
           ``load_training_state``; ``model`` + ``scheduler`` with ``only_load_scheduler_state``).
        3. else ``load_path`` ends in ``.pth``: a plain model state dict, non-strict; or it is
           safetensors weights (a ``.safetensors`` file, or a Hugging Face folder): ``model`` only.
        4. else nothing: iteration 0.
        """
        self._check_open()
        self.wait()  # never read a checkpoint that is still being committed
        extra = with_rng(extra, self.config.rng)
        objs = TrainingObjects.from_args(model, optimizer, scheduler, grad_scaler, extra)
        return self._loader.load(objs)
