"""``pinned_staging``'s host-memory budget (``max_host_bytes``): staging in windows (private).

A state larger than one buffer set's share of the budget is split, in slot order, into
*windows* that each fit it; every window starts at offset 0 of the same buffer set, so the set
is only as large as its largest window. A tensor larger than the budget is never split: it
gets a window of its own and the set grows to hold it (a warning says so).

The hand-over, per save (an *epoch* of the buffer set):

* **trainer** (:class:`WindowPump`, on the training thread inside ``save()``): copies window 0
  in ``stage``, announces it (``Window``), sends the components' ``Save`` requests, then for
  each further window waits until the writer reports the previous one *drained* (``Drained``)
  and refills the same bytes with the next one. ``save()`` returns once the last window is
  staged; the writer writes that one in the background.
* **writer** (:class:`WindowedStorageWriter`): writes the component's tensor items in window
  order with one thread, through a planner whose ``resolve_data`` waits until the item's window
  is staged (:class:`WindowBoard`). The first item of a later window means every item of the
  earlier windows has been written (one thread, in order): the writer reports those drained
  before it waits. An item asked for out of window order is an error, never stale bytes.
* Failures never hang: a trainer-side failure is announced (``Window`` with ``error``) and
  fails the writer's save; a writer failure fails the write futures the pump also waits on;
  both sides wait at most ``write_timeout_s``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, cast

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType

from ckpt_engine import CkptEngineError
from ckpt_engine.storage import EngineFileSystemWriter

from .copies import StreamPool, copy_now
from .ipc import SlotSpec, Window

__all__ = ["WindowBoard", "WindowPump", "WindowedStorageWriter", "plan_windows"]

_ALIGN = 64


def plan_windows(
    signature: Sequence[tuple[tuple[int, ...], torch.dtype]], capacity: int | None
) -> tuple[tuple[SlotSpec, ...], int, tuple[int, ...]]:
    """Slots for ``(shape, dtype)`` pairs packed in order into windows of at most ``capacity``
    bytes (a larger tensor: a window of its own); returns the slots (offsets within their
    window), the set size (the largest window) and each slot's window."""
    slots: list[SlotSpec] = []
    windows: list[int] = []
    window, offset, size = 0, 0, 0
    for shape, dtype in signature:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        aligned = -(-nbytes // _ALIGN) * _ALIGN
        if capacity is not None and offset and offset + aligned > capacity:
            window, offset = window + 1, 0
        slots.append(SlotSpec(offset=offset, shape=shape, dtype=dtype, nbytes=nbytes))
        windows.append(window)
        offset += aligned
        size = max(size, offset)
    return tuple(slots), size, tuple(windows)


class WindowError(RuntimeError):
    """A windowed hand-over failed (the other side's error, a timeout or an order violation)."""


# -- writer side ---------------------------------------------------------------------------------


class WindowBoard:
    """Which window of each windowed buffer set is staged (the writer process's view).

    Fed by the writer's pipe thread, so a save blocked in ``resolve_data`` still hears of it.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._staged: dict[int, tuple[int, int]] = {}  # set_id -> (epoch, window)
        self._errors: dict[tuple[int, int], str] = {}

    def staged(self, set_id: int, epoch: int, index: int, error: str | None) -> None:
        with self._cond:
            if error is not None:
                self._errors[(set_id, epoch)] = error
            else:
                self._staged[set_id] = max(self._staged.get(set_id, (-1, -1)), (epoch, index))
            self._cond.notify_all()

    def wait(self, set_id: int, epoch: int, index: int, timeout: float) -> None:
        with self._cond:
            ok = self._cond.wait_for(
                lambda: (set_id, epoch) in self._errors or self._staged.get(set_id, (-1, -1)) >= (epoch, index),
                timeout,
            )
            error = self._errors.get((set_id, epoch))
            if error is not None:
                raise WindowError(f"staging window {index} of buffer set {set_id} failed: {error}")
            if not ok:
                raise WindowError(f"window {index} of buffer set {set_id} was not staged within {timeout:g}s")
            if self._staged[set_id][0] != epoch:
                raise WindowError(f"buffer set {set_id} was re-staged while save epoch {epoch} still read it")

    def forget(self, set_id: int) -> None:
        with self._cond:
            self._staged.pop(set_id, None)
            self._errors = {k: v for k, v in self._errors.items() if k[0] != set_id}


@dataclasses.dataclass
class WindowCursor:
    """How far the writer has read one epoch of a windowed set (shared by its components' saves)."""

    set_id: int
    epoch: int
    board: WindowBoard
    report_drained: Callable[[int], None]
    timeout: float
    current: int = -1

    def reach(self, window: int) -> None:
        """Make ``window`` readable: report the earlier ones drained, wait until it is staged."""
        if window < self.current:
            raise WindowError(
                f"the writer asked for window {window} of buffer set {self.set_id} after window {self.current}: "
                "its bytes were already replaced (items not written in window order)"
            )
        if window == self.current:
            return
        for done in range(max(self.current, 0), window):
            self.report_drained(done)
        self.board.wait(self.set_id, self.epoch, window, self.timeout)
        self.current = window


class _WaitingPlanner:
    """The save planner, with ``resolve_data`` waiting for the item's window."""

    def __init__(self, inner: SavePlanner, windows: dict[str, int], cursor: WindowCursor) -> None:
        self._inner = inner
        self._windows = windows
        self._cursor = cursor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def resolve_data(self, write_item: WriteItem) -> Any:
        if write_item.type != WriteItemType.BYTE_IO:
            window = self._windows.get(write_item.index.fqn)
            if window is None:
                raise WindowError(f"no staging window is known for tensor {write_item.index.fqn!r}")
            self._cursor.reach(window)
        return self._inner.resolve_data(write_item)


class WindowedStorageWriter(EngineFileSystemWriter):
    """The engine's storage writer, writing tensor items in window order with one thread.

    ``window_of`` maps a value of the state dict (by ``id``) to its window.
    """

    keep_item_order = True  # windows are read in order, each drained before the next
    reuses_item_memory = True  # a drained window is refilled: its bytes are hashed before that

    def __init__(self, path: str, *, window_of: dict[int, int], cursor: WindowCursor, **kwargs: Any) -> None:
        super().__init__(path, thread_count=1, **kwargs)
        self._window_of = window_of
        self._cursor = cursor

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        flat: dict[str, Any] = getattr(planner, "state_dict", {})
        windows: dict[str, int] = {}
        for fqn, value in flat.items():
            if isinstance(value, torch.Tensor):
                window = self._window_of.get(id(value))
                if window is None:
                    raise WindowError(f"tensor {fqn!r} is not in a staging window")
                windows[fqn] = window
        items = sorted(
            plan.items,
            key=lambda i: -1 if i.type == WriteItemType.BYTE_IO else windows.get(i.index.fqn, -1),
        )
        waiting = cast(SavePlanner, _WaitingPlanner(planner, windows, self._cursor))
        return super().write_data(dataclasses.replace(plan, items=items), waiting)


# -- trainer side --------------------------------------------------------------------------------


class WindowPump:
    """Refills one buffer set window by window as the writer drains it (the training process)."""

    def __init__(
        self,
        set_id: int,
        epoch: int,
        windows: Sequence[int],
        copy_window: Callable[[int], None],
        announce: Callable[[int, str | None], None],
        timeout: float,
    ) -> None:
        self.set_id, self.epoch, self.timeout = set_id, epoch, timeout
        self.count = (max(windows) + 1) if windows else 1
        self._copy_window = copy_window
        self._announce = announce
        self._cond = threading.Condition()
        self._drained = -1
        self._futures: list[Future[Any]] = []
        #: The components whose saves were sent, in order.
        self.components: list[str] = []
        self.staged = -1
        self.ran = False

    @classmethod
    def over(
        cls,
        views: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        windows: Sequence[int],
        *,
        set_id: int,
        epoch: int,
        streams: StreamPool,
        send: Callable[[object], None],
        timeout: float,
    ) -> WindowPump:
        """The pump that copies ``sources`` into ``views`` window by window (``windows``: each
        slot's window) and announces each window to the writer with ``send``."""
        by_window: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            by_window.setdefault(w, []).append(i)

        def copy_window(index: int) -> None:
            slots = by_window.get(index, [])
            copy_now([views[i] for i in slots], [sources[i] for i in slots], streams)

        def announce(index: int, error: str | None) -> None:
            send(Window(set_id, epoch, index, error))

        return cls(set_id, epoch, windows, copy_window, announce, timeout)

    @property
    def futures(self) -> list[Future[Any]]:
        return list(self._futures)

    def send_component(
        self, component: str, order: Sequence[str], future: Future[Any], send: Callable[[], None]
    ) -> bool:
        """Send the save request of ``component`` (with ``send``), which must come next in the
        staged ``order``; ``True`` once it was the last one (then :meth:`finish` stages the rest)."""
        done = len(self.components)
        expected = order[done] if done < len(order) else None
        if component != expected:
            self.fail(f"component {component!r} written out of order")
            future.set_exception(CkptEngineError("pinned_staging: windowed save written out of order"))
            raise CkptEngineError(
                f"pinned_staging (max_host_bytes): component {component!r} was written out of the order it was "
                f"staged in ({', '.join(order)}); a save staged in windows must be written in that order"
            )
        self.components.append(component)
        self.watch(future)
        try:
            send()
        except BaseException:
            self.fail("the save request could not be sent")
            raise
        return component == order[-1]

    def finish(self, wait_s: float) -> None:
        """:meth:`run`; on a failure, wait (at most ``wait_s``) until nothing still writes the
        folder, then raise it as a :class:`CkptEngineError`."""
        try:
            self.run()
        except BaseException as err:
            # The writer stops reading at once; wait (bounded) so nothing still writes the folder.
            concurrent.futures.wait(self.futures, timeout=wait_s)
            if isinstance(err, CkptEngineError):
                raise
            raise CkptEngineError(
                f"pinned_staging (max_host_bytes): staging window {self.staged + 1} of {self.count} failed: "
                f"{type(err).__name__}: {err}"
            ) from err

    def fail(self, reason: str) -> None:
        """Tell the writer this save's windows will never all be staged (its save fails)."""
        try:
            self._announce(self.staged + 1, reason)
        except Exception:  # the writer is gone: its saves fail anyway
            return

    def stage_first(self) -> None:
        self._stage(0)

    def _stage(self, index: int) -> None:
        try:
            self._copy_window(index)
        except BaseException as err:
            self._announce(index, f"{type(err).__name__}: {err}")
            raise
        self.staged = index
        self._announce(index, None)

    def drained(self, index: int) -> None:
        """The writer will not read windows up to ``index`` again (from its pipe thread)."""
        with self._cond:
            self._drained = max(self._drained, index)
            self._cond.notify_all()

    def watch(self, future: Future[Any]) -> None:
        self._futures.append(future)
        future.add_done_callback(self._wake)

    def _wake(self, _: Future[Any]) -> None:
        with self._cond:
            self._cond.notify_all()

    def _ready(self, previous: int) -> bool:
        return self._drained >= previous or all(f.done() for f in self._futures)

    def run(self) -> None:
        """Stage windows 1.. as the writer drains their predecessors; returns after the last
        one is staged, or early once every write is done (no later window was needed)."""
        self.ran = True
        for index in range(1, self.count):
            previous = index - 1
            with self._cond:
                ok = self._cond.wait_for(functools.partial(self._ready, previous), self.timeout)
                drained = self._drained >= previous
            if not drained:
                failed = [f.exception() for f in self._futures if f.done() and f.exception() is not None]
                if failed:
                    raise failed[0]  # type: ignore[misc]
                if ok:
                    return  # every write is done without this window: none of its items is written
                self._announce(index, f"window {index - 1} was not drained within {self.timeout:g}s")
                raise WindowError(
                    f"pinned_staging: the writer did not finish window {index - 1} of {self.count} within "
                    f"{self.timeout:g}s"
                )
            self._stage(index)
