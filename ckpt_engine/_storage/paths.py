"""Checks on the local folders a config names, made when the engine starts, so that a bad
``save_dir`` is reported as what it is instead of as a failed save later."""

from __future__ import annotations

import errno
import os

from ..errors import SaveDirError

__all__ = ["check_local_save_dir"]


def _name_max(folder: str) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        return 255


def check_local_save_dir(save_dir: str) -> None:
    """Refuse a local ``save_dir`` that can never hold checkpoints: a file (or a folder below a
    file), or a path with a name longer than the filesystem allows. A folder that does not exist
    yet is fine: the first save creates it."""
    path = os.path.abspath(save_dir)
    existing = path
    while not os.path.exists(existing):
        parent = os.path.dirname(existing)
        if parent == existing:
            break
        existing = parent
    if not os.path.isdir(existing):
        what = "is a file" if existing == path else f"is below {existing!r}, which is a file"
        raise SaveDirError(
            f"save_dir {save_dir!r} {what}; checkpoints are folders inside save_dir: point save_dir at a "
            "folder (a new one is created on the first save)"
        )
    limit = _name_max(existing)
    for part in path.split(os.sep):
        if len(part.encode()) > limit:
            raise SaveDirError(
                f"save_dir {save_dir!r} has a name of {len(part.encode())} bytes ({part[:40]!r}...), longer than "
                f"the filesystem allows ({limit}; {os.strerror(errno.ENAMETOOLONG)}); choose a shorter name"
            )
