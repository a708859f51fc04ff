"""The buffer sets of ``pinned_staging``: allocated per state structure, reused, never re-staged while read (private).

A :class:`BufferPool` holds at most ``buffers`` sets. :meth:`BufferPool.acquire` returns the
least recently used idle set with the same shapes and dtypes, allocates one while there is
room, or replaces the least recently used set once no pending write reads it (waiting for
that write, bounded by ``write_timeout_s + 60`` s). With ``max_host_bytes`` each set holds at
most ``max_host_bytes / buffers`` bytes per window (``windows``). Sets of a writer
generation that is gone are freed, since no writer reads them any more.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from .ipc import Alloc, Drained, Free
from .process import PinnedWriterError, WriterProcess
from .shm import HostSlab
from .windows import WindowPump, plan_windows

__all__ = ["BufferPool", "BufferSet", "BufferSetInfo", "Signature"]

logger = logging.getLogger("ckpt_engine.pinned_staging")

#: The shapes and dtypes of a state's tensors, in slot order.
Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


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


BufferSetInfo.__module__ = "ckpt_engine_plugins.pinned_staging"


@dataclass(eq=False)
class BufferSet:
    """One buffer set: its shared memory, the structure it holds and what still reads it."""

    slab: HostSlab
    signature: Signature
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

    def info(self) -> BufferSetInfo:
        return BufferSetInfo(
            set_id=self.slab.set_id,
            nbytes=self.slab.nbytes,
            tensors=len(self.slab.slots),
            data_ptr=self.slab.data_ptr,
            pinned=self.slab.pinned,
            busy=self.busy,
            windows=(max(self.windows) + 1) if self.windows else 1,
        )


class BufferPool:
    """At most ``buffers`` buffer sets of one plugin, shared with its writer process."""

    def __init__(
        self, *, shm_dir: str, pin: bool, buffers: int, max_host_bytes: int | None, write_timeout_s: float, rank: int
    ) -> None:
        self.shm_dir, self.pin, self.buffers = shm_dir, pin, buffers
        self.max_host_bytes, self.write_timeout_s, self.rank = max_host_bytes, write_timeout_s, rank
        self._lock = threading.RLock()
        self._set_ids = itertools.count()
        self._sets: list[BufferSet] = []

    def infos(self) -> tuple[BufferSetInfo, ...]:
        with self._lock:
            return tuple(s.info() for s in self._sets)

    def hold(self, buffers: BufferSet, future: Future[Any]) -> None:
        """``buffers`` is busy until ``future`` is done (a write reads it, or a copy fills it)."""
        with self._lock:
            buffers.futures.append(future)

    # -- acquire and release ---------------------------------------------------------------

    def acquire(self, signature: Signature, writer: WriterProcess) -> BufferSet:
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
                if len(self._sets) < self.buffers:
                    return self._allocate(signature, writer)
                victim = min(self._sets, key=lambda s: s.last_used)
                if not victim.busy:
                    self._release(victim, writer)
                    return self._allocate(signature, writer)
                waiting = list(victim.futures)
            # Never re-stage a set a pending write reads: wait for it (bounded: the watchdog kills
            # a write older than write_timeout_s, which fails its future).
            _, not_done = concurrent.futures.wait(waiting, timeout=self.write_timeout_s + 60.0)
            if not_done:
                raise PinnedWriterError(
                    f"pinned_staging: the previous save still holds the staging buffers after "
                    f"{self.write_timeout_s + 60.0:g}s; cannot stage without overwriting it"
                )

    def window_capacity(self, signature: Signature) -> int | None:
        """Bytes one buffer set may hold (``max_host_bytes / buffers``); ``None``: no limit."""
        budget = self.max_host_bytes
        if budget is None:
            return None
        capacity = budget // self.buffers
        largest = max((math.prod(shape) * dtype.itemsize for shape, dtype in signature), default=0)
        if largest > capacity:
            logger.warning(
                "rank %d: a tensor of %.1f MiB is larger than the staging budget of %.1f MiB per buffer set "
                "(max_host_bytes=%d, buffers=%d); it is staged in a window of its own and the buffer set grows "
                "to hold it",
                self.rank,
                largest / 2**20,
                capacity / 2**20,
                budget,
                self.buffers,
            )
        return capacity

    def _allocate(self, signature: Signature, writer: WriterProcess) -> BufferSet:
        slots, nbytes, windows = plan_windows(signature, self.window_capacity(signature))
        set_id = next(self._set_ids)
        slab = HostSlab(set_id, self.shm_dir, slots, nbytes, self.pin)
        buffers = BufferSet(slab, signature, writer.generation, windows=windows, last_used=time.monotonic())
        self._sets.append(buffers)
        try:
            writer.send(Alloc(set_id=set_id, path=slab.path or "", nbytes=nbytes, slots=slots, windows=windows))
        except PinnedWriterError:
            self._sets.remove(buffers)
            slab.release()
            raise
        logger.info(
            "rank %d: allocated staging buffer set %d: %d tensors, %.1f MiB%s",
            self.rank,
            set_id,
            len(slots),
            nbytes / 2**20,
            " (pinned)" if slab.pinned else "",
        )
        return buffers

    def _release(self, buffers: BufferSet, writer: WriterProcess | None) -> None:
        self._sets.remove(buffers)
        buffers.slab.release()
        if writer is not None and writer.alive and writer.generation == buffers.generation:
            with contextlib.suppress(PinnedWriterError):
                writer.send(Free(buffers.slab.set_id))

    def release_all(self) -> None:
        """Free every set (at close: the writer has stopped)."""
        with self._lock:
            sets, self._sets = self._sets, []
        for s in sets:
            s.slab.release()

    # -- windowed saves (``max_host_bytes``) ------------------------------------------------

    def set_pump(self, buffers: BufferSet, pump: WindowPump | None, *, if_current: WindowPump | None = None) -> None:
        """Record the windowed save being handed over (``None``: done; with ``if_current``: only
        if that one is still recorded)."""
        with self._lock:
            if if_current is None or buffers.pump is if_current:
                buffers.pump = pump

    def abandon_pumps(self) -> None:
        """Fail the windowed saves whose writes were never all requested."""
        with self._lock:
            pumps = [s.pump for s in self._sets if s.pump is not None and not s.pump.ran]
        for pump in pumps:
            pump.fail("the save was abandoned before all of its components were written")

    # -- the writer's reports (from its reader thread) ---------------------------------------

    def on_mapped(self, set_id: int, error: str | None) -> None:
        with self._lock:
            for s in self._sets:
                if s.slab.set_id == set_id:
                    s.slab.unlink()  # both processes have it mapped: /dev/shm holds no name for it
        if error is not None:
            logger.error("rank %d: %s", self.rank, error)

    def on_drained(self, msg: Drained) -> None:
        with self._lock:
            pumps = [s.pump for s in self._sets if s.slab.set_id == msg.set_id and s.pump is not None]
        for pump in pumps:
            if pump.epoch == msg.epoch:
                pump.drained(msg.index)
