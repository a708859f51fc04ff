"""One engine's bounded collectives: its ``CollectiveWatch``, active for the length of a save or a load."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from .._dcpio.watch import CollectiveWatch, activate, active_watch

__all__ = ["bounded", "close_watch", "watch_group"]

_F = TypeVar("_F", bound=Callable[..., Any])


def _engine_watch(engine: Any) -> CollectiveWatch | None:
    """The engine's watch, created at its first save or load (a collective: every rank is there),
    and again after a timeout closed the previous one."""
    watch: CollectiveWatch | None = getattr(engine, "_watch", None)
    if watch is None or watch.group is None:
        watch = CollectiveWatch.create(engine.config.collective_timeout_s)
        engine._watch = watch
    return watch


def bounded(method: _F) -> _F:
    """Run an engine method (``save``, ``load``) with the engine's watch active in this thread."""

    @functools.wraps(method)
    def wrapper(engine: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(engine, "_closed", False) or active_watch() is not None:
            return method(engine, *args, **kwargs)
        with activate(_engine_watch(engine)):
            return method(engine, *args, **kwargs)

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
