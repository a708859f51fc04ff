"""Messages between ``pinned_staging`` and its writer process, and their framing on a pipe.

Private to the ``pinned_staging`` plugin. Both ends import this module, so the message
classes unpickle on both sides. A frame is an 8-byte little-endian length followed by one
pickle. The pipe carries only descriptions (buffer layouts, the skeleton of each state dict,
the DCP planner); tensor bytes travel through the shared-memory files the layouts name.
"""

from __future__ import annotations

import os
import pickle
import struct
from dataclasses import dataclass
from typing import Any

from ckpt_engine.types import CarriedBy

_HEADER = struct.Struct("<Q")
#: A frame larger than this is a protocol error, not a message (guards against garbage reads).
MAX_FRAME = 1 << 34


class PipeClosed(EOFError):
    """The other end closed the pipe (its process exited or was killed)."""


def encode(message: object) -> bytes:
    """One frame: length header + pickle."""
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


def write_frame(fd: int, frame: bytes) -> None:
    view = memoryview(frame)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def _read_exact(fd: int, n: int) -> bytes:
    chunks: list[bytes] = []
    remaining = n
    while remaining:
        chunk = os.read(fd, min(remaining, 1 << 20))
        if not chunk:
            raise PipeClosed(f"pipe closed with {remaining} of {n} bytes unread")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def read_message(fd: int) -> Any:
    """The next message; :class:`PipeClosed` at end of file."""
    (size,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    if size > MAX_FRAME:
        raise PipeClosed(f"corrupt frame header (length {size})")
    return pickle.loads(_read_exact(fd, size))


# -- shared-memory layout ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SlotSpec:
    """One tensor's place in a buffer set: a contiguous ``shape``/``dtype`` block at ``offset``."""

    offset: int
    shape: tuple[int, ...]
    dtype: Any  # torch.dtype (kept Any so this module does not import torch)
    nbytes: int


@dataclass(frozen=True, slots=True)
class MeshSpec:
    """A DeviceMesh of the training job, rebuilt over the writer group (same ranks and names)."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]  # row-major
    dim_names: tuple[str, ...] | None


# -- parent -> writer ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Init:
    rank: int
    world_size: int
    store_host: str | None
    store_port: int | None
    store_prefix: str
    start_timeout_s: float
    write_timeout_s: float
    #: Seconds between the writer's heartbeats (:class:`Beat`).
    heartbeat_s: float


@dataclass(frozen=True, slots=True)
class Alloc:
    set_id: int
    path: str
    nbytes: int
    slots: tuple[SlotSpec, ...]
    #: Each slot's window (``max_host_bytes``); empty: one window, the whole state.
    windows: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Free:
    set_id: int


@dataclass(frozen=True, slots=True)
class Save:
    req_id: int
    set_id: int
    iteration: int
    component: str
    path: str
    #: The state dict pickled with tensors replaced by persistent ids (see pinned_staging).
    skeleton: bytes
    meshes: tuple[MeshSpec, ...]
    planner: Any
    thread_count: int
    sync_files: bool
    #: Set when this rank's snapshot failed (``overlap``): the writers agree before DCP starts,
    #: so every rank fails this save together instead of waiting for this one.
    abort: str | None = None
    #: The buffer set's save epoch when it is staged in windows (``max_host_bytes``).
    epoch: int | None = None
    #: The engine's ``collective_timeout_s``: bounds the writers' collectives for this save.
    collective_timeout_s: float | None = None
    #: What the write may carry over (``WriteContext.carry_over``, ``incremental``).
    carry_over: Any = None
    #: A write of the node-local tier (``WriteContext.rank_local``): this rank alone, no collective.
    rank_local: bool = False


@dataclass(frozen=True, slots=True)
class Window:
    """Window ``index`` of buffer set ``set_id`` holds the save of ``epoch`` (or, with ``error``,
    never will: the save fails)."""

    set_id: int
    epoch: int
    index: int
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


# -- writer -> parent ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Ready:
    pid: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Beat:
    """The writer is running: sent every ``Init.heartbeat_s`` by a thread of its own, with the
    bytes the process has written so far (``/proc/self/io``'s ``wchar``; -1 where unknown)."""

    bytes_written: int


@dataclass(frozen=True, slots=True)
class StartFailed:
    error: str


@dataclass(frozen=True, slots=True)
class Mapped:
    set_id: int
    error: str | None


@dataclass(frozen=True, slots=True)
class Drained:
    """The writer will not read windows up to ``index`` of the set's ``epoch`` again."""

    set_id: int
    epoch: int
    index: int


@dataclass(frozen=True, slots=True)
class Done:
    req_id: int
    ok: bool
    bytes_written: int
    seconds: float
    error: str | None
    #: The writers agreed to skip this save (a rank's ``overlap`` snapshot failed) before any
    #: collective write began: their group is intact and needs no replacement.
    group_intact: bool = False
    #: Bytes carried over from the previous checkpoint (not in ``bytes_written``), and how.
    bytes_reused: int = 0
    carried_by: CarriedBy = "off"


# -- state-dict skeletons ----------------------------------------------------------------------


class SkeletonUnpickler(pickle.Unpickler):
    """Unpickles a skeleton, handing each persistent id (a staged tensor) to ``resolve``.

    With ``forbid_main`` (the writer), a class from the training script's ``__main__`` is a
    clear error: the writer process runs its own ``__main__`` and never imports the script.
    """

    def __init__(self, data: bytes, resolve: Any, *, forbid_main: bool = False) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self._resolve = resolve
        self._forbid_main = forbid_main

    def persistent_load(self, pid: Any) -> Any:
        return self._resolve(pid)

    def find_class(self, module: str, name: str) -> Any:
        if self._forbid_main and module == "__main__":
            raise pickle.UnpicklingError(
                f"the state holds a value of type {name!r} defined in the training script (__main__); the "
                "pinned_staging writer process cannot import it: define the class in an importable module"
            )
        return super().find_class(module, name)
