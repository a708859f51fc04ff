"""A save killed after its commit and before ``latest_checkpoint.txt`` moved is not lost work.

An outside crash-consistency tool (78 kill points at every file event) found one window against
the engine: a SIGKILL after ``iter_N`` was renamed into place (on an object store: after its
manifest, the completion marker, was uploaded) and before ``latest`` moved. The resume then took
``iter_N-1``, and the next save of ``N`` replaced the committed ``iter_N`` ("latest never named
it"): the interval was redone. Now the resume adopts the newest committed checkpoint that passes
the checks and repairs ``latest`` (logged); one that fails the checks is not adopted.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _forked
import pytest
from _paths import CRASH_SCRIPTS

from ckpt_engine import CheckpointEngine
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal

pytestmark = pytest.mark.full  # kill trials at every point between the commit and latest

SCRIPT = CRASH_SCRIPTS / "killed_before_latest.py"


def _killed_run(config: dict[str, Any]) -> None:
    proc = _forked.run(  # a forked child: torch and s3fs imported once, by the fork server
        SCRIPT,
        json.dumps(config),
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        preload=["s3fs"],
    )
    assert proc.returncode == -9, proc.stderr[-3000:]  # SIGKILL, in the window


def _expected() -> TinyTrainingState:
    state = TinyTrainingState.create(seed=1, hidden=64)
    state.train(1)
    return state


def _resume(config: dict[str, Any]) -> tuple[Any, TinyTrainingState]:
    state = TinyTrainingState.create(seed=7, hidden=64)
    with CheckpointEngine(config) as engine:
        result = engine.load(**state.objects())
    return result, state


def _assert_resumed_iteration_2(config: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="ckpt_engine"):
        result, state = _resume(config)
    assert result.iteration == 2
    want = _expected()
    assert_state_dicts_equal(state.model.state_dict(), want.model.state_dict())
    assert_state_dicts_equal(state.optimizer.state_dict(), want.optimizer.state_dict())
    assert any("before the pointer moved" in r.getMessage() for r in caplog.records)


def test_a_commit_killed_before_latest_moved_is_resumed_and_latest_repaired(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_dir = tmp_path / "ckpt"
    config = {"save_dir": str(save_dir)}
    _killed_run(config)
    assert (save_dir / "latest_checkpoint.txt").read_text().strip() == "iter_000000001"  # the window
    assert (save_dir / "iter_000000002" / "ckpt_engine_manifest.json").exists()
    _assert_resumed_iteration_2(config, caplog)
    assert (save_dir / "latest_checkpoint.txt").read_text().strip() == "iter_000000002"
    # The next save goes on from there: iteration 3 commits, and 2 stays as it was.
    before = (save_dir / "iter_000000002" / "ckpt_engine_manifest.json").read_bytes()
    state = _expected()
    with CheckpointEngine(config) as engine:
        engine.save(3, **state.objects()).result()
    assert (save_dir / "iter_000000002" / "ckpt_engine_manifest.json").read_bytes() == before


def test_s3_a_commit_killed_before_latest_moved_is_resumed(s3_bucket: Any, caplog: pytest.LogCaptureFixture) -> None:
    config = {"save_dir": s3_bucket.url, "storage": dict(s3_bucket.storage)}
    _killed_run(config)
    latest = f"{s3_bucket.name}/run/latest_checkpoint.txt"
    assert s3_bucket.fs().cat_file(latest).decode().strip() == "iter_000000001"
    _assert_resumed_iteration_2(config, caplog)
    assert s3_bucket.fs().cat_file(latest).decode().strip() == "iter_000000002"


def test_with_no_latest_at_all_the_committed_checkpoint_is_resumed(tmp_path: Path) -> None:
    """Killed at the first save's pointer: no latest_checkpoint.txt, a committed iter_1."""
    save_dir = tmp_path / "ckpt"
    state = _expected()
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        engine.save(1, **state.objects()).result()
    (save_dir / "latest_checkpoint.txt").unlink()
    result, got = _resume({"save_dir": str(save_dir)})
    assert result.iteration == 1
    assert_state_dicts_equal(got.model.state_dict(), state.model.state_dict())


def _two_saves(save_dir: Path) -> TinyTrainingState:
    state = TinyTrainingState.create(seed=1, hidden=64)
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        engine.save(1, **state.objects()).result()
        first = TinyTrainingState.create(seed=1, hidden=64)
        state.train(1)
        engine.save(2, **state.objects()).result()
    (save_dir / "latest_checkpoint.txt").write_text("iter_000000001\n")
    return first


def test_an_unnamed_checkpoint_that_fails_the_checks_is_not_adopted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    save_dir = tmp_path / "ckpt"
    first = _two_saves(save_dir)
    victim = max((save_dir / "iter_000000002" / "model").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(victim, "ab") as f:
        f.write(b"x")  # its size no longer matches the manifest
    with caplog.at_level("WARNING", logger="ckpt_engine"):
        result, got = _resume({"save_dir": str(save_dir)})
    assert result.iteration == 1
    assert_state_dicts_equal(got.model.state_dict(), first.model.state_dict())
    assert any("fails the checks" in r.getMessage() for r in caplog.records)
    assert (save_dir / "latest_checkpoint.txt").read_text().strip() == "iter_000000001"


def test_an_unnamed_folder_without_a_manifest_is_not_adopted(tmp_path: Path) -> None:
    """No manifest, no completed commit (plain DCP output, a copy in progress): latest decides."""
    save_dir = tmp_path / "ckpt"
    _two_saves(save_dir)
    (save_dir / "iter_000000002" / "ckpt_engine_manifest.json").unlink()
    result, _ = _resume({"save_dir": str(save_dir)})
    assert result.iteration == 1
