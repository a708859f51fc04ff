"""One engine's bounded collectives: its ``CollectiveWatch``, active for the length of a save or a load."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .._dcpio.watch import CollectiveWatch, activate, active_watch, c10d_cause
from ..errors import CollectiveError, ProcessGroupError

__all__ = ["bounded", "close_watch", "watch_group"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _engine_watch(engine: Any) -> CollectiveWatch | None:
    """The engine's watch, created at its first save or load (a collective: every rank is there),
    and again after a timeout closed the previous one. After a rank was lost the job's process
    group is broken: every later save or load fails at once instead of waiting in ``new_group``."""
    broken: ProcessGroupError | None = getattr(engine, "_broken", None)
    if broken is not None:
        raise ProcessGroupError(
            f"this engine's process group broke in an earlier save or load ({broken}); nothing more can be "
            "saved or loaded in this job: restart it",
            step=broken.step,
        )
    watch: CollectiveWatch | None = getattr(engine, "_watch", None)
    if watch is None or watch.group is None:
        watch = CollectiveWatch.create(engine.config.collective_timeout_s)
        engine._watch = watch
    return watch


def bounded(method: _F) -> _F:
    """Run an engine method (``save``, ``load``) with the engine's watch active in this thread.

    A failure inside torch.distributed that reaches the caller untyped (a peer died during one of
    DCP's own collectives), or wrapped in another engine error (a ``CheckpointSaveError`` around
    gloo's "Connection closed by peer"), becomes a :class:`~ckpt_engine.errors.ProcessGroupError`,
    and any such error marks the engine broken (see :func:`_engine_watch`)."""

    @functools.wraps(method)
    def wrapper(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(engine, "_closed", False) or active_watch() is not None:
            return method(engine, *args, **kwargs)
        watch = _engine_watch(engine)
        try:
            with activate(watch):
                return method(engine, *args, **kwargs)
        except ProcessGroupError as err:
            engine._broken = err
            raise
        except Exception as err:
            cause = None if watch is None or isinstance(err, CollectiveError) else c10d_cause(err)
            if watch is None or cause is None:
                raise
            engine._broken = typed = watch.broken(method.__name__, cause)
            raise typed from err

    return wrapper  # type: ignore[return-value]


def watch_group() -> Any:
    """The process group of the active watch (``None``: the default group)."""
    watch = active_watch()
    return watch.group if watch is not None else None


def close_watch(engine: Any) -> None:
    """Destroy the engine's watch and its process group."""
    watch: CollectiveWatch | None = getattr(engine, "_watch", None)
    engine._watch = None
    if watch is not None:
        watch.close()
