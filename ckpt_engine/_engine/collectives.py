"""One engine's bounded collectives (:class:`EngineCollectives`): its ``CollectiveWatch``, active
for the length of a save or a load, and whether a lost rank broke its process group."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from .._dcpio.watch import CollectiveWatch, activate, active_watch, c10d_cause
from ..errors import CollectiveError, ProcessGroupError

__all__ = ["EngineCollectives", "bounded", "watch_group"]

_F = TypeVar("_F", bound=Callable[..., Any])
_T = TypeVar("_T")


class EngineCollectives:
    """The collectives of one engine's saves and loads, bounded by ``collective_timeout_s``.

    The watch (and its process group) is created at the first save or load, a collective: every
    rank is there; and again after a timeout closed the previous one. After a rank was lost the
    job's process group is broken: every later save or load fails at once instead of waiting in
    ``new_group``."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._watch: CollectiveWatch | None = None
        #: The error that broke the process group, once one did.
        self.broken: ProcessGroupError | None = None

    def _current(self) -> CollectiveWatch | None:
        if self.broken is not None:
            raise ProcessGroupError(
                f"this engine's process group broke in an earlier save or load ({self.broken}); nothing more can "
                "be saved or loaded in this job: restart it",
                step=self.broken.step,
            )
        if self._watch is None or self._watch.group is None:
            self._watch = CollectiveWatch.create(self._timeout_s)
        return self._watch

    def run(self, what: str, call: Callable[[], _T]) -> _T:
        """``call()`` with the watch active in this thread. A failure inside torch.distributed that
        reaches here untyped (a peer died during one of DCP's own collectives), or wrapped in
        another engine error (a ``CheckpointSaveError`` around gloo's "Connection closed by
        peer"), becomes a :class:`~ckpt_engine.errors.ProcessGroupError`, and any such error
        marks the process group broken. Any other failure here gives the barrier the other ranks
        wait at up (:meth:`CollectiveWatch.leave`): they raise ``RankFailedError`` at once."""
        watch = self._current()
        if watch is not None:
            watch.begin(what)
        try:
            with activate(watch):
                return call()
        except ProcessGroupError as err:
            self.broken = err
            raise
        except Exception as err:
            cause = None if watch is None or isinstance(err, CollectiveError) else c10d_cause(err)
            if watch is None or isinstance(err, CollectiveError):
                raise
            if cause is None:
                # Failed here, outside a collective: the ranks waiting for this one are told now.
                watch.leave(err)
                raise
            self.broken = typed = watch.broken(what, cause)
            raise typed from err

    def close(self) -> None:
        """Destroy the watch and its process group."""
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()


class _Bounded(Protocol):
    """What :func:`bounded` needs of the engine whose method it wraps."""

    _closed: bool
    _collectives: EngineCollectives


def bounded(method: _F) -> _F:
    """Run an engine method (``save``, ``load``) through the engine's :class:`EngineCollectives`
    (a call inside another bounded call, or on a closed engine, runs as it is)."""

    @functools.wraps(method)
    def wrapper(engine: _Bounded, *args: Any, **kwargs: Any) -> Any:
        if engine._closed or active_watch() is not None:
            return method(engine, *args, **kwargs)
        return engine._collectives.run(method.__name__, lambda: method(engine, *args, **kwargs))

    return wrapper  # type: ignore[return-value]


def watch_group() -> Any:
    """The process group of the active watch (``None``: the default group)."""
    watch = active_watch()
    return watch.group if watch is not None else None
