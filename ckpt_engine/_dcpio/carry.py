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
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import BinaryIO

from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

__all__ = ["GROUP_BYTES", "FileGroup", "create_new", "group_items", "link_file"]

#: Stable tensors of at least this size get a file of their own; smaller ones are packed in
#: order into files of about this size (a changed one rewrites at most about this much).
GROUP_BYTES = 64 << 20
_BUFFER = 1 << 20


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


def link_file(source: str, target: str, size: int) -> str | None:
    """Make ``target`` a hard link to ``source``, a committed file of ``size`` bytes.

    Returns ``None`` on success, else why the file must be written instead (the source is gone,
    has another size, or the filesystem refuses links: another device, no link support, too many
    links). ``target`` is removed first if it exists (what a crashed save left)."""
    try:
        st = os.stat(source)
    except FileNotFoundError:
        return f"{source} no longer exists (retention removed it?)"
    except OSError as err:
        return f"cannot stat {source}: {err.strerror or err}"
    if st.st_size != size:
        return f"{source} has {st.st_size} bytes, its manifest says {size}"
    _remove(target)
    try:
        os.link(source, target)
    except FileNotFoundError:
        return f"{source} no longer exists (retention removed it?)"
    except OSError as err:
        name = errno.errorcode.get(err.errno or 0, "error")
        return f"hard links from {os.path.dirname(source)} are refused here ({name}: {err.strerror})"
    if os.stat(target).st_size != size:  # replaced between the checks: never keep a mismatch
        _remove(target)
        return f"{source} changed while it was linked"
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
