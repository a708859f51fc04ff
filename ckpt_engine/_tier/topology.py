"""Which ranks share a node and a failure domain, and which ranks on other nodes hold each rank's replicas.

Ranks ``0 .. ranks_per_node - 1`` are node 0, the next ``ranks_per_node`` node 1, and so on, as
torchrun numbers them. Each node belongs to one *failure domain*: the label its ranks give
(``failure_domain``, else the ``CKPT_ENGINE_FAILURE_DOMAIN`` environment variable: a rack, a
power feed, a zone), or, where no rank gives one, a domain of its own.

The placement rule (:func:`place`, the only one; every rank computes it from the same gathered
labels, so nothing about placement is exchanged):

1. the nodes are laid on a ring that spreads each domain evenly: the ``j``-th of a domain's ``m``
   nodes (in node order) sits at ``(j + 1/2) / m`` of the way round, ties in the order the domains
   first appear. Domains of equal size interleave (``a0 b0 c0 a1 b1 c1 ...``);
2. a *shift* ``s`` (1 .. nodes - 1) sends each node's copy to the node ``s`` places further on
   the ring. It is *clean* when no node's copy stays in its own domain. Replica ``k`` of every
   node uses the ``k``-th shift of: the clean shifts, smallest first, then (where fewer than
   ``peer_replicas`` are clean) the smallest other shifts;
3. rank ``r``'s ``k``-th replica is held by the rank of the same local rank on that node.

So every replica of a rank is on another node than the rank and than each other (shifts are
distinct and below the node count), every replica is in another domain when ``peer_replicas``
clean shifts exist (with ``G`` domains of equal size: ``peer_replicas <= G - 1``), and each rank
holds exactly ``peer_replicas`` replicas (each shift is a permutation: in replication round ``k``
a rank is the source of one holder and the holder of one source). Without labels each node is a
domain and the ring is node order: rank ``r``'s ``k``-th holder is ``(r + k * ranks_per_node) %
world``, the same local rank on the ``k``-th next node (NVIDIA's resiliency extension calls the
distance ``replication_jump``). :meth:`Topology.exposed` names the domains whose loss would take
every copy of some rank's checkpoint (a domain with more than half the nodes, say).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._dcpio import dist as _dist
from ..config import EngineConfig
from ..errors import ConfigError

__all__ = ["DOMAIN_ENV", "Topology", "place"]

#: The environment variable that names this rank's failure domain where the config does not.
DOMAIN_ENV = "CKPT_ENGINE_FAILURE_DOMAIN"

logger = logging.getLogger("ckpt_engine")


def place(domains: Sequence[str], replicas: int) -> list[list[int]]:
    """The placement rule (the module's): for each ``k = 1 .. replicas``, the node that holds each
    node's ``k``-th replica (``out[k - 1][node]``), given each node's domain label."""
    nodes = len(domains)
    if replicas <= 0:
        return []
    members: dict[str, list[int]] = {}
    for node, label in enumerate(domains):
        members.setdefault(label, []).append(node)
    key: dict[int, tuple[float, int]] = {}
    for first, nodes_of in enumerate(members.values()):
        for j, node in enumerate(nodes_of):
            key[node] = ((j + 0.5) / len(nodes_of), first)
    ring = sorted(range(nodes), key=key.__getitem__)
    labels = [domains[n] for n in ring]
    shifts: list[int] = []
    for s in range(1, nodes):  # each test stops at the first copy left in its domain
        if len(shifts) == replicas:
            break
        if all(labels[i] != labels[(i + s) % nodes] for i in range(nodes)):
            shifts.append(s)
    shifts += [s for s in range(1, nodes) if s not in shifts][: replicas - len(shifts)]
    out = []
    for s in shifts:
        holder = [0] * nodes
        for i, node in enumerate(ring):
            holder[node] = ring[(i + s) % nodes]
        out.append(holder)
    return out


@dataclass(frozen=True)
class Topology:
    """The job's nodes, failure domains and replica placement, for one world size."""

    world: int
    ranks_per_node: int
    #: Copies of each rank's local checkpoints on other nodes.
    replicas: int
    #: Each node's failure domain (index: node); empty: every node a domain of its own.
    domains: tuple[str, ...] = ()
    #: ``_holder[k][node]``: the node holding ``node``'s ``k+1``-th replica; ``_source``: the inverse.
    _holder: list[list[int]] = field(init=False, repr=False, compare=False)
    _source: list[list[int]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        labels = self.domains or tuple(f"node {n}" for n in range(self.nodes))
        holder = place(labels, self.replicas)
        source = []
        for row in holder:
            inverse = [0] * len(row)
            for node, held_by in enumerate(row):
                inverse[held_by] = node
            source.append(inverse)
        object.__setattr__(self, "_holder", holder)
        object.__setattr__(self, "_source", source)

    @classmethod
    def of(cls, config: EngineConfig, world: int, domains: Sequence[str | None] = ()) -> Topology:
        """The topology ``config`` gives a job of ``world`` ranks (``domains``: each rank's failure
        domain label, as :meth:`gather` collects them); a value that cannot fit it is a
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
        return cls(world, per_node, replicas, _node_domains(list(domains), per_node))

    @classmethod
    def gather(cls, config: EngineConfig, world: int) -> Topology:
        """Every rank (a collective): each rank's failure domain gathered, then :meth:`of`."""
        label = config.failure_domain if config.failure_domain is not None else os.environ.get(DOMAIN_ENV) or None
        labels: list[str | None] = _dist.all_gather_object(label, step="local tier: failure domains")
        topology = cls.of(config, world, labels)
        exposed = topology.exposed() if topology.domains and topology.replicas else []
        if exposed and _dist.rank() == 0:
            logger.warning(
                "local tier: losing failure domain(s) %s would lose every copy of some ranks' checkpoints: the "
                "domains are too few or too uneven for peer_replicas=%d (docs/reliability.md, Failure domains)",
                ", ".join(exposed[:8]),
                topology.replicas,
            )
        return topology

    @property
    def nodes(self) -> int:
        return self.world // self.ranks_per_node

    def node(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def domain(self, rank: int) -> str:
        """The failure domain of ``rank``'s node."""
        return self.domains[self.node(rank)] if self.domains else f"node {self.node(rank)}"

    def holders(self, rank: int) -> list[int]:
        """The ranks that keep a replica of ``rank``'s local checkpoints, in replica order ``k``."""
        node, local = divmod(rank, self.ranks_per_node)
        return [row[node] * self.ranks_per_node + local for row in self._holder]

    def sources(self, holder: int) -> list[int]:
        """The ranks whose replicas ``holder`` keeps, in the order of :meth:`holders`' ``k``."""
        node, local = divmod(holder, self.ranks_per_node)
        return [row[node] * self.ranks_per_node + local for row in self._source]

    def exposed(self) -> list[str]:
        """The domains whose loss would take every copy of some rank's checkpoints (first
        appearance order): a node whose replicas all stay in its own domain."""
        out: list[str] = []
        for rank in range(0, self.world, self.ranks_per_node):
            here = self.domain(rank)
            if here not in out and all(self.domain(h) == here for h in self.holders(rank)):
                out.append(here)
        return out


def _node_domains(labels: list[str | None], per_node: int) -> tuple[str, ...]:
    """Each node's domain from each rank's label (``()``: no rank gave one); the ranks of one node
    must give the same label."""
    if not any(label is not None for label in labels):
        return ()
    out = []
    for start in range(0, len(labels), per_node):
        mine = labels[start : start + per_node]
        if any(label != mine[0] for label in mine) or mine[0] is None:
            shown = ", ".join(f"rank {start + i}: {label!r}" for i, label in enumerate(mine[:8]))
            raise ConfigError(
                f"the ranks of node {start // per_node} give different failure domains ({shown}); every rank of a "
                f"node must give the same failure_domain (or {DOMAIN_ENV}), and every node one, or none does"
            )
        out.append(mine[0])
    return tuple(out)


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
