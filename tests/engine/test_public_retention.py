"""``ckpt_engine.checkpoints``: the engine's retention as a library call with a protected set
(what ``EngineTrainer``'s ``save_total_limit`` keeping the best model runs), on real engine
checkpoints."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

import pytest
import torch

from ckpt_engine import CheckpointEngine, InvalidArgumentError
from ckpt_engine.checkpoints import (
    CheckpointInUseError,
    apply_retention,
    checkpoint_name,
    iteration_of,
    latest_checkpoint,
    list_checkpoints,
    remove_checkpoint,
)
from ckpt_engine.integrity import verify_checkpoint


def _save(save_dir: Path, *iterations: int) -> None:
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        for it in iterations:
            engine.save(it, model=torch.nn.Linear(2, 2))


def _iters(save_dir: Path) -> list[int]:
    return [it for it, _ in list_checkpoints(str(save_dir))]


@pytest.fixture(scope="module")
def six(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Iterations 1 to 6, committed by the engine; each test works on its own copy."""
    save_dir = tmp_path_factory.mktemp("six") / "checkpoints"
    _save(save_dir, 1, 2, 3, 4, 5, 6)
    return save_dir


@pytest.fixture
def save_dir(six: Path, tmp_path: Path) -> Path:
    shutil.copytree(six, tmp_path / "checkpoints")
    return tmp_path / "checkpoints"


def test_names_latest_and_listing(save_dir: Path) -> None:
    assert checkpoint_name(20) == "iter_000000020" and iteration_of("iter_000000020") == 20
    assert iteration_of(str(save_dir / "iter_000000003") + "/") == 3 and iteration_of("checkpoint-3") is None
    assert latest_checkpoint(str(save_dir)) == "iter_000000006"
    assert latest_checkpoint(str(save_dir / "nothing")) is None
    assert list_checkpoints(str(save_dir))[0] == (1, str(save_dir / "iter_000000001"))


def test_keep_last_keeps_the_newest_and_the_protected_ones(save_dir: Path) -> None:
    result = apply_retention(str(save_dir), keep_last=2, protected={2})
    assert _iters(save_dir) == [2, 5, 6]
    assert sorted(iteration_of(p) for p in result.deleted) == [1, 3, 4] and result.failed == []
    assert latest_checkpoint(str(save_dir)) == "iter_000000006"
    assert verify_checkpoint(str(save_dir / "iter_000000002"), "checksums").verified  # the protected one is whole
    assert apply_retention(str(save_dir), keep_last=2).deleted == [str(save_dir / "iter_000000002")]


def test_keep_every_and_never_the_latest_nor_newer(save_dir: Path) -> None:
    (save_dir / "latest_checkpoint.txt").write_text("iter_000000004\n")  # 5 and 6: another run's, kept
    apply_retention(str(save_dir), keep_last=1, keep_every=3)
    assert _iters(save_dir) == [3, 4, 5, 6]


def test_a_checkpoint_being_read_is_skipped_and_deleted_by_the_next_call(save_dir: Path) -> None:
    """A load holds a shared lock on the folder it reads: retention reports the folder as failed
    (never raises) and deletes it on the next call once the read is over."""
    reader = os.open(save_dir / "iter_000000001", os.O_RDONLY)
    try:
        fcntl.flock(reader, fcntl.LOCK_SH)
        with pytest.raises(CheckpointInUseError):
            remove_checkpoint(str(save_dir / "iter_000000001"))
        result = apply_retention(str(save_dir), keep_last=4)
        assert [iteration_of(p) for p, _ in result.failed] == [1] and "being read" in result.failed[0][1]
        assert [iteration_of(p) for p in result.deleted] == [2]
    finally:
        os.close(reader)
    assert [iteration_of(p) for p in apply_retention(str(save_dir), keep_last=4).deleted] == [1]
    assert _iters(save_dir) == [3, 4, 5, 6]
    with pytest.raises(FileNotFoundError):
        remove_checkpoint(str(save_dir / "iter_000000001"))


@pytest.mark.parametrize("bad", [{"keep_last": 0}, {"keep_last": True}, {"keep_last": 2, "keep_every": 0}])
def test_bad_counts_are_refused_before_anything_is_deleted(save_dir: Path, bad: dict[str, int]) -> None:
    with pytest.raises(InvalidArgumentError, match="apply_retention: keep_"):
        apply_retention(str(save_dir), **bad)
    assert _iters(save_dir) == [1, 2, 3, 4, 5, 6]
