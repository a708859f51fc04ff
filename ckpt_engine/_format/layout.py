"""The on-disk layout shared with the original checkpointer (docs/design.md, section 2).

::

    <save_dir>/
      iter_000000005/{model,optim,scheduler,trainer,<extra>}/   # one DCP checkpoint each
      latest_checkpoint.txt                                      # "iter_000000005\\n"

Uncommitted saves live in a hidden sibling (``.iter_000000005.partial``) and are renamed into
place only when every component is written. The engine's other temporary folders are hidden too:
``.iter_000000005.replaced.<pid>`` (an old checkpoint being replaced by a save of the same
iteration) and ``.iter_000000005.deleting`` (a checkpoint being deleted by retention). Loaders
never look at hidden names; :func:`cleanup_leftovers` removes what a crash left behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .._storage.fscheck import require_inside, require_regular_file
from .._storage.store import Store, fsync_dir, is_url, store_for
from ..errors import (
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    SaveDirLockedError,
    denied,
)
from .metadata_read import read_metadata, recall_metadata
from .names import (
    DELETING_SUFFIX,
    LEFTOVER_RE,
    LOCK_FILE,
    MANIFEST_FILE,
    METADATA_FILE,
)
from .pointer import diagnose_not_checkpoint
from .read_lock import try_lock_for_delete

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

logger = logging.getLogger("ckpt_engine")


def component_dirs(checkpoint_dir: str | os.PathLike[str], store: Store | None = None) -> list[str]:
    """Component folder names inside a checkpoint folder, sorted."""
    try:
        entries = store_for(checkpoint_dir, store).list_dir(os.fspath(checkpoint_dir))
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"checkpoint folder {os.fspath(checkpoint_dir)!r} does not exist") from err
    except NotADirectoryError as err:
        raise CheckpointNotFoundError(f"{os.fspath(checkpoint_dir)!r} is not a checkpoint folder") from err
    except PermissionError as err:
        raise CheckpointPermissionError(
            f"cannot list checkpoint folder {os.fspath(checkpoint_dir)!r}: {denied(err)}"
        ) from err
    return [name for name, is_dir in entries if is_dir and not name.startswith(".")]


@dataclass(frozen=True)
class CheckedCheckpoint:
    path: str
    #: component -> its DCP metadata, read safely.
    components: dict[str, Metadata]
    #: On an object store, every object's size from the one listing taken (``rel -> bytes``), for
    #: checks that follow; ``None`` for a local folder.
    listing: dict[str, int] | None = None


def check_complete(
    checkpoint_dir: str | os.PathLike[str],
    store: Store | None = None,
    check_metadata_bytes: Callable[[str, bytes], None] | None = None,
) -> CheckedCheckpoint:
    """Verify a checkpoint is complete: every component folder has ``.metadata`` and every byte
    range that metadata names exists in its data file. Raises a typed error naming the file.

    ``check_metadata_bytes(path, data)`` sees each ``.metadata`` before it is parsed (the
    manifest's size and checksum, where one exists)."""
    path = os.fspath(checkpoint_dir)
    store = store_for(path, store)
    names = component_dirs(path, store)
    if not names:
        raise IncompleteCheckpointError(f"checkpoint folder {path!r} holds no component folders")
    # One listing instead of a request per file on an object store.
    listed = store.list_files(path) if store.capabilities.listing_first else None
    out: dict[str, Metadata] = {}
    for name in names:
        cdir = store.join(path, name)
        if store.capabilities.local_files:
            require_inside(path, os.path.join(cdir, METADATA_FILE))
            require_regular_file(os.path.join(cdir, METADATA_FILE), "DCP metadata")
        try:
            md = (recall_metadata(cdir) if store.capabilities.local_files else None) or read_metadata(
                cdir, store, check_metadata_bytes
            )
        except IncompleteCheckpointError as err:
            # No .metadata: an interrupted save, or a folder that is no checkpoint at all?
            not_checkpoint = diagnose_not_checkpoint(path, names, store)
            if not_checkpoint is not None:
                raise not_checkpoint from err
            raise
        check_component_files(cdir, md, store, listed, name, root=path if store.capabilities.local_files else None)
        out[name] = md
    return CheckedCheckpoint(path=path, components=out, listing=listed)


def check_component_files(
    cdir: str,
    md: Metadata,
    store: Store,
    listed: dict[str, int] | None = None,
    name: str = "",
    root: str | None = None,
) -> None:
    """Check one component's metadata (already validated by :func:`.metadata.validate_metadata`)
    against its data: every byte range a storage entry names exists in its data file (a regular
    file inside ``root``, the checkpoint folder, when given). ``listed``: sizes from one
    object-store listing (``name/rel -> bytes``)."""
    if store.capabilities.listing_first and listed is None:
        listed, name = store.list_files(cdir), ""
    needed: dict[str, int] = {}
    for index, info in (md.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            raise CorruptCheckpointError(f"{os.path.join(cdir, METADATA_FILE)}: storage entry {index} has no file")
        if "/" in rel or "\\" in rel or rel.startswith("."):
            raise CorruptCheckpointError(
                f"{os.path.join(cdir, METADATA_FILE)} names data file {rel!r} outside its folder"
            )
        needed[rel] = max(needed.get(rel, 0), int(info.offset) + int(info.length))
    for rel, end in sorted(needed.items()):
        fpath = store.join(cdir, rel)
        try:
            if listed is None:
                if root is not None:
                    require_inside(root, fpath)
                st = os.stat(fpath)
                if not stat.S_ISREG(st.st_mode):
                    require_regular_file(fpath, "a DCP data file")
                size = st.st_size
            elif (f"{name}/{rel}" if name else rel) in listed:
                size = listed[f"{name}/{rel}" if name else rel]
            else:
                raise FileNotFoundError(fpath)
        except FileNotFoundError as err:
            raise IncompleteCheckpointError(f"{fpath} is missing; {METADATA_FILE} references it") from err
        except PermissionError as err:
            raise CheckpointPermissionError(f"cannot stat {fpath}: {denied(err)}") from err
        if size < end:
            raise IncompleteCheckpointError(
                f"{fpath} is truncated: {size} bytes, but {METADATA_FILE} needs at least {end}"
            )


def remove_tree(path: str | os.PathLike[str], store: Store | None = None) -> None:
    store_for(path, store).remove_tree(os.fspath(path))


def disk_full_hint(save_dir: str | os.PathLike[str], err: BaseException) -> str:
    """`` (disk full: ...)`` when a failed write looks like one, else ``""``.

    torch's zip writer reports a full disk as ``RuntimeError: [enforce fail at
    inline_container.cc] unexpected pos ...``; the free space of ``save_dir``'s filesystem
    (measured before the failed save's folder is removed) tells what happened.
    """
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return ""  # already says so
    try:
        st = os.statvfs(save_dir)
    except OSError:
        return ""
    free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
    if total and (free < 16 << 20 or free < total // 100):
        return f" (the filesystem of {os.fspath(save_dir)} has {free} of {total} bytes free: disk full?)"
    return ""


class CheckpointInUseError(OSError):
    """:func:`remove_checkpoint` found a load reading the checkpoint; retention retries later."""


def remove_checkpoint(path: str | os.PathLike[str], store: Store | None = None) -> None:
    """Delete a committed checkpoint folder so that a crash never leaves a half-deleted one under
    its ``iter_*`` name: rename it to a hidden ``.iter_*.deleting`` first, then remove that. On
    an object store (no rename) the completion marker goes first, so that a crash leaves a prefix
    the loader ignores; the next retention pass deletes the rest."""
    store = store_for(path, store)
    if not store.capabilities.commit_by_rename:
        path = os.fspath(path)
        marker = store.join(path, MANIFEST_FILE)
        if store.exists(marker):
            store.remove_file(marker)
        store.remove_tree(path)
        return
    path = Path(path)
    trash = path.with_name(f".{path.name}{DELETING_SUFFIX}")
    if trash.exists():
        shutil.rmtree(trash)  # an earlier attempt got as far as the rename
    fd = try_lock_for_delete(os.fspath(path))
    if fd is None:
        raise CheckpointInUseError(f"{path} is being read by a load (it holds the folder's shared lock); not deleted")
    try:
        os.replace(path, trash)  # a load that locks after this finds the folder gone, before reading
        fsync_dir(path.parent)
    finally:
        os.close(fd)
    shutil.rmtree(trash)


@dataclass(frozen=True)
class Leftover:
    path: str
    #: ``partial``, ``deleting`` or ``replaced``
    kind: str
    #: The ``iter_*`` name the folder belongs to.
    checkpoint: str


def find_leftovers(save_dir: str | os.PathLike[str]) -> list[Leftover]:
    """The engine's hidden temporary folders in ``save_dir`` (see the module docstring); none on
    an object store, where saves write no temporary folders."""
    if is_url(save_dir):
        return []
    try:
        entries = list(os.scandir(save_dir))
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []
    out = []
    for e in entries:
        m = LEFTOVER_RE.match(e.name)
        if m and e.is_dir(follow_symlinks=False):
            kind = m.group(2).split(".")[1]
            out.append(Leftover(path=e.path, kind=kind, checkpoint=m.group(1)))
    return sorted(out, key=lambda lo: lo.path)


def cleanup_leftovers(save_dir: str | os.PathLike[str], leftovers: list[Leftover] | None = None) -> list[str]:
    """Remove what crashed saves and deletions left behind; returns one line per action.

    Call only while holding the save_dir lock (no other engine may be saving there). A
    ``.replaced`` folder whose checkpoint is missing (a crash between the two renames of a
    re-save) is renamed back into place instead of deleted. Errors are logged, never raised:
    this is housekeeping and the next start retries.
    """
    done = []
    for lo in find_leftovers(save_dir) if leftovers is None else leftovers:
        final = os.path.join(os.fspath(save_dir), lo.checkpoint)
        try:
            if lo.kind == "replaced" and not os.path.exists(final):
                os.replace(lo.path, final)
                fsync_dir(save_dir)
                done.append(f"restored {final} from {lo.path} (a re-save of it was interrupted)")
            else:
                shutil.rmtree(lo.path)
                done.append(f"removed {lo.path} (left behind by an interrupted save or deletion)")
        except FileNotFoundError:
            continue  # someone else (another rank) got there first
        except OSError as err:
            # Best-effort housekeeping: an uncommitted folder is invisible to loaders; retry next start.
            logger.warning("could not remove leftover folder %s: %s", lo.path, err)
    return done


# -- the save_dir lock --------------------------------------------------------------------------

_UNSUPPORTED_LOCK_ERRNOS = {errno.EBADF, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS}


def _flock(fd: int) -> bool:
    """Try an exclusive non-blocking flock: True if acquired, False if another holder has it.
    Raises OSError where the filesystem does not support it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _lock_holder(fd: int) -> str:
    """Best effort: ``pid N`` of the process holding a flock on ``fd``'s file (from /proc/locks)."""
    try:
        st = os.fstat(fd)
        with open("/proc/locks", encoding="ascii") as f:
            lines = f.read().splitlines()
    except OSError:
        return "another process"
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            pid = parts[4]
            return f"this process (pid {pid})" if pid == str(os.getpid()) else f"pid {pid}"
    return "another process"


class SaveDirLock:
    """An exclusive advisory lock on a save_dir, so two engines never save into it at once.

    It locks the folder itself (``flock`` on a directory descriptor): no file is created and the
    layout stays exactly the original checkpointer's. Where the filesystem refuses a directory
    lock (NFS turns ``flock`` into POSIX locks, which need a writable descriptor), it locks a
    hidden file ``save_dir/.ckpt_engine.lock`` instead. Where neither works, it logs a warning
    and saves unlocked. The lock dies with the process (a crashed trainer never blocks the next).
    """

    def __init__(self, save_dir: str | os.PathLike[str]) -> None:
        self.save_dir = os.fspath(save_dir)
        self._fd: int | None = None
        self._unsupported = False
        #: ``directory``, ``file``, ``none`` (unsupported) or ``None`` (not held).
        self.method: str | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None or self._unsupported

    def _try(self) -> tuple[int | None, str]:
        """Open and lock; returns (fd, method) with fd None if another holder has the lock."""
        fd = os.open(self.save_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            got = _flock(fd)
        except OSError as err:
            os.close(fd)
            if err.errno not in _UNSUPPORTED_LOCK_ERRNOS:
                raise
        else:
            if got:
                return fd, "directory"
            holder = _lock_holder(fd)
            os.close(fd)
            return None, holder
        fd = os.open(os.path.join(self.save_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            got = _flock(fd)
        except OSError:
            os.close(fd)
            raise
        if got:
            return fd, "file"
        holder = _lock_holder(fd)
        os.close(fd)
        return None, holder

    def acquire(self) -> bool:
        """Take the lock for good (until :meth:`release`); True if newly taken, False if already
        held. Raises :class:`SaveDirLockedError` if another engine holds it."""
        if self.held:
            return False
        try:
            fd, info = self._try()
        except OSError as err:
            if err.errno in _UNSUPPORTED_LOCK_ERRNOS:
                logger.warning(
                    "cannot lock %s (%s): this filesystem supports no flock; two engines saving into it "
                    "at once would not be detected",
                    self.save_dir,
                    err.strerror or err,
                )
                self._unsupported, self.method = True, "none"
                return True
            raise
        if fd is None:
            raise SaveDirLockedError(
                f"save_dir {self.save_dir!r} is locked by another CheckpointEngine ({info}) that is saving "
                "into it; two engines saving into one folder would interleave their checkpoints. Use a "
                "different save_dir, or close() the other engine first"
            )
        self._fd, self.method = fd, info
        return True

    def try_hold_briefly(self) -> SaveDirLock | None:
        """A second lock object holding the lock now, or None if it is taken (or unsupported)."""
        other = SaveDirLock(self.save_dir)
        try:
            fd, info = other._try()
        except OSError:
            return None
        if fd is None:
            return None
        other._fd, other.method = fd, info
        return other

    def __del__(self) -> None:
        # An engine dropped without close(): closing the descriptor releases the lock.
        fd = getattr(self, "_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def release(self) -> None:
        fd, self._fd = self._fd, None
        self._unsupported, self.method = False, None
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)  # also for copies of the descriptor in forked children
            finally:
                os.close(fd)


def _fsync_dirs(folders: list[Path]) -> None:
    """``fsync_dir`` of every folder, concurrently; returns when all are done, and raises the
    first error any of them raised (a folder that may not be durable fails the commit).

    Plain threads, not a ``ThreadPoolExecutor``: a save still in flight when the interpreter
    exits is committed from an ``atexit`` handler, where ``concurrent.futures`` refuses new work
    ("cannot schedule new futures after interpreter shutdown";
    ``tests/plugins/test_pinned_staging.py::test_exit_without_close_commits_and_needs_no_main_guard``)."""
    errors: list[BaseException] = []

    def one(folder: Path) -> None:
        try:
            fsync_dir(folder)
        except BaseException as err:  # raised below, in the committing thread
            errors.append(err)

    threads = [threading.Thread(target=one, args=(f,), name="ckpt-fsync") for f in folders[1:]]
    for t in threads:
        t.start()
    try:
        if folders:
            fsync_dir(folders[0])
    finally:
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


def commit_rename(partial: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Move a fully written ``partial`` folder into place as ``final``, replacing an old one.

    Before the rename, every folder in ``partial`` and ``partial`` itself are fsynced, all at
    once: that makes the names of the files written there durable (their bytes were fsynced by
    their writers), and concurrent fsyncs share one journal commit and one cache flush where
    one after the other each may issue its own. After it, ``final``'s parent: the rename."""
    partial, final = Path(partial), Path(final)
    _fsync_dirs([*(sub for sub in partial.iterdir() if sub.is_dir()), partial])
    trash = None
    if final.exists():
        trash = final.with_name(f".{final.name}.replaced.{os.getpid()}")
        os.replace(final, trash)
    os.replace(partial, final)
    fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)  # best effort: the new checkpoint is committed
