"""What a folder given as a checkpoint is, when it is not one: a save folder (its checkpoints are
inside), the folder above a save folder, or a folder of something else. The errors say what it
is and what was probably meant, instead of blaming an interrupted save."""

from __future__ import annotations

from collections.abc import Sequence

from .._storage.store import Store
from ..errors import CheckpointNotFoundError, NotACheckpointError
from ..types import STANDARD_COMPONENTS
from .names import LATEST_FILE, METADATA_FILE, parse_iteration
from .pointer import list_checkpoints, read_latest

__all__ = ["diagnose_not_checkpoint", "resolve_save_folder"]


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
