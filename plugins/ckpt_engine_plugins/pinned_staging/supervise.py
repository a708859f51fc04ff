"""Supervision of ``pinned_staging``'s writer process: start, replace, kill when hung, close at exit (private).

A :class:`WriterSupervisor` owns the current :class:`~.process.WriterProcess` of one
plugin and whether the plugin is closed. A writer that is lost after it became ready is
replaced at once; one that never became ready is retried by the next save
(:meth:`WriterSupervisor.live`). With several ranks a failed write replaces the writer on
every rank, since its process group may be broken. A watchdog thread kills a writer not ready
after ``writer_start_timeout_s``, a write pending longer than ``write_timeout_s``, a write still
pending after ``close()``'s deadline, and, once the main thread has ended, a write still
pending ``close_timeout_s`` later. An ``atexit`` hook closes the plugins never closed; in a
forked child (a DataLoader worker) they are closed without touching the parent's writer.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import itertools
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ckpt_engine import CkptEngineError

from .ipc import Drained, Init
from .process import PinnedWriterError, WriterProcess

__all__ = ["WriterSettings", "WriterSupervisor", "register", "unregister"]

logger = logging.getLogger("ckpt_engine.pinned_staging")


@dataclass(frozen=True)
class WriterSettings:
    """Where the writers of one plugin meet, and the timeouts they are held to."""

    rank: int
    world: int
    store_host: str | None
    store_port: int | None
    instance: int
    start_timeout_s: float
    write_timeout_s: float
    close_timeout_s: float
    #: A writer silent this long while a write is pending is stopped or frozen (see ``watch``).
    heartbeat_timeout_s: float = 30.0
    #: The clock a writer's liveness is judged by (its start, its heartbeats, its pending writes):
    #: ``time.monotonic``, or a clock a test advances itself so no verdict depends on how fast a
    #: loaded machine schedules the writer. Close and exit deadlines are real waits on ``time.monotonic``.
    clock: Callable[[], float] = time.monotonic

    @property
    def heartbeat_s(self) -> float:
        """How often the writer beats: ten beats per timeout, at most one a second."""
        return min(1.0, self.heartbeat_timeout_s / 10)

    @classmethod
    def for_job(
        cls,
        instance: int,
        *,
        start_timeout_s: float,
        write_timeout_s: float,
        close_timeout_s: float,
        heartbeat_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> WriterSettings:
        """This process's rank in the job, and the job's rendezvous store (torchrun's) with several ranks."""
        rank, world = _job_rank_world()
        host: str | None = None
        port: str | None = None
        if world > 1:
            host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
            if not host or not port or not port.isdigit():
                raise CkptEngineError(
                    f"pinned_staging with {world} ranks needs the job's rendezvous store in MASTER_ADDR and "
                    "MASTER_PORT (torchrun sets both); launch with torchrun or set them as for init_method='env://'"
                )
        return cls(
            rank=rank,
            world=world,
            store_host=host,
            store_port=int(port) if port is not None else None,
            instance=instance,
            start_timeout_s=start_timeout_s,
            write_timeout_s=write_timeout_s,
            close_timeout_s=close_timeout_s,
            heartbeat_timeout_s=heartbeat_timeout_s,
            clock=clock,
        )


def _job_rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    try:
        return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 0, 1


class WriterSupervisor:
    """The writer process of one plugin: started, replaced when lost, killed when hung."""

    def __init__(
        self,
        settings: WriterSettings,
        *,
        on_mapped: Callable[[int, str | None], None],
        on_drained: Callable[[Drained], None],
        at_exit_round: Callable[[], None],
    ) -> None:
        self.settings = settings
        self._on_mapped, self._on_drained, self._at_exit_round = on_mapped, on_drained, at_exit_round
        self._lock = threading.RLock()
        self.closed = False
        self.owner_pid = os.getpid()
        self.close_deadline: float | None = None
        self._generation = itertools.count()
        self.writer: WriterProcess | None = None
        self.writer = self._spawn()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_supervise, args=(weakref.ref(self), self._stop), name="pinned-staging-watchdog", daemon=True
        )
        self._thread.start()

    # -- open and closed --------------------------------------------------------------------

    def check_open(self) -> None:
        if self.closed:
            raise CkptEngineError("pinned_staging is closed (its engine was closed); create a new engine")

    def begin_close(self) -> None:
        """Start the ``close_timeout_s`` clock."""
        with self._lock:
            if self.close_deadline is None:
                self.close_deadline = time.monotonic() + self.settings.close_timeout_s

    def mark_closed(self) -> bool:
        """Close for good; ``False`` if it already was."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
            return True

    def remaining(self) -> float:
        """Seconds left until the close deadline (0 without one)."""
        return max(0.0, (self.close_deadline or time.monotonic()) - time.monotonic())

    def close_reason(self) -> str:
        return (
            "the engine was closed and the in-flight save did not finish within "
            f"close_timeout_s={self.settings.close_timeout_s:g}s"
        )

    def stop(self) -> PinnedWriterError | None:
        """Wait until the close deadline for pending writes, then stop the writer and the watchdog;
        returns the error of a write that had to be abandoned."""
        writer = self.writer
        error: PinnedWriterError | None = None
        if writer is not None and writer.alive:
            _, not_done = concurrent.futures.wait(writer.pending_futures(), timeout=self.remaining())
            if not_done:
                writer.kill(self.close_reason())
                error = writer.error
            else:
                writer.shutdown(timeout=min(30.0, self.settings.close_timeout_s))
        self._stop.set()
        return error

    def stop_watchdog(self) -> None:
        self._stop.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def after_fork_in_child(self) -> None:
        """A forked child (e.g. a DataLoader worker) must never drive the parent's writer."""
        self.closed = True
        writer = self.writer
        if writer is not None:
            writer.close_fds_after_fork()

    # -- the writer ---------------------------------------------------------------------------

    def _spawn(self) -> WriterProcess:
        s = self.settings
        generation = next(self._generation)
        run = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        init = Init(
            rank=s.rank,
            world_size=s.world,
            store_host=s.store_host,
            store_port=s.store_port,
            store_prefix=f"ckpt_engine/pinned_staging/{run}/{restart}/{s.instance}/{generation}/",
            start_timeout_s=s.start_timeout_s,
            write_timeout_s=s.write_timeout_s,
            heartbeat_s=s.heartbeat_s,
        )
        writer = WriterProcess(
            init,
            generation,
            on_lost=self._on_writer_lost,
            on_mapped=self._on_mapped,
            on_failed_write=self._on_failed_write,
            on_drained=self._on_drained,
            clock=s.clock,
        )
        logger.debug("rank %d: started pinned_staging writer pid %d (generation %d)", s.rank, writer.pid, generation)
        return writer

    def live(self) -> WriterProcess:
        """The current writer; a new one if the last one is gone."""
        with self._lock:
            self.check_open()
            writer = self.writer
            if writer is None or not writer.alive:
                previous = writer.error if writer is not None else None
                writer = self.writer = self._spawn()
                if previous is not None:
                    logger.warning("rank %d: started writer pid %d after: %s", self.settings.rank, writer.pid, previous)
            return writer

    def _on_writer_lost(self, writer: WriterProcess, error: PinnedWriterError) -> None:
        logger.error("rank %d: %s", self.settings.rank, error)
        with self._lock:
            if writer is not self.writer or self.closed or os.getpid() != self.owner_pid:
                return
            if writer.ready:  # a writer that never started is retried by the next save, not in a loop
                try:
                    self.writer = self._spawn()
                except Exception:
                    logger.exception("rank %d: could not start a replacement writer process", self.settings.rank)

    def _on_failed_write(self, writer: WriterProcess) -> None:
        if self.settings.world > 1:
            # The writers' process group may be left mid-collective: replace the writer on every
            # rank (every rank sees the failure: DCP and the pre-save agreement fail all ranks).
            writer.kill("a write failed and the writer group may be inconsistent; it is replaced")

    # -- the watchdog ---------------------------------------------------------------------------

    def watch(self, exit_deadline: float | None) -> float | None:
        """One watchdog round; returns the interpreter-exit deadline (see the module docstring)."""
        s = self.settings
        if not threading.main_thread().is_alive():  # nobody steps an optimizer any more
            self._at_exit_round()
        writer = self.writer
        if writer is None or not writer.alive:
            return exit_deadline
        now = s.clock()
        if not writer.ready and now - writer.started > s.start_timeout_s:
            writer.kill(f"it did not become ready within writer_start_timeout_s={s.start_timeout_s:g}s")
            return exit_deadline
        age = writer.oldest_pending_age()
        silent = now - writer.last_heard
        if age is not None and age > s.write_timeout_s:
            writer.kill(f"a write was still pending after write_timeout_s={s.write_timeout_s:g}s")
        elif age is not None and writer.ready and min(age, silent) > s.heartbeat_timeout_s:
            written = f" (it had written {writer.bytes_written} bytes)" if writer.bytes_written >= 0 else ""
            writer.kill(
                f"it sent no heartbeat for {silent:.0f}s while a write was pending, more than "
                f"heartbeat_timeout_s={s.heartbeat_timeout_s:g}s: the process is stopped (SIGSTOP, a debugger) "
                f"or frozen{written}"
            )
        elif age is not None and self.close_deadline is not None and time.monotonic() > self.close_deadline:
            writer.kill(self.close_reason())
        elif age is not None and not threading.main_thread().is_alive():
            # Interpreter exit: the engine's commit thread is being joined and waits on the writer.
            if exit_deadline is None:
                return time.monotonic() + s.close_timeout_s
            if time.monotonic() > exit_deadline:
                writer.kill(
                    f"the interpreter is exiting and the in-flight save did not finish within "
                    f"close_timeout_s={s.close_timeout_s:g}s"
                )
        return exit_deadline


def _supervise(ref: weakref.ref[WriterSupervisor], stop: threading.Event) -> None:
    exit_deadline: float | None = None
    while not stop.wait(0.2):
        supervisor = ref()
        if supervisor is None:
            return
        try:
            exit_deadline = supervisor.watch(exit_deadline)
        except Exception:  # the watchdog must keep watching; log and carry on
            logger.exception("pinned_staging watchdog error")
        del supervisor


# -- every open plugin of this process: closed at exit, disowned after fork ------------------------


class Closable(Protocol):
    def close(self) -> None: ...


_LIVE: dict[Closable, WriterSupervisor] = {}
_LIVE_LOCK = threading.Lock()


def register(plugin: Closable, supervisor: WriterSupervisor) -> None:
    """Close ``plugin`` at interpreter exit unless it was closed before."""
    with _LIVE_LOCK:
        _LIVE[plugin] = supervisor


def unregister(plugin: Closable) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(plugin, None)


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
        supervisors = list(_LIVE.values())
        _LIVE.clear()
    for supervisor in supervisors:
        supervisor.after_fork_in_child()


atexit.register(_close_all_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
