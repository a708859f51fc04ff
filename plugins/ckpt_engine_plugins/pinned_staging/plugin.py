"""The ``pinned_staging`` plugin class, and the design of asynchronous saves through reused host
buffers and a writer process (the package docstring says which module does what).

The training loop pays only for copying its state into host memory; a background writer
process serialises it with DCP and the engine commits it.

**stage** (every rank, in the training thread). Each state dict becomes a *skeleton*: the state
dict with every tensor replaced by a slot reference, pickled for the writer, which holds a
copy of every non-tensor value and the exact nesting, so the writer rebuilds the same keys. A
state dict with anything but tensors and immutable values is pickled in ``stage`` (a deep copy);
a flat one of tensors and numbers, strings or tuples of them (every model and flattened
optimizer state dict) is kept as a shallow copy and pickled only for the writer (with
``overlap``, on the copy thread after the copy). Each
distinct tensor (by object; aliases share a slot) gets a slot in a *buffer set*; DTensors
(FSDP2, TP) contribute their local shard, and their mesh, placements, global shape and stride
travel in the skeleton. The tensors are copied into the set, and ``stage`` returns only when
every copy is complete: the state is then fixed, and the training loop may step the optimizer.
CPU tensors are copied with ``copy_``; CUDA tensors are copied with ``non_blocking=True`` on a
side stream that first waits for the current stream, into page-locked buffers, and that
stream is synchronised before ``stage`` returns (the CUDA path was not run on a GPU yet).

**Buffers.** A buffer set is one file in ``/dev/shm`` mapped by both processes (see
``shm``), allocated on the first save and reused by every later save whose tensors
have the same shapes and dtypes in the same order; a different structure allocates a new set
and frees the old one. ``buffers: 2`` keeps two sets so a save can stage while the previous
one is still being written (the plugin declares ``max_saves_in_flight = 2`` and the engine
then waits only for the save before last). A set is never re-staged while a write that reads
it is pending: staging waits for it.

**Budget** (``max_host_bytes``). Each buffer set holds at most ``max_host_bytes / buffers``
bytes. A larger state is staged in *windows* of the same set (see ``windows``): the
first is copied in ``stage``, the rest by the last ``write`` as the writer drains each previous
window, so ``save()`` returns once the last window is staged. A tensor is never split: one
larger than the share gets a window of its own and the set grows to hold it. ``overlap`` is
refused with a budget. Without a budget, or for a state that fits, nothing changes.

**write** (every rank, per component). Queues a request for the writer and returns a future.
The writer (``writer``) is a plain ``python -m`` subprocess, started when the plugin
is created (at engine construction, so the first save does not wait for it). It never imports
the training script, so a script without an ``if __name__ == "__main__":`` guard works, and no
file descriptors are passed (the writer opens the buffer files by path). With several ranks,
the writers form one gloo group through the job's own rendezvous store (torchrun's
``MASTER_ADDR``/``MASTER_PORT``), under a key prefix unique to this plugin instance, its writer
generation and the torchrun run and restart: no port is chosen. DTensors are rebuilt over a
CPU DeviceMesh of that group with ``DTensor.from_local(..., shape=, stride=)``, so DCP writes
per-rank shards exactly as it would in the training process. The engine commits (rename, then
``latest_checkpoint.txt``) in its commit thread once every component's future succeeded.

**Failures never hang.** The writer's end of the pipe is the liveness signal: if it exits or
is killed (SIGKILL, the OOM killer), every pending future fails at once with a
:class:`PinnedWriterError` naming its pid, exit status and the writes in flight; the engine
reports the save as failed and leaves ``latest_checkpoint.txt`` alone, and the next
``save()``/``wait()``/``close()`` raises that error. A replacement writer is started at once
(a writer that never became ready is retried by the next save instead). A write that takes
longer than ``write_timeout_s``, or a writer not ready after ``writer_start_timeout_s``, is
killed the same way. With several ranks any failed write replaces the writer on every rank,
since its process group may be broken.

**Preemption.** A preemption save (``engine.save_on_preemption()``) must not wait for a
writer that is not ready (still starting, or lost and being replaced): the saver asks
:meth:`PinnedStagingPlugin.background_ready` on every rank and, unless every rank's writer is
ready, makes the preemption save inside :meth:`PinnedStagingPlugin.saving_in_process` on every
rank. There ``stage`` hands over the live state (no copy, no buffers, no writer) and ``write``
runs the engine's own DCP save with :class:`~ckpt_engine.storage.EngineFileSystemWriter` in the
training thread, over the engine's process group: the files of the engine's synchronous save,
committed before ``save()`` returns.

**Shutdown.** ``close()`` (the engine calls it from ``CheckpointEngine.close()`` and ``with``)
waits up to ``close_timeout_s`` for the in-flight save, then stops the writer; an ``atexit``
hook does the same for engines never closed. At interpreter exit the engine's commit thread
is joined before ``atexit`` hooks run, so an accepted save is committed; a watchdog kills a
writer that still has not finished ``close_timeout_s`` after the main thread ended, so exit
cannot hang either.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckpt_engine import CkptEngineError, SaveContext, StagedState, WriteContext, WriteResult, hookimpl
from ckpt_engine.storage import write_component

from .collect import Collector, Staged, collect, staged_components
from .copies import Snapshot, StreamPool, stage_copy
from .ipc import Save
from .pool import BufferPool, BufferSet, BufferSetInfo
from .process import PinnedWriterError, WriterProcess
from .shm import default_shm_dir, sweep_stale_files
from .supervise import WriterSettings, WriterSupervisor, register, unregister
from .windows import WindowPump

__all__ = ["PinnedStagingPlugin"]

logger = logging.getLogger("ckpt_engine.pinned_staging")

_INSTANCES = itertools.count()


class PinnedStagingPlugin:
    """Asynchronous saves: point-in-time copies into reused host buffers, written by a writer process.

    Provides the ``stage`` and ``write`` hooks; enable it with ``plugins: [pinned_staging]`` (or
    pass an instance in ``CheckpointEngine(..., plugins=[...])``). See the module docstring for
    the design and ``docs/performance.md`` for measurements. Its parts, modules of this
    package: the buffer sets (``pool``), the skeletons (``collect``), the copies (``copies``),
    the windows (``windows``) and the writer process's supervision (``supervise``).
    """

    name = "pinned_staging"

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        buffers: Literal[1, 2] = Field(
            default=1,
            description="Buffer sets. 1: a save waits for the previous one to be written. 2: a save may "
            "stage while the previous one is still being written (twice the host memory).",
        )
        close_timeout_s: float = Field(
            default=300.0, gt=0, description="close() and interpreter exit wait this long for an in-flight save."
        )
        writer_start_timeout_s: float = Field(
            default=120.0, gt=0, description="A writer not ready this long after it was started is killed."
        )
        write_timeout_s: float = Field(
            default=300.0,
            gt=0,
            description="A write still pending this long is declared hung: the writer is killed and the save "
            "fails with an error naming its pid and the writes in flight. Also the writer group's collective "
            "timeout. Raise it for states that take longer to write.",
        )
        heartbeat_timeout_s: float = Field(
            default=30.0,
            gt=0,
            description="The writer process beats from a thread of its own; one silent this long while a write "
            "is pending is stopped or frozen, and is killed so the save fails with an error saying so (a slow "
            "writer keeps beating and is bounded by write_timeout_s instead).",
        )
        thread_count: int | None = Field(
            default=None, ge=1, le=64, description="DCP writer threads; default: the engine's thread_count."
        )
        shm_dir: str | None = Field(
            default=None, description="Where buffer files live; default /dev/shm (a tmpfs), else the temp dir."
        )
        pin_memory: bool | None = Field(
            default=None, description="Page-lock buffers for CUDA copies; default: when CUDA is available."
        )
        overlap: bool = Field(
            default=False,
            description="Copy parameters and optimizer state in the background after save() returns; the next "
            "optimizer.step() waits for the copy, and a tensor changed in place before it was copied fails "
            "that save with SnapshotChangedError.",
        )
        max_host_bytes: int | None = Field(
            default=None,
            gt=0,
            description="Staging memory budget in bytes for all buffer sets together (each gets "
            "max_host_bytes / buffers). A larger state is staged in windows that fit, reusing the same "
            "buffers: save() then returns after the last window is staged. Default: no limit.",
        )

        @model_validator(mode="after")
        def _overlap_or_budget(self) -> PinnedStagingPlugin.Options:
            if self.overlap and self.max_host_bytes is not None:
                raise ValueError(
                    "overlap: true and max_host_bytes cannot be combined: a state staged in windows is copied "
                    "while save() waits for the writer, so there is no copy left to overlap; drop one of them"
                )
            return self

    def __init__(self, options: Options | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` is what the watchdog judges the writer's liveness by (``writer_start_timeout_s``,
        ``heartbeat_timeout_s``, ``write_timeout_s``): leave it, or pass a clock you advance yourself
        (a test, a simulation) so those verdicts never depend on how a loaded machine schedules the writer."""
        self.options = opts = options if options is not None else self.Options()
        self._lock = threading.RLock()
        settings = WriterSettings.for_job(
            next(_INSTANCES),
            start_timeout_s=opts.writer_start_timeout_s,
            write_timeout_s=opts.write_timeout_s,
            close_timeout_s=opts.close_timeout_s,
            heartbeat_timeout_s=opts.heartbeat_timeout_s,
            clock=clock,
        )
        self._rank, self._world = settings.rank, settings.world
        shm_dir = opts.shm_dir or default_shm_dir()
        if not os.path.isdir(shm_dir):
            raise CkptEngineError(f"pinned_staging: shm_dir {shm_dir!r} is not a directory")
        sweep_stale_files(shm_dir)
        self._pool = BufferPool(
            shm_dir=shm_dir,
            pin=opts.pin_memory if opts.pin_memory is not None else torch.cuda.is_available(),
            buffers=opts.buffers,
            max_host_bytes=opts.max_host_bytes,
            write_timeout_s=opts.write_timeout_s,
            rank=self._rank,
        )
        self._req_ids = itertools.count()
        self._staged: dict[str, Staged] = {}
        self._streams = StreamPool()
        self._snapshots: list[Snapshot] = []
        self._warned_no_optimizer = False
        #: Inside ``saving_in_process()``: saves bypass the writer (see the module docstring).
        self._in_process = False
        #: The live state dicts ``stage`` handed over in process, by component, until written.
        self._live: dict[str, dict[str, Any]] = {}
        self._writers = WriterSupervisor(
            settings,
            on_mapped=self._pool.on_mapped,
            on_drained=self._pool.on_drained,
            at_exit_round=self._confirm_snapshots_at_exit,
        )
        register(self, self._writers)

    def __repr__(self) -> str:
        return f"PinnedStagingPlugin(rank={self._rank}, world={self._world}, writer={self._writer!r})"

    # -- public introspection -------------------------------------------------------------

    @property
    def max_saves_in_flight(self) -> int:
        """How many saves may be pending while a new one stages (read by the engine)."""
        return self.options.buffers

    @property
    def writer_pid(self) -> int | None:
        writer = self._writer
        return writer.pid if writer is not None and writer.alive else None

    @property
    def _writer(self) -> WriterProcess | None:
        """The current writer process (``None`` only while the first one is being started)."""
        return self._writers.writer

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until the writer process is ready; returns its start-up seconds.

        Never needed for correctness (requests queue until the writer is ready); useful to
        keep start-up out of a measurement. Raises :class:`PinnedWriterError` if it failed.
        """
        writer = self._writers.live()
        return writer.wait_ready(self.options.writer_start_timeout_s if timeout is None else timeout)

    def buffer_sets(self) -> tuple[BufferSetInfo, ...]:
        return self._pool.infos()

    # -- saves that must not wait for the writer (``SavesInBackground``) ---------------------

    def background_ready(self) -> bool:
        """Whether the writer process is ready now, so a save would not wait for it to start
        (never blocks)."""
        writer = self._writer
        return not self._writers.closed and writer is not None and writer.alive and writer.ready

    @contextlib.contextmanager
    def saving_in_process(self) -> Iterator[None]:
        """Saves made inside are written synchronously in this process, by the engine's DCP
        save, without the writer process or the host buffers: the same checkpoint, committed
        before ``save()`` returns. Enter it on every rank or on none (the ranks' DCP collectives
        must match); the preemption saver does so when a writer is not ready on some rank."""
        with self._lock:
            self._in_process = True
        try:
            yield
        finally:
            with self._lock:
                self._in_process, self._live = False, {}

    # -- stage ----------------------------------------------------------------------------

    @hookimpl
    def stage(self, ctx: SaveContext, state: Mapping[str, dict[str, Any]]) -> StagedState:
        if ctx.world_size != self._world or ctx.rank != self._rank:
            raise CkptEngineError(
                f"pinned_staging was created for rank {self._rank} of {self._world}, but the save runs on rank "
                f"{ctx.rank} of {ctx.world_size}; create the engine after init_process_group"
            )
        if self._in_process:
            self._writers.check_open()
            with self._lock:
                self._live = dict(state)
            return StagedState(components=dict(state), is_copy=False)  # written before save() returns
        writer = self._writers.live()
        collector, skeletons = collect(state, share_across_components=self.options.max_host_bytes is None)
        self._settle_snapshots()  # an earlier overlap copy: complete and confirmed before its buffers are reused
        self._pool.abandon_pumps()  # a windowed save whose writes were never all requested
        buffers = self._pool.acquire(collector.signature(), writer)
        pump: WindowPump | None = None
        snapshot: Snapshot | None = None
        if buffers.windowed:
            pump = self._stage_windowed(collector, buffers, writer)
        else:
            snapshot = self._copy(ctx, state, collector, buffers)
        staged = staged_components(skeletons, buffers, tuple(collector.meshes), snapshot, pump)
        with self._lock:
            self._staged = staged
        if snapshot is not None:  # the skeletons the writer needs, pickled off save()'s path
            snapshot.after_copy(lambda: [s.skeleton.pickled() for s in staged.values()])
        trees = {name: s.tree for name, s in staged.items()}
        return StagedState(components=trees, is_copy=True, snapshot=snapshot)

    def _copy(
        self, ctx: SaveContext, state: Mapping[str, dict[str, Any]], collector: Collector, buffers: BufferSet
    ) -> Snapshot | None:
        """Copy into ``buffers``: everything now, or (``overlap``) the rest in a background snapshot."""
        views, sources = buffers.slab.views, collector.sources
        if self.options.overlap and not ctx.optimizers and not self._warned_no_optimizer:
            self._warned_no_optimizer = True
            warnings.warn(
                "pinned_staging: overlap is on, but save() got no optimizer, so nothing guards the next step "
                "and every tensor is copied inside save() (no overlap). Pass optimizer= to save() to overlap "
                "the copy of parameters and optimizer state with the next forward and backward pass",
                UserWarning,
                stacklevel=2,
            )
        snapshot = stage_copy(
            views, sources, collector.objects, state, ctx.optimizers, self._streams, overlap=self.options.overlap
        )
        if snapshot is not None:
            self._pool.hold(buffers, snapshot.settled)
            with self._lock:
                self._snapshots.append(snapshot)
        return snapshot

    def _stage_windowed(self, collector: Collector, buffers: BufferSet, writer: WriterProcess) -> WindowPump:
        """Copy window 0 now; the last ``write`` stages the rest as the writer drains them."""
        buffers.epoch += 1
        pump = WindowPump.over(
            buffers.slab.views,
            collector.sources,
            buffers.windows,
            set_id=buffers.slab.set_id,
            epoch=buffers.epoch,
            streams=self._streams,
            send=writer.send,
            timeout=self.options.write_timeout_s + 60.0,
        )
        self._pool.set_pump(buffers, pump)
        pump.stage_first()
        return pump

    def _settle_snapshots(self, timeout: float | None = None) -> None:
        """Complete and confirm earlier overlap copies (on the training thread); their saves
        report their own failures, so none is raised here."""
        with self._lock:
            pending, self._snapshots = self._snapshots, [s for s in self._snapshots if not s.settled.done()]
        for snapshot in pending:
            with contextlib.suppress(Exception):
                snapshot.wait(timeout)
            snapshot.remove_hooks()

    def _confirm_snapshots_at_exit(self) -> None:
        """The main thread has ended: nobody steps an optimizer any more (the watchdog calls this)."""
        with self._lock:
            snapshots = list(self._snapshots)
        for snapshot in snapshots:
            snapshot.confirm_at_exit()

    # -- write ----------------------------------------------------------------------------

    @hookimpl
    def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> Future[WriteResult] | WriteResult:
        if not ctx.staged_copy:
            return self._write_in_process(ctx, state_dict)
        with self._lock:
            self._writers.check_open()
            staged = self._staged.get(ctx.component)
            writer = self._writer
        if staged is None or staged.tree is not state_dict:
            raise CkptEngineError(
                f"pinned_staging.write got a state dict for component {ctx.component!r} that pinned_staging.stage "
                "did not produce; the two hooks must both come from pinned_staging"
            )
        if writer is None or not writer.alive or writer.generation != staged.buffers.generation:
            error = writer.error if writer is not None else None
            raise PinnedWriterError(
                "pinned_staging: the writer process was lost while this save was being staged"
                + (f" ({error})" if error else "")
                + "; save again"
            )
        future: Future[WriteResult] = Future()
        message = Save(
            req_id=next(self._req_ids),
            set_id=staged.buffers.slab.set_id,
            iteration=ctx.iteration,
            component=ctx.component,
            path=ctx.path,
            skeleton=b"",  # below: pickled now, or (overlap) once the snapshot is settled
            meshes=staged.meshes,
            planner=ctx.planner,
            thread_count=self.options.thread_count or ctx.thread_count,
            sync_files=ctx.sync_files,
            epoch=staged.epoch,
            collective_timeout_s=ctx.collective_timeout_s,
            carry_over=ctx.carry_over,
            rank_local=ctx.rank_local,
        )
        self._pool.hold(staged.buffers, future)  # busy until the writer has read it
        if staged.snapshot is not None:  # hand over only a complete, confirmed snapshot
            pickled = staged.skeleton.pickled  # by the copy thread, usually, before the snapshot settles (stage)
            staged.snapshot.when_settled(lambda error: writer.hand_over(message, future, error, self._world, pickled))
            return future
        message = dataclasses.replace(message, skeleton=staged.skeleton.pickled())
        if staged.pump is not None:
            self._write_windowed(staged, staged.pump, writer, message, future)
        else:
            writer.submit(message, future)
        return future

    def _write_in_process(self, ctx: WriteContext, state_dict: dict[str, Any]) -> WriteResult:
        """Write the live state of one component now, as the engine's own ``write`` does."""
        with self._lock:
            self._writers.check_open()
            live = self._live.get(ctx.component)  # a save with a local tier writes it twice
        if live is None or live is not state_dict:
            raise CkptEngineError(
                f"pinned_staging.write got the live state dict of component {ctx.component!r}, but "
                "pinned_staging.stage did not hand it over in process; the two hooks must both come from pinned_staging"
            )
        # No process group given: DCP runs over the engine's (the active CollectiveWatch's, the
        # ctx.process_group the engine's own write passes), bounded by collective_timeout_s.
        return write_component(
            state_dict,
            component=ctx.component,
            path=ctx.path,
            planner=ctx.planner,
            thread_count=self.options.thread_count or ctx.thread_count,
            sync_files=ctx.sync_files,
            carry_over=ctx.carry_over,
            process_group=ctx.process_group if ctx.rank_local else None,
        )

    def writes_rank_local(self) -> bool:
        """Whether this plugin can write the node-local tier (``ckpt_engine.lifecycle.WritesRankLocal``):
        yes, unless ``max_host_bytes`` stages in windows, which the writer drains as it writes them
        once, while a save with a local tier writes its state twice."""
        return self.options.max_host_bytes is None

    def _write_windowed(
        self, staged: Staged, pump: WindowPump, writer: WriterProcess, message: Save, future: Future[WriteResult]
    ) -> None:
        """Send one component of a windowed save; after the last one, stage the remaining
        windows as the writer drains them (``save()`` returns once the last is staged)."""
        if not pump.send_component(message.component, staged.order, future, lambda: writer.submit(message, future)):
            return
        try:
            pump.finish(self.options.write_timeout_s + 60.0)
        finally:
            self._pool.set_pump(staged.buffers, None, if_current=pump)

    # -- shutdown -------------------------------------------------------------------------

    def begin_close(self) -> None:
        """Start the ``close_timeout_s`` clock (the engine calls this before it waits for saves)."""
        self._writers.begin_close()

    def close(self) -> None:
        """Wait up to ``close_timeout_s`` for in-flight writes, stop the writer, free the buffers.

        Idempotent. Raises :class:`PinnedWriterError` if an in-flight write had to be abandoned.
        """
        self.begin_close()
        if not self._writers.mark_closed():
            return
        unregister(self)
        if os.getpid() != self._writers.owner_pid:
            self._writers.stop_watchdog()
            return
        self._settle_snapshots(self._writers.remaining())
        error = self._writers.stop()
        self._pool.release_all()
        with self._lock:
            self._staged = {}
        self._writers.join(2.0)
        if error is not None:
            raise error
