"""The save folder's index: ``latest_checkpoint.txt`` (read, validated, replaced atomically), the
list of its ``iter_*`` checkpoints, and what a folder given as a checkpoint is when it is not one
(a save folder, whose checkpoints are inside; the folder above a save folder; a folder of
something else): the errors say what it is and what was probably meant, instead of blaming an
interrupted save."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

from .._storage.store import Store, store_for
from ..errors import (
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CkptEngineError,
    CorruptCheckpointError,
    NotACheckpointError,
    denied,
)
from ..types import STANDARD_COMPONENTS
from .names import LATEST_FILE, METADATA_FILE, parse_iteration

__all__ = [
    "advance_latest",
    "diagnose_not_checkpoint",
    "list_checkpoints",
    "read_latest",
    "resolve_save_folder",
    "write_latest",
]

logger = logging.getLogger("ckpt_engine")


def read_latest(load_dir: str | os.PathLike[str], store: Store | None = None) -> str | None:
    """The checkpoint folder name ``latest_checkpoint.txt`` names, or ``None`` if there is none.

    The content must be one folder name inside ``load_dir``: a path separator, ``..`` or an
    absolute path is refused, so a tampered pointer cannot send the loader elsewhere.
    """
    store = store_for(load_dir, store)
    path = store.join(os.fspath(load_dir), LATEST_FILE)
    try:
        raw = store.read_bytes(path, 4096)[:4096].decode("utf-8")
    except FileNotFoundError:
        return None
    except PermissionError as err:
        raise CheckpointPermissionError(f"cannot read {path}: {denied(err, 'make it readable')}") from err
    except IsADirectoryError as err:
        raise CorruptCheckpointError(f"{path} is a folder; expected a file naming the latest checkpoint") from err
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


def write_latest(save_dir: str | os.PathLike[str], name: str, store: Store | None = None) -> None:
    """Atomically point ``latest_checkpoint.txt`` at ``name`` (locally: temp file, fsync, rename,
    fsync dir; on an object store: one PUT, which replaces the object atomically)."""
    save_dir = os.fspath(save_dir)
    store = store_for(save_dir, store)
    store.write_bytes(store.join(save_dir, LATEST_FILE), f"{name}\n".encode())


def advance_latest(save_dir: str, name: str, store: Store | None = None, *, warn: bool = True) -> bool:
    """Point ``latest_checkpoint.txt`` at ``name`` unless it names a newer iteration already
    (logged, where ``warn``); returns whether it moved. An unreadable pointer is replaced."""
    new = parse_iteration(name)
    try:
        current = read_latest(save_dir, store)
    except CkptEngineError:
        current = None
    old = parse_iteration(current) if current is not None else None
    if new is not None and old is not None and old > new:
        if not warn:
            return False
        logger.warning(
            "committed %s, but latest_checkpoint.txt in %s names the newer %s: it is left there (latest never "
            "moves to an older iteration)",
            name,
            save_dir,
            current,
        )
        return False
    write_latest(save_dir, name, store)
    return True


def list_checkpoints(save_dir: str | os.PathLike[str], store: Store | None = None) -> list[tuple[int, str]]:
    """``(iteration, path)`` of every ``iter_*`` folder in ``save_dir``, oldest first (complete or not)."""
    save_dir = os.fspath(save_dir)
    store = store_for(save_dir, store)
    try:
        entries = store.list_dir(save_dir)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name, is_dir in entries:
        it = parse_iteration(name)
        if it is not None and is_dir:
            found.append((it, store.join(save_dir, name)))
    return sorted(found)


# -- a folder given as a checkpoint that is not one ---------------------------------------------


def _iter_names(path: str, store: Store) -> list[str]:
    return [p.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1] for _, p in list_checkpoints(path, store)]


def _is_save_folder(path: str, store: Store) -> bool:
    return store.exists(store.join(path, LATEST_FILE)) or bool(_iter_names(path, store))


def resolve_save_folder(path: str, store: Store, what: str = "load_path") -> str | None:
    """The checkpoint a save folder's ``latest_checkpoint.txt`` names, or ``None`` when ``path``
    is not a save folder. A save folder without that file is an error naming its newest checkpoint."""
    if not _is_save_folder(path, store):
        return None
    latest = read_latest(path, store)
    if latest is not None:
        target = store.join(path, latest)
        if not store.isdir(target):
            raise CheckpointNotFoundError(
                f"{what} {path!r} is a save folder whose {LATEST_FILE} names {latest!r}, but {target} does not "
                f"exist; name one of its checkpoints instead"
            )
        return target
    names = _iter_names(path, store)
    raise NotACheckpointError(
        f"{what} {path!r} is a save folder without {LATEST_FILE}; name one of its checkpoints, e.g. "
        f"{store.join(path, names[-1])} (newest: {', '.join(names[-3:])})"
    )


def diagnose_not_checkpoint(path: str, names: Sequence[str], store: Store) -> NotACheckpointError | None:
    """Why ``path``, whose sub-folders are ``names``, is not a checkpoint; ``None`` when at least
    one sub-folder is a DCP component (then it is a checkpoint, complete or not)."""
    if any(store.exists(store.join(path, n, METADATA_FILE)) for n in names):
        return None
    iters = _iter_names(path, store)
    if iters or store.exists(store.join(path, LATEST_FILE)):
        shown = ", ".join(iters[-3:]) or "none yet"
        return NotACheckpointError(
            f"{path} is a save folder (it holds checkpoints: {shown}), not one checkpoint; load a checkpoint "
            f"inside it (e.g. {store.join(path, iters[-1]) if iters else path + '/iter_XXXXXXXXX'}), or resume "
            f"it with load_dir={path!r}"
        )
    inner = [n for n in names if _is_save_folder(store.join(path, n), store)]
    if inner:
        save = store.join(path, inner[0])
        return NotACheckpointError(
            f"{path} is not a checkpoint: it holds the save folder {save}; did you mean {save} "
            "(its latest checkpoint) or a checkpoint inside it?"
        )
    base = path.rstrip("/").replace("\\", "/").rsplit("/", 1)[-1]
    if parse_iteration(base) is not None or set(names) & set(STANDARD_COMPONENTS):
        return None  # shaped like a checkpoint: an interrupted save
    return NotACheckpointError(
        f"{path} is not a checkpoint: none of its folders ({', '.join(names[:5])}"
        f"{', ...' if len(names) > 5 else ''}) holds a {METADATA_FILE} file, which every checkpoint "
        "component has"
    )
