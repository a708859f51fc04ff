"""What a plugin may implement besides hooks: its part in the engine's life, as typed protocols.

Hooks are called per save or load; these are called once, around the engine's own lifetime. A
plugin implements any subset, as plain methods (or, for ``max_saves_in_flight``, a property);
the engine recognises them by these ``runtime_checkable`` protocols and calls them from one place
(:class:`ckpt_engine.pipeline.Pipeline`), never by probing names. ``docs/hooks.md`` documents
them beside the hooks.

>>> from ckpt_engine.lifecycle import Closeable
>>> class HoldsAProcess:
...     def close(self) -> None:
...         print("stopped")
>>> isinstance(HoldsAProcess(), Closeable)
True
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol, runtime_checkable

__all__ = [
    "BoundsPendingSaves",
    "Closeable",
    "ClosesInTwoSteps",
    "SavesInBackground",
    "StartsInBackground",
    "WritesRankLocal",
]


@runtime_checkable
class Closeable(Protocol):
    """Holds resources (a process, host buffers): ``close()`` frees them.

    Called once by ``CheckpointEngine.close()``, after every pending save finished, in reverse
    fold order. It should be idempotent; an exception is collected and re-raised by ``close()``
    after every other plugin was closed.
    """

    def close(self) -> None: ...


@runtime_checkable
class ClosesInTwoSteps(Protocol):
    """Wants to know that the engine is closing before it waits for pending saves, e.g. to start
    a deadline for in-flight work. ``begin_close()`` runs first, in fold order; an exception is
    logged and does not stop the close."""

    def begin_close(self) -> None: ...


@runtime_checkable
class BoundsPendingSaves(Protocol):
    """A ``stage`` provider that can have more than one save pending (double buffering).

    ``max_saves_in_flight`` (an int >= 1; default 1 when not implemented) is how many saves may
    be pending while a new one stages; the engine waits for older ones beyond that.
    """

    @property
    def max_saves_in_flight(self) -> int: ...


@runtime_checkable
class StartsInBackground(Protocol):
    """Starts something in the background when created (a writer process). ``wait_ready()``
    blocks until it is ready and returns the start-up seconds; never needed for correctness
    (work queues until then), useful to keep start-up out of a measurement."""

    def wait_ready(self, timeout: float | None = None) -> float: ...


@runtime_checkable
class SavesInBackground(Protocol):
    """A plugin that provides both ``stage`` and ``write``, writes in a background process that
    may not be ready yet (``pinned_staging``'s writer), and can also write a save synchronously.

    :class:`~ckpt_engine.PreemptionSaver` uses it so that a preemption save never waits for that
    process. Both methods are called on every rank, in the same order.
    """

    def background_ready(self) -> bool:
        """Whether a save started now would be written in the background without waiting for the
        background process to start. Must not block."""
        ...

    def saving_in_process(self) -> AbstractContextManager[None]:
        """A context in which saves are written synchronously by this process, as the engine's
        default ``write`` provider writes them: the same checkpoint layout, committed by the engine
        before ``save()`` returns. Enter it on every rank or on none."""
        ...


@runtime_checkable
class WritesRankLocal(Protocol):
    """A ``write`` provider that can write the node-local tier (``EngineConfig.local_dir``).

    A write with ``WriteContext.rank_local`` set writes this rank's state alone: every item it
    holds into ``ctx.path`` with a ``.metadata`` of its own, and no collective at all
    (``ckpt_engine.storage.write_component(..., process_group=ctx.process_group)`` does it, as
    ``ctx.process_group`` is then :data:`ckpt_engine.storage.RANK_LOCAL`). The engine's default
    ``write`` can; a ``write`` provider that does not implement this protocol (or returns False)
    is refused when the engine is created with a ``local_dir``, naming the plugin.
    """

    def writes_rank_local(self) -> bool: ...
