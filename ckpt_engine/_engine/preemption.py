"""Saves on preemption and at an interval, at step boundaries.

Schedulers (Slurm, Kubernetes, cloud spot instances) send SIGTERM some time before they kill a
job. :class:`PreemptionSaver` turns that signal into a flag; the training loop calls
:meth:`PreemptionSaver.step_done` after every step, which saves synchronously (committed before
it returns) when the flag is set, and then ends the process cleanly with ``SystemExit``. The
same call saves every ``every`` steps, so the loop needs no save logic of its own::

    with CheckpointEngine(config) as engine, engine.save_on_preemption(every=100) as saver:
        start = engine.load(model=model, optimizer=opt).iteration
        for step in range(start + 1, total + 1):
            train_step()
            saver.step_done(step, model=model, optimizer=opt)

Under several ranks the signal may reach the ranks at different steps, so ``step_done`` agrees
on it across ranks (one small all-gather per call) and every rank saves the same step.

**The grace period.** A preemption save never waits for a background writer that is not ready.
Where the ``stage``/``write`` provider writes in a process of its own (``pinned_staging``: a
:class:`~ckpt_engine.lifecycle.SavesInBackground`), the same all-gather carries whether each
rank's writer is ready now. If it is on every rank, the preemption save takes the provider's
usual background path; if it is not on some rank (still starting, or lost and being replaced),
every rank makes the save inside the provider's ``saving_in_process()``: written synchronously in this
process as the engine's default provider writes it (same files, committed before ``save()``
returns), so it takes about as long as a synchronous save of the state. Every rank decides from
the same gathered answers, so all ranks take the same path and their collectives match.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Protocol

from .._dcpio import dist as _dist
from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from ..pipeline import Pipeline
    from .pending import SaveHandle

__all__ = ["PreemptionSaver", "SavingEngine"]

logger = logging.getLogger("ckpt_engine")


class SavingEngine(Protocol):
    """What a :class:`PreemptionSaver` needs of the engine (``CheckpointEngine`` is one): a save,
    the wait for every save's commit, and the pipeline whose background writer it asks."""

    @property
    def pipeline(self) -> Pipeline: ...

    def save(self, iteration: int, *args: Any, **objects: Any) -> SaveHandle: ...

    def wait(self) -> None: ...


class PreemptionSaver:
    """See the module docstring. ``signals`` default to SIGTERM; ``exit_code`` is the status the
    process exits with after the preemption save (0: the scheduler sees a clean exit)."""

    def __init__(
        self,
        engine: SavingEngine,
        *,
        every: int | None = None,
        signals: Sequence[signal.Signals] = (signal.SIGTERM,),
        exit_code: int = 0,
    ) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise InvalidArgumentError(f"every must be a positive int or None, got {every!r}")
        self.engine = engine
        self.every = every
        self.signals = tuple(signals)
        self.exit_code = exit_code
        self._requested = threading.Event()
        self._previous: dict[signal.Signals, Any] = {}
        self._last_saved: int | None = None
        self._background = engine.pipeline.saves_in_background()

    @property
    def requested(self) -> bool:
        """Whether a preemption signal arrived (on this rank)."""
        return self._requested.is_set()

    def request(self) -> None:
        """Act as if the signal arrived: the next :meth:`step_done` saves and exits."""
        self._requested.set()

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        del frame
        self._requested.set()
        logger.warning("received %s: saving at the end of this step, then exiting", signal.Signals(signum).name)

    def __enter__(self) -> PreemptionSaver:
        if threading.current_thread() is not threading.main_thread():
            raise InvalidArgumentError("save_on_preemption() must be entered in the main thread (signal handlers)")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def _agree(self) -> tuple[bool, bool]:
        """Whether a preemption signal arrived on any rank, and whether every rank's background
        writer is ready (one all-gather of both, so every rank gets the same two answers)."""
        ready = self._background is None or self._background.background_ready()
        if _dist.world_size() == 1:
            return self.requested, ready
        votes = _dist.all_gather_object((self.requested, ready))
        return any(requested for requested, _ in votes), all(ok for _, ok in votes)

    def step_done(self, step: int, **objects: Any) -> SaveHandle | None:
        """Call after step ``step`` with ``save()``'s keyword arguments. Saves every ``every``
        steps; after a preemption signal, saves (unless this step is saved already), waits for the
        commit and raises ``SystemExit(exit_code)``. The preemption save is written in this
        process when a background writer is not ready on some rank (see the module docstring)."""
        preempted, ready = self._agree()
        in_process = self._background if preempted and not ready else None
        handle = None
        start = time.perf_counter()
        if (preempted or (self.every is not None and step % self.every == 0)) and self._last_saved != step:
            with in_process.saving_in_process() if in_process is not None else nullcontext():
                handle = self.engine.save(step, **objects)
            self._last_saved = step
        if preempted:
            self.engine.wait()  # committed before the process goes
            if _dist.rank() == 0:
                how = (
                    " (written in this process: the background writer was not ready)" if in_process is not None else ""
                )
                logger.warning(
                    "preempted: saved iteration %d in %.2fs%s; exiting with status %d",
                    step,
                    time.perf_counter() - start,
                    how,
                    self.exit_code,
                )
            raise SystemExit(self.exit_code)
        return handle
