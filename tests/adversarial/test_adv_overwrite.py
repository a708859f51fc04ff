"""Saving over a committed checkpoint is refused by default; ``latest`` never moves back."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adversarial._adv import ckpt, load, save
from ckpt_engine import CheckpointEngine, CheckpointExistsError
from ckpt_engine.testing import TinyTrainingState


def test_resave_of_a_committed_iteration_is_refused_and_changes_nothing(save_dir: str) -> None:
    saved = save(save_dir, 10)
    before = sorted(os.listdir(ckpt(save_dir, 10)))
    other = TinyTrainingState.create(seed=77, steps=1)
    with (
        CheckpointEngine({"save_dir": save_dir}) as engine,
        pytest.raises(CheckpointExistsError, match=r"iteration 10 is already committed.*allow_overwrite=True"),
    ):
        engine.save(10, model=other.model)  # a model-only save over model + optimizer
    assert sorted(os.listdir(ckpt(save_dir, 10))) == before
    result, state = load(save_dir)
    assert result.iteration == 10 and set(result.components) == {"model", "optim", "scheduler", "trainer", "rng"}
    assert all(state.model.state_dict()[k].equal(v) for k, v in saved[10].items())


def test_allow_overwrite_replaces_it(save_dir: str) -> None:
    save(save_dir, 10)
    replaced = save(save_dir, 10, allow_overwrite=True)
    result, state = load(save_dir)
    assert result.iteration == 10
    assert all(state.model.state_dict()[k].equal(v) for k, v in replaced[10].items())
    assert sorted(os.listdir(save_dir)) == ["iter_000000010", "latest_checkpoint.txt"]


def test_latest_never_moves_to_an_older_iteration(save_dir: str) -> None:
    save(save_dir, 10)
    save(save_dir, 5)  # committed, but older than what latest names
    assert Path(save_dir, "latest_checkpoint.txt").read_text() == "iter_000000010\n"
    assert ckpt(save_dir, 5).is_dir()
    assert load(save_dir)[0].iteration == 10


def test_a_commit_killed_before_latest_moved_does_not_block_the_resumed_run(save_dir: str) -> None:
    """A SIGKILL between a commit's rename and the pointer update leaves ``iter_N`` complete but
    never named by ``latest``; the run resumes from ``N-1``, redoes ``N`` and saves it again. That
    save replaces the orphan (nothing resumed from it) instead of failing every restart."""
    save(save_dir, 4)
    save(save_dir, 5)
    Path(save_dir, "latest_checkpoint.txt").write_text("iter_000000004\n")  # as the kill left it
    redone = save(save_dir, 5)  # no allow_overwrite: the resumed run's ordinary save
    assert Path(save_dir, "latest_checkpoint.txt").read_text() == "iter_000000005\n"
    result, state = load(save_dir)
    assert result.iteration == 5
    assert all(state.model.state_dict()[k].equal(v) for k, v in redone[5].items())
