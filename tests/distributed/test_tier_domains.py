"""Failures one after another and failure domains in the node-local tier, on 4 gloo ranks
(``tests/dist_scripts/tier_domains.py``, one launch for every scenario).

A node rebuilt from its peers' replicas at a resume holds again, right after it, the replicas it
kept for others, and its peers hold its ranks' replicas again: a second node lost before any
save still resumes the step from the tier. With failure domains (two racks), replicas are placed
on the other rack: a whole rack lost resumes from the tier, with one replica per rank and with two.
"""

from __future__ import annotations

from typing import Any

import pytest
from _torchrun import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.full]

RANKS = 4


def _taken(reports: list[dict[str, Any]]) -> list[str]:
    """Where each rank's part came from: ``peer`` where any byte did (it also links the files its
    node holds with the same bytes), else its single source."""
    return ["peer" if "peer" in r["by_source"] else "+".join(sorted(r["by_source"])) for r in reports]


def _from_tier(reports: list[dict[str, Any]]) -> bool:
    """The last step, equal bit for bit, with 0 bytes from ``save_dir`` on every rank."""
    return all(r["iteration"] == 5 and r["same"] and "durable" not in r["by_source"] for r in reports)


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Each resume's reports by rank, keyed by scenario and loss number."""
    run = run_torchrun("tier_domains.py", str(tmp_path_factory.mktemp("domains")), nproc=RANKS, timeout=300)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == list(range(RANKS)), run.describe()
    out: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rank in range(RANKS):
        seen: dict[str, int] = {}
        for r in results[rank]:
            n = seen[r["scenario"]] = seen.get(r["scenario"], -1) + 1
            out.setdefault((r["scenario"], n), []).append(r)
    return out


def test_a_second_node_lost_before_any_save_still_resumes_from_the_tier(resumed: dict[Any, Any]) -> None:
    first, second = resumed["rebuild", 0], resumed["rebuild", 1]
    assert [(r["iteration"], r["same"]) for r in first] == [(5, True)] * RANKS
    assert _taken(first) == ["local", "local", "peer", "peer"]  # node 1 rebuilt from node 0's replicas
    # Node 0 lost too, with no save in between: node 1 holds node 0's replicas again.
    assert [(r["iteration"], r["same"]) for r in second] == [(5, True)] * RANKS
    assert _from_tier(first) and _from_tier(second)
    assert _taken(second) == ["peer", "peer", "local", "local"]  # 0 bytes from save_dir


def test_a_whole_rack_lost_resumes_from_the_other_rack(resumed: dict[Any, Any]) -> None:
    # Two replicas, both on the other rack: rack b lost, then (no save between) rack a.
    rack_b, rack_a = resumed["racks2", 0], resumed["racks2", 1]
    assert [(r["iteration"], r["same"]) for r in rack_b] == [(5, True)] * RANKS
    assert _taken(rack_b) == ["local", "local", "peer", "peer"]
    assert [(r["iteration"], r["same"]) for r in rack_a] == [(5, True)] * RANKS
    assert _taken(rack_a) == ["peer", "peer", "local", "local"]
    assert _from_tier(rack_b) and _from_tier(rack_a)
    # One replica (domains given in the config): node order would put rank 0's copy on node 1,
    # its own rack; the placement puts it on rack b.
    (one,) = [resumed["racks1", 0]]
    assert [(r["iteration"], r["same"]) for r in one] == [(5, True)] * RANKS
    assert _taken(one) == ["peer", "peer", "local", "local"] and _from_tier(one)
