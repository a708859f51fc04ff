"""Incremental saves (``EngineConfig.incremental``) in the storage writer: files laid out so that
what did not change can be carried over whole, and the carrying over itself.

A rank's items go into two kinds of files, by a rule that depends only on the items and the
engine's hint of which ones should not change (``CarryOver.stable``: the model's frozen
parameters and its buffers), so the same state gives the same files, with the same names, at
every save:

* *stable* files: each hinted tensor of at least :data:`GROUP_BYTES` in a file of its own, the
  smaller ones packed in order into files of about that size. Before one is written, the bytes
  it would hold are hashed with the manifest's algorithm; when the previous checkpoint's
  manifest lists a file of that name with the same size and checksum, the file is carried over
  (a hard link to it) instead of written. Content decides, never the hint, a version counter or
  a pointer: a hinted tensor that did change, by any means, changes the bytes and is written.
* *other* files: everything else (trainable parameters, optimizer state, values), laid out and
  written as a full save writes them, one file per writer thread: every byte of them changes
  at every training step, so comparing them would cost and never pay. Few large files keep a
  save where everything changes as fast as without ``incremental`` (each file costs a few
  milliseconds of ``fsync`` on its own).

A carried-over file is shared between checkpoints, so nothing may ever write through it: every
file the writer creates is a new inode (:func:`create_new`), never an existing one truncated.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from .._format.hashing import hash_stream, new_hasher
from .._storage.store import local_file_version

__all__ = ["GROUP_BYTES", "CarriedFile", "FileGroup", "create_new", "group_items", "link_file"]

logger = logging.getLogger("ckpt_engine")

#: Stable tensors of at least this size get a file of their own; smaller ones are packed in
#: order into files of about this size (a changed one rewrites at most about this much).
GROUP_BYTES = 64 << 20
_BUFFER = 1 << 20


@dataclass(frozen=True)
class CarriedFile:
    """A file of the previous checkpoint, as its manifest lists it: what carrying it over needs."""

    size: int
    checksum: str
    algorithm: str
    #: Its version at commit (:func:`.local_file_version`); ``None``: not recorded.
    seen: str | None


@dataclass(frozen=True)
class FileGroup:
    """The items of one file, and whether it may be carried over (a *stable* file)."""

    items: list[WriteItem]
    stable: bool


def group_items(
    items: Sequence[WriteItem],
    nbytes: Callable[[WriteItem], int],
    stable: frozenset[str],
    buckets: Callable[[list[WriteItem]], list[list[WriteItem]]],
    *,
    keep_order: bool = False,
) -> list[FileGroup]:
    """The files of an incremental save: a deterministic function of ``items`` (in their order)
    and the ``stable`` hint (storage keys). Stable files come first, then the others as
    ``buckets`` splits them (the full save's layout). ``keep_order``: a writer that must write
    the items in the order given (staging windows) gets consecutive runs instead, split where
    the hint changes. Returns no empty file."""
    if keep_order:
        return _runs(items, nbytes, stable)
    hinted = [i for i in items if i.type != WriteItemType.BYTE_IO and i.index.fqn in stable]
    others = [i for i in items if i.type == WriteItemType.BYTE_IO or i.index.fqn not in stable]
    groups = [FileGroup(g, True) for g in _packs(hinted, nbytes)]
    return groups + [FileGroup(g, False) for g in buckets(others) if g]


def _packs(items: Sequence[WriteItem], nbytes: Callable[[WriteItem], int]) -> list[list[WriteItem]]:
    files: list[list[WriteItem]] = []
    pack: list[WriteItem] = []
    packed = 0
    for item in items:
        size = nbytes(item)
        if size >= GROUP_BYTES:
            files.append([item])
            continue
        pack.append(item)
        packed += size
        if packed >= GROUP_BYTES:
            files.append(pack)
            pack, packed = [], 0
    if pack:
        files.append(pack)
    return files


def _runs(items: Sequence[WriteItem], nbytes: Callable[[WriteItem], int], stable: frozenset[str]) -> list[FileGroup]:
    groups: list[FileGroup] = []
    run: list[WriteItem] = []
    run_stable = False
    for item in items:
        hinted = item.type != WriteItemType.BYTE_IO and item.index.fqn in stable
        if run and hinted != run_stable:
            groups += [FileGroup(g, run_stable) for g in (_packs(run, nbytes) if run_stable else [run])]
            run = []
        run_stable = hinted
        run.append(item)
    if run:
        groups += [FileGroup(g, run_stable) for g in (_packs(run, nbytes) if run_stable else [run])]
    return groups


def link_file(source: str, target: str, expected: CarriedFile) -> str | None:
    """Make ``target`` a hard link to ``source``, a file of the previous checkpoint that its
    manifest lists as ``expected``, if ``source`` still holds those bytes.

    It does when it is a regular file (a symlink is never followed, nor linked) of the recorded
    size, and either its version is still the one recorded at commit (nothing wrote, replaced
    or touched it since), or its bytes, read again, still have the recorded checksum: the
    version also changes for what leaves the bytes alone (retention removing another link to
    the file), and a manifest from before versions were recorded has none.

    Returns ``None`` on success, else why the file must be written instead (the source is gone,
    changed, not a regular file, or the filesystem refuses links: another device, no link
    support, too many links). ``target`` is removed first if it exists (what a crashed save left)."""
    try:
        st = os.lstat(source)
    except FileNotFoundError:
        return f"{source} no longer exists (retention removed it?)"
    except OSError as err:
        return f"cannot stat {source}: {err.strerror or err}"
    if not stat.S_ISREG(st.st_mode):
        what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        return f"{source} is {what}; a checkpoint's files must be its own"
    if st.st_size != expected.size:
        return f"{source} has {st.st_size} bytes, its manifest says {expected.size}"
    if expected.seen is None or local_file_version(st) != expected.seen:
        reason = _vouch_by_reading(source, st, expected)
        if reason is not None:
            return reason
    _remove(target)
    try:
        os.link(source, target, follow_symlinks=False)
    except FileNotFoundError:
        return f"{source} no longer exists (retention removed it?)"
    except OSError as err:
        name = errno.errorcode.get(err.errno or 0, "error")
        return f"hard links from {os.path.dirname(source)} are refused here ({name}: {err.strerror})"
    now = os.lstat(target)
    if (now.st_ino, now.st_size, now.st_mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns):
        _remove(target)  # replaced or written between the checks: never keep a mismatch
        return f"{source} changed while it was linked"
    return None


def _vouch_by_reading(source: str, st: os.stat_result, expected: CarriedFile) -> str | None:
    """Hash ``source`` (whose ``lstat`` is ``st``) again; ``None`` when its bytes still have the
    recorded checksum, else why it cannot be carried over."""
    hasher = new_hasher(expected.algorithm)
    if hasher is None:
        return f"{source} cannot be checked: checksum algorithm {expected.algorithm!r} is not available here"
    t = time.perf_counter()
    try:
        fd = os.open(source, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as err:
        return f"cannot read {source}: {err.strerror or err}"
    try:
        if os.fstat(fd).st_ino != st.st_ino:
            return f"{source} was replaced while it was checked"
        with os.fdopen(os.dup(fd), "rb", buffering=0) as f:
            hash_stream(f, hasher)
    finally:
        os.close(fd)
    if hasher.hexdigest() != expected.checksum:
        return f"{source} changed since its checkpoint was committed (its bytes no longer have the manifest's checksum)"
    logger.info(
        "%s: version changed since its commit, bytes unchanged (re-read %d bytes in %.3fs); carried over",
        source,
        st.st_size,
        time.perf_counter() - t,
    )
    return None


def create_new(path: str) -> BinaryIO:
    """Open ``path`` for writing as a new file: an existing one (perhaps a link shared with a
    committed checkpoint) is unlinked first, never truncated and written through."""
    _remove(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    return os.fdopen(fd, "wb", buffering=_BUFFER)


def _remove(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
