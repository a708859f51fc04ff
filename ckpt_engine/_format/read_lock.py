"""Retention never deletes what is being read: a shared ``flock`` on the checkpoint folder.

A load holds a shared ``flock`` on the checkpoint folder from before its checks until the last
tensor is read; retention takes the exclusive lock without waiting before it deletes, and skips
a folder someone reads (retrying after the next commit). Where the filesystem has no ``flock``
(some network filesystems), and on object stores, there is no such lock: there, keep
``keep_last`` large enough that a reader finishes before its checkpoint ages out
(docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass

from ..errors import CheckpointNotFoundError

__all__ = ["ReadLock", "try_lock_for_delete"]

_NO_LOCK = {errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


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
            fcntl.flock(fd, fcntl.LOCK_SH)  # blocks only while retention renames it (moments)
            # Retention may have renamed the folder away between our open and our lock.
            if os.stat(path).st_ino != os.fstat(fd).st_ino:
                raise FileNotFoundError(path)
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
