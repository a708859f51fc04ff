"""Ranks that fail together (``ckpt_engine/_engine/consensus.py``) on 2 torchrun ranks: the commit,
verification, fallback and lock of the single-process tests, with one rank's read or check
failing on every rank (``tests/dist_scripts/reliability_dist.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.mark.dist
def test_two_ranks_commit_verify_fallback_lock_and_one_rank_failures(tmp_path: Path) -> None:
    from _torchrun import run_torchrun

    # The ranks keep the default collective_timeout_s (600 s): a rank left waiting for one that
    # failed would outlast the launch's hang guard, so finishing shows that every rank raised.
    run = run_torchrun("reliability_dist.py", str(tmp_path / "ckpt"), timeout=120.0)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == [0, 1], run.describe()
    # rng is on by default: each rank's generators are a component of their own
    components = ("model", "optim", "rng", "trainer")
    names = [f"{c}/{f}" for c in components for f in (".metadata", ".metadata_index", "__0_0.distcp", "__1_0.distcp")]
    for rank in (0, 1):
        got = results[rank][0]
        what = f"rank {rank}"
        commit = got["commit"]
        assert commit["listing"] == ["iter_000000002", "iter_000000003", "latest_checkpoint.txt"], what
        assert commit["world_size"] == 2 and commit["files"] == names and commit["all_checksummed"], what
        assert got["verified"]["value"] == {"iteration": 3, "verified": True, "fell_back_from": None, "equal_to": [3]}
        flip = got["flip"]
        assert flip["raised"] == "IntegrityError" and "model/__1_0.distcp" in flip["message"], what
        assert "checksum" in flip["message"] and flip["untouched"], what
        fallback = got["fallback"]["value"]
        assert fallback["iteration"] == 2 and fallback["equal_to"] == [2] and fallback["verified"], what
        assert fallback["fell_back_from"].endswith("iter_000000003"), what
        read_flip = got["read_flip"]  # found by rank 1's read alone: every rank raises it
        assert read_flip["raised"] == "CorruptCheckpointError" and "model/__1_0.distcp" in read_flip["message"], what
        read_fallback = got["read_fallback"]["value"]  # and every rank falls back alike
        assert read_fallback["iteration"] == 2 and read_fallback["equal_to"] == [2], what
        assert read_fallback["fell_back_from"].endswith("iter_000000003"), what
        # one rank fails: every rank raises a typed error naming the file
        read = got["read_error"]
        assert read["raised"] == "CheckpointLoadError" and "Input/output error" in read["message"], what
        assert "iter_000000002/model/__" in read["message"], what
        check = got["check_error"]
        assert check["raised"] == "CheckpointPermissionError", what
        assert "permission denied" in check["message"], what
        lock = got["lock"]
        assert lock["raised"] in ("SaveDirLockedError", "CheckpointSaveError"), what
        assert "SaveDirLockedError" in lock["message"] or "is locked by another" in lock["message"], what
        assert got["lock_after_close"]["value"] is True and got["lock_latest"] == "iter_000000002\n", what
        assert got["leftover_removed"], what
    # rank 0 runs the pre-load checks for every rank: the other ranks raise its error, saying so
    assert "(found by rank 0)" in results[1][0]["check_error"]["message"]
