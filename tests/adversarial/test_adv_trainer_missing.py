"""Resuming (rule 1) from a checkpoint that lacks ``trainer`` or a component the caller passed is
refused, naming it, instead of silently restarting at iteration 0 or leaving state fresh."""

from __future__ import annotations

import shutil

import pytest

from adversarial._adv import ckpt, load, save
from ckpt_engine import CheckpointEngine, IncompleteCheckpointError
from ckpt_engine._format.manifest import MANIFEST_FILE
from ckpt_engine.testing import TinyTrainingState


@pytest.mark.parametrize("verify", ["off", "sizes"])
def test_missing_trainer_is_refused_without_a_grad_scaler(save_dir: str, verify: str) -> None:
    save(save_dir, 5)
    shutil.rmtree(ckpt(save_dir, 5) / "trainer")
    (ckpt(save_dir, 5) / MANIFEST_FILE).unlink()  # legacy: nothing says trainer/ was there
    state = TinyTrainingState.create(seed=1, steps=0)
    with (
        CheckpointEngine({"save_dir": save_dir, "verify": verify}) as engine,
        pytest.raises(IncompleteCheckpointError, match=r"no component 'trainer'.*iteration 0"),
    ):
        engine.load(model=state.model, optimizer=state.optimizer, scheduler=state.scheduler)


def test_missing_passed_component_is_refused_and_keys_not_to_resume_allows_it(save_dir: str) -> None:
    save(save_dir, 5)
    shutil.rmtree(ckpt(save_dir, 5) / "scheduler")
    (ckpt(save_dir, 5) / MANIFEST_FILE).unlink()
    with pytest.raises(IncompleteCheckpointError, match="no component 'scheduler'"):
        load(save_dir, strict=False)
    result, _ = load(save_dir, keys_not_to_resume=["scheduler"])
    assert result.iteration == 5 and "scheduler" not in result.components
