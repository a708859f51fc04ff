"""The trainer state an ``EngineTrainer`` resumes is checked, never just believed.

A resumed checkpoint's trainer state names ``best_model_checkpoint``; with
``load_best_model_at_end`` the Trainer loaded the final model from whatever folder it named,
outside the run's folders too. A trainer state with a field ``TrainerState`` does not know, or a
field of the wrong type, failed with a bare ``TypeError`` from ``TrainerState(**state)``. Both
runs here are real ``Trainer.train`` runs on the CPU (``tests/hf_scripts/hf_train.py``), resumed
from a checkpoint written by ``CheckpointEngine`` with a trainer state of the test's making.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

import hf_train as script
from transformers import TrainerControl, TrainerState

from ckpt_engine import CheckpointEngine, CorruptCheckpointError
from ckpt_engine.integrations._trainer_checkpoint import COMPONENT, StateItems

STEP = 3


def _saved(root: Path, **state: Any) -> Path:
    """An engine checkpoint of step 3 in ``root/checkpoints`` as EngineTrainer saves one with
    ``save_only_model``, its trainer state ``TrainerState(global_step=3)`` updated with ``state``."""
    fields = {
        **dataclasses.asdict(
            TrainerState(global_step=STEP, max_steps=6, train_batch_size=4, stateful_callbacks=[TrainerControl()])
        ),
        **state,
    }
    items = StateItems(json.dumps(fields), ("model", "trainer", COMPONENT))
    with CheckpointEngine({"save_dir": str(root / "checkpoints")}) as engine:
        engine.save(STEP, model=script.build_model("gpt2"), extra={COMPONENT: items})
    return root / "checkpoints" / f"iter_{STEP:09}"


def test_the_best_model_loads_only_from_inside_the_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    elsewhere = tmp_path / "elsewhere" / "checkpoint-3"
    planted = script.build_model("gpt2")
    with torch.no_grad():
        for p in planted.parameters():
            p.zero_()
    planted.save_pretrained(elsewhere)  # a folder the Trainer's own loader would load
    # a best metric no step of this run beats: the best stays the one the state names
    _saved(tmp_path, best_metric=-1.0, best_global_step=2, best_model_checkpoint=str(elsewhere))
    trainer = script.trainer(
        str(tmp_path),
        eval_dataset=script.Tokens(8),
        max_steps=6,
        eval_strategy="steps",
        eval_steps=STEP,
        metric_for_best_model="loss",
        greater_is_better=False,
        load_best_model_at_end=True,
    )
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.state.best_model_checkpoint == str(elsewhere)
    assert all(p.abs().sum() > 0 for p in trainer.model.parameters())  # the final model, not the planted one
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert str(elsewhere) in warned and "outside this run" in warned and "copy it into" in warned


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"bogus_field": 1}, "bogus_field"),
        ({"best_metric": "high"}, "best_metric"),
        ({"log_history": [3]}, "log_history"),
        ({"stateful_callbacks": {"TrainerControl": {"args": []}}}, "stateful_callbacks"),
    ],
)
def test_a_trainer_state_with_unknown_or_mistyped_fields_is_a_typed_error(
    tmp_path: Path, state: dict[str, Any], field: str
) -> None:
    folder = _saved(tmp_path, **state)
    with pytest.raises(CorruptCheckpointError, match=rf"{folder}/{COMPONENT}: .*'{field}'"):
        script.trainer(str(tmp_path), max_steps=6).train(resume_from_checkpoint=True)
    # the Trainer's own checkpoint folder, resumed through its loader, is checked the same way
    own = tmp_path / "out" / "checkpoint-3"
    own.mkdir(parents=True)
    (own / "trainer_state.json").write_text(json.dumps({"global_step": STEP, **state}))
    with pytest.raises(CorruptCheckpointError, match=rf"trainer_state\.json: .*'{field}'"):
        script.trainer(str(tmp_path / "other"), max_steps=6).train(resume_from_checkpoint=str(own))
