"""``pinned_staging``: asynchronous saves through reused host buffers and a writer process.

The entry point is ``ckpt_engine_plugins.pinned_staging:PinnedStagingPlugin``; the design is
told in ``plugin``'s docstring. The modules, one job each (all but ``plugin`` private):

- ``plugin``: the plugin class: its options, the ``stage`` and ``write`` hooks, its lifecycle;
- ``pool``: the buffer sets, allocated per state structure, reused, never re-staged while read;
- ``shm``: the shared-memory file behind each buffer set, mapped by both processes;
- ``collect``: the skeleton of each state dict, every tensor replaced by a slot;
- ``copies``: the copies into the buffers, in ``stage`` or in the background (``overlap``);
- ``windows``: staging a state larger than ``max_host_bytes`` in windows of one buffer set;
- ``ipc``: the messages between the training process and the writer, and their framing;
- ``process``: the training process's handle on one writer process (pipes, futures, death);
- ``supervise``: the writer's start, replacement, watchdog, atexit and after-fork handling;
- ``writer``: the writer process itself, run as ``python -m ckpt_engine_plugins.pinned_staging.writer``.

The public names are imported on first use: the writer process imports this package before it
runs ``writer`` as ``__main__``, and starts with only ``ipc`` imported (no torch, no engine).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .copies import SnapshotChangedError
    from .plugin import PinnedStagingPlugin
    from .pool import BufferSetInfo
    from .process import PinnedWriterError

__all__ = ["BufferSetInfo", "PinnedStagingPlugin", "PinnedWriterError", "SnapshotChangedError"]

#: The module defining each public name.
_HOMES = {
    "BufferSetInfo": "pool",
    "PinnedStagingPlugin": "plugin",
    "PinnedWriterError": "process",
    "SnapshotChangedError": "copies",
}


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
