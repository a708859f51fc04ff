"""Retention: delete old checkpoints after a commit (``keep_last`` / ``keep_every``).

Rules (docs/reliability.md):

* runs only after a successful commit, on one rank (rank 0), serialised with saves;
* never deletes the checkpoint ``latest_checkpoint.txt`` names, nor any checkpoint with a higher
  iteration (it may belong to another run whose ``latest`` was rolled back: ambiguous, so kept),
  nor an uncommitted save (those are hidden ``.iter_*.partial`` folders, never ``iter_*``);
* keeps the ``keep_last`` newest *complete* checkpoints up to ``latest`` and every checkpoint
  whose iteration is a multiple of ``keep_every``; an incomplete folder inside that window is
  left alone (it counts for nothing), one older than it is deleted with the rest;
* a checkpoint is deleted by renaming it to a hidden ``.iter_*.deleting`` folder first, so a
  crash never leaves a half-deleted ``iter_*`` folder; on an object store (no rename) its
  completion marker is deleted first, so a half-deleted prefix is one the loader ignores;
* a deletion that fails is logged and retried after the next commit; it never fails a save.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Collection
from dataclasses import dataclass, field

from .._storage.store import Store, store_for
from ..errors import CkptEngineError
from .layout import check_complete, find_leftovers, remove_checkpoint
from .names import MANIFEST_FILE, parse_iteration
from .pointer import list_checkpoints, read_latest

logger = logging.getLogger("ckpt_engine")

__all__ = ["RetentionResult", "apply_retention", "plan_retention"]


@dataclass(frozen=True)
class RetentionResult:
    deleted: list[str] = field(default_factory=list)
    #: ``(path, error)`` of deletions that failed; retried after the next commit.
    failed: list[tuple[str, str]] = field(default_factory=list)


def _is_complete(path: str, store: Store) -> bool:
    if not store.capabilities.commit_by_rename:  # the completion marker is written last (docs/storage.md)
        return store.exists(store.join(path, MANIFEST_FILE))
    try:
        check_complete(path)
    except CkptEngineError:
        return False
    return True


def plan_retention(
    save_dir: str, keep_last: int, keep_every: int | None = None, store: Store | None = None
) -> list[str]:
    """Paths of the checkpoints retention would delete now (see the module docstring)."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    store = store_for(save_dir, store)
    latest = read_latest(save_dir, store)
    latest_iter = parse_iteration(latest) if latest is not None else None
    if latest_iter is None:
        return []  # no (parsable) latest: nothing is provably old
    candidates = [(it, p) for it, p in list_checkpoints(save_dir, store) if it <= latest_iter]
    keep: set[str] = set()
    complete_kept = 0
    for it, path in sorted(candidates, reverse=True):
        if complete_kept >= keep_last:
            break
        keep.add(path)  # within the window: kept, complete or not
        if it == latest_iter or _is_complete(path, store):
            complete_kept += 1
    doomed = []
    for it, path in candidates:
        if path in keep or it == latest_iter:
            continue
        if keep_every is not None and it % keep_every == 0:
            continue
        doomed.append(path)
    return doomed


def apply_retention(
    save_dir: str,
    keep_last: int,
    keep_every: int | None = None,
    store: Store | None = None,
    *,
    in_use: Collection[int] = (),
) -> RetentionResult:
    """Delete what :func:`plan_retention` names (but the iterations ``in_use``: still being read,
    e.g. sent to a peer replica), and finish deletions an earlier run left half-done
    (``.iter_*.deleting``). Failures are logged and returned, never raised: retention is a
    best-effort side job, and the next commit retries."""
    store = store_for(save_dir, store)
    result = RetentionResult()
    for leftover in find_leftovers(save_dir):
        if leftover.kind == "deleting":
            try:
                shutil.rmtree(leftover.path)
            except FileNotFoundError:
                pass
            except OSError as err:
                result.failed.append((leftover.path, str(err)))
    try:
        doomed = plan_retention(save_dir, keep_last, keep_every, store)
    except (CkptEngineError, OSError) as err:  # StorageError is a CkptEngineError
        # Best effort: e.g. an unreadable latest_checkpoint.txt; the next commit rewrites it.
        logger.warning("retention skipped in %s: %s", save_dir, err)
        return result
    for path in doomed:
        if parse_iteration(os.path.basename(path.rstrip("/"))) in in_use:
            continue
        try:
            remove_checkpoint(path, store)
        except FileNotFoundError:
            continue
        except (OSError, CkptEngineError) as err:
            result.failed.append((path, f"{type(err).__name__}: {err}"))
        else:
            result.deleted.append(path)
    for path, why in result.failed:
        # Logged, not raised: a failed deletion must never fail training; retried next commit.
        logger.warning("retention could not delete %s (%s); will retry after the next commit", path, why)
    if result.deleted:
        # Named with its folder: a two-tier save's local copy and the object store's are both kept.
        logger.info("retention deleted %s in %s", ", ".join(os.path.basename(p) for p in result.deleted), save_dir)
    return result
