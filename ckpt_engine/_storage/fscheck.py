"""File-type and containment checks for local checkpoint files, done before anything is opened.

* Opening a FIFO for reading blocks until a writer appears (forever, for a planted one), and a
  device file can be endless: :func:`require_regular_file` refuses anything but a regular file.
  :func:`read_regular` opens without blocking and checks the opened file itself, so no swap
  between the check and the read can get past it.
* A data file symlinked to a same-size file elsewhere would load as the checkpoint's own:
  :func:`require_inside` refuses a path that resolves outside its checkpoint folder.

Object stores have neither FIFOs nor symlinks; callers skip these checks there.
"""

from __future__ import annotations

import io
import os
import stat

from ..errors import CorruptCheckpointError

__all__ = ["open_regular", "read_regular", "require_inside", "require_regular_file"]


def _kind(mode: int) -> str:
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device file"
    return "not a regular file"


def _refuse(path: str, mode: int, what: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"{path} is {_kind(mode)}, not a regular file; expected {what}. Replace it with the real file (a "
        "pipe or device here would block or feed the reader forever)"
    )


def require_regular_file(path: str | os.PathLike[str], what: str = "a checkpoint file") -> None:
    """Raise :class:`CorruptCheckpointError` if ``path`` exists and is not a regular file (after
    following symlinks). A missing file passes: the caller's open reports that as it always did."""
    path = os.fspath(path)
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return
    if not stat.S_ISREG(mode):
        raise _refuse(path, mode, what)


def _open_checked(path: str, what: str) -> int:
    """A descriptor of the regular file ``path``: opened with ``O_NONBLOCK`` and checked as opened,
    so a FIFO (or one swapped in after a check) is refused instead of waited on."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(21, "Is a directory", path)
        if not stat.S_ISREG(mode):
            raise _refuse(path, mode, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_regular(path: str | os.PathLike[str], what: str = "a checkpoint file") -> io.BufferedReader:
    """The regular file ``path`` opened for binary reading (see :func:`_open_checked`).
    ``FileNotFoundError`` / ``PermissionError`` / ``IsADirectoryError`` pass through."""
    fd = _open_checked(os.fspath(path), what)
    try:
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike[str], limit: int | None = None, what: str = "a checkpoint file") -> bytes:
    """The content of the regular file ``path`` (at most ``limit`` + 1 bytes), read in chunks so a
    large ``limit`` allocates nothing up front. ``FileNotFoundError`` / ``PermissionError`` /
    ``IsADirectoryError`` pass through."""
    fd = _open_checked(os.fspath(path), what)
    try:
        chunks, want = [], (limit + 1) if limit is not None else None
        while want is None or want > 0:
            chunk = os.read(fd, 1 << 20 if want is None else min(want, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            if want is not None:
                want -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def require_inside(root: str | os.PathLike[str], path: str | os.PathLike[str]) -> None:
    """Raise :class:`CorruptCheckpointError` if ``path`` (a file of the checkpoint folder ``root``)
    resolves, through symlinks, to somewhere outside ``root`` itself (as resolved)."""
    real_root = os.path.realpath(root)
    real = os.path.realpath(path)
    if real != real_root and not real.startswith(real_root.rstrip(os.sep) + os.sep):
        raise CorruptCheckpointError(
            f"{os.fspath(path)} resolves to {real}, outside its checkpoint folder {real_root}; a checkpoint's "
            "files must be its own (replace the symlink with the file, or copy the checkpoint)"
        )
