"""``EngineConfig.rng``: every rank's random state is saved and restored, so a resumed run draws
exactly what an uninterrupted one draws."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _torchrun import run_torchrun
from torch import nn

from ckpt_engine import (
    CheckpointEngine,
    CheckpointLoadError,
    ConfigError,
    EngineConfig,
    IncompleteCheckpointError,
    RngWorldSizeError,
)
from ckpt_engine._engine.rng import RngState


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _build() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.Linear(16, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
    """A step whose data, dropout mask and augmentation all come from the global generators."""
    x = torch.randn(4, 8) * (1.0 + random.random()) + float(np.random.randn())
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]
    opt.step()
    return loss.item()


def _train(save_dir: str, start_at: int, until: int, save_at: int | None = None) -> list[float]:
    model, opt = _build()
    _seed(1234)
    losses = []
    with CheckpointEngine({"save_dir": save_dir, "rng": True}) as engine:
        if start_at:
            _seed(999)  # a new job starts with other random state; load must replace it
            assert engine.load(model=model, optimizer=opt).iteration == start_at
        for step in range(start_at + 1, until + 1):
            losses.append(_step(model, opt))
            if step == save_at:
                engine.save(step, model=model, optimizer=opt)
    return losses


def test_resumed_run_draws_what_an_uninterrupted_run_draws(tmp_path: Path) -> None:
    straight = _train(str(tmp_path / "a"), 0, 8)
    first = _train(str(tmp_path / "b"), 0, 5, save_at=4)
    resumed = _train(str(tmp_path / "b"), 4, 8)
    assert first[:4] == straight[:4]
    assert resumed == straight[4:]  # bit for bit: data, dropout and augmentation alike
    assert (tmp_path / "b" / "iter_000000004" / "rng" / ".metadata").is_file()


def test_without_rng_the_resumed_run_differs(tmp_path: Path) -> None:
    def train(start_at: int, until: int, save_at: int | None = None) -> list[float]:
        model, opt = _build()
        _seed(1234)
        out = []
        with CheckpointEngine({"save_dir": str(tmp_path / "c")}) as engine:
            if start_at:
                _seed(999)
                engine.load(model=model, optimizer=opt)
            for step in range(start_at + 1, until + 1):
                out.append(_step(model, opt))
                if step == save_at:
                    engine.save(step, model=model, optimizer=opt)
        return out

    straight = _train(str(tmp_path / "a"), 0, 8)
    train(0, 4, save_at=4)
    assert train(4, 8) != straight[4:]  # what the component is for
    assert not (tmp_path / "c" / "iter_000000004" / "rng").exists()


def test_rng_is_off_by_default_and_its_name_is_reserved(tmp_path: Path) -> None:
    assert EngineConfig(save_dir="ck").rng is False
    with (
        CheckpointEngine({"save_dir": str(tmp_path / "ck"), "rng": True}) as engine,
        pytest.raises(ConfigError, match="'rng' clashes"),
    ):
        engine.save(1, model=nn.Linear(2, 2), extra={"rng": RngState()})


def test_checkpoint_without_rng_is_a_clear_error_and_keys_not_to_resume_skips_it(tmp_path: Path) -> None:
    save_dir = str(tmp_path / "ck")
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=nn.Linear(2, 2))
    with (
        CheckpointEngine({"save_dir": save_dir, "rng": True}) as engine,
        pytest.raises(IncompleteCheckpointError, match=r"no component 'rng'.*keys_not_to_resume"),
    ):
        engine.load(model=nn.Linear(2, 2))
    with CheckpointEngine({"save_dir": save_dir, "rng": True, "keys_not_to_resume": ["rng"]}) as engine:
        assert engine.load(model=nn.Linear(2, 2)).components == ("model", "trainer")


@pytest.mark.dist
def test_two_ranks_restore_their_own_state_and_one_process_refuses_it(tmp_path: Path) -> None:
    save_dir = str(tmp_path / "ck")
    result = run_torchrun("rng_resume.py", save_dir, nproc=2)
    assert result.returncode == 0, result.describe()
    by_rank = {rank: lines[0] for rank, lines in result.results().items()}
    assert sorted(by_rank) == [0, 1]
    for rank, got in by_rank.items():
        assert got["after_load"] == got["after_save"], rank
        assert "rng" in got["components"]
    assert by_rank[0]["after_save"] != by_rank[1]["after_save"]  # each rank read its own keys

    with (
        CheckpointEngine({"save_dir": save_dir, "rng": True}) as engine,
        pytest.raises(RngWorldSizeError, match=r"random state of 2 rank.*this job has 1") as info,
    ):
        engine.load(model=nn.Linear(4, 4))
    assert isinstance(info.value, CheckpointLoadError)
    with CheckpointEngine({"save_dir": save_dir, "rng": True, "keys_not_to_resume": ["rng"]}) as engine:
        assert engine.load(model=nn.Linear(4, 4)).iteration == 1
