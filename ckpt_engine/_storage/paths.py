"""The folders a config names: checked when the engine starts (a bad ``save_dir`` is reported as
what it is instead of as a failed save later), and compared by one rule wherever the engine asks
whether two of them are one folder."""

from __future__ import annotations

import errno
import os

from ..errors import SaveDirError
from .urls import is_url, local_path

__all__ = ["check_local_save_dir", "same_folder"]


def same_folder(a: str, b: str) -> bool:
    """Whether the folders ``a`` and ``b`` are one: URLs (other than ``file://``) equal but for a
    trailing ``/``; local paths (``file://`` URLs too) equal as absolute paths or as real paths
    (symbolic links followed), so a symlinked spelling of ``save_dir`` is ``save_dir``.

    The one rule for "is this ``save_dir``": whether a resume consults the node-local tier and
    repairs ``latest``, whether ``load_path`` starts another run (a warm start), and whether an
    integration's pointer names this run's folder."""
    if is_url(a) or is_url(b):
        return a.rstrip("/") == b.rstrip("/")
    la, lb = os.path.abspath(local_path(a)), os.path.abspath(local_path(b))
    return la == lb or os.path.realpath(la) == os.path.realpath(lb)


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
