"""Checks a load makes before it reads anything, and the lock it holds while it reads.

* **Checksums fail closed.** ``verify: checksums`` that cannot be done (no manifest, a sizes-only
  or newer manifest, an algorithm not available here) refuses the load with
  :class:`UnverifiableCheckpointError` saying why, unless ``allow_unverified`` is set.
* **The folder is the checkpoint it claims to be.** A manifest records its iteration; a folder
  ``iter_000000010`` whose manifest says 5 (say, a symlink to another run's checkpoint) is
  refused.
* **Retention never deletes what is being read.** A load holds a shared ``flock`` on the
  checkpoint folder from before its checks until the last tensor is read; retention takes the
  exclusive lock without waiting before it deletes, and skips a folder someone reads (retrying
  after the next commit). Where the filesystem has no ``flock`` (some network filesystems), and
  on object stores, there is no such lock: there, keep ``keep_last`` large enough that a reader
  finishes before its checkpoint ages out (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
from dataclasses import dataclass

from .errors import CheckpointNotFoundError, CorruptCheckpointError, UnverifiableCheckpointError
from .integrity import Manifest, VerifyReport, iteration_problem

__all__ = [
    "ReadLock",
    "check_manifest_iteration",
    "fail_unverified",
    "missing_for_resume",
    "require_verifiable",
    "try_lock_for_delete",
]

_NO_LOCK = {errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


def require_verifiable(path: str, level: str, checked: bool, reason: str | None, allow: bool) -> None:
    """Refuse a ``checksums`` load whose checksums could not all be checked (``checked`` false,
    ``reason`` why), unless ``allow`` (``allow_unverified``)."""
    if level != "checksums" or checked or allow:
        return
    raise UnverifiableCheckpointError(
        f"verify='checksums' was asked for, but the checksums of {path} cannot be checked: {reason or 'unknown'}; "
        "nothing was loaded. Set allow_unverified=True to load it unverified (e.g. a checkpoint of plain DCP or "
        "the original checkpointer), or verify='sizes'"
    )


def fail_unverified(report: VerifyReport, allow: bool) -> VerifyReport:
    """``report`` of ``verify_checkpoint(level="checksums")``, failed (a problem added) when its
    checksums could not be checked, unless ``allow``."""
    if report.level != "checksums" or report.verified or not report.ok or allow:
        return report
    why = report.unverified_reason or "no manifest"
    problem = f"{report.path}: checksums cannot be checked ({why}); pass --allow-unverified to accept that"
    return dataclasses.replace(report, problems=[*report.problems, problem])


def check_manifest_iteration(path: str, manifest: Manifest) -> None:
    """Refuse a checkpoint folder whose name's iteration differs from its manifest's."""
    problem = iteration_problem(path, manifest)
    if problem is not None:
        raise CorruptCheckpointError(f"{problem}; nothing was loaded")


def missing_for_resume(path: str, name: str, present: tuple[str, ...]) -> str:
    """The message refusing to resume (rule 1) from ``path``, which lacks component ``name``."""
    what = (
        "its iteration: training would silently restart at iteration 0 with the state of a later one"
        if name == "trainer"
        else "state you passed in: it would keep its fresh values while the rest resumes"
    )
    return (
        f"cannot resume from {path}: it has no component {name!r} (it has: {', '.join(present) or 'none'}), which "
        f"holds {what}. Restore {name}/, add {name!r} to keys_not_to_resume to resume without it, or point "
        "latest_checkpoint.txt at a complete checkpoint"
    )


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
