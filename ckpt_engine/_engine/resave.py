"""Saving over a committed checkpoint, and moving ``latest``.

* ``save(n)`` when ``iter_n`` is already committed is refused with
  :class:`CheckpointExistsError` unless ``allow_overwrite`` is set. Locally the replacement is
  crash-safe: the new checkpoint is written in a hidden folder and swapped in by two renames
  (a crash between them is undone at the next start, see :mod:`ckpt_engine._format.layout`). On an
  object store a replacement deletes the old checkpoint's completion marker before uploading
  (no rename there): a crash mid-upload leaves no checkpoint under that name.
* ``latest_checkpoint.txt`` only ever moves forward: a save of an iteration older than the one
  it names is committed, but ``latest`` keeps naming the newer checkpoint.
"""

from __future__ import annotations

import logging
import os

from .._format.layout import check_complete
from .._format.names import MANIFEST_FILE, parse_iteration
from .._format.pointer import read_latest, write_latest
from .._storage.store import Store
from ..errors import CheckpointExistsError, CkptEngineError

__all__ = ["advance_latest", "is_committed", "refuse_resave"]

logger = logging.getLogger("ckpt_engine")


def is_committed(path: str, store: Store) -> bool:
    """Whether ``path`` holds a committed checkpoint: its manifest (the engine's completion
    marker), or, for a checkpoint without one (plain DCP, the original checkpointer), complete."""
    if store.is_object_store:
        return store.exists(store.join(path, MANIFEST_FILE))
    if not os.path.isdir(path):
        return False
    if os.path.exists(os.path.join(path, MANIFEST_FILE)):
        return True
    try:
        check_complete(path)
    except CkptEngineError:
        return False
    return True


def _never_named(path: str, iteration: int, store: Store) -> bool:
    """Whether the committed ``path`` is newer than what its save folder's ``latest`` names (or
    there is no ``latest``): a commit killed between its rename and the pointer update. Nothing
    resumed from it, and a resumed run redoes and re-saves that iteration."""
    save_dir = os.path.dirname(path.rstrip("/"))
    try:
        latest = read_latest(save_dir, store)
    except CkptEngineError:
        return False  # an unreadable pointer: refuse, the user decides
    named = parse_iteration(latest) if latest is not None else None
    return named is None or named < iteration


def refuse_resave(iteration: int, targets: list[tuple[str, Store]], allow: bool) -> None:
    """Raise :class:`CheckpointExistsError` if any of ``targets`` (``(path, store)``) is a
    committed checkpoint and ``allow`` (``allow_overwrite``) is false. A committed checkpoint
    that ``latest`` never named (its commit was killed before the pointer moved) is replaced: the
    run that redoes its iteration resumed from an older one."""
    for path, store in targets:
        if not is_committed(path, store):
            continue
        if _never_named(path, iteration, store):
            logger.warning(
                "iteration %d is committed at %s but latest_checkpoint.txt never named it (a commit interrupted "
                "before the pointer moved); replacing it",
                iteration,
                path,
            )
            continue
        if allow:
            logger.warning("iteration %d is committed at %s; replacing it (allow_overwrite=True)", iteration, path)
            return
        raise CheckpointExistsError(
            f"iteration {iteration} is already committed at {path}; refusing to replace it. Save under a new "
            "iteration, delete the old checkpoint, or set allow_overwrite=True to replace it"
        )


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
