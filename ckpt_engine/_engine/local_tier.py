"""The node-local tier in a save (``EngineConfig.local_dir``): this rank's folder, its writes and
commit, and the replication round that follows.

Every rank writes its own rank-local checkpoint (every item it holds, with a ``.metadata`` of its
own, no collective: :data:`~ckpt_engine.storage.RANK_LOCAL`) into
``<local_dir>/rank_<r>/.iter_X.partial`` and commits it by itself: manifest (naming the rank and
the job's world size), rename, ``latest`` and ``local_keep_last`` retention in its folder, the
same steps as a local ``save_dir`` commit. The saver decides which saves also go to ``save_dir``
(``persist_every``); this part does the local side of every save.

At the first save (every rank, at the same point: it is collective) the tier checks that
``local_dir`` is node-local as ``ranks_per_node`` says (each rank writes a marker and every rank
must see the markers of exactly the ranks of its node: a folder shared between nodes would let a
replica overwrite its own original), and starts the :class:`~ckpt_engine._tier.replication.Replicator`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

from .._dcpio import dist as _dist
from .._dcpio.coordination import RANK_LOCAL
from .._dcpio.dist import new_gloo_group
from .._dcpio.planner import EngineSavePlanner
from .._format.digests import written_entries
from .._format.hashing import DEFAULT_ALGORITHM
from .._format.layout import SaveDirLock, cleanup_leftovers, remove_checkpoint, remove_tree
from .._format.manifest import FileEntry, Lineage, Manifest, Place, list_files, lookup_manifest
from .._format.names import iter_dirname, parse_iteration, partial_dirname
from .._format.pointer import read_latest, write_latest
from .._format.retention import apply_retention
from .._storage.store import open_store
from .._tier.folders import rank_folder
from .._tier.lineage import durable_view, note_committed, place_of, read_run, saved_elsewhere, write_run
from .._tier.recovery import Recovered, recover
from .._tier.replication import Replicator
from .._tier.reshard import TierSurvey, reshard, survey
from .._tier.topology import Topology
from ..config import EngineConfig
from ..errors import (
    CheckpointSaveError,
    CkptEngineError,
    CollectiveError,
    ConfigError,
    RankLocalCoverageError,
    SaveDirLockedError,
)
from ..pipeline import Pipeline
from ..types import WriteResult
from .consensus import agree
from .incremental import CarryBase, carry_base_in
from .resave import refuse_resave
from .resume import CheckpointReader, LoadSource, LocalTierSource, ResumeAsk
from .targets import SavePaths, commit_locally
from .tiers import CommitPhase, Outcomes, Round, WriteInputs, component_context, gate_on_check, wait_writes

__all__ = ["LocalTier", "node_local_tiers"]

logger = logging.getLogger("ckpt_engine")

#: The manifests' checksum algorithm: a local tier needs ``save_checksums`` (:meth:`LocalTier.open`).
_ALGORITHM = DEFAULT_ALGORITHM

#: The folder inside ``local_dir`` where the first save's node check leaves its markers.
_PROBE_DIR = ".ckpt_engine_nodes"


class LocalTier:
    """This rank's part of the node-local tier (a :class:`~.tiers.Tier`): staging, writes, commit,
    retention, and replication, its after-commit step."""

    name = "local"

    def __init__(self, config: EngineConfig, pipeline: Pipeline) -> None:
        assert config.local_dir is not None
        self.config = config
        self.root = config.local_dir
        self._pipeline = pipeline
        self._topology: Topology | None = None
        self._replicator: Replicator | None = None
        self._lock: SaveDirLock | None = None
        #: This engine's lineage: the run, the instance (one per engine, agreed at its first
        #: save), the saves it began, and the newest durable step committed (save id, iteration).
        self._run: str | None = None
        self._instance = ""
        self._saves = 0
        self._parent: tuple[str, int] | None = None
        self._place: Place | None = None
        #: The step this engine's last load resumed (``None``: it loaded none): its saves go on
        #: from it, so the run's copies newer than it are a future it abandoned.
        self._resumed_from: int | None = None
        #: The lineage of the save :meth:`begin` began last (recorded in its manifests).
        self.current: Lineage | None = None
        #: A rank-local write that raised on this rank, kept for this save's commit (which every
        #: rank joins, so the failure is agreed instead of leaving the others waiting).
        self._write_error: BaseException | None = None
        self._entries: dict[str, FileEntry] = {}

    @classmethod
    def open(cls, config: EngineConfig, pipeline: Pipeline) -> LocalTier:
        """The local tier ``config`` asks for, once its needs are checked: a ``write`` provider
        that writes rank-local checkpoints, and checksums."""
        refused = pipeline.rank_local_writer()
        if refused is not None:
            raise ConfigError(
                f"local_dir is set, but the write hook is provided by {refused}, which does not declare that it "
                "writes rank-local checkpoints (ckpt_engine.lifecycle.WritesRankLocal); use the engine's own write "
                "or pinned_staging without max_host_bytes, or unset local_dir"
            )
        if not config.save_checksums:
            raise ConfigError(
                "local_dir needs save_checksums: peer replicas are checked against the manifest's checksums; set "
                "save_checksums true (or unset local_dir)"
            )
        return cls(config, pipeline)

    # -- where ----------------------------------------------------------------------------------

    @property
    def folder(self) -> str:
        """This rank's folder of the local tier."""
        return rank_folder(self.root, _dist.rank())

    def topology(self) -> Topology:
        world = _dist.world_size()
        if self._topology is None or self._topology.world != world:
            self._topology = Topology.gather(self.config, world)
        return self._topology

    def paths(self, iteration: int) -> SavePaths:
        final = os.path.join(self.folder, iter_dirname(iteration))
        return SavePaths(iteration, final, os.path.join(self.folder, partial_dirname(iteration)), final)

    # -- before the write -----------------------------------------------------------------------

    def prepare(self, paths: SavePaths) -> None:
        """Every rank, before staging: this rank's folder locked (the first time; leftovers of a
        crash removed), a committed iteration refused as in ``save_dir``, the partial folder cleared;
        a ``ranks_per_node`` or ``peer_replicas`` that cannot fit is refused first."""
        self.topology()
        if self._lock is None:
            os.makedirs(self.folder, exist_ok=True)
            lock = SaveDirLock(self.folder)
            if not lock.acquire():
                raise SaveDirLockedError(f"another engine holds {self.folder}; two engines cannot save as one rank")
            self._lock = lock
            for line in cleanup_leftovers(self.folder):
                logger.warning("local tier: %s", line)
        found = _committed_lineage(paths.final)
        if self._of_another_run(found):
            logger.warning(
                "local tier: %s was saved by another run than save_dir's, or for another save_dir; replacing it",
                paths.final,
            )
        elif self._abandoned(found, paths.iteration):
            logger.warning(
                "local tier: %s was saved by an earlier job that went on past step %d, from which this job resumed "
                "(no resume takes it any more); replacing it",
                paths.final,
                self._resumed_from,
            )
        else:
            refuse_resave(paths.iteration, [(paths.final, open_store(paths.final))], self.config.allow_overwrite)
        if os.path.exists(paths.partial):
            remove_tree(paths.partial)

    def _of_another_run(self, found: Lineage | None) -> bool:
        """Whether the committed checkpoint in this rank's folder whose lineage is ``found``
        records another run than this engine's (``save_dir``'s latest's, before the first save),
        or was saved for another ``save_dir`` location: a resume would set it aside, so a save of
        its iteration replaces it instead of being refused as a re-save."""
        if found is None:
            return False
        run = self._run if self._run is not None else _save_dir_run(self.config)[0]
        here = self._place if self._place is not None else place_of(self.config.save_dir, self.root)
        return found.run_id != run or saved_elsewhere(found.place, here)

    def _abandoned(self, found: Lineage | None, iteration: int) -> bool:
        """Whether the committed checkpoint of ``iteration`` in this rank's folder, whose lineage is
        ``found``, is of a future this engine abandoned: another engine instance saved it, past the
        step this engine resumed. Its save replaces it, as a resume sets it aside
        (:mod:`.._tier.lineage`)."""
        if self._resumed_from is None or iteration <= self._resumed_from or found is None:
            return False
        return found.instance != self._instance

    def resumed(self, iteration: int) -> None:
        """This engine's load resumed step ``iteration``: its saves go on from it."""
        self._resumed_from = iteration

    def begin(self, iteration: int) -> Future[Manifest | None] | None:
        """Every rank, once the save is prepared: at the first save, the node check and the
        replicator (collective); then this save's replication round, to resolve after the commit."""
        topology = self.topology()
        self._begin_lineage(iteration)
        if self._replicator is None and topology.world > 1:
            self._check_node_local(topology)
            if topology.replicas > 0:
                self._replicator = Replicator(
                    local_dir=self.root,
                    topology=topology,
                    rank=_dist.rank(),
                    group=new_gloo_group(self.config.collective_timeout_s),
                    timeout_s=self.config.collective_timeout_s,
                    keep_last=self.config.local_keep_last,
                    bandwidth_mb_s=self.config.peer_bandwidth_mb_s,
                    sync_files=self.config.sync_files,
                    max_in_flight=self.config.replication_max_in_flight,
                    when_behind=self.config.replication_when_behind,
                )
        return self._replicator.expect(iteration) if self._replicator is not None else None

    def _begin_lineage(self, iteration: int) -> None:
        """This save's lineage (every rank alike). At the first save, rank 0 reads the run and the
        newest durable step from ``save_dir``'s latest (a new run where it has none, or one
        without a lineage) and draws this engine's instance id; every rank takes them from it."""
        if self._run is None:
            start = iteration - 1 if self._resumed_from is None else self._resumed_from
            first = _dist.broadcast_object(
                _lineage_start(self.config, start) if _dist.rank() == 0 else None, step="local tier: lineage"
            )
            self._run, self._instance, self._parent, self._place = first
        self._saves += 1
        assert self._run is not None
        parent_id, parent_it = self._parent if self._parent is not None else (None, None)
        self.current = Lineage(self._run, f"{self._instance}-{self._saves}", parent_id, parent_it, self._place)

    def durable_committed(self, paths: SavePaths) -> None:
        """A durable save of this engine is committed in ``save_dir``: the saves that follow
        descend from it, and rank 0's folder records the commit (a ``save_dir`` later rolled back
        past it is then told from a commit that did not finish: :mod:`.._tier.lineage`). Only rank
        0 knows: it makes the commit, and in a commit in the background the other ranks get here
        before it has (a record there, then a kill, set aside every step since the last durable)."""
        lineage, iteration = paths.lineage, paths.iteration
        if lineage is not None and (self._parent is None or iteration >= self._parent[1]):
            self._parent = (lineage.save_id, iteration)
            if _dist.rank() != 0:
                return
            try:
                note_committed(self.folder, lineage, iteration)
            except OSError as err:  # the save is committed; only a later rollback goes unseen
                logger.warning("local tier: cannot record the commit of step %d in %s: %s", iteration, self.folder, err)

    def lineage(self) -> Lineage | None:
        """The lineage of the save :meth:`begin` began last (its manifests record it)."""
        return self.current

    def _check_node_local(self, topology: Topology) -> None:
        """Every rank must see the markers of exactly the ranks ``ranks_per_node`` puts on its node."""
        rank = _dist.rank()
        token = _dist.broadcast_object(secrets.token_hex(8), step="local tier: node check")
        probe = os.path.join(self.root, _PROBE_DIR)
        os.makedirs(probe, exist_ok=True)
        marker = os.path.join(probe, f"{token}.{rank}")
        with open(marker, "w"):
            pass
        _dist.all_gather_object(None, step="local tier: node check")
        seen = sorted(int(n.rsplit(".", 1)[1]) for n in os.listdir(probe) if n.startswith(token + "."))
        views = _dist.all_gather_object(seen, step="local tier: node check")
        os.remove(marker)
        wrong = [
            (r, v)
            for r, v in enumerate(views)
            if v != [q for q in range(topology.world) if topology.node(q) == topology.node(r)]
        ]
        if wrong:
            r, v = wrong[0]
            raise ConfigError(
                f"local_dir {self.root!r} is not node-local as ranks_per_node={topology.ranks_per_node} says: rank {r} "
                f"sees the local_dir of ranks {v[:16]}, but only ranks of node {topology.node(r)} should share it. "
                "Point local_dir at storage of each node's own (tmpfs, local NVMe), and set ranks_per_node to the "
                "ranks each node runs"
            )

    # -- the write ------------------------------------------------------------------------------

    def write(self, paths: SavePaths, inputs: WriteInputs) -> tuple[SavePaths, Outcomes]:
        """Hand each component to the ``write`` provider as a rank-local write; returns the paths
        (with what an incremental save carries over from this rank's previous checkpoint) and the
        outcomes. A write that raises is not raised here: the commit reports it, on every rank.

        Each archive's serialization id is derived from its content (the writer does it for a
        rank-local write): equal state gives equal bytes, so a peer that holds the same shards (a
        data-parallel replica) or the previous step's unchanged files links them instead of
        receiving them. With ``incremental``, the files are laid out and unchanged ones linked from
        this rank's previous checkpoint as in ``save_dir`` (``inputs.stable``: the model's frozen keys)."""
        pipeline, staged, checksum, stable = inputs.pipeline, inputs.staged, _ALGORITHM, inputs.stable
        plan_prefix, key_maps = inputs.plan_prefix, inputs.local_maps
        paths, carry = self._carry(dataclasses.replace(paths, per_rank=inputs.per_rank), checksum)
        outcomes: list[WriteResult | Future[WriteResult]] = []
        for name, state in staged.components.items():
            planner = EngineSavePlanner(key_maps[name], cache_key=f"{plan_prefix}local:{name}", checksum=checksum)
            ctx = component_context(self.config, paths, name, planner, staged.is_copy, carry, stable, RANK_LOCAL)
            try:
                out = pipeline.write(ctx, state)
                if isinstance(out, Future) and not staged.is_copy:
                    out = out.result()  # the live state: must be written before save() returns
            except Exception as err:  # this rank's own write (a full disk): failed in the commit
                self._write_error = err
                if any(isinstance(o, Future) for o in outcomes):  # the commit waits for them
                    failed: Future[WriteResult] = Future()
                    failed.set_exception(err)
                    outcomes.append(failed)
                break
            outcomes.append(out)
        return paths, gate_on_check(outcomes, inputs.checked)

    def _carry(self, paths: SavePaths, checksum: str) -> tuple[SavePaths, CarryBase | None]:
        """With ``incremental``: this rank's previous checkpoint to carry unchanged files over from,
        and ``paths`` naming it."""
        if not self.config.incremental:
            return paths, None
        carry = carry_base_in(self.folder, open_store(self.folder), "link", self.config, checksum, paths.iteration)
        return dataclasses.replace(paths, carry_chain=carry.chain, carry_from=carry.folder), carry

    # -- the commit -----------------------------------------------------------------------------

    def commit(
        self, paths: SavePaths, components: tuple[str, ...], outcomes: Outcomes, round_: Round, *, collective: bool
    ) -> CommitPhase:
        """This rank's commit of the save in its folder. In a synchronous save (``collective``) the
        ranks agree before it (a rank whose write failed, a full disk, fails the save on every
        rank, and no rank commits: never two saves of one step in the tier) and after it."""
        phase = self._check(self._pipeline, paths, outcomes, _ALGORITHM)
        together = collective and _dist.world_size() > 1
        if together:
            _agree_local(phase, "write", "local writes")
        wrote = phase.error is None  # the same on every rank, once agreed
        phase = self._commit(paths, components, _ALGORITHM, phase, round_)
        if together and wrote:
            _agree_local(phase, "commit", "local commit")
        return phase

    def _check(self, pipeline: Pipeline, paths: SavePaths, outcomes: Sequence[Any], algorithm: str) -> CommitPhase:
        """This rank's writes of the save, waited for and listed (nothing committed yet): the
        phase to agree on before :meth:`_commit` (its error: this rank's write failure)."""
        phase = CommitPhase()
        try:
            wait_writes(pipeline, outcomes, phase)
            if phase.error is None and self._write_error is not None:
                phase.error = self._write_error
            if phase.error is None:
                self._entries = written_entries(paths.partial, list_files(paths.partial), algorithm)
        except Exception as err:
            phase.error = err
        finally:
            self._write_error = None
        return phase

    def _commit(
        self,
        paths: SavePaths,
        components: tuple[str, ...],
        algorithm: str,
        phase: CommitPhase,
        round_: Round,
    ) -> CommitPhase:
        """This rank's commit of the checked save (where ``phase`` holds no error: every rank's
        writes worked); resolves the replication round (with the committed manifest, or
        ``None``) whatever happens."""
        manifest = None
        try:
            if phase.error is None:
                commit_locally(paths, components, algorithm, self._entries, _dist.world_size(), rank=_dist.rank())
                manifest = lookup_manifest(paths.final).manifest
                if self._resumed_from is not None and self._run is not None:
                    _drop_abandoned(self.folder, paths.name, self._run, self._instance, self._resumed_from)
                self._retain()
        except Exception as err:
            phase.error = err
        finally:
            self._entries = {}
            if round_ is not None:
                round_.set_result(manifest if phase.error is None else None)
        if phase.error is not None:
            self.finish(paths, cleanup=True)
        return phase

    def _retain(self) -> None:
        """``local_keep_last`` in this rank's folder; a checkpoint a replication round may still
        send is kept until that round has finished (the next retention removes it)."""
        in_use = self._replicator.in_flight() if self._replicator is not None else frozenset()
        try:
            apply_retention(self.folder, self.config.local_keep_last, in_use=in_use)
        except Exception:
            logger.warning(
                "local tier: retention in %s failed; retrying after the next save", self.folder, exc_info=True
            )

    def finish(self, paths: SavePaths, *, cleanup: bool) -> None:
        """After a failed save: remove what it staged in this rank's folder."""
        if cleanup and os.path.exists(paths.partial):
            try:
                remove_tree(paths.partial)
            except OSError:
                logger.warning("local tier: could not remove %s", paths.partial, exc_info=True)

    # -- the resume side ---------------------------------------------------------------------------

    def newest(self, reader: CheckpointReader, ask: ResumeAsk) -> LoadSource | None:
        """Every rank: the tier's newest step for this resume (:func:`_recovered_source`)."""
        return _recovered_source(self.config, reader, ask)

    # -- replication and shutdown -----------------------------------------------------------------

    def wait(self, timeout: float | None = None) -> None:
        """Block until every replication round so far finished; raise :class:`ReplicationError` for
        what failed since the last call."""
        if self._replicator is not None:
            self._replicator.wait(timeout)

    def close(self) -> None:
        """Finish the replication rounds (bounded by ``collective_timeout_s``), release the lock."""
        try:
            if self._replicator is not None:
                self._replicator.close(self.config.collective_timeout_s)
        finally:
            if self._lock is not None:
                self._lock.release()


def node_local_tiers(config: EngineConfig, pipeline: Pipeline) -> tuple[LocalTier, ...]:
    """The node-local tiers of a :class:`~.tiers.TierStack`: one where ``local_dir`` is set (its
    needs checked: :meth:`LocalTier.open`), none otherwise."""
    return () if config.local_dir is None else (LocalTier.open(config, pipeline),)


def _recovered_source(config: EngineConfig, reader: CheckpointReader, ask: ResumeAsk) -> LoadSource | None:
    """Every rank: the local tier's source when it holds a step of ``save_dir``'s run at least as
    new as ``save_dir``'s (latest, or a committed one latest does not name yet) and descended from
    it, complete across all ranks (received from peers' replicas where a rank lacks its part),
    that covers this job's sharding (checked with the rest, agreed); else ``None`` (logged)."""
    assert config.local_dir is not None
    place = _dist.broadcast_object(
        place_of(ask.load_dir, config.local_dir) if _dist.rank() == 0 else None, step="local tier: place"
    )
    durable = durable_view(ask.load_dir, ask.store, (ask.latest, ask.unnamed()), place)
    try:
        topology = Topology.gather(config, _dist.world_size())
    except ConfigError as err:  # another world size than the saves had: save_dir reshards
        if _dist.rank() == 0:
            logger.warning("not resuming from the local tier: %s", err)
        return None
    recovered = recover(
        config.local_dir,
        topology,
        durable,
        keep_last=config.local_keep_last,
        sync=config.sync_files,
        checksums=config.verify == "checksums",
    )
    # None of this job's shape, or a newer one of another shape (the job ran on fewer ranks for a
    # while): resharded (tensors saved per rank are told apart in save_dir's checkpoints only)
    if not config.per_rank_keys:
        found = survey(config.local_dir, durable)
        if recovered is None or _newer_elsewhere(found, recovered):
            recovered = reshard(config.local_dir, found, sync=config.sync_files)
    if recovered is None:
        if _dist.rank() == 0:
            logger.info("the local tier holds no step newer than save_dir's complete on every rank")
        return None
    try:
        validated = reader.validate_rank_local(recovered.path, ask.objs, ask.wanted)
    except RankLocalCoverageError as err:  # raised on every rank: the check is agreed
        if recovered.reshard is not None:
            recovered.reshard.discard()
        if _dist.rank() == 0:
            logger.warning("the local tier cannot serve this job (%s); resuming from save_dir", err)
        return None
    if _dist.rank() == 0:
        logger.info("resuming iteration %d from the local tier", recovered.iteration)
    return LocalTierSource(recovered, ask.wanted, validated)


def _newer_elsewhere(found: TierSurvey, recovered: Recovered) -> bool:
    """Whether the tier holds a step newer than ``recovered`` complete for a job of another world
    size (the same answer on every rank: the survey's plan is)."""
    newest = found.newest
    return newest is not None and newest[0] > recovered.iteration and newest[1] != _dist.world_size()


def _agree_local(phase: CommitPhase, what: str, step: str) -> None:
    """Every rank's outcome of a local-tier step: the first failure, as one typed error naming
    its rank and cause, on every rank (the failing one included)."""
    try:
        failed = agree(phase.error, fallback=CheckpointSaveError, step=step).first
    except CollectiveError as err:
        phase.error = err
        return
    if failed is not None and not isinstance(phase.error, CollectiveError):
        error = CheckpointSaveError(f"rank {failed.rank} failed to {what} its local-tier checkpoint: {failed.text}")
        error.__cause__ = phase.error
        phase.error = error


def _committed_lineage(path: str) -> Lineage | None:
    """The lineage the committed checkpoint ``path`` records (``None``: no checkpoint there, none
    recorded, or a manifest that cannot be read, which a resume's checks report)."""
    if not os.path.isdir(path):
        return None
    try:
        found = lookup_manifest(path).manifest
    except CkptEngineError:
        return None
    return None if found is None else found.lineage


def _drop_abandoned(folder: str, committed: str, run: str, instance: str, start: int) -> None:
    """After this engine committed ``committed`` into its rank ``folder``, having resumed step
    ``start``: remove the steps there that another engine instance of the run saved past
    ``start``. They are a future this job abandoned, which a resume sets aside now that this job
    has a step of its own (:func:`.._tier.lineage.abandoned`); kept, ``local_keep_last`` counted
    them as the newest and removed this job's own steps, and the folder's ``latest`` kept naming
    them. ``latest`` then names ``committed``. Best effort, logged."""
    removed = []
    for name in sorted(os.listdir(folder)):
        iteration = parse_iteration(name)
        if iteration is None or iteration <= start or name == committed:
            continue
        path = os.path.join(folder, name)
        lineage = _committed_lineage(path)
        if lineage is None or lineage.run_id != run or lineage.instance == instance:
            continue
        try:
            remove_checkpoint(path)
        except OSError as err:
            logger.warning("local tier: cannot remove %s, a step this job abandoned: %s", path, err)
            continue
        removed.append(iteration)
    if removed:
        write_latest(folder, committed)
        logger.warning(
            "local tier: removed step(s) %s from %s: an earlier job saved them past step %d, from which this job "
            "went on",
            ", ".join(map(str, removed)),
            folder,
            start,
        )


def _lineage_start(config: EngineConfig, start: int) -> tuple[str, str, tuple[str, int] | None, Place]:
    """Rank 0, at an engine's first save: the run (:func:`_save_dir_run`'s, or a new one), a new
    instance id, recorded in ``save_dir`` with ``start``, the step its saves go on from (the run's
    fork: :mod:`.._tier.lineage`), before any of them is committed; the durable step the saves
    descend from (``save_dir``'s latest, if it records a lineage; with ``allow_overwrite``, the
    older ``start`` the job went back to) and where the saves are made."""
    store = open_store(config.save_dir, config.storage)
    run, parent = _save_dir_run(config)
    if config.allow_overwrite and parent is not None and start < parent[1]:
        parent = _went_back_to(config, start) or parent  # its first durable save rewinds latest to it
    run, instance = run or secrets.token_hex(8), secrets.token_hex(8)
    try:
        write_run(config.save_dir, store, run, (instance, start))
    except (OSError, CkptEngineError) as err:  # its steps still record it; a resume needs one
        logger.warning("local tier: the run's id and this job's start cannot be recorded in save_dir (%s)", err)
    assert config.local_dir is not None
    return run, instance, parent, place_of(config.save_dir, config.local_dir)


def _save_dir_run(config: EngineConfig) -> tuple[str | None, tuple[str, int] | None]:
    """The run ``save_dir`` belongs to (its latest's, else the one its run file names; ``None``:
    none yet) and its latest durable step (save id, iteration) where that records a lineage."""
    store = open_store(config.save_dir, config.storage)
    try:
        name = read_latest(config.save_dir, store)
        found = None if name is None else lookup_manifest(store.join(config.save_dir, name), store).manifest
    except (OSError, CkptEngineError) as err:
        logger.warning("local tier: save_dir's latest cannot be read (%s)", err)
        found = None
    if found is None or found.lineage is None:
        return read_run(config.save_dir, store), None
    return found.lineage.run_id, (found.lineage.save_id, found.iteration)


def _went_back_to(config: EngineConfig, start: int) -> tuple[str, int] | None:
    """With ``allow_overwrite``, a job that went back to step ``start``, older than ``save_dir``'s
    latest, rewrites the history from there (:func:`~.resave.move_latest`): its saves descend
    from ``save_dir``'s checkpoint of ``start`` (save id, iteration), where that records a lineage."""
    store = open_store(config.save_dir, config.storage)
    try:
        found = lookup_manifest(store.join(config.save_dir, iter_dirname(start)), store).manifest
    except (OSError, CkptEngineError):
        return None
    return None if found is None or found.lineage is None else (found.lineage.save_id, start)
