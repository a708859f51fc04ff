"""Early writeback: a file being written is handed to the disk in chunks, so its final fsync waits for less.

A checkpoint file written in full and then fsynced keeps the disk idle while the bytes are
produced (copied into the page cache, hashed) and the CPU idle while ``fsync`` writes them all.
Linux's ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts the writeback of a range of dirty
pages without waiting for it: called on each finished chunk, the disk writes chunk *n* while
chunk *n + 1* is produced, and the ``fsync`` at the end only waits for the last chunk and the
metadata. On the development machine a 256 MiB file written in 1 MiB writes then fsynced took
206-278 ms, with writeback every 16 MiB 128-203 ms (docs/performance.md).

It is a hint and nothing more: it makes nothing durable (no metadata, no disk cache flush), so
the writer's ``fsync`` stays the one call that does, and raises as before. Where the call does
not exist (not Linux, no libc symbol) or a filesystem refuses it (``EINVAL`` on some FUSE and
network filesystems, ``ESPIPE``), :class:`Writeback` does nothing, and the file is written and
fsynced exactly as without it.
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable

__all__ = ["CHUNK_BYTES", "Writeback"]

#: Bytes written between two writeback requests: large enough that the calls cost nothing
#: (16 per 256 MiB), small enough that the disk starts early.
CHUNK_BYTES = 16 << 20

_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of dirty pages in the range, do not wait

_Call = Callable[[int, int, int, int], int]


def _load() -> _Call | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # a libc without it (very old, or not glibc/musl)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    call: _Call = fn
    return call


_sync_file_range: _Call | None = _load()


class Writeback:
    """Starts the writeback of one sequentially written file every :data:`CHUNK_BYTES`.

    ``wrote(end)`` after each write, with the file's size so far; the first refusal by the
    filesystem turns it off for the rest of the file."""

    __slots__ = ("_call", "_fd", "_started")

    def __init__(self, fd: int, enabled: bool = True) -> None:
        self._fd = fd
        self._started = 0  # the end of the last range handed to the disk
        self._call = _sync_file_range if enabled else None

    @property
    def active(self) -> bool:
        """Whether writeback requests are being made (the call exists and was not refused)."""
        return self._call is not None

    def wrote(self, end: int) -> None:
        """The file now holds ``end`` bytes: hand the range since the last request to the disk
        if it is a chunk or more."""
        if self._call is None or end - self._started < CHUNK_BYTES:
            return
        if self._call(self._fd, self._started, end - self._started, _SYNC_FILE_RANGE_WRITE) != 0:
            self._call = None  # refused by this filesystem: a hint, the fsync still follows
            return
        self._started = end
