"""Where a save goes and how it becomes committed: one :class:`SaveTarget` per storage mode.

The engine chooses its target once, at construction (:func:`open_target`), and from then on asks
it instead of testing the storage mode:

* :class:`LocalTarget`: ``save_dir`` is a local folder. Ranks write into a hidden
  ``.iter_X.partial`` folder there; rank 0 writes the manifest into it and renames it into place
  (the rename is the commit), then moves ``latest_checkpoint.txt``.
* :class:`ObjectStoreTarget`: ``save_dir`` is an object-store URL. Ranks write into a local spool
  folder and each uploads its own files; rank 0 checks the upload against the DCP metadata and
  writes the manifest last: the manifest is the completion marker (an object store has no rename).
* :class:`TwoTierTarget`: an object-store URL with ``storage.local_dir``. The save commits locally
  as :class:`LocalTarget` does, then rank 0 uploads it in the background (marker last).

A target owns the staging folder, the per-rank file publication, the commit, what follows it,
the cleanup of an uncommitted save and the folders retention runs in. The commit *protocol*
(waiting for the writes, the ranks' agreement) is :func:`ckpt_engine._engine.tiers.run_commit`'s,
run by the durable tier (:class:`~ckpt_engine._engine.tiers.DurableTier`) that holds the target.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._dcpio import dist as _dist
from .._format.digests import remove_parts, report_blocks, written_entries
from .._format.layout import check_complete, commit_rename, remove_checkpoint, remove_tree
from .._format.manifest import (
    FileEntry,
    Lineage,
    Manifest,
    entry_doc,
    list_files,
    lookup_manifest,
    new_manifest,
    owner_rank,
    referenced_files,
    unchanged_files,
    write_manifest,
)
from .._format.names import MANIFEST_FILE, RANK_PART_PREFIX, iter_dirname, partial_dirname, replacing_dirname
from .._storage.paths import check_local_save_dir
from .._storage.store import FsspecStore, Store, open_store, store_for
from ..config import EngineConfig
from ..errors import CheckpointSaveError, CkptEngineError, IncompleteCheckpointError, StorageError
from .resave import advance_latest, move_latest, promote_replacement, recover_replacements, refuse_resave

__all__ = [
    "LocalTarget",
    "ObjectStoreTarget",
    "RetentionJob",
    "SavePaths",
    "SaveTarget",
    "TwoTierTarget",
    "commit_locally",
    "open_target",
]

logger = logging.getLogger("ckpt_engine")


@dataclass(frozen=True)
class SavePaths:
    """Where one save goes. ``final`` is the checkpoint's name for users (a local folder or a URL);
    ``partial`` the local folder the write providers write into; ``local_final`` the local folder
    it is renamed to (``None`` when the checkpoint lives only in an object store)."""

    iteration: int
    final: str
    partial: str
    local_final: str | None
    #: Where an object-store save uploads its files and writes its manifest, when not ``final``:
    #: a re-save of a committed iteration goes to ``.iter_n.replacing`` first (see resave.py).
    replacing: str | None = None
    #: What the manifest records as ``carry_chain`` (``incremental``: saves since a full write).
    carry_chain: int = 0
    #: The previous checkpoint an incremental save carries files over from (a folder or a URL).
    carry_from: str | None = None
    #: The run and save the manifest records (with a node-local tier; ``None``: none recorded).
    lineage: Lineage | None = None
    #: The components the manifest records as saved per rank (a rank-local checkpoint's).
    per_rank: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return iter_dirname(self.iteration)

    @property
    def upload(self) -> str:
        """Where the ranks upload this save (an object store)."""
        return self.replacing or self.final


@dataclass(frozen=True)
class RetentionJob:
    """One folder retention runs in after a commit, with its limits (``store`` ``None``: local)."""

    folder: str
    keep_last: int
    keep_every: int | None
    store: Store | None


class SaveTarget(ABC):
    """One storage mode's side of a save: staging, publication, commit, cleanup, retention."""

    #: Every rank reports (and publishes) the files it wrote before the commit, also where the
    #: ranks run no collective (the commit thread of background writes): the object store, where
    #: rank 0 cannot see another rank's spool.
    ranks_publish_files = False
    #: :meth:`after_commit` waits on the network: a synchronous save runs it in the background.
    after_commit_in_background = False

    def __init__(self, config: EngineConfig, store: Store, staging_root: str) -> None:
        self.config = config
        self.save_dir = config.save_dir
        self.store = store
        #: The local folder that receives uncommitted saves (the same path on every rank).
        self.staging_root = staging_root
        #: The iterations this target committed (:func:`~.resave.move_latest`).
        self.committed: set[int] = set()

    @property
    def local_dir(self) -> str | None:
        """The local folder of committed copies that loads look in first (two tier only)."""
        return None

    @abstractmethod
    def paths(self, iteration: int) -> SavePaths:
        """Where the save of ``iteration`` is staged and where it ends up."""

    def resave_targets(self, paths: SavePaths) -> list[tuple[str, Store]]:
        """Where a committed checkpoint of this iteration would be, checked before the save."""
        return [(paths.final, self.store)]

    def clear_for_save(self, paths: SavePaths) -> None:
        """Rank 0, holding the save_dir lock: remove what a crashed save of this iteration left."""
        if os.path.exists(paths.partial):
            remove_tree(paths.partial)

    def clear_own_files(self, paths: SavePaths, rank: int, world: int) -> None:
        """Every other rank, before the save: remove what only this rank can see (nothing, where
        the staging folder is shared and rank 0 clears it)."""
        return None

    def publish_files(self, paths: SavePaths, rels: Sequence[str], copies: Mapping[str, int] | None = None) -> None:
        """Make this rank's written files (``rels``, relative to ``paths.partial``) part of the
        checkpoint before the commit (nothing where rank 0 commits the staging folder itself);
        ``copies``: files (and their sizes) to copy from ``paths.carry_from`` inside the store."""
        if copies:
            raise CheckpointSaveError(f"{paths.final}: files to copy inside a store, but the target has none")

    def exchange_reports(
        self, paths: SavePaths, entries: dict[str, FileEntry], error: BaseException | None
    ) -> dict[str, FileEntry]:
        """Without collectives (background writes), several ranks: bring every rank's reported
        files to rank 0. Where rank 0 reads the staging folder itself, nothing to exchange."""
        if error is not None:
            raise error
        return entries

    @abstractmethod
    def commit(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        algorithm: str | None,
        entries: dict[str, FileEntry],
        world: int,
    ) -> int:
        """Rank 0, every rank's write succeeded: write the manifest, make the checkpoint visible
        and move ``latest``. Returns the bytes the manifest covers."""

    def after_commit(self, paths: SavePaths) -> BaseException | None:
        """Rank 0, after a successful commit: the work that follows it (two tier: the upload).
        Returns the error instead of raising: the committed checkpoint stays committed."""
        return None

    def finish(self, paths: SavePaths, rank: int, world: int, *, cleanup: bool, succeeded: bool) -> None:
        """After the save (committed or failed): remove its uncommitted files where ``cleanup``
        (a failed save), and the bookkeeping a committed one leaves."""
        if cleanup and rank == 0 and os.path.exists(paths.partial):
            _remove_quietly(paths.partial)

    def retention_jobs(self) -> list[RetentionJob]:
        """Where retention runs after a commit: ``keep_last`` / ``keep_every`` in ``save_dir``."""
        if self.config.keep_last is None:
            return []
        return [RetentionJob(self.save_dir, self.config.keep_last, self.config.keep_every, self.store)]


class _CommitsLocally(SaveTarget):
    """A target whose saves are committed by renaming the local staging folder into place."""

    def commit(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        algorithm: str | None,
        entries: dict[str, FileEntry],
        world: int,
    ) -> int:
        covered = commit_locally(paths, components, algorithm, entries, world, advance=False)
        move_latest(
            os.path.dirname(paths.local_final or ""), paths.name, None, self.committed, self.config.allow_overwrite
        )
        return covered


class LocalTarget(_CommitsLocally):
    """``save_dir`` is a local folder: write a hidden folder there, rename it into place."""

    def __init__(self, config: EngineConfig, store: Store) -> None:
        check_local_save_dir(config.save_dir)
        super().__init__(config, store, config.save_dir)

    def paths(self, iteration: int) -> SavePaths:
        final = os.path.join(self.save_dir, iter_dirname(iteration))
        return SavePaths(iteration, final, os.path.join(self.staging_root, partial_dirname(iteration)), final)


class ObjectStoreTarget(SaveTarget):
    """``save_dir`` is an object store: every rank uploads its files, the manifest goes last."""

    ranks_publish_files = True

    def __init__(self, config: EngineConfig, store: FsspecStore) -> None:
        super().__init__(config, store, _spool_root(config))
        self.object_store = store
        if _dist.rank() == 0:
            try:
                if store.isdir(self.save_dir):
                    recover_replacements(self.save_dir, store)
            except (OSError, CkptEngineError) as err:
                # Nothing is lost by waiting: the interrupted copy stays committed under its
                # .replacing prefix, and the load or save that follows reports the storage error.
                logger.warning("could not finish interrupted re-saves in %s yet: %s", self.save_dir, err)

    def paths(self, iteration: int) -> SavePaths:
        final = self.store.join(self.save_dir, iter_dirname(iteration))
        partial = os.path.join(self.staging_root, partial_dirname(iteration))
        replacing = None
        if self.config.allow_overwrite and self.store.exists(self.store.join(final, MANIFEST_FILE)):
            # A committed copy to replace: keep it until the new one is committed beside it.
            replacing = self.store.join(self.save_dir, replacing_dirname(iteration))
        return SavePaths(iteration, final, partial, None, replacing)

    def clear_for_save(self, paths: SavePaths) -> None:
        super().clear_for_save(paths)
        if paths.replacing is not None:
            if self.store.exists(paths.replacing):  # what an earlier killed re-save uploaded
                self.store.remove_tree(paths.replacing)
        elif self.store.exists(paths.final):
            # What a killed save uploaded, or a committed copy latest never named: the old
            # marker goes first, so that no reader ever takes the mix for a checkpoint.
            logger.warning("%s exists; deleting it before saving iteration %d again", paths.final, paths.iteration)
            remove_checkpoint(paths.final, self.store)

    def clear_own_files(self, paths: SavePaths, rank: int, world: int) -> None:
        _remove_own_files(paths.partial, rank, world)  # a node-local spool another node cannot clear

    def publish_files(self, paths: SavePaths, rels: Sequence[str], copies: Mapping[str, int] | None = None) -> None:
        upload_files(self.object_store, paths.partial, paths.upload, rels)
        if copies:
            assert paths.carry_from is not None
            copy_within(self.object_store, paths.carry_from, paths.upload, copies)

    def exchange_reports(
        self, paths: SavePaths, entries: dict[str, FileEntry], error: BaseException | None
    ) -> dict[str, FileEntry]:
        """Every rank reports its upload in a small object next to the checkpoint; rank 0 waits
        for all of them (``storage.commit_timeout_s``) and returns the merged entries, or raises
        the first rank's failure."""
        rank, world = _dist.rank(), _dist.world_size()
        store = self.store
        part = {
            "rank": rank,
            "error": None if error is None else f"{type(error).__name__}: {error}",
            "files": {rel: entry_doc(e) for rel, e in entries.items()},
        }
        store.write_bytes(self._report_path(paths, rank), json.dumps(part).encode())
        if error is not None:
            raise error
        if rank != 0:
            return entries
        return self._collect_reports(paths, dict(entries), set(range(1, world)))

    def _collect_reports(
        self, paths: SavePaths, merged: dict[str, FileEntry], waiting: set[int]
    ) -> dict[str, FileEntry]:
        timeout = self.config.storage.commit_timeout_s
        deadline = time.monotonic() + timeout
        delay = 0.05
        while waiting:
            for r in sorted(waiting):
                try:
                    doc = json.loads(self.store.read_bytes(self._report_path(paths, r)))
                except FileNotFoundError:
                    continue
                if doc.get("error"):
                    raise CheckpointSaveError(f"rank {r} failed to upload its files: {doc['error']}")
                for rel, e in doc.get("files", {}).items():
                    carried = e.get("carried") if e.get("carried") in ("link", "copy") else None
                    merged[rel] = FileEntry(
                        size=int(e["size"]), checksum=e.get("checksum"), carried=carried, blocks=report_blocks(e)
                    )
                waiting.discard(r)
            if waiting:
                if time.monotonic() > deadline:
                    raise CheckpointSaveError(
                        f"rank(s) {sorted(waiting)} did not report their uploads to {paths.final} within "
                        f"{timeout}s (storage.commit_timeout_s); did they crash?"
                    )
                time.sleep(delay)
                delay = min(1.0, delay * 2)
        return merged

    def _report_path(self, paths: SavePaths, rank: int) -> str:
        return self.store.join(paths.upload, f"{RANK_PART_PREFIX}{rank:05d}.json")

    def commit(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        algorithm: str | None,
        entries: dict[str, FileEntry],
        world: int,
    ) -> int:
        covered = write_checked_manifest(
            paths.upload,
            self.store,
            paths.iteration,
            components,
            algorithm,
            entries,
            world,
            paths.carry_chain,
            lineage=paths.lineage,
        )
        if paths.replacing is not None:  # committed beside the old copy: now move it over it
            promote_replacement(self.object_store, paths.replacing, paths.final)
        move_latest(self.save_dir, paths.name, self.store, self.committed, self.config.allow_overwrite)
        return covered

    def finish(self, paths: SavePaths, rank: int, world: int, *, cleanup: bool, succeeded: bool) -> None:
        # The spool copy is never needed again, committed or not.
        if rank == 0:
            if os.path.exists(paths.partial):
                _remove_quietly(paths.partial)
        else:
            _remove_own_files(paths.partial, rank, world)
        if succeeded and rank == 0 and world > 1:
            self._remove_reports(paths, world)
        if cleanup and not succeeded and rank == 0 and paths.replacing is not None:
            with contextlib.suppress(OSError, CkptEngineError):  # else the next start removes it
                if not self.store.exists(self.store.join(paths.replacing, MANIFEST_FILE)):
                    self.store.remove_tree(paths.replacing)

    def _remove_reports(self, paths: SavePaths, world: int) -> None:
        try:
            self.object_store.remove_files([self._report_path(paths, r) for r in range(world)])
        except (OSError, CkptEngineError):  # bookkeeping only: loaders and listings ignore them
            logger.debug("could not remove the upload reports of %s", paths.final, exc_info=True)


class TwoTierTarget(_CommitsLocally):
    """An object store with ``storage.local_dir``: commit locally, then upload the local copy."""

    after_commit_in_background = True

    def __init__(self, config: EngineConfig, store: FsspecStore, local_dir: str) -> None:
        super().__init__(config, store, local_dir)
        self.object_store = store
        self._local = local_dir

    @property
    def local_dir(self) -> str:
        return self._local

    def paths(self, iteration: int) -> SavePaths:
        name = iter_dirname(iteration)
        return SavePaths(
            iteration,
            self.store.join(self.save_dir, name),
            os.path.join(self.staging_root, partial_dirname(iteration)),
            os.path.join(self._local, name),
        )

    def resave_targets(self, paths: SavePaths) -> list[tuple[str, Store]]:
        # The local copy only: the object store is checked by the upload, which must not make
        # save() wait on the network.
        assert paths.local_final is not None
        return [(paths.local_final, open_store(paths.local_final))]

    def after_commit(self, paths: SavePaths) -> BaseException | None:
        """Upload the committed local copy; the manifest (the completion marker) goes last, then
        ``latest``; a re-save uploads beside the old copy (``.iter_n.replacing/``), moved over it
        once complete. Returns the error, if any (the local copy stays complete)."""
        assert paths.local_final is not None
        store, replacing = self.object_store, None
        try:
            refuse_resave(paths.iteration, [(paths.final, store)], self.config.allow_overwrite)
            if store.exists(paths.final):  # a failed upload must leave the old copy as it was
                replacing = store.join(self.save_dir, replacing_dirname(paths.iteration))
                store.remove_tree(replacing)  # what an earlier failed re-save uploaded, if any
            dest = replacing or paths.final
            manifest = lookup_manifest(paths.local_final).manifest
            if manifest is None:
                raise IncompleteCheckpointError(f"{paths.local_final} has no manifest; it cannot be uploaded")
            copies, source = self._carried_remotely(paths, manifest)
            rels = [rel for rel in list_files(paths.local_final) if rel not in copies]
            upload_files(store, paths.local_final, dest, rels)
            if copies:
                copy_within(store, source, dest, copies)
            # With the uploaded objects' versions: the next upload copies only objects that still have them.
            remote = dataclasses.replace(manifest, files=with_versions(manifest.files, dest, store))
            store.write_bytes(store.join(dest, MANIFEST_FILE), remote.to_json().encode("utf-8"))
            if replacing is not None:
                promote_replacement(store, replacing, paths.final)
            move_latest(self.save_dir, paths.name, store, self.committed, self.config.allow_overwrite)
        except StorageError as err:
            wrapped = StorageError(f"{err}; the local copy {paths.local_final} is complete and is resumed from")
            wrapped.__cause__ = err
            return wrapped
        except Exception as err:
            return err
        return None

    def _carried_remotely(self, paths: SavePaths, manifest: Manifest) -> tuple[dict[str, int], str]:
        """The files of an incremental save (its local ``manifest``) the previous checkpoint's
        upload holds unchanged (linked locally; the object keeps its recorded version and
        checksum): copied inside the store, not uploaded again."""
        if paths.carry_from is None:
            return {}, ""
        source = self.store.join(self.save_dir, os.path.basename(paths.carry_from))
        try:
            there = unchanged_files(source, self.store)
        except CkptEngineError as err:
            logger.warning(
                "uploading every file of %s: the previous upload %s is unreadable (%s)", paths.final, source, err
            )
            return {}, source
        copies = {}
        for rel, entry in manifest.files.items():
            old = there.get(rel)
            if entry.carried == "link" and old is not None and (old.size, old.checksum) == (entry.size, entry.checksum):
                copies[rel] = entry.size
        return copies, source

    def retention_jobs(self) -> list[RetentionJob]:
        local = RetentionJob(self._local, self.config.storage.local_keep_last, None, None)
        return [*super().retention_jobs(), local]


def open_target(config: EngineConfig) -> SaveTarget:
    """The save target for ``config.save_dir`` and ``config.storage``, chosen once."""
    store = open_store(config.save_dir, config.storage)
    if store.capabilities.commit_by_rename:
        return LocalTarget(config, store)
    assert isinstance(store, FsspecStore)
    if config.storage.local_dir is not None:
        return TwoTierTarget(config, store, config.storage.local_dir)
    return ObjectStoreTarget(config, store)


def write_checked_manifest(
    root: str,
    store: Store | None,
    iteration: int,
    components: tuple[str, ...],
    algorithm: str | None,
    entries: dict[str, FileEntry],
    world: int,
    carry_chain: int = 0,
    rank: int | None = None,
    lineage: Lineage | None = None,
    per_rank: tuple[str, ...] = (),
) -> int:
    """Rank 0 (``rank``: the rank of a rank-local checkpoint, which writes its own): check the
    checkpoint under ``root`` is complete, then write its manifest; returns the bytes it covers.

    Locally (``store`` ``None``) into the uncommitted folder, checksumming what no rank did. On an
    object store, after every rank uploaded: the DCP metadata is checked against one listing of
    the prefix, every file must have been reported by a rank, and the manifest written is the
    completion marker."""
    uploaded = store is not None
    checked = check_complete(root, store)
    missing = [c for c in components if c not in checked.components]
    if missing:
        done = "uploaded" if uploaded else "written"
        raise IncompleteCheckpointError(f"{root}: components {missing} were not {done}")
    entries = dict(entries)
    if uploaded:
        unreported = referenced_files(checked) - set(entries)
        if unreported:
            raise IncompleteCheckpointError(
                f"{root}: {sorted(unreported)[:5]} are referenced by DCP metadata but no rank reported uploading them"
            )
    else:
        expected = set(list_files(root)) | referenced_files(checked)
        entries.update(written_entries(root, expected - set(entries), algorithm))
        remove_parts(root)
    files = with_versions(entries, root, store)
    manifest = new_manifest(iteration, world, components, algorithm, files, carry_chain, rank, lineage, per_rank)
    write_manifest(root, manifest, store)
    return manifest.total_bytes


def with_versions(entries: Mapping[str, FileEntry], root: str, store: Store | None) -> dict[str, FileEntry]:
    """``entries`` with each file's version as the store shows it now (:meth:`.Store.versions`),
    recorded in the manifest so that an incremental save can tell a file changed since."""
    versions = store_for(root, store).versions(root)
    return {rel: dataclasses.replace(e, seen=versions.get(rel)) for rel, e in entries.items()}


def commit_locally(
    paths: SavePaths,
    components: tuple[str, ...],
    algorithm: str | None,
    entries: dict[str, FileEntry],
    world: int,
    rank: int | None = None,
    *,
    advance: bool = True,
) -> int:
    """Rank 0 (or, ``rank``, each rank its own rank-local checkpoint): the manifest into the
    hidden folder, the rename into place, then (``advance``) ``latest`` in that folder's save
    directory; returns the bytes the manifest covers."""
    assert paths.local_final is not None
    covered = write_checked_manifest(
        paths.partial,
        None,
        paths.iteration,
        components,
        algorithm,
        entries,
        world,
        paths.carry_chain,
        rank,
        paths.lineage,
        paths.per_rank,
    )
    commit_rename(paths.partial, paths.local_final)
    if advance:
        advance_latest(os.path.dirname(paths.local_final), paths.name)
    return covered


def upload_files(store: FsspecStore, local_root: str, remote_root: str, rels: Sequence[str]) -> None:
    """Upload ``rels`` (relative to ``local_root``) under ``remote_root``, in parallel."""
    pairs = [(os.path.join(local_root, *rel.split("/")), store.join(remote_root, rel)) for rel in rels]
    t = time.perf_counter()
    nbytes = store.upload_many(pairs)
    logger.debug(
        "uploaded %d file(s), %.1f MB, to %s in %.3fs", len(pairs), nbytes / 1e6, remote_root, time.perf_counter() - t
    )


def copy_within(store: FsspecStore, source_root: str, remote_root: str, expected: Mapping[str, int]) -> None:
    """Copy the files ``expected`` names (with their sizes) from the previous checkpoint
    ``source_root`` to ``remote_root`` inside the store (no bytes through this process on S3).
    Each source must still be the object that checkpoint was committed with (its version, as
    its manifest recorded it: :func:`.unchanged_files`); one that is gone or changed fails the
    save (nothing is committed, ``latest`` is unchanged), naming the file."""
    vouched = unchanged_files(source_root, store)
    pairs = []
    for rel in sorted(expected):
        entry = vouched.get(rel)
        if entry is None or entry.size != expected[rel]:
            raise CheckpointSaveError(
                f"cannot carry {rel} over: {store.join(source_root, rel)} is gone or changed since its checkpoint "
                "was committed (retention or another job changed it while this save ran); save again: the next "
                "save compares with the current latest"
            )
        pairs.append((store.join(source_root, rel), store.join(remote_root, rel)))
    t = time.perf_counter()
    store.copy_files(pairs)
    logger.debug(
        "copied %d unchanged file(s) inside the store to %s in %.3fs", len(pairs), remote_root, time.perf_counter() - t
    )


def _spool_root(config: EngineConfig) -> str:
    """The local spool of saves to this store's URL: the same path on every rank. The key names
    the store, not only the URL: the endpoint (two servers may each hold a bucket of one name),
    and for fsspec's ``memory://``, whose objects live in one process, that process (two
    processes on one machine, each with its own store, shared one spool and its lock before)."""
    local = os.getpid() if config.save_dir.lower().startswith("memory://") else ""
    where = f"{config.storage.endpoint_url or ''}\n{local}\n{config.save_dir}"
    digest = hashlib.sha1(where.encode()).hexdigest()[:16]
    return os.path.join(config.storage.spool_dir or tempfile.gettempdir(), "ckpt-engine-spool", digest)


def _remove_own_files(partial: str, rank: int, world: int) -> None:
    """Rank ``rank`` (not 0): remove the data files it wrote into ``partial``."""
    if rank == 0 or not os.path.isdir(partial):
        return
    for rel in list_files(partial):
        if owner_rank(rel, world) == rank:
            try:
                os.remove(os.path.join(partial, rel))
            except FileNotFoundError:
                continue


def _remove_quietly(folder: str) -> None:
    try:
        remove_tree(folder)
    except OSError:
        logger.warning("could not remove uncommitted folder %s", folder, exc_info=True)
