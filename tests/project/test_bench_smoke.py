"""The benchmark suite runs end to end in its tiny ``--smoke`` mode (untimed: nothing is asserted
about speed), so it cannot rot. The real runs and their figures are in benchmarks/RESULTS.md."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import _forked
import pytest
from _paths import ROOT

pytestmark = pytest.mark.full  # every benchmark end to end in its smoke mode

REPO = ROOT
BENCH = REPO / "benchmarks" / "bench.py"


def _bench(script: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``python SCRIPT ARGS`` from the repository root; fails the test (with the output's tail)
    unless it exits 0. The benchmark and the Python processes it starts (torchrun's agent and
    ranks, its workers, its cold-load processes) are forked from a process that imported torch
    (tests/_forked_python.py): a smoke run checks that every path runs, not what it costs."""
    proc = _forked.run(script, *args, timeout=timeout, cwd=REPO, python=_forked.python_stand_in())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """One ``bench.py --smoke --dist`` run for the two tests below: every one-process method and
    the 2-rank torchrun rows (a second run would pay for a second interpreter and raw_write)."""
    tmp_path = tmp_path_factory.mktemp("bench")
    out = tmp_path / "results.json"
    args = ["--smoke", "--dist", "--dirs", "repo", "--plot", str(tmp_path / "plot.png")]
    proc = _bench(BENCH, *args, "--workdir", str(tmp_path / "work"), "--out", str(out))
    assert "median s" in proc.stdout  # the table was printed
    result: dict[str, Any] = json.loads(out.read_text())
    return tmp_path, result


@pytest.mark.dist
def test_smoke_run_covers_every_method(bench_run: tuple[Path, dict[str, Any]]) -> None:
    tmp_path, result = bench_run
    rows = result["rows"]
    errors = [(r["method"], r.get("note")) for r in rows if "median" not in r and "Skip" not in str(r.get("note"))]
    skipped = {r["method"]: r.get("note") for r in rows if "median" not in r}
    # only optional dependencies may be missing; nothing may fail
    assert all(m.startswith("safetensors") for m in skipped), errors
    measured = {r["method"] for r in rows if "median" in r}
    for name in ("raw_write", "raw_read", "memcpy", "dcp_save", "dcp_load", "ours_save", "ours_load"):
        assert name in measured
    assert {"small_dcp_save", "small_dcp_load", "small_ours_save", "small_ours_load"} <= measured
    ours_load = next(r for r in rows if r["method"] == "ours_load")
    assert ours_load["x_limit"] > 0 and ours_load["speedup_vs_dcp"] > 0 and ours_load["peak_extra_bytes"] >= 0
    assert result["machine"]["loadavg"] and result["rss_mode"]
    assert not os.listdir(tmp_path / "work")  # every child cleaned up after itself


@pytest.mark.dist
def test_smoke_run_of_the_two_rank_rows(bench_run: tuple[Path, dict[str, Any]]) -> None:
    _, result = bench_run
    dist_rows = [r for r in result["rows"] if r["method"].startswith("ours_2rank")]
    assert {r["method"] for r in dist_rows} == {"ours_2rank_save", "ours_2rank_load_resharded"}
    assert all(r["bit_exact"] for r in dist_rows)
    assert result["dist_errors"] == []


def test_storage_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/storage_bench.py end to end against its own moto server (untimed)."""
    out = tmp_path / "storage.json"
    _bench(REPO / "benchmarks" / "storage_bench.py", "--smoke", "--out", str(out), timeout=300)
    rows = json.loads(out.read_text())["rows"]
    assert {r["method"] for r in rows} == {"s3fs_put", "ours_save", "s3fs_cat", "ours_load"}
    assert all(r["median_s"] > 0 and r["mb_per_s"] > 0 for r in rows)
    assert all(r["x_s3fs"] > 0 for r in rows if r["method"].startswith("ours"))


def test_write_path_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/write_path_bench.py end to end (untimed): every method saves, nothing is left."""
    out, work = tmp_path / "write_path.json", tmp_path / "work"
    script = REPO / "benchmarks" / "write_path_bench.py"
    _bench(script, "--smoke", "--out", str(out), "--workdir", str(work), timeout=300)
    result = json.loads(out.read_text())
    (row,) = result["results"]
    ran = {m for m, v in row["samples_s"].items() if v}
    every = {"raw_write", "ours_sync", "ours_no_value_cache", "ours_no_early_writeback", "safetensors"}
    assert ran | set(result["skipped"]) == every
    assert {"raw_write", "ours_sync"} <= ran and all(x > 0 for v in row["samples_s"].values() for x in v)
    assert row["ratios"]["ours_sync / raw_write"] > 0
    (parts,) = result["breakdown"]  # where a save's time goes: every part timed, fsyncs counted
    assert parts["parts_s"]["data files: write + checksum"] > 0 and parts["save_s"] > 0
    assert parts["fsyncs_per_save"]["data file (.distcp)"] >= 1 and parts["fsyncs_per_save"]["manifest"] == 1
    assert not work.exists()


def test_cold_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/cold_bench.py end to end (untimed; its smoke mode runs the four methods in one
    process): the loads checked against the saved values, peak memory reported, nothing left behind."""
    out = tmp_path / "cold.json"
    script = REPO / "benchmarks" / "cold_bench.py"
    _bench(script, "--smoke", "--out", str(out), "--dir", str(tmp_path), timeout=300)
    (row,) = json.loads(out.read_text())["results"]
    assert set(row["median_s"]) == {"ours_save", "ours_load", "safetensors_save", "safetensors_load"}
    assert all(v > 0 for v in row["median_s"].values()) and all(v > 0 for v in row["ratios"].values())
    assert row["median_peak_bytes"]["ours_load"] > 0 and row["ours_imports_s"]["ours_save"] >= 0
    assert os.listdir(tmp_path) == ["cold.json"]


def test_reader_ab_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/reader_ab_bench.py end to end (one round, untimed) with the current reader on
    both sides, on the embedding-table state: every load timed, the ratios reported, the
    checkpoints removed."""
    out, work = tmp_path / "ab.json", tmp_path / "work"
    reader = REPO / "ckpt_engine" / "_dcpio" / "fast_read.py"
    args = ["--a", str(reader), "--state", "emb8", "--rounds", "1", "--workdir", str(work), "--out", str(out)]
    _bench(REPO / "benchmarks" / "reader_ab_bench.py", *args, timeout=300)
    result = json.loads(out.read_text())
    assert result["state"].startswith("8 MiB embedding-table") and result["rounds"] == 1
    assert {k: len(v) for k, v in result["wall_s"].items()} == {"a": 1, "b": 1, "safetensors": 1}
    assert set(result["ratios"]) == {"b/a", "a/safetensors", "b/safetensors"} and all(
        v > 0 for v in result["ratios"].values()
    )
    assert not work.exists()


def test_scale_bench_smoke() -> None:
    """benchmarks/scale_bench.py runs (tiny, untimed). Its hang guard is ``_bench``'s, like the
    other runs': 120 s was a wall-clock guess that a loaded 2-core machine exceeded."""
    proc = _bench(REPO / "benchmarks" / "scale_bench.py", "--smoke")
    assert "200 tensors" in proc.stdout


@pytest.mark.dist
def test_coordination_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/coord_bench.py at 1 and 2 ranks (tiny, untimed): every op reports its phases,
    the 2-rank run spends time in collectives and gathers bytes to rank 0, loads are bit-exact."""
    out = tmp_path / "coord.json"
    script = REPO / "benchmarks" / "coord_bench.py"
    proc = _bench(script, "--smoke", "--workdir", str(tmp_path), "--out", str(out), timeout=120)
    assert "| phase | 1 rank | 2 ranks |" in proc.stdout  # the tables were printed
    res = json.loads(out.read_text())["results"]
    assert set(res) == {"1", "2"}
    for world in res.values():
        assert world["bit_exact"]
        assert {"prepare", "stage", "plan", "write", "metadata", "commit"} <= set(world["save_cold"]["phases"])
        assert {"validate", "plan", "read"} <= set(world["load"]["phases"])
    two = res["2"]
    assert two["save_cold"]["phases"]["plan"]["rank0_transfer_s"] > 0
    # A first save of FSDP2's layout is planned by each rank alone (_dcpio/local_plan.py): like a
    # warm save, its plan step gathers nothing to rank 0 (only the small all-gathered check);
    # its final items travel to rank 0 with its write results instead.
    cold, warm = (two[op]["bytes"] for op in ("save_cold", "save_warm"))
    assert cold["plan"]["to_rank0"] == warm["plan"]["to_rank0"] == 0 and 0 < cold["plan"]["to_all"] < 1024
    assert cold["write"]["to_rank0"] > warm["write"]["to_rank0"] > 0
    # the load plans on each rank: only the fixed-size agreement is sent, per rank and component
    # a small int and the 16-byte digest of its plan (35 bytes pickled); at most 4 components
    load_plan = two["load"]["bytes"]["plan"]
    assert load_plan["to_rank0"] == 0 and 0 < load_plan["to_all"] <= 2 * 4 * 40, load_plan
    assert not [p for p in os.listdir(tmp_path) if p.startswith("coord-bench-")]  # cleaned up


def test_peers_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/peers_bench.py end to end (tiny states, one round, untimed): the engine's three
    modes and DCP's three paths run and load back what they saved (the benchmark checks each load
    against a copy taken at the save); a peer whose package is absent is a row with the reason."""
    out, work = tmp_path / "peers.json", tmp_path / "work"
    proc = _bench(REPO / "benchmarks" / "peers_bench.py", "--smoke", "--workdir", str(work), "--out", str(out))
    assert "| save() blocks |" in proc.stdout and "Best peer against the engine" in proc.stdout
    result = json.loads(out.read_text())
    assert result["failed_states"] == []
    states = result["states"]
    assert [s["kind"] for s in states] == ["big", "small"]
    for state in states:
        methods, best = state["summary"]["methods"], state["summary"]["best"]
        for name, why in result["availability"].items():
            if why is None:  # installed here: it must have run, with no error
                assert "not_run" not in methods[name], (name, methods[name]["not_run"], state["errors"].get(name))
            else:  # absent: reported, never dropped
                assert "not installed" in methods[name]["not_run"] and "not installed" in why
        for name in ("ours_sync", "ours_pinned", "ours_overlap", "dcp", "dcp_async_thread", "dcp_async_process"):
            m = methods[name]
            assert m["blocking_s"] > 0 and m["durable_s"] >= m["blocking_s"] and m["disk_bytes"] > 0, (name, m)
        for name in ("ours_sync", "dcp"):  # the readers; the other modes share them
            assert methods[name]["load_hot_s"] > 0 and methods[name]["load_cold_s"] > 0
        assert methods["ours_pinned"]["load_as"] == "ours_sync" and "load_hot_s" in methods["ours_pinned"]
        assert best["blocking_s"]["engine"].startswith("ours_") and best["blocking_s"]["ratio"] > 0
        assert not best["durable_s"]["best_peer"].startswith("ours_")
        paired = state["paired_loads"]  # the engine verified and not, safetensors: each load checked
        methods = ("ours_verified", "ours_unverified", "safetensors", "read_floor")
        assert all(len(paired["wall_s"][n]) == 2 for n in methods)
        assert paired["ratios"]["verified_x_unverified_wall"]["median"] > 0
        assert paired["ratios"]["verified_x_floor_wall"]["median"] > 0
    assert "Hot loads, paired round by round" in proc.stdout
    assert not work.exists() or not os.listdir(work)  # every checkpoint removed
    # The tables again from the recorded run: printed, and the record left as it was (it was
    # rewritten, with this environment's versions in place of the run's).
    result["machine"]["versions"]["torch"] = "2.0.0 (another machine's run)"
    out.write_text(json.dumps(result, indent=1))
    recorded = out.read_bytes()
    again = _bench(REPO / "benchmarks" / "peers_bench.py", "--from-json", str(out))
    assert "| save() blocks |" in again.stdout
    assert out.read_bytes() == recorded


@pytest.mark.dist
def test_peers_benchmark_two_rank_smoke(tmp_path: Path) -> None:
    """The ``--ranks 2`` variant: two torchrun ranks with FSDP2-sharded layers run the engine and
    DCP's asynchronous path (in a group of its own) in step, load back what they saved, and
    report the one-process peers as not run, with the reason."""
    out, work = tmp_path / "peers2.json", tmp_path / "work"
    methods = "ours_sync,ours_overlap,dcp_async_thread,safetensors"
    args = ["--smoke", "--ranks", "2", "--states", "8", "--methods", methods, "--workdir", str(work), "--out", str(out)]
    _bench(REPO / "benchmarks" / "peers_bench.py", *args)
    result = json.loads(out.read_text())
    assert result["failed_states"] == []
    (state,) = result["states"]
    assert state["ranks"] == 2 and "2 ranks (FSDP2)" in state["label"]
    assert len(state["state_bytes_per_rank"]) == 2 and state["state_bytes"] == sum(state["state_bytes_per_rank"])
    methods = state["summary"]["methods"]
    for name in ("ours_sync", "ours_overlap", "dcp_async_thread"):
        m = methods[name]
        assert m["blocking_s"] > 0 and m["durable_s"] >= m["blocking_s"] and m["disk_bytes"] > 0, (name, m)
    assert methods["ours_sync"]["load_hot_s"] > 0 and methods["ours_sync"]["load_cold_s"] > 0
    assert "2 ranks: one file from one process" in methods["safetensors"]["not_run"]
    assert not work.exists() or not os.listdir(work)


def test_peers_full_writes_the_two_rank_run_beside_the_one_rank_run() -> None:
    """``peers_bench.py --full`` is the whole table in one command: the two-rank run's JSON and
    plot go beside the one-rank run's, named after them; it refuses to be a smoke run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("peers_bench", REPO / "benchmarks" / "peers_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results = "benchmarks/results/performance-peers"
    assert bench._two_rank_name(f"{results}-results.json") == f"{results}-2rank-results.json"
    assert bench._two_rank_name(f"{results}.png") == f"{results}-2rank.png"
    with pytest.raises(SystemExit):
        bench.main(["--full", "--smoke"])


@pytest.mark.dist
def test_tier_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/tier_bench.py end to end: 2 ranks as 2 nodes, the three phases, the S3 server (untimed)."""
    out = tmp_path / "tier.json"
    _bench(REPO / "benchmarks" / "tier_bench.py", "--smoke", "--out", str(out))
    (result,) = json.loads(out.read_text())["results"]
    assert {"blocked", "step", "recover"} <= set(result)
    assert result["blocked"]["local_s"] > 0 and result["blocked"]["floor_s"] > 0
    sources = result["recover"]["bytes_by_source"]
    assert [set(s) for s in sources["restart"]] == [{"local"}, {"local"}]
    assert [set(s) for s in sources["node_loss"]] == [{"local"}, {"peer"}]  # rank 1's node was wiped
    assert [set(s) for s in sources["durable_s3"]] == [{"durable"}, {"durable"}]


def test_cli_bench_smoke_run() -> None:
    """``benchmarks/cli_bench.py --smoke``: one round of every command, each must run (exit 0)."""
    proc = _bench(REPO / "benchmarks" / "cli_bench.py", "--smoke")
    for row in ("ckpt-engine ls SAVE_DIR (10 checkpoints)", "ckpt-engine inspect model.safetensors", "import torch"):
        assert row in proc.stdout
    assert "failed" not in proc.stdout


def test_verified_read_benchmark_smoke_run(tmp_path: Path) -> None:
    """benchmarks/verified_read_bench.py end to end (tiny, untimed): both levels load every round."""
    out = tmp_path / "verified.json"
    _bench(REPO / "benchmarks" / "verified_read_bench.py", "--smoke", "--out", str(out), "--dir", str(tmp_path))
    result = json.loads(out.read_text())
    assert {level: len(ts) for level, ts in result["seconds"].items()} == {"sizes": 2, "read": 2}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("verified-read-bench-")]  # cleaned up


@pytest.mark.dist
def test_per_rank_digest_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/perrank_digest_bench.py at 2 ranks (tiny, untimed): every mode saves with the
    check on and off, and every checkpoint is removed."""
    out = tmp_path / "perrank.json"
    script = REPO / "benchmarks" / "perrank_digest_bench.py"
    _bench(script, "--smoke", "--workdir", str(tmp_path), "--out", str(out), timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tensors"] == 196 and row["digest_ms"] > 0
    for mode in ("sync", "async"):
        assert set(row[mode]) == {"off", "on"} and all(v > 0 for v in row[mode].values())
    assert os.listdir(tmp_path) == ["perrank.json"]
