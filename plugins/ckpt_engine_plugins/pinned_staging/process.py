"""The training process's handle on one ``pinned_staging`` writer process (private).

The writer is a plain subprocess (``python -m ckpt_engine_plugins.pinned_staging.writer``,
started by :data:`start_writer`) with two pipes. A sender thread writes requests, so a busy or
stopped writer never blocks the training loop on a full pipe; a reader thread resolves the
futures the ``write`` hook returned. The end of the pipe is the death signal: when the writer
exits or is killed, every pending future fails with a :class:`PinnedWriterError` that names the
pid, the exit status and the writes that were in flight. Nothing here waits on the child
without a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, Protocol

from ckpt_engine import CheckpointSaveError, CkptEngineError, WriteResult

from .ipc import (
    Beat,
    Done,
    Drained,
    Init,
    Mapped,
    PipeClosed,
    Ready,
    Save,
    Shutdown,
    StartFailed,
    encode,
    read_message,
)

WRITER_MODULE = "ckpt_engine_plugins.pinned_staging.writer"

logger = logging.getLogger("ckpt_engine.pinned_staging")


class PinnedWriterError(CheckpointSaveError):
    """The ``pinned_staging`` writer process failed, died, or could not be started."""


PinnedWriterError.__module__ = "ckpt_engine_plugins.pinned_staging"


@dataclass
class Pending:
    """One ``write`` request the writer has not answered yet."""

    future: Future[WriteResult]
    iteration: int
    component: str
    #: When it was sent, on the writer's clock (:attr:`WriterProcess.clock`).
    submitted: float

    def describe(self) -> str:
        return f"iteration {self.iteration} component {self.component!r}"


def _status(returncode: int | None, killed_by_us: bool) -> str:
    if returncode is None:
        return "did not exit after SIGKILL"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        why = ""
        if name == "SIGKILL" and not killed_by_us:
            why = " (by another process, or by the kernel's out-of-memory killer)"
        return f"was killed by {name}{why}, exit code {returncode}"
    return f"exited with code {returncode}"


class WriterHandle(Protocol):
    """A started writer process, as :class:`subprocess.Popen` gives one (``returncode`` is ``-N``
    after signal N)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int:
        """The exit status; :class:`subprocess.TimeoutExpired` past ``timeout``."""
        ...

    def kill(self) -> None: ...


class StartWriter(Protocol):
    """Starts ``python -m`` :data:`WRITER_MODULE` ``*args`` with ``pass_fds`` (its two pipe ends) at
    their numbers, ``env`` as its whole environment, stdin on ``/dev/null`` and this process's
    stdout and stderr. Called once per writer (a lost writer's replacement is a new call), under
    the supervisor's lock; it returns once the process exists, never waiting for it to start."""

    def __call__(self, args: list[str], pass_fds: tuple[int, int], env: dict[str, str]) -> WriterHandle: ...


def popen_writer(args: list[str], pass_fds: tuple[int, int], env: dict[str, str]) -> WriterHandle:
    """The writer in a new interpreter (what :data:`start_writer` is unless replaced)."""
    return subprocess.Popen(
        [sys.executable, "-m", WRITER_MODULE, *args], pass_fds=pass_fds, stdin=subprocess.DEVNULL, env=env
    )


#: How every writer process is started: a new interpreter. The project's tests, which start
#: writers by the hundred, fork them from a process that has already imported torch instead.
start_writer: StartWriter = popen_writer


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # The writer reads host memory only: hiding GPUs keeps DCP from creating a CUDA context
    # (hundreds of MB of device memory per rank) in a process that never uses it.
    env["CUDA_VISIBLE_DEVICES"] = ""
    env["OMP_NUM_THREADS"] = "1"
    env.pop("TORCHELASTIC_ERROR_FILE", None)  # the training process's error file is not ours
    # Whatever the training process can import (the engine, planners, classes of saved
    # values), the writer can import too; the training script itself is never run.
    paths = [p for p in sys.path if p and os.path.isdir(p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


class WriterProcess:
    """Spawn, feed and watch one writer process."""

    def __init__(
        self,
        init: Init,
        generation: int,
        *,
        on_lost: Callable[[WriterProcess, PinnedWriterError], None],
        on_mapped: Callable[[int, str | None], None],
        on_failed_write: Callable[[WriterProcess], None],
        on_drained: Callable[[Drained], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.rank = init.rank
        #: What ``started``, ``last_heard`` and the pending writes' ages are measured on.
        self.clock = clock
        self.generation = generation
        self.start_timeout_s = init.start_timeout_s
        self._on_lost = on_lost
        self._on_mapped = on_mapped
        self._on_failed_write = on_failed_write
        self._on_drained = on_drained
        self._lock = threading.Lock()
        self._pending: dict[int, Pending] = {}
        self._outbox: queue.Queue[bytes | None] = queue.Queue()
        self._ready_or_lost = threading.Event()
        self._lost = threading.Event()
        self.ready = False
        self.ready_seconds: float | None = None
        self.started = clock()
        #: When the writer was last heard from (any message; it beats every ``Init.heartbeat_s``).
        self.last_heard = self.started
        #: Its last reported bytes written (``Beat``), for the stall message.
        self.bytes_written = -1
        self.error: PinnedWriterError | None = None
        self._start_error: str | None = None
        self._kill_reason: str | None = None
        self._expected_exit = self._stopped_unready = False  # the latter: see shutdown()
        self._start(init)

    def _start(self, init: Init) -> None:
        """Spawn the writer process on two pipes, hand it ``init`` and start the two I/O threads."""
        child_in, parent_out = os.pipe()
        parent_in, child_out = os.pipe()
        try:
            self.proc = start_writer([str(child_in), str(child_out)], (child_in, child_out), _child_env())
        except BaseException:
            for fd in (parent_out, parent_in):
                os.close(fd)
            raise
        finally:
            os.close(child_in)
            os.close(child_out)
        self.pid = self.proc.pid
        self._fd_out, self._fd_in = parent_out, parent_in
        os.set_blocking(parent_out, False)  # send() must never wait for the writer
        self._backlog = 1  # frames queued for the sender thread and not yet fully written
        self._outbox.put(encode(init))
        self._sender = threading.Thread(target=self._send_loop, name=f"pinned-writer-send-{self.pid}", daemon=True)
        self._reader = threading.Thread(target=self._read_loop, name=f"pinned-writer-recv-{self.pid}", daemon=True)
        self._sender.start()
        self._reader.start()

    def __repr__(self) -> str:
        state = "lost" if self._lost.is_set() else "ready" if self.ready else "starting"
        return f"WriterProcess(pid={self.pid}, generation={self.generation}, {state})"

    # -- state ------------------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return not self._lost.is_set()

    def pending_futures(self) -> list[Future[WriteResult]]:
        with self._lock:
            return [p.future for p in self._pending.values()]

    def oldest_pending_age(self) -> float | None:
        with self._lock:
            if not self._pending:
                return None
            return self.clock() - min(p.submitted for p in self._pending.values())

    def wait_ready(self, timeout: float) -> float:
        """Seconds the writer took to start; raises if it died or did not start in ``timeout``."""
        if not self._ready_or_lost.wait(timeout):
            self.kill(f"it did not become ready within writer_start_timeout_s={timeout:g}s")
        if self.error is not None:
            raise self.error
        assert self.ready_seconds is not None
        return self.ready_seconds

    # -- requests ---------------------------------------------------------------------------

    def send(self, message: object, pending: tuple[int, Pending] | None = None) -> None:
        """Send ``message``; raises the writer's error if it is gone. Never blocks on the pipe.

        The frame goes straight into the pipe when nothing is queued before it and the pipe has
        room (the common case: no thread hand-off in the training loop); otherwise, or for what
        did not fit, the sender thread finishes it, in order.
        """
        frame = encode(message)
        with self._lock:
            if self.error is not None:
                raise self.error
            if self._lost.is_set():
                raise PinnedWriterError(f"the pinned_staging writer process (pid {self.pid}) has stopped")
            if pending is not None:
                self._pending[pending[0]] = pending[1]
            if self._backlog == 0:
                try:
                    written = os.write(self._fd_out, frame)
                except (BlockingIOError, InterruptedError):
                    written = 0
                except OSError:
                    written = 0  # a broken pipe: the sender thread reports it
                if written == len(frame):
                    return
                frame = frame[written:]
            self._backlog += 1
            self._outbox.put(frame)

    def submit(self, message: Save, future: Future[WriteResult]) -> None:
        """Send a save request that ``future`` awaits; a request that cannot be sent fails it too
        (never leaving a buffer set marked busy)."""
        try:
            self.send(message, (message.req_id, Pending(future, message.iteration, message.component, self.clock())))
        except PinnedWriterError as err:
            future.set_exception(err)
            raise
        except Exception as err:
            future.set_exception(err)
            raise CkptEngineError(
                f"pinned_staging cannot send the save request of component {message.component!r} to the writer "
                f"process (the planner {type(message.planner).__qualname__} must be picklable): "
                f"{type(err).__name__}: {err}"
            ) from err

    def hand_over(
        self,
        message: Save,
        future: Future[WriteResult],
        error: BaseException | None,
        world_size: int,
        skeleton: Callable[[], bytes],
    ) -> None:
        """Submit a settled ``overlap`` save with its ``skeleton()``, or (``error``: its snapshot
        failed) fail ``future`` with it and tell this rank's writer to fail the save on every
        rank (no skeleton needed); never raises: a failure fails ``future``."""
        try:
            if error is None:
                self.submit(dataclasses.replace(message, skeleton=skeleton()), future)
                return
            if world_size > 1:  # the other ranks' writers must fail this save too, not wait for ours
                aborted: Future[WriteResult] = Future()
                abort = dataclasses.replace(message, abort=f"rank {self.rank}: {error}")
                with contextlib.suppress(Exception):
                    pending = Pending(aborted, message.iteration, message.component, self.clock())
                    self.send(abort, (message.req_id, pending))
            future.set_exception(error)
        except Exception as err:
            if not future.done():
                future.set_exception(err)

    def _send_loop(self) -> None:
        try:
            while True:
                frame = self._outbox.get()
                if frame is None:
                    return
                try:
                    _write_blocking(self._fd_out, frame)
                except OSError as err:
                    self._handle_loss(f"the pipe to it broke ({err})")
                    return
                with self._lock:
                    self._backlog -= 1
        finally:
            with contextlib.suppress(OSError):
                os.close(self._fd_out)

    def _read_loop(self) -> None:
        reason: str | None = None
        while True:
            try:
                msg = read_message(self._fd_in)
            except PipeClosed:
                break
            except (OSError, pickle.UnpicklingError, EOFError) as err:
                reason = f"its messages could not be read ({err})"
                break
            self.last_heard = self.clock()
            if isinstance(msg, Beat):
                self.bytes_written = msg.bytes_written
            elif isinstance(msg, Done):
                self._resolve(msg)
            elif isinstance(msg, Drained):
                if self._on_drained is not None:
                    self._on_drained(msg)
            elif isinstance(msg, Mapped):
                self._on_mapped(msg.set_id, msg.error)
            elif isinstance(msg, Ready):
                self.ready, self.ready_seconds = True, msg.seconds
                self._ready_or_lost.set()
            elif isinstance(msg, StartFailed):
                self._start_error = msg.error
        with contextlib.suppress(OSError):
            os.close(self._fd_in)
        self._handle_loss(reason)

    def _resolve(self, msg: Done) -> None:
        with self._lock:
            pending = self._pending.pop(msg.req_id, None)
        if pending is None:
            return
        logger.debug(
            "rank %d: writer pid %d %s %s in %.3fs (%d bytes; %.3fs after the request)",
            self.rank,
            self.pid,
            "wrote" if msg.ok else "failed to write",
            pending.describe(),
            msg.seconds,
            msg.bytes_written,
            self.clock() - pending.submitted,
        )
        if msg.ok:
            _settle(
                pending.future,
                WriteResult(
                    component=pending.component,
                    bytes_written=msg.bytes_written,
                    seconds=msg.seconds,
                    bytes_reused=msg.bytes_reused,
                    carried_by=msg.carried_by,
                ),
            )
            return
        _settle(
            pending.future,
            PinnedWriterError(
                f"the pinned_staging writer process (pid {self.pid}, rank {self.rank}) failed to write "
                f"{pending.describe()}: {msg.error}"
            ),
        )
        if not msg.group_intact:
            self._on_failed_write(self)

    # -- ending -----------------------------------------------------------------------------

    def kill(self, reason: str) -> None:
        """SIGKILL the writer and fail what it had pending with ``reason``; idempotent."""
        with self._lock:
            if self._kill_reason is None:
                self._kill_reason = reason
        with contextlib.suppress(OSError):
            self.proc.kill()
        self._handle_loss(reason)

    def shutdown(self, timeout: float) -> None:
        """Ask the writer to exit once its queue is empty; kill it after ``timeout``.

        A writer that is not ready and has nothing pending is killed at once: it holds no work,
        and waiting for it to finish starting (seconds; with several ranks, up to its rendezvous
        timeout) would hold up ``close()``, and a preempted job's exit, for nothing."""
        with self._lock:
            lost = self._lost.is_set()
            stop_now = not lost and not self.ready and not self._pending
            if not lost:
                self._expected_exit, self._stopped_unready = True, stop_now
                if not stop_now:
                    self._outbox.put(encode(Shutdown()))
        if stop_now:
            with contextlib.suppress(OSError):
                self.proc.kill()
        elif not lost:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill(f"it did not exit within {timeout:g}s of being asked to stop")
        self._handle_loss(None)
        self._reader.join(5.0)
        self._sender.join(5.0)

    def _handle_loss(self, reason: str | None) -> None:
        with self._lock:
            if self._lost.is_set():
                return
            self._lost.set()
            pending = list(self._pending.values())
            self._pending.clear()
            killed_by_us = self._kill_reason is not None
            reason = self._kill_reason or reason
            expected = self._expected_exit
        if self.proc.poll() is None:
            try:
                self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(OSError):
                    self.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10.0)
        self._outbox.put(None)  # stop the sender
        rc = self.proc.returncode
        error: PinnedWriterError | None = None
        if not (expected and not pending and (rc == 0 or self._stopped_unready)):
            parts = [
                f"the pinned_staging writer process (pid {self.pid}, rank {self.rank}) {_status(rc, killed_by_us)}"
            ]
            if reason:
                parts.append(f"because {reason}" if killed_by_us else reason)
            if self._start_error:
                parts.append(f"it failed to start: {self._start_error}")
            if pending:
                writes = ", ".join(p.describe() for p in pending)
                parts.append(
                    f"{len(pending)} write(s) were in flight ({writes}); that checkpoint was not committed and "
                    "latest_checkpoint.txt still names the previous one"
                )
            error = PinnedWriterError("; ".join(parts))
            self.error = error
            for p in pending:
                _settle(p.future, error)
        self._ready_or_lost.set()
        if error is not None and not expected:
            self._on_lost(self, error)

    def close_fds_after_fork(self) -> None:
        """In a forked child: drop this process's copies of the pipe ends (never write to them)."""
        for fd in (self._fd_out, self._fd_in):
            with contextlib.suppress(OSError):
                os.close(fd)


def _write_blocking(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the non-blocking ``fd``, waiting for room as needed."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except (BlockingIOError, InterruptedError):
            select.select([], [fd], [], 1.0)
            continue
        view = view[written:]


def _settle(future: Future[Any], outcome: Any) -> None:
    with contextlib.suppress(InvalidStateError):
        if isinstance(outcome, BaseException):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)
