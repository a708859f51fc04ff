"""Retention never deletes what is being read: a shared ``flock`` on the checkpoint folder.

A load holds a shared ``flock`` on the checkpoint folder from before its checks until the last
tensor is read; retention takes the exclusive lock without waiting before it deletes, and skips
a folder someone reads (retrying after the next commit). Where the filesystem has no ``flock``
(some network filesystems), and on object stores, there is no such lock: there, keep
``keep_last`` large enough that a reader finishes before its checkpoint ages out
(docs/reliability.md).

Retention holds the exclusive lock only across a rename, so a reader retries without blocking
for at most :data:`LOCK_WAIT_S`: anyone who can open the folder can take ``LOCK_EX`` and hold it
(a read-only user, a stuck tool), and a blocking ``flock`` would then hang every load for ever.
After the wait the load fails with :class:`CheckpointLockedError` naming the holder, when
``/proc/locks`` tells it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import time
from dataclasses import dataclass

from ..errors import CheckpointLockedError, CheckpointNotFoundError

__all__ = ["ReadLock", "try_lock_for_delete"]

_NO_LOCK = {errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}
#: How long a reader waits for a folder's exclusive lock to go (retention holds it for a rename).
LOCK_WAIT_S = 10.0
#: Most bytes of ``/proc/locks`` read to name a holder (a line per lock in the system).
_MAX_PROC_LOCKS = 1 << 20


@dataclass
class ReadLock:
    """A shared ``flock`` on a local checkpoint folder, held while it is read (see the module
    docstring). ``acquire`` returns ``None`` on object stores and where the filesystem cannot lock."""

    path: str
    fd: int

    @classmethod
    def acquire(cls, path: str, local: bool) -> ReadLock | None:
        if not local:
            return None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None  # the checks that follow report a missing or unreadable folder
        try:
            _lock_shared(fd, path)
            # Retention may have renamed the folder away between our open and our lock.
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(path)
        except CheckpointLockedError:
            os.close(fd)
            raise
        except FileNotFoundError as err:
            os.close(fd)
            raise CheckpointNotFoundError(
                f"checkpoint folder {path} was deleted (by retention?) as the load began; nothing was loaded"
            ) from err
        except OSError as err:
            os.close(fd)
            if err.errno in _NO_LOCK:
                return None
            raise
        return cls(path, fd)

    def release(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def __del__(self) -> None:
        with contextlib.suppress(OSError):
            self.release()


def _lock_shared(fd: int, path: str) -> None:
    """``LOCK_SH`` on ``fd``, retried without blocking for at most :data:`LOCK_WAIT_S`."""
    deadline = time.monotonic() + LOCK_WAIT_S
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                break
            time.sleep(delay)
            delay = min(delay * 2, 0.1)
    holder = lock_holder(fd)
    raise CheckpointLockedError(
        f"checkpoint folder {path} is held under an exclusive lock by {holder or 'another process'} for more "
        f"than {LOCK_WAIT_S:g}s; the engine's retention holds it only for a rename, so something else does. "
        "Stop that process (or load another checkpoint with load_path); nothing was loaded"
    )


def lock_holder(fd: int) -> str | None:
    """``"pid N (command)"`` of a process holding an ``flock`` on the file of ``fd``, from
    ``/proc/locks`` (Linux), or ``None`` where it cannot be known."""
    st = os.fstat(fd)
    inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks", "rb") as f:
            table = f.read(_MAX_PROC_LOCKS).decode("ascii", "replace")
    except OSError:
        return None
    for line in table.splitlines():
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 1234 08:01:5678 0 EOF" (a "->" marks a blocked waiter)
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
            return f"pid {fields[4]} ({_command(int(fields[4]))})"
    return None


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", "rb") as f:
            return f.read(64).decode("utf-8", "replace").strip() or "?"
    except OSError:
        return "?"


def try_lock_for_delete(path: str) -> int | None:
    """An open descriptor of ``path`` holding its exclusive ``flock`` (close it after the
    deletion), or ``None`` if a reader holds the shared lock. Where the filesystem cannot lock,
    a descriptor without a lock."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as err:
        if err.errno not in _NO_LOCK:
            os.close(fd)
            raise
    return fd
