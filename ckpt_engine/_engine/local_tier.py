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

import logging
import os
import secrets
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import Any

from .._dcpio import dist as _dist
from .._dcpio.coordination import RANK_LOCAL
from .._dcpio.dist import new_gloo_group
from .._dcpio.planner import EngineSavePlanner
from .._format.digests import written_entries
from .._format.layout import SaveDirLock, cleanup_leftovers, remove_tree
from .._format.manifest import Manifest, list_files, lookup_manifest
from .._format.names import iter_dirname, partial_dirname
from .._format.retention import apply_retention
from .._storage.store import open_store
from .._tier.folders import rank_folder
from .._tier.replication import Replicator
from .._tier.topology import Topology
from ..config import EngineConfig
from ..errors import ConfigError, SaveDirLockedError
from ..pipeline import Pipeline
from ..types import StagedState, WriteContext, WriteResult
from .commit import CommitPhase, wait_writes
from .incremental import carry_base_in
from .resave import refuse_resave
from .targets import SavePaths, commit_locally

__all__ = ["LocalTier"]

logger = logging.getLogger("ckpt_engine")

#: The folder inside ``local_dir`` where the first save's node check leaves its markers.
_PROBE_DIR = ".ckpt_engine_nodes"


class LocalTier:
    """This rank's part of the node-local tier: staging, writes, commit, retention, replication."""

    def __init__(self, config: EngineConfig) -> None:
        assert config.local_dir is not None
        self.config = config
        self.root = config.local_dir
        self._topology: Topology | None = None
        self._replicator: Replicator | None = None
        self._lock: SaveDirLock | None = None

    @classmethod
    def open(cls, config: EngineConfig, pipeline: Pipeline) -> LocalTier | None:
        """The local tier ``config`` asks for (``None`` without ``local_dir``), once its needs are
        checked: a ``write`` provider that writes rank-local checkpoints, and checksums."""
        if config.local_dir is None:
            return None
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
        return cls(config)

    # -- where ----------------------------------------------------------------------------------

    @property
    def folder(self) -> str:
        """This rank's folder of the local tier."""
        return rank_folder(self.root, _dist.rank())

    def topology(self) -> Topology:
        world = _dist.world_size()
        if self._topology is None or self._topology.world != world:
            self._topology = Topology.of(self.config, world)
        return self._topology

    def paths(self, iteration: int) -> SavePaths:
        final = os.path.join(self.folder, iter_dirname(iteration))
        return SavePaths(iteration, final, os.path.join(self.folder, partial_dirname(iteration)), final)

    # -- before the write -----------------------------------------------------------------------

    def prepare(self, paths: SavePaths) -> None:
        """Every rank, before staging: this rank's folder locked (the first time; leftovers of a
        crash removed), a committed iteration refused as in ``save_dir``, the partial folder cleared."""
        if self._lock is None:
            os.makedirs(self.folder, exist_ok=True)
            lock = SaveDirLock(self.folder)
            if not lock.acquire():
                raise SaveDirLockedError(f"another engine holds {self.folder}; two engines cannot save as one rank")
            self._lock = lock
            for line in cleanup_leftovers(self.folder):
                logger.warning("local tier: %s", line)
        refuse_resave(paths.iteration, [(paths.final, open_store(paths.final))], self.config.allow_overwrite)
        if os.path.exists(paths.partial):
            remove_tree(paths.partial)

    def begin(self, iteration: int) -> Future[Manifest | None] | None:
        """Every rank, once the save is prepared: at the first save, the node check and the
        replicator (collective); then this save's replication round, to resolve after the commit."""
        topology = self.topology()
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

    def write(
        self,
        pipeline: Pipeline,
        paths: SavePaths,
        staged: StagedState,
        key_maps: Mapping[str, dict[str, str]],
        *,
        plan_prefix: str,
        checksum: str,
        stable: frozenset[str],
    ) -> tuple[SavePaths, list[WriteResult | Future[WriteResult]]]:
        """Hand each component to the ``write`` provider as a rank-local write; returns the paths
        (with what an incremental save carries over from this rank's previous checkpoint) and the
        outcomes.

        Each archive's serialization id is derived from its content (the writer does it for a
        rank-local write): equal state gives equal bytes, so a peer that holds the same shards (a
        data-parallel replica) or the previous step's unchanged files links them instead of
        receiving them. With ``incremental``, the files are laid out and unchanged ones linked from
        this rank's previous checkpoint as in ``save_dir`` (``stable``: the model's frozen keys)."""
        carry = None
        if self.config.incremental:
            carry = carry_base_in(self.folder, open_store(self.folder), "link", self.config, checksum, paths.iteration)
            paths = SavePaths(
                paths.iteration,
                paths.final,
                paths.partial,
                paths.local_final,
                carry_chain=carry.chain,
                carry_from=carry.folder,
            )
        outcomes: list[WriteResult | Future[WriteResult]] = []
        for name, state in staged.components.items():
            planner = EngineSavePlanner(key_maps[name], cache_key=f"{plan_prefix}local:{name}", checksum=checksum)
            ctx = WriteContext(
                component=name,
                iteration=paths.iteration,
                path=os.path.join(paths.partial, name),
                rank=_dist.rank(),
                world_size=_dist.world_size(),
                planner=planner,
                staged_copy=staged.is_copy,
                thread_count=self.config.thread_count,
                sync_files=self.config.sync_files,
                process_group=RANK_LOCAL,
                carry_over=None
                if carry is None
                else carry.for_component(name, stable if name == "model" else frozenset()),
                rank_local=True,
            )
            out = pipeline.write(ctx, state)
            if isinstance(out, Future) and not staged.is_copy:
                out = out.result()  # the live state: must be written before save() returns
            outcomes.append(out)
        return paths, outcomes

    # -- the commit -----------------------------------------------------------------------------

    def commit(
        self,
        pipeline: Pipeline,
        paths: SavePaths,
        components: tuple[str, ...],
        outcomes: Sequence[Any],
        algorithm: str,
        round_: Future[Manifest | None] | None,
    ) -> CommitPhase:
        """This rank's commit, once its writes are done; resolves the replication round (with the
        committed manifest, or ``None``) whatever happens."""
        phase = CommitPhase()
        manifest = None
        try:
            wait_writes(pipeline, outcomes, phase)
            if phase.error is None:
                rels = list_files(paths.partial)
                entries = written_entries(paths.partial, rels, algorithm)
                commit_locally(paths, components, algorithm, entries, _dist.world_size(), rank=_dist.rank())
                manifest = lookup_manifest(paths.final).manifest
                self._retain()
        except Exception as err:
            phase.error = err
        finally:
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

    # -- replication and shutdown -----------------------------------------------------------------

    def wait_replicated(self, timeout: float | None = None) -> None:
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
