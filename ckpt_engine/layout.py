"""The on-disk layout shared with the original checkpointer (DESIGN section 2).

::

    <save_dir>/
      iter_000000005/{model,optim,scheduler,trainer,<extra>}/   # one DCP checkpoint each
      latest_checkpoint.txt                                      # "iter_000000005\\n"

Uncommitted saves live in a hidden sibling (``.iter_000000005.partial``) and are renamed into
place only when every component is written.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from ._metadata import METADATA_FILE, read_metadata
from .errors import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError

LATEST_FILE = "latest_checkpoint.txt"
_ITER_RE = re.compile(r"^iter_(\d{9,})$")
PARTIAL_SUFFIX = ".partial"


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:09}"


def partial_dirname(iteration: int) -> str:
    return f".{iter_dirname(iteration)}{PARTIAL_SUFFIX}"


def parse_iteration(name: str) -> int | None:
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or file creation inside ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # e.g. some network filesystems refuse fsync on a directory
    finally:
        os.close(fd)


def read_latest(load_dir: str | os.PathLike[str]) -> str | None:
    """The checkpoint folder name ``latest_checkpoint.txt`` names, or ``None`` if there is none.

    The content must be one folder name inside ``load_dir``: a path separator, ``..`` or an
    absolute path is refused, so a tampered pointer cannot send the loader elsewhere.
    """
    path = os.path.join(os.fspath(load_dir), LATEST_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read(4096)
    except FileNotFoundError:
        return None
    except UnicodeDecodeError as err:
        raise CorruptCheckpointError(f"{path} is not text; expected a folder name like 'iter_000000100'") from err
    except OSError as err:
        raise CorruptCheckpointError(f"cannot read {path}: {err.strerror or err}") from err
    name = raw.strip()
    if not name:
        raise CorruptCheckpointError(
            f"{path} is empty; expected a folder name like 'iter_000000100'. Delete the file to start "
            "from scratch, or write the name of the checkpoint to resume"
        )
    if "/" in name or "\\" in name or name in (".", "..") or os.path.isabs(name) or "\n" in name or "\0" in name:
        raise CorruptCheckpointError(
            f"{path} holds {name[:80]!r}; it must name one checkpoint folder inside {os.fspath(load_dir)!r} "
            "(no path separators, '..' or absolute paths)"
        )
    return name


def write_latest(save_dir: str | os.PathLike[str], name: str) -> None:
    """Atomically point ``latest_checkpoint.txt`` at ``name`` (temp file, fsync, rename, fsync dir)."""
    save_dir = os.fspath(save_dir)
    final = os.path.join(save_dir, LATEST_FILE)
    tmp = f"{final}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(f"{name}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, final)
    fsync_dir(save_dir)


def component_dirs(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Component folder names inside a checkpoint folder, sorted."""
    try:
        entries = sorted(os.scandir(checkpoint_dir), key=lambda e: e.name)
    except FileNotFoundError as err:
        raise CheckpointNotFoundError(f"checkpoint folder {os.fspath(checkpoint_dir)!r} does not exist") from err
    except NotADirectoryError as err:
        raise CheckpointNotFoundError(f"{os.fspath(checkpoint_dir)!r} is not a checkpoint folder") from err
    return [e.name for e in entries if e.is_dir() and not e.name.startswith(".")]


@dataclass(frozen=True)
class CheckedCheckpoint:
    path: str
    #: component -> its DCP metadata, read safely.
    components: dict[str, Metadata]


def check_complete(checkpoint_dir: str | os.PathLike[str]) -> CheckedCheckpoint:
    """Verify a checkpoint is complete: every component folder has ``.metadata`` and every byte
    range that metadata names exists in its data file. Raises a typed error naming the file."""
    path = os.fspath(checkpoint_dir)
    names = component_dirs(path)
    if not names:
        raise IncompleteCheckpointError(f"checkpoint folder {path!r} holds no component folders")
    out: dict[str, Metadata] = {}
    for name in names:
        cdir = os.path.join(path, name)
        md = read_metadata(cdir)
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
            fpath = os.path.join(cdir, rel)
            try:
                size = os.stat(fpath).st_size
            except FileNotFoundError as err:
                raise IncompleteCheckpointError(f"{fpath} is missing; {METADATA_FILE} references it") from err
            if size < end:
                raise IncompleteCheckpointError(
                    f"{fpath} is truncated: {size} bytes, but {METADATA_FILE} needs at least {end}"
                )
        out[name] = md
    return CheckedCheckpoint(path=path, components=out)


def list_checkpoints(save_dir: str | os.PathLike[str]) -> list[tuple[int, str]]:
    """``(iteration, path)`` of every ``iter_*`` folder in ``save_dir``, oldest first (complete or not)."""
    try:
        entries = list(os.scandir(save_dir))
    except FileNotFoundError:
        return []
    found = []
    for e in entries:
        it = parse_iteration(e.name)
        if it is not None and e.is_dir():
            found.append((it, e.path))
    return sorted(found)


def remove_tree(path: str | os.PathLike[str]) -> None:
    shutil.rmtree(path, ignore_errors=False)


def commit_rename(partial: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Move a fully written ``partial`` folder into place as ``final``, replacing an old one."""
    partial, final = Path(partial), Path(final)
    for sub in partial.iterdir():
        if sub.is_dir():
            fsync_dir(sub)
    fsync_dir(partial)
    trash = None
    if final.exists():
        trash = final.with_name(f".{final.name}.replaced.{os.getpid()}")
        os.replace(final, trash)
    os.replace(partial, final)
    fsync_dir(final.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)  # best effort: the new checkpoint is committed
