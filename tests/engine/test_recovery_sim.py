"""The recovery planner's simulation (``benchmarks/recovery_sim_bench.py``) runs, and the planner
it measures chooses what the planner before it chose, in linear time."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from ckpt_engine._format.manifest import Lineage
from ckpt_engine._tier import recovery
from ckpt_engine._tier.lineage import Announced
from ckpt_engine._tier.topology import Topology

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "recovery_sim_bench.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("recovery_sim_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.full  # over 2 s on 2 cores: the simulation's smoke run
def test_the_smoke_run_reports_every_phase(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    assert _bench().main(["--smoke", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["peer_replicas"], r["mode"]) for r in rows] == [(1, "today"), (1, "now"), (2, "today"), (2, "now")]
    for row in rows:
        assert row["ranks"] == 64 and row["agreement"]["seconds"] > 0 and row["agreement"]["peak_mib"] > 0
        assert row["pairs"]["lost"] == 1 and row["pairs"]["ordinary"] == 0  # a lost rank receives its part
        if row["mode"] == "now":  # the lost node held replicas of 8 ranks per replica: sent again
            assert row["replicas_restored"] == 8 * row["peer_replicas"]
            assert row["restore_pairs"]["lost"] == row["peer_replicas"] and row["exposed_domains"] == []


def test_the_plan_is_the_one_the_quadratic_planner_made() -> None:
    """Each part from its own node, else its first replica holder, else the lowest rank holding
    it (rank 1 here: neither rank 5 nor its holder rank 7 keeps a copy of it, ranks 3 and 1 do)."""
    topo = Topology(8, 2, 1)
    lineage = Lineage("0a", "1b-4", None, None)
    kept = [Announced(r, r, 4, lineage) for r in range(8) if r not in (5, 2)]
    kept += [Announced(4, 2, 4, lineage), Announced(1, 5, 4, lineage), Announced(3, 5, 4, lineage)]
    plan = recovery._plan(kept, set(), topo)
    assert plan is not None and plan.source == _bench().today_plan(kept, topo)
    assert plan.source[2] == 4 and plan.source[5] == 1
