"""Load sources on the node's own storage: the node-local tier (``local_dir``, with its peer
replicas and recovery planner) and the two-tier local copy of an object store
(``storage.local_dir``).

Both are chosen by :meth:`~.loader.Loader._source` before ``save_dir`` when they hold a step at
least as new as the one ``save_dir`` would give, and both read through the loader's checks and
per-component load.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .._dcpio import dist as _dist
from .._format.names import parse_iteration
from .._format.pointer import read_latest
from .._storage.store import open_store
from .._tier.lineage import Durable
from .._tier.recovery import Recovered, recover
from .._tier.reshard import reshard
from .._tier.topology import Topology
from ..config import EngineConfig
from ..errors import CkptEngineError, ConfigError, CorruptCheckpointError, RankLocalCoverageError
from ..types import LoadResult
from .consensus import agreed
from .load_guard import Validated
from .state import TrainingObjects

if TYPE_CHECKING:
    from .loader import Loader

__all__ = ["LocalTierSource", "local_tier_source", "two_tier_copy"]

logger = logging.getLogger("ckpt_engine")


@dataclass(frozen=True)
class LocalTierSource:
    """This rank's part of a step the node-local tier holds complete for every rank: on its own
    node already, or just received from a peer's replica (:func:`~ckpt_engine._tier.recovery.recover`)."""

    recovered: Recovered
    wanted: list[str]

    def read(self, loader: Loader, objs: TrainingObjects) -> LoadResult:
        # The recovery checked the sizes (and per verify, checksums) of every copy it uses, and
        # every byte received from a peer: the sizes are checked once more as the load opens it.
        recovered = self.recovered
        resharded = recovered.reshard  # a step of another shape: its own reader
        try:
            validated = loader.validate_rank_local(recovered.path)
            result = loader.read_checkpoint(
                objs,
                recovered.path,
                self.wanted,
                "latest",
                validated,
                dedup_reads="off",
                local_reader=None if resharded is None else resharded.reader,
            )
        except (RankLocalCoverageError, CorruptCheckpointError) as err:  # on every rank: the load agrees
            if resharded is None and not isinstance(err, RankLocalCoverageError):
                raise
            if _dist.rank() == 0:
                logger.warning("the local tier cannot serve this job (%s); resuming from save_dir", err)
            return loader.durable_source(objs).read(loader, objs)
        finally:
            if resharded is not None:
                resharded.discard()
        if resharded is not None:
            return dataclasses.replace(result, bytes_by_source=resharded.by_source())
        if recovered.source == _dist.rank():  # on its own node: everything read came from there
            by_source = {"local": result.bytes_read}
        else:  # received from a peer into this node (and what this node had of it, linked)
            by_source = {"local": recovered.bytes_linked, "peer": recovered.bytes_received}
        return dataclasses.replace(result, bytes_by_source={k: v for k, v in by_source.items() if v})


def local_tier_source(config: EngineConfig, durable: Durable | None, wanted: list[str]) -> LocalTierSource | None:
    """Every rank: the local tier's source when it holds a step of ``save_dir``'s run at least as
    new as ``durable`` (``save_dir``'s latest, ``None`` if it has none) and descended from it,
    complete across all ranks (one save of it), else ``None`` (logged)."""
    assert config.local_dir is not None
    try:
        topology = Topology.of(config, _dist.world_size())
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
    if recovered is None and not config.per_rank_keys:  # none of this job's shape: one of another,
        # resharded (tensors saved per rank are told apart in save_dir's checkpoints only)
        recovered = reshard(config.local_dir, durable, sync=config.sync_files)
    if recovered is None:
        if _dist.rank() == 0:
            logger.info("the local tier holds no step newer than save_dir's complete on every rank")
        return None
    if _dist.rank() == 0:
        logger.info("resuming iteration %d from the local tier", recovered.iteration)
    return LocalTierSource(recovered, wanted)


def two_tier_copy(loader: Loader, local_dir: str, remote_latest: str | None) -> Validated | None:
    """Two-tier: the local copy to resume from, if its ``latest`` is complete and at least as
    new as the object store's; ``None`` (logged) otherwise."""
    try:
        name = agreed(lambda: read_latest(local_dir))
    except CkptEngineError as err:
        logger.warning("ignoring the local copy in %s: %s", local_dir, err)
        return None
    names = _dist.all_gather_object(name, step="local copy")
    if any(n != name for n in names):  # each host decides alike, or none reads its copy
        if _dist.rank() == 0:
            shown = ", ".join(f"rank {r}: {n!r}"[:100] for r, n in enumerate(names[:8]))
            logger.warning("the ranks' local copies name different checkpoints (%s); using %s", shown, loader.save_dir)
        return None
    if name is None:
        return None
    local_iter, remote_iter = parse_iteration(name), parse_iteration(remote_latest or "")
    if local_iter is None or (remote_iter is not None and local_iter < remote_iter):
        return None
    try:
        validated = loader.validate(
            os.path.join(local_dir, name), open_store(local_dir), shared=False, what="the local copy"
        )
    except CkptEngineError as err:
        if _dist.rank() == 0:
            logger.warning("the local copy %s cannot be resumed (%s); using %s", name, err, loader.save_dir)
        return None
    if _dist.rank() == 0:
        logger.info(
            "resuming from the local copy %s (the object store's latest: %s)", validated.checked.path, remote_latest
        )
    return validated
