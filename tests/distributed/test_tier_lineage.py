"""The lineage of the node-local tier's steps on 4 gloo ranks as 2 simulated nodes
(``tests/dist_scripts/tier_lineage.py``, every scenario in one launch): a save that fails on one
node fails on every rank with one typed error and leaves no second save of its step, the next
saves work; a rolled-back or empty ``save_dir`` is what a resume follows; ranks that see
different ``save_dir``s are told so; a planted symlink in one rank's copy sends that rank to its
replica."""

from __future__ import annotations

from typing import Any

import pytest
from _torchrun import run_torchrun

pytestmark = pytest.mark.dist

RANKS = 4


@pytest.fixture(scope="module")
def reports(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("lineage")
    run = run_torchrun("tier_lineage.py", str(root), nproc=RANKS, timeout=420)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == list(range(RANKS)), run.describe()
    out: dict[str, list[dict[str, Any]]] = {}
    for rank in range(RANKS):
        for report in results[rank]:
            out.setdefault(report["scenario"], []).append(report)
    return out


def test_a_save_failing_on_one_node_fails_everywhere_and_the_next_saves_work(
    reports: dict[str, list[dict[str, Any]]],
) -> None:
    resave = reports["resave"]
    assert [r["loaded"] for r in resave] == [7] * RANKS
    for r in resave:
        failed = r["failed"]
        assert failed["raised"] == "CheckpointSaveError", failed
        assert "rank 2 failed to write its local-tier checkpoint" in failed["message"], failed
        assert "No space left on device" in failed["message"], failed
    assert [[s["value"] for s in r["later"]] for r in resave] == [["local", "durable"]] * RANKS


def test_a_step_whose_resave_failed_resumes_as_one_save(reports: dict[str, list[dict[str, Any]]]) -> None:
    """No rank committed the failed save of 7: every rank resumes the first save of 7."""
    got = reports["after_fail"]
    assert [(r["raised"], r["iteration"], r["same"]) for r in got] == [(None, 7, {"a": True, "b": False})] * RANKS, got


def test_only_rank_0_records_a_durable_commit(reports: dict[str, list[dict[str, Any]]]) -> None:
    """The record that tells a rollback from an unfinished commit: the other ranks reached the
    point before rank 0 had committed (a commit in the background), and a kill then set aside
    every local step since the last durable one."""
    assert [r["recorded"] for r in reports["records"]] == [True] + [False] * (RANKS - 1)


def test_a_rolled_back_save_dir_and_an_empty_one_are_followed(reports: dict[str, list[dict[str, Any]]]) -> None:
    rollback = reports["rollback"]
    assert [(r["iteration"], set(r["by_source"]), r["same"]["a"]) for r in rollback] == [
        (3, {"durable"}, True)
    ] * RANKS, rollback
    assert [(r["raised"], r["iteration"]) for r in reports["new_run"]] == [(None, 0)] * RANKS


def test_ranks_that_see_different_save_dirs_are_told_so(reports: dict[str, list[dict[str, Any]]]) -> None:
    views = reports["views"]
    assert [r["raised"] for r in views] == ["CheckpointDisagreementError"] * RANKS, views


def test_a_planted_symlink_in_one_ranks_copy_sends_it_to_the_replica(
    reports: dict[str, list[dict[str, Any]]],
) -> None:
    got = reports["symlink"]
    assert [(r["raised"], r["iteration"], r["same"]["a"]) for r in got] == [(None, 7, True)] * RANKS, got
    assert [set(r["by_source"]) for r in got] == [{"local"}, {"peer"}, {"local"}, {"local"}]
