"""The node-local tier's folders on this node: each rank's committed checkpoints, their checks, and
committing a copy received from a peer.

``<local_dir>/rank_<r>/`` holds rank ``r``'s rank-local checkpoints as a save folder holds a job's:
``iter_*`` folders committed by renaming a hidden ``.iter_*.partial`` folder, each with its
manifest (which names the rank and the job's world size), and a ``latest_checkpoint.txt``. On
rank ``r``'s own node the folder holds what ``r`` saved; on a peer's node, the replicas that peer
keeps for ``r``: the same files, committed the same way.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .._format.layout import cleanup_leftovers, commit_rename, remove_tree
from .._format.manifest import FileEntry, Manifest, lookup_manifest, unchanged_files, write_manifest
from .._format.names import iter_dirname, partial_dirname, rank_dirname
from .._format.pointer import advance_latest, list_checkpoints
from .._format.retention import apply_retention
from .._format.verify import check_against_manifest
from .._storage.store import open_store
from ..errors import CkptEngineError

__all__ = [
    "Held",
    "abandon_copy",
    "commit_copy",
    "held_checkpoints",
    "link_local_files",
    "local_sources",
    "rank_folder",
    "start_copy",
    "verify_held",
]

logger = logging.getLogger("ckpt_engine")


@dataclass(frozen=True)
class Held:
    """A committed local-tier checkpoint of rank ``owner`` on this node."""

    owner: int
    iteration: int
    path: str
    manifest: Manifest


def rank_folder(local_dir: str, owner: int) -> str:
    return os.path.join(local_dir, rank_dirname(owner))


def held_checkpoints(local_dir: str, owner: int, world: int | None, *, since: int | None = None) -> list[Held]:
    """Rank ``owner``'s committed checkpoints in this node's ``local_dir``, newest first, from
    iteration ``since`` on: those whose manifest names ``owner`` and a job of ``world`` ranks (any
    number: ``None``, a resharding recovery's survey) and
    whose files are all regular files of the sizes it records (one ``lstat`` and ``stat`` each;
    checksums are :func:`verify_held`'s). Anything else (a damaged, foreign or half-deleted
    folder, a planted symlink) is skipped: the planner takes another source. Whose run a copy
    belongs to is :mod:`.lineage`'s question."""
    folder = rank_folder(local_dir, owner)
    if not os.path.isdir(folder):
        return []
    out = []
    for iteration, path in reversed(list_checkpoints(folder)):
        if since is not None and iteration < since:
            break
        try:
            manifest = lookup_manifest(path).manifest
        except CkptEngineError as err:
            logger.warning("local tier: %s is not usable (%s)", path, err)
            continue
        if manifest is None or manifest.rank != owner or manifest.algorithm is None:
            continue
        if world is not None and manifest.world_size != world:
            continue
        if manifest.iteration != iteration:
            continue
        odd = _not_regular(path, manifest)
        if odd is not None:
            logger.warning("local tier: %s holds %s, not a regular file of its own; not used", path, odd)
            continue
        if check_against_manifest(path, manifest, "sizes").problems:
            logger.warning("local tier: %s does not match its manifest's sizes; not used", path)
            continue
        out.append(Held(owner, iteration, path, manifest))
    return out


def _not_regular(path: str, manifest: Manifest) -> str | None:
    """The first file of ``manifest`` in ``path`` that is not a regular file there (a symlink, a
    FIFO: a load would refuse it, on this rank only), or ``None``. One ``lstat`` each."""
    for rel in manifest.files:
        try:
            mode = os.lstat(os.path.join(path, *rel.split("/"))).st_mode
        except OSError:
            continue  # a missing file: the size check names it
        if not stat.S_ISREG(mode):
            return rel
    return None


def verify_held(held: Held) -> list[str]:
    """Every file of ``held`` read and compared with its manifest's checksum: the problems found."""
    check = check_against_manifest(held.path, held.manifest, "checksums")
    problems = list(check.problems)
    if not check.complete_check:
        problems.append(f"{held.path}: checksums cannot be checked ({check.reason})")
    return problems


def local_sources(held: Iterable[Held]) -> dict[tuple[int, str], str]:
    """``(size, checksum)`` -> a file on this node with those bytes, from the checkpoints
    ``held``: only files whose version is still the one their manifest recorded (nothing touched
    them since their commit), so a link to one is as good as the bytes it stands for."""
    out: dict[tuple[int, str], str] = {}
    for h in held:
        for rel, entry in unchanged_files(h.path, manifest=h.manifest).items():
            if entry.checksum is not None:
                out.setdefault((entry.size, entry.checksum), os.path.join(h.path, *rel.split("/")))
    return out


def link_local_files(
    partial: str, files: Mapping[str, FileEntry], sources: Mapping[tuple[int, str], str]
) -> dict[str, FileEntry]:
    """Hard-link into ``partial`` every file of ``files`` that ``sources`` has (a copy where a
    link is refused); returns the files still needed from a peer."""
    needed = {}
    for rel, entry in files.items():
        source = sources.get((entry.size, entry.checksum or ""))
        dest = os.path.join(partial, *rel.split("/"))
        if source is not None:
            try:
                os.makedirs(os.path.dirname(dest), exist_ok=True)
                try:
                    os.link(source, dest)
                except OSError:
                    shutil.copyfile(source, dest)
                continue
            except OSError as err:
                logger.debug("local tier: cannot link %s (%s); fetching it", source, err)
        needed[rel] = entry
    return needed


def start_copy(local_dir: str, owner: int, iteration: int) -> str:
    """A clean hidden folder to assemble rank ``owner``'s ``iteration`` in (what a killed copy
    left there removed first)."""
    folder = rank_folder(local_dir, owner)
    os.makedirs(folder, exist_ok=True)
    for line in cleanup_leftovers(folder):
        logger.info("local tier: %s", line)
    partial = os.path.join(folder, partial_dirname(iteration))
    if os.path.exists(partial):
        remove_tree(partial)
    os.makedirs(partial)
    return partial


def commit_copy(local_dir: str, manifest: Manifest, partial: str, keep_last: int) -> str:
    """Commit the copy of rank ``manifest.rank``'s checkpoint assembled in ``partial``: its manifest
    (the sender's entries, with this node's file versions, so a later incremental copy can link
    them), the rename into place, ``latest`` and retention in that rank's folder. Returns the
    committed folder."""
    assert manifest.rank is not None
    folder = rank_folder(local_dir, manifest.rank)
    store = open_store(partial)
    versions = store.versions(partial)
    files = {rel: dataclasses.replace(e, seen=versions.get(rel), carried=None) for rel, e in manifest.files.items()}
    write_manifest(partial, dataclasses.replace(manifest, files=files))
    final = os.path.join(folder, iter_dirname(manifest.iteration))
    commit_rename(partial, final)
    advance_latest(folder, iter_dirname(manifest.iteration))
    # The step received is the one a resume is about to read: never retention's, even where the
    # folder holds newer ones (a save_dir rolled back, a recovery passing over newer saves).
    apply_retention(folder, keep_last, in_use=frozenset({manifest.iteration}))
    return final


def abandon_copy(partial: str) -> None:
    """Remove a copy that will not be committed (best effort: a leftover is removed next time)."""
    try:
        if os.path.exists(partial):
            remove_tree(partial)
    except OSError:
        logger.warning("local tier: could not remove %s", partial, exc_info=True)
