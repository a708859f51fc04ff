"""Saving over a committed checkpoint, and moving ``latest``.

* ``save(n)`` when ``iter_n`` is already committed is refused with
  :class:`CheckpointExistsError` unless ``allow_overwrite`` is set. Locally the replacement is
  crash-safe: the new checkpoint is written in a hidden folder and swapped in by two renames
  (a crash between them is undone at the next start, see :mod:`ckpt_engine._format.layout`). On an
  object store (no rename there) the new copy is uploaded under ``.iter_n.replacing/`` and
  committed there with its own manifest; only then is it copied over the old one
  (:func:`promote_replacement`: the old marker goes first, the new marker last). A kill before
  the new copy's marker keeps the old checkpoint; a kill after it keeps the new one, which the
  next engine started on that ``save_dir`` finishes moving into place
  (:func:`recover_replacements`).
* ``latest_checkpoint.txt`` only ever moves forward: a save of an iteration older than the one
  it names is committed, but ``latest`` keeps naming the newer checkpoint. Except with
  ``allow_overwrite``, where such a save made by an engine that did not save the newer ones is a
  run that went back to an older step and rewrites the history from there
  (:func:`rewind_latest`): the newer checkpoints, of the history it left, are moved aside into
  :data:`ABANDONED_DIR` and ``latest`` names the new save.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Collection
from typing import cast

from .._format.layout import check_complete
from .._format.names import MANIFEST_FILE, RANK_PART_PREFIX, iter_dirname, parse_iteration, replaced_name
from .._format.pointer import advance_latest, list_checkpoints, read_latest, write_latest
from .._storage.store import FsspecStore, Store, store_for
from ..errors import CheckpointExistsError, CkptEngineError

__all__ = [
    "ABANDONED_DIR",
    "advance_latest",
    "is_committed",
    "move_latest",
    "newest_unnamed",
    "promote_replacement",
    "recover_replacements",
    "refuse_resave",
    "rewind_latest",
]

logger = logging.getLogger("ckpt_engine")


def is_committed(path: str, store: Store) -> bool:
    """Whether ``path`` holds a committed checkpoint: its manifest (the engine's completion
    marker), or, for a checkpoint without one (plain DCP, the original checkpointer), complete."""
    if not store.capabilities.commit_by_rename:  # the manifest is the completion marker
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


def newest_unnamed(save_dir: str, store: Store, latest: str | None) -> str | None:
    """The newest checkpoint folder of ``save_dir`` newer than the one ``latest`` names (any,
    where there is no ``latest``) that holds its manifest, or ``None``. Its commit completed (the
    manifest is written inside the hidden folder before the rename into place, and last of all
    on an object store) but the save was stopped before ``latest_checkpoint.txt`` moved: it is
    the newest complete state, which a resume adopts (``Loader``) instead of redoing its
    iterations. Checkpoints without a manifest (plain DCP, the original checkpointer) are only
    ever resumed when ``latest`` names them, as the original does."""
    named = parse_iteration(latest) if latest is not None else None
    if latest is not None and named is None:
        return None  # a pointer to a folder of another naming: the user's, left alone
    for iteration, path in reversed(list_checkpoints(save_dir, store)):
        if named is not None and iteration <= named:
            return None
        if store.exists(store.join(path, MANIFEST_FILE)):
            return iter_dirname(iteration)
    return None


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


def promote_replacement(store: FsspecStore, staging: str, final: str) -> None:
    """Move the committed copy under ``staging`` (it holds its manifest) over ``final``.

    The old copy's marker is deleted first, so no reader takes a mix of the two for a
    checkpoint, then its objects; the new objects are copied server-side, the marker last, and
    ``staging`` is removed. Rerunnable from any point: :func:`recover_replacements` does that
    after a kill."""
    files = [rel for rel in store.list_files(staging) if not rel.startswith(RANK_PART_PREFIX)]
    if MANIFEST_FILE not in files:
        raise CkptEngineError(f"{staging} holds no {MANIFEST_FILE}: it is not a committed copy to move into place")
    marker = store.join(final, MANIFEST_FILE)
    if store.exists(marker):
        store.remove_file(marker)
    store.remove_tree(final)
    store.copy_files([(store.join(staging, rel), store.join(final, rel)) for rel in files if rel != MANIFEST_FILE])
    store.copy_files([(store.join(staging, MANIFEST_FILE), marker)])
    store.remove_tree(staging)


def recover_replacements(save_dir: str, store: FsspecStore) -> list[str]:
    """Finish or drop the object-store re-saves a kill interrupted (rank 0, at engine start).

    A ``.iter_n.replacing`` prefix with its manifest is a committed new copy: it is moved into
    place. One without is a re-save killed before its commit: it is removed, and the old
    checkpoint, never touched, stays. Returns the checkpoints moved into place."""
    moved = []
    for name, is_dir in store.list_dir(save_dir):
        target = replaced_name(name)
        if target is None or not is_dir:
            continue
        staging, final = store.join(save_dir, name), store.join(save_dir, target)
        if store.exists(store.join(staging, MANIFEST_FILE)):
            logger.warning("finishing the replacement of %s interrupted by a crash (its new copy is committed)", final)
            promote_replacement(store, staging, final)
            moved.append(final)
        else:
            logger.warning("removing %s: a re-save of %s killed before its commit (the old copy stays)", staging, final)
            store.remove_tree(staging)
    return moved


def move_latest(folder: str, name: str, store: Store | None, committed: set[int], allow_overwrite: bool) -> None:
    """Rank 0, after the commit of ``name`` into the save folder ``folder`` (``committed``: the
    iterations this engine committed, ``name``'s added): move its ``latest`` forward
    (:func:`advance_latest`); with ``allow_overwrite``, back to ``name`` where this save went back
    to an older step (:func:`rewind_latest`)."""
    iteration = parse_iteration(name)
    if iteration is not None:
        committed.add(iteration)
    if advance_latest(folder, name, store, warn=not allow_overwrite) or not allow_overwrite:
        return
    if not rewind_latest(folder, name, store_for(folder, store), committed):
        advance_latest(folder, name, store)  # the engine's own newer save stays named: said why


#: Where :func:`rewind_latest` moves the checkpoints of a history a run left (``<save_dir>/
#: .ckpt_engine_abandoned/<the save that left it>-<UTC time>-<random>/iter_N``): kept, never
#: resumed or retained.
ABANDONED_DIR = ".ckpt_engine_abandoned"


def rewind_latest(save_dir: str, name: str, store: Store, ours: Collection[int]) -> list[str]:
    """``allow_overwrite``: the save ``name`` was committed while ``latest`` names a newer
    iteration. Where this engine saved neither that one nor any checkpoint newer than ``name``
    (``ours``: the iterations it committed), the run went back to an older step (a resume of an
    older checkpoint) and rewrites the history from there: the newer checkpoints descend from the
    history it left, and a resume (``latest``, or the newest committed one ``latest`` does not name)
    must never take them. Each is moved into :data:`ABANDONED_DIR`, the one ``latest`` names last,
    then ``latest`` names ``name``; returns what was moved.

    A crash in between leaves either ``latest`` naming the old newest (as before this save) or,
    after its move, a ``latest`` that names a missing checkpoint: an error at the next resume
    (or, with ``fallback_to_last_complete``, the newest complete one, this save), never another
    history resumed in silence."""
    iteration = parse_iteration(name)
    try:
        named = read_latest(save_dir, store)
    except CkptEngineError:
        return []
    current = parse_iteration(named) if named is not None else None
    if iteration is None or current is None or current <= iteration:
        return []
    newer = [(it, path) for it, path in list_checkpoints(save_dir, store) if it > iteration]
    if any(it in ours for it, _ in newer):
        return []  # this engine's own newer saves: the ordinary rule (latest never moves back)
    # One folder per rewind: a run may go back to the same step again (its own abandoned history
    # then goes beside the first one's, never over it).
    aside = store.join(
        save_dir, ABANDONED_DIR, f"{name}-{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{secrets.token_hex(3)}"
    )
    moved: list[str] = []
    for _, path in sorted(newer, key=lambda p: p[0] == current):  # the one latest names last
        _move_tree(store, path, store.join(aside, os.path.basename(path.rstrip("/"))))
        moved.append(path)
    write_latest(save_dir, name, store)
    logger.warning(
        "%s was saved after a resume of an older step (allow_overwrite=True): the checkpoints of the history it "
        "left (%s) are moved to %s, and latest_checkpoint.txt names %s",
        name,
        ", ".join(os.path.basename(p.rstrip("/")) for p in moved),
        aside,
        name,
    )
    return moved


def _move_tree(store: Store, source: str, target: str) -> None:
    """Move the folder ``source`` to ``target`` (a rename locally; copies then removals elsewhere)."""
    if store.capabilities.local_files:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.replace(source, target)
        return
    remote = cast(FsspecStore, store)  # every store without local files is one
    files = remote.list_files(source)
    remote.copy_files([(store.join(source, rel), store.join(target, rel)) for rel in files])
    marker = store.join(source, MANIFEST_FILE)
    if MANIFEST_FILE in files:  # the commit marker first: no reader takes what is left for a checkpoint
        store.remove_file(marker)
    store.remove_tree(source)
