"""``ckpt_engine.testing.check_exact_resume``: an exact script is reported exact; a script that does
not resume its scheduler, its random state or its data position is reported at the right step and key.

The training script is this module's ``build``/``step`` (the checker's new processes import them):
a small regressor with dropout, AdamW, a LinearLR schedule, batches chosen by a data position and
augmented with Python, NumPy and torch draws.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from ckpt_engine import ArgumentTypeError, InvalidArgumentError
from ckpt_engine._exact.compare import compare
from ckpt_engine.testing import Difference, ExactResumeReport, ExactResumeRunError, check_exact_resume

DATA = torch.randn(48, 4, generator=torch.Generator().manual_seed(0))
STEPS, SAVE_AT = 5, 2


class Position:
    """Where the data stream is: a ``Stateful`` extra state, as a resumable sampler is."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.position = int(state_dict["position"])


class ForgetfulPosition(Position):
    """A sampler whose ``load_state_dict`` does not restore its position."""

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        pass


def build() -> dict[str, Any]:
    random.seed(0)  # the script seeds every generator it draws from: the runs start equal
    np.random.seed(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.25), nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.2, total_iters=10)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler, "extra": {"data": Position()}}


def step(objs: Mapping[str, Any], i: int) -> None:
    data = objs["extra"]["data"]
    x = DATA[data.position % 48 : data.position % 48 + 4]
    data.position += 4
    x = x * (1.0 + 0.1 * random.random()) + 0.1 * float(np.random.randn()) + 0.01 * torch.randn_like(x)
    loss = objs["model"](x).pow(2).mean()
    objs["optimizer"].zero_grad()
    loss.backward()
    objs["optimizer"].step()
    objs["scheduler"].step()


_HIDDEN: dict[str, Any] = {}


def build_keeping_the_scheduler_to_itself() -> dict[str, Any]:
    objs = build()
    _HIDDEN["scheduler"] = objs.pop("scheduler")  # never given to the engine
    return objs


def step_with_the_hidden_scheduler(objs: Mapping[str, Any], i: int) -> None:
    step({**objs, "scheduler": _HIDDEN["scheduler"]}, i)


def build_with_a_forgetful_sampler() -> dict[str, Any]:
    objs = build()
    objs["extra"]["data"] = ForgetfulPosition()
    return objs


def _check(tmp_path: Path, build_ref: Any = build, step_ref: Any = step, **config: Any) -> ExactResumeReport:
    return check_exact_resume(build_ref, step_ref, steps=STEPS, save_at=SAVE_AT, config=config, workdir=tmp_path)


@pytest.mark.full  # three new interpreters: the check as users run it (a fork would share the
# hash seed and the imported modules, which could hide a difference between processes)
def test_an_exact_script_is_reported_exact(tmp_path: Path) -> None:
    report = _check(tmp_path)
    assert report.exact and report.first_difference is None, str(report)
    assert report.keys_compared > 20  # parameters, optimizer and scheduler state, data position, generators
    assert str(report).startswith("exact resume:")
    report.raise_if_not_exact()
    assert (tmp_path / "checkpoints" / "iter_000000002" / "rng").is_dir()  # the engine saved, rng on by default


@pytest.mark.full
@pytest.mark.usefixtures("forked_python")  # its three runs forked (tests/_forked_python.py)
def test_a_scheduler_the_engine_never_saw_shows_in_the_learning_rate_of_the_next_step(tmp_path: Path) -> None:
    report = _check(tmp_path, build_keeping_the_scheduler_to_itself, step_with_the_hidden_scheduler)
    first = report.first_difference
    assert first is not None and not report.exact
    assert (first.step, first.key, first.kind, first.after_resume) == (
        SAVE_AT + 1,
        "optimizer/param_groups/0/lr",
        "optimizer",
        False,
    )
    with pytest.raises(AssertionError, match=r"optimizer 'optimizer/param_groups/0/lr' after step 3"):
        report.raise_if_not_exact()


@pytest.mark.full
@pytest.mark.usefixtures("forked_python")  # its three runs forked (tests/_forked_python.py)
def test_random_state_not_saved_shows_right_after_the_resume(tmp_path: Path) -> None:
    report = _check(tmp_path, rng=False)
    first = report.first_difference
    assert first is not None and first.step == SAVE_AT and first.after_resume
    assert first.kind == "rng" and first.key.startswith("rng/"), first
    assert "right after the resume at step 2" in str(report)


@pytest.mark.full
@pytest.mark.usefixtures("forked_python")  # its three runs forked (tests/_forked_python.py)
def test_a_data_position_not_restored_shows_right_after_the_resume(tmp_path: Path) -> None:
    report = _check(tmp_path, build_with_a_forgetful_sampler)
    first = report.first_difference
    assert first is not None
    assert (first.step, first.key, first.kind) == (SAVE_AT, "extra/data/position", "extra")
    assert first.description == "8 uninterrupted, 0 resumed"
    # the draws and the weights are still equal there: the position is the cause, not an effect
    assert [d.key for d in report.differences] == ["extra/data/position"]


def test_functions_a_new_process_cannot_import_are_refused_with_the_fix() -> None:
    def nested() -> dict[str, Any]:
        return build()

    for bad in (lambda: build(), nested):
        with pytest.raises(ArgumentTypeError, match=r"cannot import it\. Define build at module level"):
            check_exact_resume(bad, step, steps=3, save_at=1)
    with pytest.raises(InvalidArgumentError, match=r"'no_such_module_xyz:build' cannot be imported"):
        check_exact_resume("no_such_module_xyz:build", step, steps=3, save_at=1)
    with pytest.raises(InvalidArgumentError, match=r"save_at=3 must be at least 1 and below steps=3"):
        check_exact_resume(build, step, steps=3, save_at=3)


def _boom(objs: Mapping[str, Any], i: int) -> None:
    raise RuntimeError(f"step {i} failed")


@pytest.mark.full
@pytest.mark.usefixtures("forked_python")  # its three runs forked (tests/_forked_python.py)
def test_a_failing_step_is_an_error_with_the_runs_output(tmp_path: Path) -> None:
    with pytest.raises(ExactResumeRunError, match=r"(?s)exited with status 1.*RuntimeError: step 1 failed"):
        check_exact_resume(build, _boom, steps=3, save_at=1, workdir=tmp_path)


def test_the_comparison_is_bitwise_and_names_causes_before_effects() -> None:
    def snap(weight: torch.Tensor, lr: float, position: int) -> dict[str, tuple[str, Any]]:
        return {
            "model/w": ("parameter", weight),
            "optimizer/param_groups/0/lr": ("optimizer", lr),
            "extra/data/position": ("extra", position),
        }

    zero, negative_zero, nan = torch.zeros(2), torch.tensor([-0.0, 0.0]), torch.tensor([float("nan"), 0.0])
    same = {1: snap(nan, 0.1, 4), 2: snap(zero, 0.1, 8)}
    assert compare(same, {1: snap(nan.clone(), 0.1, 4), 2: snap(zero.clone(), 0.1, 8)}, 2, 1).exact  # NaN is NaN
    report = compare(same, {1: snap(nan, 0.1, 4), 2: snap(negative_zero, 0.2, 9)}, 2, 1)
    assert [(d.step, d.key) for d in report.differences] == [
        (2, "extra/data/position"),
        (2, "optimizer/param_groups/0/lr"),
        (2, "model/w"),  # -0.0 == 0.0 numerically, not bit for bit
    ]
    assert report.differences[2].description == "1 of 2 element(s) differ, max |difference| 0"
    assert report.first_difference == Difference(2, "extra/data/position", "extra", "8 uninterrupted, 9 resumed")
    text = str(report)
    assert text.startswith("NOT an exact resume (steps 1..2") and "also at step 2: parameter 'model/w'" in text
