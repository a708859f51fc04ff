"""Which ranks share a node, and which ranks on other nodes hold each rank's replicas.

Ranks ``0 .. ranks_per_node - 1`` are node 0, the next ``ranks_per_node`` node 1, and so on, as
torchrun numbers them. Rank ``r``'s ``k``-th replica (``k = 1 .. peer_replicas``) is held by rank
``(r + k * ranks_per_node) % world``: the same local rank on the ``k``-th next node, so the
copies of one rank are on as many different nodes, none on its own (NVIDIA's resiliency
extension calls the distance ``replication_jump``). Every rank computes the same map from the
same three numbers, so nothing about placement is exchanged.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..config import EngineConfig
from ..errors import ConfigError

__all__ = ["Topology"]


@dataclass(frozen=True)
class Topology:
    """The job's nodes and replica placement, for one world size."""

    world: int
    ranks_per_node: int
    #: Copies of each rank's local checkpoints on other nodes.
    replicas: int

    @classmethod
    def of(cls, config: EngineConfig, world: int) -> Topology:
        """The topology ``config`` gives a job of ``world`` ranks; a value that cannot fit it is a
        :class:`~ckpt_engine.errors.ConfigError` naming the field and the fix."""
        per_node = config.ranks_per_node
        if per_node is None:
            per_node = _local_world_size(world)
        if world % per_node != 0:
            raise ConfigError(
                f"ranks_per_node={per_node} does not divide the job's {world} ranks; set ranks_per_node to the "
                "number of ranks on each node (torchrun --nproc-per-node)"
            )
        nodes = world // per_node
        replicas = config.peer_replicas
        if replicas is None:
            replicas = 1 if nodes > 1 else 0
        elif replicas > nodes - 1:
            raise ConfigError(
                f"peer_replicas={replicas} needs {replicas + 1} nodes (each copy on a node of its own), but this job "
                f"has {nodes} ({world} ranks, ranks_per_node={per_node}); lower peer_replicas to at most {nodes - 1}"
            )
        return cls(world=world, ranks_per_node=per_node, replicas=replicas)

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def holders(self, rank: int) -> list[int]:
        """The ranks that keep a replica of ``rank``'s local checkpoints, nearest node first."""
        return [(rank + k * self.ranks_per_node) % self.world for k in range(1, self.replicas + 1)]

    def sources(self, holder: int) -> list[int]:
        """The ranks whose replicas ``holder`` keeps, in the order of :meth:`holders`' ``k``."""
        return [(holder - k * self.ranks_per_node) % self.world for k in range(1, self.replicas + 1)]


def _local_world_size(world: int) -> int:
    """torchrun's ``LOCAL_WORLD_SIZE`` (all ranks on one node without it)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return world
    try:
        value = int(raw)
    except ValueError as err:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE is {raw[:20]!r}, not a number; set ranks_per_node in the config instead"
        ) from err
    if value < 1:
        raise ConfigError(f"LOCAL_WORLD_SIZE is {value}; set ranks_per_node in the config instead")
    return value
