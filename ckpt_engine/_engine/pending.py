"""The saves in flight: each one's :class:`SaveHandle`, the commit thread, and back-pressure.

A save whose writes continue in the background (``pinned_staging``) is committed from one
commit thread; the engine keeps its handle here until someone waits for it. How many may be in
flight is the stage provider's ``max_saves_in_flight``: before a new save stages, the queue
waits for the older ones beyond that. A failure nobody asked about through its handle is logged
when a new save notices it, and raised by the next :meth:`SaveQueue.wait` without ``keep``
(``wait()`` / ``close()``), so it is never lost.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ..errors import CheckpointSaveError, CkptEngineError, ObserverError
from ..types import PendingSnapshot, SaveResult

__all__ = ["SaveHandle", "SaveQueue"]

logger = logging.getLogger("ckpt_engine")


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
            try:
                self._snapshot.wait(timeout)
            except TimeoutError:
                raise
            except Exception:
                self.reported = True  # the caller saw the failure: a later close() need not raise it again
                raise

    def result(self, timeout: float | None = None) -> SaveResult:
        """The save's :class:`SaveResult`; raises :class:`CheckpointSaveError` if it failed."""
        if self._snapshot is not None:
            try:
                self._snapshot.wait(timeout)  # a background copy hands over only once confirmed
            except TimeoutError:
                raise
            except Exception:
                pass  # a failed copy fails the save: the result below carries its error
        try:
            result = self._future.result(timeout)
        except ObserverError:
            self.reported = True  # raised once, here: a later save() need not raise it again
            raise
        if not result.succeeded:
            self.reported = True
            raise CheckpointSaveError(
                f"saving iteration {self.iteration} to {self.path} failed: {result.error}"
            ) from result.error
        return result

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"SaveHandle(iteration={self.iteration}, path={self.path!r}, {state})"


class SaveQueue:
    """The engine's pending saves, oldest first, and the thread that commits background writes."""

    def __init__(self) -> None:
        self._pending: list[SaveHandle] = []
        #: Failures of saves whose handle nobody asked, noticed by a later save() (which
        #: proceeds): raised by the next wait() / close().
        self._failed: list[CkptEngineError] = []
        self._lock = threading.Lock()
        self._committer: ThreadPoolExecutor | None = None

    def submit(self, handle: SaveHandle, fn: Callable[..., None], *args: Any) -> None:
        """Keep ``handle`` pending and run ``fn(*args)`` (which completes it) on the commit thread."""
        with self._lock:
            if self._committer is None:
                self._committer = ThreadPoolExecutor(1, thread_name_prefix="ckpt-engine-commit")
            self._pending.append(handle)
        self._committer.submit(fn, *args)

    def may_keep(self, iteration: int, limit: int) -> int:
        """How many earlier saves may stay pending while a new one stages: ``limit`` (the stage
        provider's ``max_saves_in_flight``) minus one; none when one of them is this iteration."""
        with self._lock:
            if any(h.iteration == iteration for h in self._pending):
                return 0
        return limit - 1

    def wait(self, keep: int = 0, *, raise_errors: bool = True) -> list[SaveResult]:
        """Wait for pending saves, oldest first, until at most ``keep`` remain. A failure is
        raised, or with ``raise_errors`` false (a new save: it proceeds) logged and kept for the
        next wait, unless the caller already saw it through its handle."""
        with self._lock:
            cut = max(0, len(self._pending) - keep)
            pending, self._pending = self._pending[:cut], self._pending[cut:]
        results = []
        first_error: CkptEngineError | None = None
        for handle in pending:
            seen = handle.reported
            try:
                results.append(handle.result())
            except (CheckpointSaveError, ObserverError) as err:
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

    def shutdown(self) -> None:
        """Stop the commit thread (after :meth:`wait`: nothing is pending)."""
        if self._committer is not None:
            self._committer.shutdown(wait=True)
            self._committer = None
