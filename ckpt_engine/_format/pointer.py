"""The save folder's index: ``latest_checkpoint.txt`` (read, validated, replaced atomically) and
the list of its ``iter_*`` checkpoints."""

from __future__ import annotations

import logging
import os

from .._storage.store import Store, store_for
from ..errors import CheckpointPermissionError, CkptEngineError, CorruptCheckpointError, denied
from .names import LATEST_FILE, parse_iteration

__all__ = ["advance_latest", "list_checkpoints", "read_latest", "write_latest"]

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


def advance_latest(save_dir: str, name: str, store: Store | None = None) -> bool:
    """Point ``latest_checkpoint.txt`` at ``name`` unless it names a newer iteration already;
    returns whether it moved. An unreadable pointer is replaced."""
    new = parse_iteration(name)
    try:
        current = read_latest(save_dir, store)
    except CkptEngineError:
        current = None
    old = parse_iteration(current) if current is not None else None
    if new is not None and old is not None and old > new:
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
