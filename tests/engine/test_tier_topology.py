"""Replica placement across failure domains (``_tier/topology.py``'s rule), on many job shapes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine import EngineConfig
from ckpt_engine._tier.topology import DOMAIN_ENV, Topology, place
from ckpt_engine.errors import ConfigError


def _config(**fields: object) -> EngineConfig:
    return EngineConfig(save_dir="/x", local_dir="/l", **fields)  # type: ignore[arg-type]


@st.composite
def _jobs(draw: st.DrawFn) -> tuple[int, int, list[str]]:
    """``(ranks_per_node, replicas, each node's domain)``: 2 to 40 nodes in 1 to 8 domains of any sizes."""
    nodes = draw(st.integers(2, 40))
    domains = draw(st.integers(1, min(nodes, 8)))
    labels = draw(st.lists(st.integers(0, domains - 1), min_size=nodes, max_size=nodes))
    return draw(st.integers(1, 3)), draw(st.integers(1, nodes - 1)), [f"rack{i}" for i in labels]


@settings(max_examples=300, deadline=None)
@given(_jobs())
def test_every_shape_keeps_holders_distinct_off_node_and_one_replica_per_round(job: tuple[int, int, list[str]]) -> None:
    per_node, replicas, domains = job
    world = per_node * len(domains)
    topo = Topology(world, per_node, replicas, tuple(domains))
    held = [0] * world
    for rank in range(world):
        holders = topo.holders(rank)
        assert len(holders) == replicas and len(set(holders)) == replicas  # distinct holders
        assert all(topo.node(h) != topo.node(rank) for h in holders)  # never on its own node
        assert all(h % per_node == rank % per_node for h in holders)  # the same local rank
        for k, h in enumerate(holders):
            assert topo.sources(h)[k] == rank  # round k pairs each rank with one source, one holder
            held[h] += 1
    assert held == [replicas] * world  # the replicas are spread evenly


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 12), st.integers(1, 12), st.data())
def test_with_enough_domains_every_replica_is_in_another_domain(groups: int, size: int, data: st.DataObject) -> None:
    """Equal domains, shuffled over the nodes: every replica of every node leaves its domain
    whenever there are more domains than replicas, and a loss of any one domain leaves a copy."""
    replicas = data.draw(st.integers(1, groups - 1)) if groups > 1 else 0
    labels = [f"zone{i % groups}" for i in range(groups * size)]
    labels = data.draw(st.permutations(labels))
    for k, holder in enumerate(place(labels, replicas)):
        assert sorted(holder) == list(range(len(labels))), k  # a permutation of the nodes
        assert all(labels[holder[n]] != labels[n] for n in range(len(labels))), k
    if replicas:
        assert Topology(len(labels), 1, replicas, tuple(labels)).exposed() == []


def test_without_labels_the_placement_is_the_next_nodes() -> None:
    """No labels (each node a domain): rank r's k-th replica on rank r + k * ranks_per_node, as before."""
    for nodes, per_node in ((2, 2), (3, 2), (5, 1), (7, 3)):
        world = nodes * per_node
        for replicas in range(nodes):
            topo = Topology(world, per_node, replicas)
            for rank in range(world):
                assert topo.holders(rank) == [(rank + k * per_node) % world for k in range(1, replicas + 1)]
                assert topo.sources(rank) == [(rank - k * per_node) % world for k in range(1, replicas + 1)]


def test_two_racks_of_two_nodes_with_two_replicas() -> None:
    """The torchrun test's shape: ranks 0, 1 on rack a, ranks 2, 3 on rack b, one rank per node."""
    topo = Topology.of(_config(ranks_per_node=1, peer_replicas=2), 4, ["a", "a", "b", "b"])
    # Shifts 1 and 3 of the ring a0 b0 a1 b1 both leave the rack: every copy is on the other rack.
    assert [topo.holders(r) for r in range(4)] == [[2, 3], [3, 2], [1, 0], [0, 1]]
    assert all(topo.domain(h) != topo.domain(r) for r in range(4) for h in topo.holders(r))
    assert topo.exposed() == []
    # The same racks laid out a, b, a, b: the ring is the same up to the labels' order.
    mixed = Topology.of(_config(ranks_per_node=1, peer_replicas=1), 4, ["a", "b", "a", "b"])
    assert [mixed.holders(r) for r in range(4)] == [[1], [2], [3], [0]]


def test_a_domain_too_large_to_leave_is_named() -> None:
    """Three of four nodes in one rack: with one replica per rank, some node of that rack keeps
    its only copy in the rack, and the topology names it."""
    topo = Topology(4, 1, 1, ("big", "big", "big", "small"))
    assert topo.exposed() == ["big"]
    assert all(topo.node(topo.holders(r)[0]) != r for r in range(4))  # still on another node


@pytest.mark.full  # over 2 s on 2 cores: new processes
def test_every_rank_computes_the_same_placement() -> None:
    """The rule depends on nothing but its input: another interpreter (another hash seed) gives
    the same holders for a shape with many domains of uneven sizes."""
    labels = [f"r{(n * 7) % 5}" if n % 3 else f"z{n % 4}" for n in range(30)]
    code = f"from ckpt_engine._tier.topology import place; print(place({labels!r}, 3))"
    env = {**os.environ, "PYTHONHASHSEED": "123"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == str(place(labels, 3))


def test_the_ranks_of_a_node_must_give_one_domain() -> None:
    with pytest.raises(ConfigError, match=r"node 1 give different failure domains \(rank 2: 'b', rank 3: 'c'\)"):
        Topology.of(_config(ranks_per_node=2), 4, ["a", "a", "b", "c"])
    with pytest.raises(ConfigError, match=r"rank 2: None.*every node one, or none does"):
        Topology.of(_config(ranks_per_node=2), 4, ["a", "a", None, None])
    assert Topology.of(_config(ranks_per_node=2), 4, [None] * 4).domains == ()


def test_the_domain_comes_from_the_config_else_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """One rank (no process group): the gathered labels are this rank's."""
    monkeypatch.setenv(DOMAIN_ENV, "rack7")
    assert Topology.gather(_config(ranks_per_node=1), 1).domains == ("rack7",)
    assert Topology.gather(_config(ranks_per_node=1, failure_domain="zone-b"), 1).domains == ("zone-b",)
    monkeypatch.delenv(DOMAIN_ENV)
    assert Topology.gather(_config(ranks_per_node=1), 1).domains == ()
    with pytest.raises(ConfigError, match="failure_domain set without local_dir"):
        EngineConfig(save_dir="/x", failure_domain="rack1")
