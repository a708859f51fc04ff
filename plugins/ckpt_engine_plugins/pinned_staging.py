"""``pinned_staging``: asynchronous saves through reused host buffers and a writer process.

The training loop pays only for copying its state into host memory; a background writer
process serialises it with DCP and the engine commits it.

**stage** (every rank, in the training thread). The state dicts are pickled once with every
tensor replaced by a slot reference: that pickle is the *skeleton*, which holds a deep copy
of every non-tensor value and the exact nesting, so the writer rebuilds the same keys. Each
distinct tensor (by object; aliases share a slot) gets a slot in a *buffer set*; DTensors
(FSDP2, TP) contribute their local shard, and their mesh, placements, global shape and stride
travel in the skeleton. The tensors are copied into the set, and ``stage`` returns only when
every copy is complete: the state is then fixed, and the training loop may step the optimizer.
CPU tensors are copied with ``copy_``; CUDA tensors are copied with ``non_blocking=True`` on a
side stream that first waits for the current stream, into page-locked buffers, and that
stream is synchronised before ``stage`` returns (the CUDA path was not run on a GPU yet).

**Buffers.** A buffer set is one file in ``/dev/shm`` mapped by both processes (see
``_pinned_buffers``), allocated on the first save and reused by every later save whose tensors
have the same shapes and dtypes in the same order; a different structure allocates a new set
and frees the old one. ``buffers: 2`` keeps two sets so a save can stage while the previous
one is still being written (the plugin declares ``max_saves_in_flight = 2`` and the engine
then waits only for the save before last). A set is never re-staged while a write that reads
it is pending: staging waits for it.

**Budget** (``max_host_bytes``). Each buffer set holds at most ``max_host_bytes / buffers``
bytes. A larger state is staged in *windows* of the same set (see ``_pinned_windows``): the
first is copied in ``stage``, the rest by the last ``write`` as the writer drains each previous
window, so ``save()`` returns once the last window is staged. A tensor is never split: one
larger than the share gets a window of its own and the set grows to hold it. ``overlap`` is
refused with a budget. Without a budget, or for a state that fits, nothing changes.

**write** (every rank, per component). Queues a request for the writer and returns a future.
The writer (``_pinned_writer``) is a plain ``python -m`` subprocess, started when the plugin
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

**Shutdown.** ``close()`` (the engine calls it from ``CheckpointEngine.close()`` and ``with``)
waits up to ``close_timeout_s`` for the in-flight save, then stops the writer; an ``atexit``
hook does the same for engines never closed. At interpreter exit the engine's commit thread
is joined before ``atexit`` hooks run, so an accepted save is committed; a watchdog kills a
writer that still has not finished ``close_timeout_s`` after the main thread ended, so exit
cannot hang either.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import dataclasses
import io
import itertools
import logging
import math
import os
import pickle
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch.distributed.tensor import DTensor

from ckpt_engine import CkptEngineError, SaveContext, StagedState, WriteContext, WriteResult, hookimpl

from ._pinned_buffers import HostSlab, default_shm_dir, sweep_stale_files
from ._pinned_copy import (
    Snapshot,
    SnapshotChangedError,
    StreamPool,
    copy_now,
    is_owned,
    optimizer_owned,
    owners_of,
    tensor_names,
)
from ._pinned_ipc import Alloc, Drained, Free, Init, MeshSpec, Save, SkeletonUnpickler, Window
from ._pinned_process import Pending, PinnedWriterError, WriterProcess
from ._pinned_windows import WindowPump, plan_windows

__all__ = ["BufferSetInfo", "PinnedStagingPlugin", "PinnedWriterError", "SnapshotChangedError"]

logger = logging.getLogger("ckpt_engine.pinned_staging")

_INSTANCES = itertools.count()
_LIVE: set[PinnedStagingPlugin] = set()
_LIVE_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class BufferSetInfo:
    """One buffer set, as :meth:`PinnedStagingPlugin.buffer_sets` reports it."""

    set_id: int
    nbytes: int
    tensors: int
    data_ptr: int
    pinned: bool
    busy: bool
    #: Windows a save is staged in (``max_host_bytes``); 1: the whole state at once.
    windows: int = 1


@dataclass(eq=False)
class _BufferSet:
    slab: HostSlab
    signature: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    generation: int
    #: Each slot's window (``max_host_bytes``); all 0: the whole state at once.
    windows: tuple[int, ...] = ()
    #: Saves staged into this set so far (a windowed save's epoch).
    epoch: int = 0
    #: The windowed save now being handed over, if any.
    pump: WindowPump | None = None
    #: Writes that read the set, and an ``overlap`` copy still writing into it.
    futures: list[Future[Any]] = field(default_factory=list)
    last_used: float = 0.0

    @property
    def windowed(self) -> bool:
        return bool(self.windows) and max(self.windows) > 0

    @property
    def busy(self) -> bool:
        self.futures = [f for f in self.futures if not f.done()]
        return bool(self.futures)


@dataclass(frozen=True, eq=False)
class _Staged:
    buffers: _BufferSet
    skeleton: bytes
    meshes: tuple[MeshSpec, ...]
    tree: dict[str, Any]
    snapshot: Snapshot | None = None
    #: ``max_host_bytes``: the window hand-over, its epoch and the components in write order.
    pump: WindowPump | None = None
    epoch: int | None = None
    order: tuple[str, ...] = ()


class _Collector:
    """Assigns staging slots to the tensors met while pickling a skeleton."""

    def __init__(self, *, share_across_components: bool = True) -> None:
        self.share_across_components = share_across_components
        self.sources: list[torch.Tensor] = []
        self.meshes: list[MeshSpec] = []
        self._slots: dict[int, int] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids unique while the skeletons are pickled
        self._mesh_index: dict[MeshSpec, int] = {}

    def _slot(self, obj: torch.Tensor, local: torch.Tensor) -> int:
        slot = self._slots.get(id(obj))
        if slot is None:
            if local.layout != torch.strided or local.device.type == "meta":
                raise CkptEngineError(
                    f"pinned_staging cannot stage a {local.layout} tensor on {local.device} "
                    f"(shape {list(local.shape)}); only dense tensors with data can be saved asynchronously"
                )
            slot = len(self.sources)
            self._slots[id(obj)] = slot
            self.sources.append(local)
            self._keep.append(obj)
        return slot

    def next_component(self) -> None:
        """A windowed save writes components one after another: a tensor two components share
        gets a slot in each, so neither reads a window the other's writes have moved past."""
        if not self.share_across_components:
            self._slots = {}

    @property
    def objects(self) -> list[torch.Tensor]:
        """The tensor met for each slot (a DTensor itself, where ``sources`` holds its shard)."""
        return self._keep

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        if isinstance(obj, DTensor):
            mesh = obj.device_mesh
            spec = MeshSpec(
                shape=tuple(mesh.mesh.shape),
                ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()),
                dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
            )
            index = self._mesh_index.setdefault(spec, len(self.meshes))
            if index == len(self.meshes):
                self.meshes.append(spec)
            slot = self._slot(obj, obj.to_local())
            return ("dt", slot, index, tuple(obj.placements), tuple(obj.shape), tuple(obj.stride()))
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise CkptEngineError(
                f"pinned_staging cannot stage a tensor of type {type(obj).__qualname__}; plain tensors, "
                "parameters and DTensors are supported"
            )
        return ("t", self._slot(obj, obj))

    def signature(self) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
        return tuple((tuple(t.shape), t.dtype) for t in self.sources)


class _SkeletonPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO, collector: _Collector) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self._collector = collector

    def persistent_id(self, obj: Any) -> Any:
        return self._collector.persistent_id(obj)


def _job_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


class PinnedStagingPlugin:
    """Asynchronous saves: point-in-time copies into reused host buffers, written by a writer process.

    Provides the ``stage`` and ``write`` hooks; enable it with ``plugins: [pinned_staging]`` (or
    pass an instance in ``CheckpointEngine(..., plugins=[...])``). See the module docstring for
    the design and ``docs/performance.md`` for measurements.
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

    def __init__(self, options: Options | None = None) -> None:
        self.options = options if options is not None else self.Options()
        self._lock = threading.RLock()
        self._closed = False
        self._owner_pid = os.getpid()
        self._instance = next(_INSTANCES)
        self._rank, self._world = _job_rank_world()
        self._store_host: str | None = None
        self._store_port: int | None = None
        if self._world > 1:
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not host or not port or not port.isdigit():
                raise CkptEngineError(
                    f"pinned_staging with {self._world} ranks needs the job's rendezvous store in MASTER_ADDR and "
                    "MASTER_PORT (torchrun sets both); launch with torchrun or set them as for init_method='env://'"
                )
            self._store_host, self._store_port = host, int(port)
        self._shm_dir = self.options.shm_dir or default_shm_dir()
        if not os.path.isdir(self._shm_dir):
            raise CkptEngineError(f"pinned_staging: shm_dir {self._shm_dir!r} is not a directory")
        sweep_stale_files(self._shm_dir)
        self._pin = self.options.pin_memory if self.options.pin_memory is not None else torch.cuda.is_available()
        self._generation = itertools.count()
        self._set_ids = itertools.count()
        self._req_ids = itertools.count()
        self._sets: list[_BufferSet] = []
        self._staged: dict[str, _Staged] = {}
        self._streams = StreamPool()
        self._snapshots: list[Snapshot] = []
        self._close_deadline: float | None = None
        self._writer: WriterProcess | None = None
        self._writer = self._spawn_writer()
        self._stop = threading.Event()
        self._supervisor = threading.Thread(
            target=_supervise, args=(weakref.ref(self), self._stop), name="pinned-staging-watchdog", daemon=True
        )
        self._supervisor.start()
        with _LIVE_LOCK:
            _LIVE.add(self)

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

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until the writer process is ready; returns its start-up seconds.

        Never needed for correctness (requests queue until the writer is ready); useful to
        keep start-up out of a measurement. Raises :class:`PinnedWriterError` if it failed.
        """
        writer = self._live_writer()
        return writer.wait_ready(self.options.writer_start_timeout_s if timeout is None else timeout)

    def buffer_sets(self) -> tuple[BufferSetInfo, ...]:
        with self._lock:
            return tuple(
                BufferSetInfo(
                    set_id=s.slab.set_id,
                    nbytes=s.slab.nbytes,
                    tensors=len(s.slab.slots),
                    data_ptr=s.slab.data_ptr,
                    pinned=s.slab.pinned,
                    busy=s.busy,
                    windows=(max(s.windows) + 1) if s.windows else 1,
                )
                for s in self._sets
            )

    # -- writer lifecycle -----------------------------------------------------------------

    def _spawn_writer(self) -> WriterProcess:
        generation = next(self._generation)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        init = Init(
            rank=self._rank,
            world_size=self._world,
            store_host=self._store_host,
            store_port=self._store_port,
            store_prefix=f"ckpt_engine/pinned_staging/{run}/{restart}/{self._instance}/{generation}/",
            start_timeout_s=self.options.writer_start_timeout_s,
            write_timeout_s=self.options.write_timeout_s,
        )
        writer = WriterProcess(
            init,
            generation,
            on_lost=self._on_writer_lost,
            on_mapped=self._on_mapped,
            on_failed_write=self._on_failed_write,
            on_drained=self._on_drained,
        )
        logger.debug(
            "rank %d: started pinned_staging writer pid %d (generation %d)", self._rank, writer.pid, generation
        )
        return writer

    def _live_writer(self) -> WriterProcess:
        """The current writer; a new one if the last one is gone."""
        with self._lock:
            self._check_open()
            writer = self._writer
            if writer is None or not writer.alive:
                previous = writer.error if writer is not None else None
                writer = self._writer = self._spawn_writer()
                if previous is not None:
                    logger.warning("rank %d: started writer pid %d after: %s", self._rank, writer.pid, previous)
            return writer

    def _on_writer_lost(self, writer: WriterProcess, error: PinnedWriterError) -> None:
        logger.error("rank %d: %s", self._rank, error)
        with self._lock:
            if writer is not self._writer or self._closed or os.getpid() != self._owner_pid:
                return
            if writer.ready:  # a writer that never started is retried by the next save, not in a loop
                try:
                    self._writer = self._spawn_writer()
                except Exception:
                    logger.exception("rank %d: could not start a replacement writer process", self._rank)

    def _on_failed_write(self, writer: WriterProcess) -> None:
        if self._world > 1:
            # The writers' process group may be left mid-collective: replace the writer on every
            # rank (every rank sees the failure: DCP and the pre-save agreement fail all ranks).
            writer.kill("a write failed and the writer group may be inconsistent; it is replaced")

    def _on_mapped(self, set_id: int, error: str | None) -> None:
        with self._lock:
            for s in self._sets:
                if s.slab.set_id == set_id:
                    s.slab.unlink()  # both processes have it mapped: /dev/shm holds no name for it
        if error is not None:
            logger.error("rank %d: %s", self._rank, error)

    def _on_drained(self, msg: Drained) -> None:
        with self._lock:
            pumps = [s.pump for s in self._sets if s.slab.set_id == msg.set_id and s.pump is not None]
        for pump in pumps:
            if pump.epoch == msg.epoch:
                pump.drained(msg.index)

    # -- stage ----------------------------------------------------------------------------

    @hookimpl
    def stage(self, ctx: SaveContext, state: Mapping[str, dict[str, Any]]) -> StagedState:
        if ctx.world_size != self._world or ctx.rank != self._rank:
            raise CkptEngineError(
                f"pinned_staging was created for rank {self._rank} of {self._world}, but the save runs on rank "
                f"{ctx.rank} of {ctx.world_size}; create the engine after init_process_group"
            )
        writer = self._live_writer()
        collector = _Collector(share_across_components=self.options.max_host_bytes is None)
        skeletons: dict[str, bytes] = {}
        for name, sd in state.items():
            collector.next_component()
            buf = io.BytesIO()
            try:
                _SkeletonPickler(buf, collector).dump(sd)
            except CkptEngineError:
                raise
            except Exception as err:
                raise CkptEngineError(
                    f"pinned_staging cannot copy the non-tensor values of component {name!r}: "
                    f"{type(err).__name__}: {err}; values must be picklable"
                ) from err
            skeletons[name] = buf.getvalue()
        self._settle_snapshots()  # an earlier overlap copy: complete and confirmed before its buffers are reused
        self._abandon_pumps()  # a windowed save whose writes were never all requested
        buffers = self._acquire(collector.signature(), writer)
        views = buffers.slab.views
        pump: WindowPump | None = None
        snapshot: Snapshot | None = None
        if buffers.windowed:
            pump = self._stage_windowed(collector, buffers, writer)
        else:
            snapshot = self._copy(ctx, state, collector, buffers)
        trees: dict[str, dict[str, Any]] = {}
        meshes = tuple(collector.meshes)
        staged: dict[str, _Staged] = {}
        order = tuple(skeletons)
        for name, skeleton in skeletons.items():
            # With windows, the views show whichever window the set holds now: only the writer reads them.
            tree = SkeletonUnpickler(skeleton, lambda pid: views[pid[1]]).load()
            trees[name] = tree
            epoch = buffers.epoch if pump is not None else None
            staged[name] = _Staged(buffers, skeleton, meshes, tree, snapshot, pump, epoch, order)
        with self._lock:
            self._staged = staged
        return StagedState(components=trees, is_copy=True, snapshot=snapshot)

    def _copy(
        self, ctx: SaveContext, state: Mapping[str, dict[str, Any]], collector: _Collector, buffers: _BufferSet
    ) -> Snapshot | None:
        """Copy into ``buffers``: everything now, or (``overlap``) now only what can change outside
        the optimizer and the rest in a background :class:`Snapshot`."""
        views, sources = buffers.slab.views, collector.sources
        owned = optimizer_owned(ctx.optimizers) if self.options.overlap else {}
        later = [i for i, s in enumerate(sources) if owned and is_owned(s, owned)]
        deferred = set(later)
        now = [i for i in range(len(sources)) if i not in deferred]
        copy_now([views[i] for i in now], [sources[i] for i in now], self._streams)
        if not later:
            return None
        names = tensor_names(state)
        snapshot = Snapshot(
            [views[i] for i in later],
            [sources[i] for i in later],
            [names.get(id(collector.objects[i]), f"tensor {i}") for i in later],
            [owners_of(sources[i], owned) for i in later],
            ctx.optimizers,
            self._streams,
        )
        with self._lock:
            buffers.futures.append(snapshot.settled)
            self._snapshots.append(snapshot)
        return snapshot

    def _stage_windowed(self, collector: _Collector, buffers: _BufferSet, writer: WriterProcess) -> WindowPump:
        """Copy window 0 now; the last ``write`` stages the rest as the writer drains them."""
        views, sources, windows = buffers.slab.views, collector.sources, buffers.windows
        by_window: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_window.setdefault(w, []).append(i)
        set_id = buffers.slab.set_id
        buffers.epoch += 1
        epoch = buffers.epoch

        def copy_window(index: int) -> None:
            slots = by_window.get(index, [])
            copy_now([views[i] for i in slots], [sources[i] for i in slots], self._streams)

        def announce(index: int, error: str | None) -> None:
            writer.send(Window(set_id, epoch, index, error))

        pump = WindowPump(set_id, epoch, windows, copy_window, announce, self.options.write_timeout_s + 60.0)
        with self._lock:
            buffers.pump = pump
        pump.stage_first()
        return pump

    def _abandon_pumps(self) -> None:
        with self._lock:
            pumps = [s.pump for s in self._sets if s.pump is not None and not s.pump.ran]
        for pump in pumps:
            pump.fail("the save was abandoned before all of its components were written")

    def _settle_snapshots(self, timeout: float | None = None) -> None:
        """Complete and confirm earlier overlap copies (on the training thread); their saves
        report their own failures, so none is raised here."""
        with self._lock:
            pending, self._snapshots = self._snapshots, [s for s in self._snapshots if not s.settled.done()]
        for snapshot in pending:
            with contextlib.suppress(Exception):
                snapshot.wait(timeout)
            snapshot.remove_hooks()

    def _acquire(self, signature: tuple[tuple[tuple[int, ...], torch.dtype], ...], writer: WriterProcess) -> _BufferSet:
        """A buffer set for ``signature`` that no pending write reads."""
        with self._lock:
            stale = [s for s in self._sets if s.generation != writer.generation]
            self._sets = [s for s in self._sets if s.generation == writer.generation]
        for s in stale:
            s.slab.release()  # its writer is gone; nobody reads it
        while True:
            with self._lock:
                matching = [s for s in self._sets if s.signature == signature and not s.busy]
                if matching:
                    chosen = min(matching, key=lambda s: s.last_used)
                    chosen.last_used = time.monotonic()
                    return chosen
                if len(self._sets) < self.options.buffers:
                    return self._allocate(signature, writer)
                victim = min(self._sets, key=lambda s: s.last_used)
                if not victim.busy:
                    self._release(victim, writer)
                    return self._allocate(signature, writer)
                waiting = list(victim.futures)
            # Never re-stage a set a pending write reads: wait for it (bounded: the watchdog kills
            # a write older than write_timeout_s, which fails its future).
            _, not_done = concurrent.futures.wait(waiting, timeout=self.options.write_timeout_s + 60.0)
            if not_done:
                raise PinnedWriterError(
                    f"pinned_staging: the previous save still holds the staging buffers after "
                    f"{self.options.write_timeout_s + 60.0:g}s; cannot stage without overwriting it"
                )

    def _window_capacity(self, signature: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> int | None:
        """Bytes one buffer set may hold (``max_host_bytes / buffers``); ``None``: no limit."""
        budget = self.options.max_host_bytes
        if budget is None:
            return None
        capacity = budget // self.options.buffers
        largest = max((math.prod(shape) * dtype.itemsize for shape, dtype in signature), default=0)
        if largest > capacity:
            logger.warning(
                "rank %d: a tensor of %.1f MiB is larger than the staging budget of %.1f MiB per buffer set "
                "(max_host_bytes=%d, buffers=%d); it is staged in a window of its own and the buffer set grows "
                "to hold it",
                self._rank,
                largest / 2**20,
                capacity / 2**20,
                budget,
                self.options.buffers,
            )
        return capacity

    def _allocate(
        self, signature: tuple[tuple[tuple[int, ...], torch.dtype], ...], writer: WriterProcess
    ) -> _BufferSet:
        slots, nbytes, windows = plan_windows(signature, self._window_capacity(signature))
        set_id = next(self._set_ids)
        slab = HostSlab(set_id, self._shm_dir, slots, nbytes, self._pin)
        buffers = _BufferSet(slab, signature, writer.generation, windows=windows, last_used=time.monotonic())
        self._sets.append(buffers)
        try:
            writer.send(Alloc(set_id=set_id, path=slab.path or "", nbytes=nbytes, slots=slots, windows=windows))
        except PinnedWriterError:
            self._sets.remove(buffers)
            slab.release()
            raise
        logger.info(
            "rank %d: allocated staging buffer set %d: %d tensors, %.1f MiB%s",
            self._rank,
            set_id,
            len(slots),
            nbytes / 2**20,
            " (pinned)" if slab.pinned else "",
        )
        return buffers

    def _release(self, buffers: _BufferSet, writer: WriterProcess | None) -> None:
        self._sets.remove(buffers)
        buffers.slab.release()
        if writer is not None and writer.alive and writer.generation == buffers.generation:
            with contextlib.suppress(PinnedWriterError):
                writer.send(Free(buffers.slab.set_id))

    # -- write ----------------------------------------------------------------------------

    @hookimpl
    def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> Future[WriteResult]:
        with self._lock:
            self._check_open()
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
        req_id = next(self._req_ids)
        message = Save(
            req_id=req_id,
            set_id=staged.buffers.slab.set_id,
            iteration=ctx.iteration,
            component=ctx.component,
            path=ctx.path,
            skeleton=staged.skeleton,
            meshes=staged.meshes,
            planner=ctx.planner,
            thread_count=self.options.thread_count or ctx.thread_count,
            sync_files=ctx.sync_files,
            epoch=staged.epoch,
        )
        with self._lock:
            staged.buffers.futures.append(future)  # busy until the writer has read it
        if staged.pump is not None:
            self._write_windowed(ctx, staged, writer, message, future)
        elif staged.snapshot is None:
            self._send(writer, message, future)
        else:  # hand over only a complete, confirmed snapshot
            staged.snapshot.when_settled(lambda error: self._hand_over(writer, message, future, error))
        return future

    def _write_windowed(
        self, ctx: WriteContext, staged: _Staged, writer: WriterProcess, message: Save, future: Future[WriteResult]
    ) -> None:
        """Send one component of a windowed save; after the last one, stage the remaining
        windows as the writer drains them (``save()`` returns once the last is staged)."""
        pump = staged.pump
        assert pump is not None
        done = len(pump.components)
        expected = staged.order[done] if done < len(staged.order) else None
        if ctx.component != expected:
            pump.fail(f"component {ctx.component!r} written out of order")
            future.set_exception(CkptEngineError("pinned_staging: windowed save written out of order"))
            raise CkptEngineError(
                f"pinned_staging (max_host_bytes): component {ctx.component!r} was written out of the order it was "
                f"staged in ({', '.join(staged.order)}); a save staged in windows must be written in that order"
            )
        pump.components.append(ctx.component)
        pump.watch(future)
        try:
            self._send(writer, message, future)
        except BaseException:
            pump.fail("the save request could not be sent")
            raise
        if ctx.component != staged.order[-1]:
            return
        try:
            pump.run()
        except BaseException as err:
            # The writer stops reading at once; wait (bounded) so nothing still writes the folder.
            concurrent.futures.wait(pump.futures, timeout=self.options.write_timeout_s + 60.0)
            if isinstance(err, CkptEngineError):
                raise
            raise CkptEngineError(
                f"pinned_staging (max_host_bytes): staging window {pump.staged + 1} of {pump.count} failed: "
                f"{type(err).__name__}: {err}"
            ) from err
        finally:
            with self._lock:
                if staged.buffers.pump is pump:
                    staged.buffers.pump = None

    def _send(self, writer: WriterProcess, message: Save, future: Future[WriteResult]) -> None:
        try:
            writer.send(message, (message.req_id, Pending(future, message.iteration, message.component)))
        except PinnedWriterError as err:
            future.set_exception(err)  # never leave the buffer set marked busy
            raise
        except Exception as err:
            future.set_exception(err)
            raise CkptEngineError(
                f"pinned_staging cannot send the save request of component {message.component!r} to the writer "
                f"process (the planner {type(message.planner).__qualname__} must be picklable): "
                f"{type(err).__name__}: {err}"
            ) from err

    def _hand_over(
        self, writer: WriterProcess, message: Save, future: Future[WriteResult], error: BaseException | None
    ) -> None:
        """Send a settled overlap save to the writer; its failure goes into ``future``, never up."""
        try:
            if error is None:
                self._send(writer, message, future)
                return
            if self._world > 1:  # the other ranks' writers must fail this save too, not wait for ours
                aborted: Future[WriteResult] = Future()
                abort = dataclasses.replace(message, abort=f"rank {self._rank}: {error}")
                with contextlib.suppress(Exception):
                    writer.send(abort, (message.req_id, Pending(aborted, message.iteration, message.component)))
            future.set_exception(error)
        except Exception as err:
            if not future.done():
                future.set_exception(err)

    # -- shutdown -------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise CkptEngineError("pinned_staging is closed (its engine was closed); create a new engine")

    def begin_close(self) -> None:
        """Start the ``close_timeout_s`` clock (the engine calls this before it waits for saves)."""
        with self._lock:
            if self._close_deadline is None:
                self._close_deadline = time.monotonic() + self.options.close_timeout_s

    def close(self) -> None:
        """Wait up to ``close_timeout_s`` for in-flight writes, stop the writer, free the buffers.

        Idempotent. Raises :class:`PinnedWriterError` if an in-flight write had to be abandoned.
        """
        self.begin_close()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            writer = self._writer
            deadline = self._close_deadline
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if os.getpid() != self._owner_pid:
            self._stop.set()
            return
        self._settle_snapshots(max(0.0, (deadline or time.monotonic()) - time.monotonic()))
        error: PinnedWriterError | None = None
        if writer is not None and writer.alive:
            pending = writer.pending_futures()
            remaining = max(0.0, (deadline or time.monotonic()) - time.monotonic())
            _, not_done = concurrent.futures.wait(pending, timeout=remaining)
            if not_done:
                writer.kill(self._close_reason())
                error = writer.error
            else:
                writer.shutdown(timeout=min(30.0, self.options.close_timeout_s))
        self._stop.set()
        with self._lock:
            sets, self._sets = self._sets, []
            self._staged = {}
        for s in sets:
            s.slab.release()
        self._supervisor.join(2.0)
        if error is not None:
            raise error

    def _close_reason(self) -> str:
        return (
            "the engine was closed and the in-flight save did not finish within "
            f"close_timeout_s={self.options.close_timeout_s:g}s"
        )

    def _after_fork_in_child(self) -> None:
        """A forked child (e.g. a DataLoader worker) must never drive the parent's writer."""
        self._closed = True
        writer = self._writer
        if writer is not None:
            writer.close_fds_after_fork()

    def _watch(self, exit_deadline: float | None) -> float | None:
        """One watchdog round; returns the interpreter-exit deadline (see the module docstring)."""
        if not threading.main_thread().is_alive():  # nobody steps an optimizer any more
            with self._lock:
                snapshots = list(self._snapshots)
            for snapshot in snapshots:
                snapshot.confirm_at_exit()
        writer = self._writer
        if writer is None or not writer.alive:
            return exit_deadline
        now = time.monotonic()
        if not writer.ready and now - writer.started > self.options.writer_start_timeout_s:
            writer.kill(
                f"it did not become ready within writer_start_timeout_s={self.options.writer_start_timeout_s:g}s"
            )
            return exit_deadline
        age = writer.oldest_pending_age()
        if age is not None and age > self.options.write_timeout_s:
            writer.kill(f"a write was still pending after write_timeout_s={self.options.write_timeout_s:g}s")
        elif age is not None and self._close_deadline is not None and now > self._close_deadline:
            writer.kill(self._close_reason())
        elif age is not None and not threading.main_thread().is_alive():
            # Interpreter exit: the engine's commit thread is being joined and waits on the writer.
            if exit_deadline is None:
                return now + self.options.close_timeout_s
            if now > exit_deadline:
                writer.kill(
                    f"the interpreter is exiting and the in-flight save did not finish within "
                    f"close_timeout_s={self.options.close_timeout_s:g}s"
                )
        return exit_deadline


def _supervise(plugin_ref: weakref.ref[PinnedStagingPlugin], stop: threading.Event) -> None:
    exit_deadline: float | None = None
    while not stop.wait(0.2):
        plugin = plugin_ref()
        if plugin is None:
            return
        try:
            exit_deadline = plugin._watch(exit_deadline)
        except Exception:  # the watchdog must keep watching; log and carry on
            logger.exception("pinned_staging watchdog error")
        del plugin


def _close_all_at_exit() -> None:
    with _LIVE_LOCK:
        plugins = list(_LIVE)
    for plugin in plugins:
        try:
            plugin.close()
        except Exception as err:
            logger.error("pinned_staging: closing at interpreter exit: %s", err)


def _after_fork_in_child() -> None:
    with _LIVE_LOCK:
        plugins = list(_LIVE)
        _LIVE.clear()
    for plugin in plugins:
        plugin._after_fork_in_child()


atexit.register(_close_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
