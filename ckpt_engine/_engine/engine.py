"""``CheckpointEngine``: save and restore the full training state as DCP checkpoints."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

from .._dcpio import dist as _dist
from .._dcpio.fast_save import drop_plan_caches
from .._dcpio.planner import EngineSavePlanner, flat_keys
from .._dcpio.watch import phase as publish_phase
from .._format.digests import remove_parts, written_entries
from .._format.layout import (
    SaveDirLock,
    check_complete,
    cleanup_leftovers,
    commit_rename,
    disk_full_hint,
    find_leftovers,
    remove_checkpoint,
    remove_tree,
)
from .._format.manifest import (
    DEFAULT_ALGORITHM,
    FileEntry,
    list_files,
    new_manifest,
    owner_rank,
    referenced_files,
    write_manifest,
)
from .._format.names import MANIFEST_FILE, RANK_PART_PREFIX, iter_dirname, partial_dirname
from .._format.retention import apply_retention
from .._storage.paths import check_local_save_dir
from .._storage.store import FsspecStore, Store, open_store
from ..config import EngineConfig
from ..errors import (
    CheckpointExistsError,
    CheckpointSaveError,
    CkptEngineError,
    CollectiveTimeoutError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    SaveDirLockedError,
    StorageError,
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
from .consensus import agree, unwrap
from .loader import Loader
from .preemption import PreemptionSaver
from .resave import advance_latest, refuse_resave
from .rng import with_rng
from .state import TrainingObjects, component_state_dict

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


@dataclass
class _Phase:
    """What the commit phase of a save found (filled in as it goes)."""

    error: BaseException | None = None
    nbytes: int = 0
    write_end: float = 0.0


@dataclass(frozen=True)
class _SavePaths:
    """Where one save goes. ``final`` is the checkpoint's name for users (a local folder or a URL);
    ``partial`` the local folder the write providers write into; ``local_final`` the local folder
    it is renamed to (``None`` when the checkpoint lives only in an object store)."""

    iteration: int
    final: str
    partial: str
    local_final: str | None

    @property
    def name(self) -> str:
        return iter_dirname(self.iteration)


class SaveHandle:
    """The outcome of one ``save()``; completes when the checkpoint is committed or has failed."""

    def __init__(
        self, iteration: int, path: str, future: Future[SaveResult], snapshot: PendingSnapshot | None = None
    ) -> None:
        self.iteration = iteration
        self.path = path
        self._future = future
        self._snapshot = snapshot
        #: Whether :meth:`result` raised this save's failure to a caller of its own.
        self.reported = False

    def done(self) -> bool:
        return self._future.done()

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until the save's point-in-time copy is complete; raise if it failed.

        Returns at once where ``save()`` made the copy itself (everything but ``pinned_staging``
        with ``overlap``). Call it before changing weights outside the optimizer.
        """
        if self._snapshot is not None:
            self._snapshot.wait(timeout)

    def result(self, timeout: float | None = None) -> SaveResult:
        """The save's :class:`SaveResult`; raises :class:`CheckpointSaveError` if it failed."""
        if self._snapshot is not None:
            try:
                self._snapshot.wait(timeout)  # a background copy hands over only once confirmed
            except TimeoutError:
                raise
            except Exception:
                pass  # a failed copy fails the save: the result below carries its error
        result = self._future.result(timeout)
        if not result.succeeded:
            self.reported = True
            raise CheckpointSaveError(
                f"saving iteration {self.iteration} to {self.path} failed: {result.error}"
            ) from result.error
        return result

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SaveHandle(iteration={self.iteration}, path={self.path!r}, {state})"


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
        self._pending: list[SaveHandle] = []
        #: Failures of saves whose handle nobody asked, noticed by a later save() (which proceeds):
        #: raised by the next wait() / close().
        self._failed: list[CheckpointSaveError] = []
        self._lock = threading.Lock()
        self._committer: ThreadPoolExecutor | None = None
        self._closed = False
        self._watch: Any = None  # the CollectiveWatch of collective_timeout_s (collectives.py)
        #: Names this engine's save-plan caches (``fast_save``): one per component.
        self._plan_prefix = f"engine-{os.getpid()}-{id(self):x}:"
        storage = self.config.storage
        self._store = open_store(self.save_dir, storage)
        self._remote = self._store.is_object_store
        if not self._remote:
            check_local_save_dir(self.save_dir)
        #: Two-tier saves (``storage.local_dir``): local commit first, upload in the background.
        self._local_dir = storage.local_dir if self._remote else None
        #: Saves go straight into the object store: every rank uploads its own files from the spool.
        self._direct = self._remote and self._local_dir is None
        #: The local folder that receives uncommitted saves: ``save_dir`` itself, the two-tier
        #: ``local_dir``, or a spool folder for this save_dir URL (same path on every rank).
        self._staging_root = self.save_dir
        if self._remote:
            digest = hashlib.sha1(self.save_dir.encode()).hexdigest()[:16]
            base = storage.spool_dir or tempfile.gettempdir()
            self._staging_root = self._local_dir or os.path.join(base, "ckpt-engine-spool", digest)
        #: Held by rank 0 from the first save until close(): a second engine saving into the
        #: same folder gets SaveDirLockedError instead of interleaving checkpoints. (An object
        #: store has no lock: the local staging folder is what is locked there.)
        self._save_lock = SaveDirLock(self._staging_root)
        self._loader = Loader(self.config, self.pipeline, self.save_dir, self._local_dir)
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
        leftovers = find_leftovers(self._staging_root)
        if not leftovers:
            return
        holder = self._save_lock.try_hold_briefly()
        if holder is None:
            logger.info(
                "%s holds %d leftover temporary folder(s), but another engine holds its lock (or it cannot "
                "be locked); leaving them",
                self._staging_root,
                len(leftovers),
            )
            return
        try:
            for line in cleanup_leftovers(self._staging_root, leftovers):
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
        self._wait_pending(keep=self._saves_to_keep(iteration), raise_errors=False)

        clock = _Clock(time.perf_counter())
        t0 = clock.t0
        rank, world = _dist.rank(), _dist.world_size()
        paths = self._save_paths(iteration)
        final_dir, partial_dir = paths.final, paths.partial
        components = tuple(objs.available())
        try:
            prepared = self._prepare_save(objs, paths, components, rank, world, clock)
        except Exception as err:
            result = SaveResult(
                iteration=iteration,
                path=final_dir,
                succeeded=False,
                error=err,
                components=components,
                blocked_seconds=time.perf_counter() - t0,
                total_seconds=time.perf_counter() - t0,
            )
            self._finish(result, paths, cleanup=False)
            if isinstance(err, (SaveDirLockedError, CheckpointExistsError, CollectiveTimeoutError)):
                raise
            detail = str(err) if isinstance(err, CkptEngineError) else f"{type(err).__name__}: {err}"
            raise CheckpointSaveError(f"saving iteration {iteration} to {final_dir} failed: {detail}") from err

        staged, key_maps = prepared
        clock.snapshot = staged.snapshot
        clock.write_start = time.perf_counter()
        outcomes: list[WriteResult | Future[WriteResult]] = []
        try:
            for name in components:
                ctx = WriteContext(
                    component=name,
                    iteration=iteration,
                    path=os.path.join(partial_dir, name),
                    rank=rank,
                    world_size=world,
                    planner=EngineSavePlanner(
                        key_maps[name],
                        cache_key=self._plan_prefix + name,
                        checksum=DEFAULT_ALGORITHM if self.config.save_checksums else None,
                    ),
                    staged_copy=staged.is_copy,
                    thread_count=self.config.thread_count,
                    sync_files=self.config.sync_files,
                    process_group=watch_group(),
                )
                out = self.pipeline.write(ctx, staged.components[name])
                if isinstance(out, Future) and not staged.is_copy:
                    out = out.result()  # the live state: must be written before save() returns
                outcomes.append(out)
        except (Exception, CheckpointException) as exc:
            cause, ranks = unwrap(exc)
            failure = self._fail_sync(paths, components, cause, ranks, clock)
            if isinstance(cause, CollectiveTimeoutError):
                raise cause from None
            raise failure from cause

        clock.blocked = time.perf_counter() - t0
        future: Future[SaveResult] = Future()
        handle = SaveHandle(iteration, final_dir, future, staged.snapshot)
        if all(isinstance(o, WriteResult) for o in outcomes):
            if self._local_dir is not None:
                # Two-tier: commit the local copy now, upload it in the background.
                phase = self._commit_phase(paths, components, outcomes, collective=True)
                if phase.error is not None:
                    result = self._result(paths, components, phase, clock, collective=True)
                    self._finish(result, paths, cleanup=True)
                    future.set_result(result)
                    raise CheckpointSaveError(
                        f"saving iteration {iteration} to {final_dir} failed: {result.error}"
                    ) from result.error
                self._submit(handle, self._upload_background, future, paths, components, phase, clock)
                return handle
            result = self._commit(paths, components, outcomes, clock, collective=True)
            future.set_result(result)
            if isinstance(result.error, CollectiveTimeoutError):
                raise result.error
            if not result.succeeded:
                raise CheckpointSaveError(
                    f"saving iteration {iteration} to {final_dir} failed: {result.error}"
                ) from result.error
            return handle

        # Background writes: commit from the engine's commit thread (no collectives there; the
        # last DCP write of every component already synchronised all ranks).
        self._submit(handle, self._commit_background, future, paths, components, outcomes, clock)
        return handle

    def _submit(self, handle: SaveHandle, fn: Callable[..., None], *args: Any) -> None:
        with self._lock:
            if self._committer is None:
                self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-engine-commit")
            self._pending.append(handle)
        self._committer.submit(fn, *args)

    def _save_paths(self, iteration: int) -> _SavePaths:
        name = iter_dirname(iteration)
        partial = os.path.join(self._staging_root, partial_dirname(iteration))
        if not self._remote:
            return _SavePaths(iteration, os.path.join(self.save_dir, name), partial, os.path.join(self.save_dir, name))
        local_final = os.path.join(self._local_dir, name) if self._local_dir is not None else None
        return _SavePaths(iteration, self._store.join(self.save_dir, name), partial, local_final)

    def _prepare_save(
        self,
        objs: TrainingObjects,
        paths: _SavePaths,
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
            if rank == 0:
                refuse_resave(paths.iteration, self._resave_targets(paths), self.config.allow_overwrite)
                os.makedirs(self._staging_root, exist_ok=True)
                if self._save_lock.acquire():  # first save: also clear what a crash left behind
                    for line in cleanup_leftovers(self._staging_root):
                        logger.warning("%s", line)
                if os.path.exists(paths.partial):
                    remove_tree(paths.partial)  # left behind by a crashed save of this iteration
                if self._direct and self._store.exists(paths.final):
                    # A re-save of this iteration (or what a killed save uploaded): the old marker
                    # goes first, so that no reader ever takes the mix for a checkpoint.
                    logger.warning(
                        "%s exists; deleting it before saving iteration %d again", paths.final, paths.iteration
                    )
                    remove_checkpoint(paths.final, self._store)
            elif self._direct:
                self._remove_own_files(paths.partial, rank)  # a node-local spool another node cannot clear
            t_stage = time.perf_counter()
            publish_phase("stage")
            staged = self.pipeline.stage(
                SaveContext(
                    iteration=paths.iteration,
                    checkpoint_path=paths.final,
                    components=components,
                    rank=rank,
                    world_size=world,
                    optimizers=tuple(objs.optimizers),
                ),
                state,
            )
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

    def _resave_targets(self, paths: _SavePaths) -> list[tuple[str, Store]]:
        """Where a committed checkpoint of this iteration would be, checked before the save: the
        save's own place, or for two-tier saves the local copy (the object store is checked by
        the background upload, which must not make ``save()`` wait on the network)."""
        if paths.local_final is not None:
            return [(paths.local_final, open_store(paths.local_final))]
        return [(paths.final, self._store)]

    @staticmethod
    def _remove_own_files(partial: str, rank: int) -> None:
        """Remove this rank's data files from an earlier attempt of a save in ``partial``."""
        if not os.path.isdir(partial):
            return
        for rel in list_files(partial):
            if os.path.basename(rel).startswith(f"__{rank}_"):
                try:
                    os.remove(os.path.join(partial, rel))
                except FileNotFoundError:
                    continue

    def _fail_sync(
        self,
        paths: _SavePaths,
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
        hint = disk_full_hint(self._staging_root, err)  # before the partial folder frees its space
        self._finish(result, paths, cleanup=True)
        where = f" on rank(s) {ranks}" if _dist.world_size() > 1 else ""
        return CheckpointSaveError(
            f"saving iteration {paths.iteration} to {paths.final} failed{where}: {type(err).__name__}: {err}{hint}; "
            "the previous checkpoint is untouched"
        )

    def _commit(
        self,
        paths: _SavePaths,
        components: tuple[str, ...],
        outcomes: Sequence[Any],
        clock: _Clock,
        *,
        collective: bool,
    ) -> SaveResult:
        """The commit protocol (docs/reliability.md, docs/storage.md), then ``_finish``.

        ``collective``: every rank calls this at the same point (synchronous saves); each rank
        checksums the files it wrote and the ranks agree before rank 0 commits. Otherwise (the
        commit thread of background writes) no collective is used.
        """
        phase = self._commit_phase(paths, components, outcomes, collective=collective)
        if phase.error is None and self._local_dir is not None and _dist.rank() == 0:
            phase.error = self._upload_local_copy(paths)
        result = self._result(paths, components, phase, clock, collective=collective)
        self._finish(result, paths, cleanup=phase.error is not None)
        return result

    def _commit_phase(
        self, paths: _SavePaths, components: tuple[str, ...], outcomes: Sequence[Any], *, collective: bool
    ) -> _Phase:
        """Wait for the writes, then commit: locally (manifest, rename, ``latest``), or straight
        into the object store (every rank uploads its own files; rank 0 writes the manifest, the
        completion marker, then ``latest``)."""
        phase = _Phase()
        if collective:
            publish_phase("commit")
        try:
            results = [self.pipeline.check_write_result(o.result() if isinstance(o, Future) else o) for o in outcomes]
            phase.nbytes = sum(r.bytes_written for r in results)
        except (Exception, CheckpointException) as exc:
            phase.error = unwrap(exc)[0]
            # The other components' writes may still be running: let them end before the failed
            # save's folder is removed (bounded by the write provider's own timeout).
            concurrent.futures.wait([o for o in outcomes if isinstance(o, Future)])
        phase.write_end = time.perf_counter()
        rank, world = _dist.rank(), _dist.world_size()
        algorithm = DEFAULT_ALGORITHM if self.config.save_checksums else None
        entries: dict[str, FileEntry] = {}
        direct = self._direct
        if direct or (collective and world > 1):
            # Each rank sizes and checksums the files it wrote (still in its page cache) and, for an
            # object store, uploads them; then the ranks agree that every write succeeded.
            if phase.error is None:
                try:
                    mine = [rel for rel in list_files(paths.partial) if owner_rank(rel, world) == rank]
                    entries = written_entries(paths.partial, mine, algorithm)
                    if direct:
                        self._upload_files(paths.partial, paths.final, mine)
                except Exception as err:
                    phase.error = err
            if collective and world > 1:
                try:
                    wrote = agree(phase.error, entries, fallback=CheckpointSaveError, step="commit")
                except CollectiveTimeoutError as err:
                    phase.error = err
                    return phase
                if phase.error is None and wrote.first is not None:
                    phase.error = CheckpointSaveError(
                        f"rank {wrote.first.rank} failed to write its files: {wrote.first.text}"
                    )
                entries = {rel: entry for part in wrote.payloads for rel, entry in part.items()}
            elif direct and world > 1:
                try:
                    entries = self._exchange_parts(paths, entries, phase.error)
                except Exception as err:
                    phase.error = phase.error or err
        if phase.error is None and rank == 0:
            try:
                t_manifest = time.perf_counter()
                if direct:
                    covered = self._write_manifest(paths, components, algorithm, entries, world, uploaded=True)
                    advance_latest(self.save_dir, paths.name, self._store)
                else:
                    covered = self._write_manifest(paths, components, algorithm, entries, world)
                    assert paths.local_final is not None
                    commit_rename(paths.partial, paths.local_final)
                    advance_latest(os.path.dirname(paths.local_final), paths.name)
                logger.debug(
                    "manifest of iteration %d: %.1f MB covered in %.3fs",
                    paths.iteration,
                    covered / 1e6,
                    time.perf_counter() - t_manifest,
                )
            except Exception as err:
                phase.error = err
        if collective and world > 1:
            # Doubles as the barrier that keeps ranks from running ahead of the commit.
            try:
                committed = agree(phase.error, fallback=CheckpointSaveError, step="committed").first
            except CollectiveTimeoutError as err:
                phase.error = err
                return phase
            if phase.error is None and committed is not None:
                phase.error = CheckpointSaveError(f"rank {committed.rank} failed to commit: {committed.text}")
        return phase

    def _result(
        self,
        paths: _SavePaths,
        components: tuple[str, ...],
        phase: _Phase,
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

    def _write_manifest(
        self,
        paths: _SavePaths,
        components: tuple[str, ...],
        algorithm: str | None,
        entries: dict[str, FileEntry],
        world: int,
        *,
        uploaded: bool = False,
    ) -> int:
        """Rank 0: check the checkpoint is complete, then write its manifest; returns the bytes
        the manifest covers.

        Locally (``uploaded`` false) into the uncommitted folder, checksumming what no rank did.
        On an object store (``uploaded``), after every rank uploaded: the DCP metadata is checked
        against one listing of the prefix, every file must have been reported by a rank, and the
        manifest written is the completion marker."""
        root, store = (paths.final, self._store) if uploaded else (paths.partial, None)
        checked = check_complete(root, store)
        missing = [c for c in components if c not in checked.components]
        if missing:
            raise IncompleteCheckpointError(
                f"{root}: components {missing} were not {'uploaded' if uploaded else 'written'}"
            )
        entries = dict(entries)
        if uploaded:
            unreported = referenced_files(checked) - set(entries)
            if unreported:
                raise IncompleteCheckpointError(
                    f"{root}: {sorted(unreported)[:5]} are referenced by DCP metadata but no rank reported "
                    "uploading them"
                )
        else:
            expected = set(list_files(root)) | referenced_files(checked)
            entries.update(written_entries(root, expected - set(entries), algorithm))
            remove_parts(root)
        manifest = new_manifest(paths.iteration, world, components, algorithm, entries)
        write_manifest(root, manifest, store)
        return manifest.total_bytes

    # -- object stores ------------------------------------------------------------------------

    def _upload_files(self, local_root: str, remote_root: str, rels: Sequence[str]) -> None:
        """Upload ``rels`` (relative to ``local_root``) under ``remote_root``, in parallel."""
        store = self._store
        assert isinstance(store, FsspecStore)
        pairs = [(os.path.join(local_root, *rel.split("/")), store.join(remote_root, rel)) for rel in rels]
        t = time.perf_counter()
        nbytes = store.upload_many(pairs)
        logger.debug(
            "uploaded %d file(s), %.1f MB, to %s in %.3fs",
            len(pairs),
            nbytes / 1e6,
            remote_root,
            time.perf_counter() - t,
        )

    def _exchange_parts(
        self, paths: _SavePaths, entries: dict[str, FileEntry], error: BaseException | None
    ) -> dict[str, FileEntry]:
        """Background saves to an object store, several ranks, no collectives: every rank reports
        its upload in a small object next to the checkpoint; rank 0 waits for all of them
        (``storage.commit_timeout_s``) and returns the merged entries, or raises the first
        rank's failure."""
        rank, world = _dist.rank(), _dist.world_size()
        store = self._store
        part = {
            "rank": rank,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "files": {rel: {"size": e.size, "checksum": e.checksum} for rel, e in entries.items()},
        }
        store.write_bytes(store.join(paths.final, f"{RANK_PART_PREFIX}{rank:05d}.json"), json.dumps(part).encode())
        if error is not None:
            raise error
        if rank != 0:
            return entries
        merged = dict(entries)
        deadline = time.monotonic() + self.config.storage.commit_timeout_s
        waiting = set(range(1, world))
        delay = 0.05
        while waiting:
            for r in sorted(waiting):
                path = store.join(paths.final, f"{RANK_PART_PREFIX}{r:05d}.json")
                try:
                    doc = json.loads(store.read_bytes(path))
                except FileNotFoundError:
                    continue
                if doc.get("error"):
                    raise CheckpointSaveError(f"rank {r} failed to upload its files: {doc['error']}")
                for rel, e in doc.get("files", {}).items():
                    merged[rel] = FileEntry(size=int(e["size"]), checksum=e.get("checksum"))
                waiting.discard(r)
            if waiting:
                if time.monotonic() > deadline:
                    raise CheckpointSaveError(
                        f"rank(s) {sorted(waiting)} did not report their uploads to {paths.final} within "
                        f"{self.config.storage.commit_timeout_s}s (storage.commit_timeout_s); did they crash?"
                    )
                time.sleep(delay)
                delay = min(1.0, delay * 2)
        return merged

    def _remove_parts(self, paths: _SavePaths) -> None:
        store = self._store
        parts = [store.join(paths.final, f"{RANK_PART_PREFIX}{r:05d}.json") for r in range(_dist.world_size())]
        try:
            if isinstance(store, FsspecStore):
                store.remove_files(parts)
        except (OSError, CkptEngineError):  # bookkeeping only: loaders and listings ignore them
            logger.debug("could not remove the upload reports of %s", paths.final, exc_info=True)

    def _upload_local_copy(self, paths: _SavePaths) -> BaseException | None:
        """Two-tier, rank 0: upload the committed local copy; the manifest (the completion marker)
        goes last, then ``latest``. Returns the error, if any (the local copy stays complete)."""
        assert paths.local_final is not None
        try:
            refuse_resave(paths.iteration, [(paths.final, self._store)], self.config.allow_overwrite)
            if self._store.exists(paths.final):  # a re-save: the old marker goes first
                remove_checkpoint(paths.final, self._store)
            rels = list_files(paths.local_final)
            self._upload_files(paths.local_final, paths.final, rels)
            marker = os.path.join(paths.local_final, MANIFEST_FILE)
            with open(marker, "rb") as f:
                self._store.write_bytes(self._store.join(paths.final, MANIFEST_FILE), f.read())
            advance_latest(self.save_dir, paths.name, self._store)
        except StorageError as err:
            wrapped = StorageError(f"{err}; the local copy {paths.local_final} is complete and is resumed from")
            wrapped.__cause__ = err
            return wrapped
        except Exception as err:
            return err
        return None

    def _upload_background(
        self,
        future: Future[SaveResult],
        paths: _SavePaths,
        components: tuple[str, ...],
        phase: _Phase,
        clock: _Clock,
    ) -> None:
        try:
            if _dist.rank() == 0:
                phase.error = self._upload_local_copy(paths)
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

    def _finish(self, result: SaveResult, paths: _SavePaths, *, cleanup: bool) -> None:
        partial_dir = paths.partial
        direct = self._direct
        if (cleanup or direct) and _dist.rank() == 0 and os.path.exists(partial_dir):
            try:
                remove_tree(partial_dir)
            except OSError:
                logger.warning("could not remove uncommitted folder %s", partial_dir, exc_info=True)
        elif direct:
            self._remove_own_files(partial_dir, _dist.rank())
        if result.succeeded:
            if _dist.rank() == 0:
                if direct and _dist.world_size() > 1:
                    self._remove_parts(paths)
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
        """Rank 0, after a commit: ``keep_last`` / ``keep_every`` (and, two-tier, the local
        folder's ``local_keep_last``). A best-effort side job: a failure is logged and retried
        after the next commit, never raised into training."""
        jobs: list[tuple[str, int, int | None, Store | None]] = []
        if self.config.keep_last is not None:
            jobs.append((self.save_dir, self.config.keep_last, self.config.keep_every, self._store))
        if self._local_dir is not None:
            jobs.append((self._local_dir, self.config.storage.local_keep_last, None, None))
        for folder, keep_last, keep_every, store in jobs:
            try:
                apply_retention(folder, keep_last, keep_every, store)
            except Exception:
                logger.warning("retention in %s failed; retrying after the next commit", folder, exc_info=True)

    def _saves_to_keep(self, iteration: int) -> int:
        """How many earlier saves may stay pending while a new one stages: the stage provider's
        ``max_saves_in_flight`` (default 1) minus one; none when one of them is this iteration."""
        limit = self.pipeline.max_saves_in_flight()
        with self._lock:
            if any(h.iteration == iteration for h in self._pending):
                return 0
        return limit - 1

    def _wait_pending(self, keep: int = 0, *, raise_errors: bool = True) -> list[SaveResult]:
        """Wait for pending saves, oldest first, until at most ``keep`` remain. A failure is
        raised, or with ``raise_errors`` false (a new save: it proceeds) logged and kept for the
        next :meth:`wait` / :meth:`close`, unless the caller already saw it through its handle."""
        with self._lock:
            cut = max(0, len(self._pending) - keep)
            pending, self._pending = self._pending[:cut], self._pending[cut:]
        results = []
        first_error: CheckpointSaveError | None = None
        for handle in pending:
            seen = handle.reported
            try:
                results.append(handle.result())
            except CheckpointSaveError as err:
                if raise_errors:
                    first_error = first_error or err
                elif not seen:
                    logger.warning("%s; the new save proceeds", err)
                    self._failed.append(err)
        if raise_errors:
            kept, self._failed = self._failed, []
            if kept or first_error is not None:
                raise kept[0] if kept else first_error  # type: ignore[misc]
        return results

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
        self._wait_pending()

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
            self._wait_pending()
        finally:
            self._closed = True
            drop_plan_caches(self._plan_prefix)
            close_watch(self)
            if self._committer is not None:
                self._committer.shutdown(wait=True)
                self._committer = None
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
