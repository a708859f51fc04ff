"""``EngineConfig.rng`` (on by default): every rank's random state is saved and restored, so a
resumed run draws exactly what an uninterrupted one draws; a checkpoint without it, or a resume
into another world size, still loads, with a warning."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from _torchrun import run_torchrun
from torch import nn

from ckpt_engine import CheckpointEngine, ConfigError, EngineConfig
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
    with CheckpointEngine({"save_dir": save_dir}) as engine:  # rng: on by default
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
        with CheckpointEngine({"save_dir": str(tmp_path / "c"), "rng": False}) as engine:
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


def test_rng_is_on_by_default_and_its_name_is_reserved(tmp_path: Path) -> None:
    assert EngineConfig(save_dir="ck").rng is True
    with (
        CheckpointEngine({"save_dir": str(tmp_path / "ck")}) as engine,
        pytest.raises(ConfigError, match="'rng' clashes"),
    ):
        engine.save(1, model=nn.Linear(2, 2), extra={"rng": RngState()})


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "not bit-exact" in r.getMessage()]


def test_a_checkpoint_without_rng_resumes_with_one_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    save_dir = str(tmp_path / "ck")
    with CheckpointEngine({"save_dir": save_dir, "rng": False}) as engine:  # as versions before the default
        engine.save(1, model=nn.Linear(2, 2))
    model = nn.Linear(2, 2)
    _seed(5)
    expected = (random.random(), torch.rand(1))
    _seed(5)
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"), CheckpointEngine({"save_dir": save_dir}) as engine:
        result = engine.load(model=model)
    assert result.iteration == 1 and result.components == ("model", "trainer")
    assert (random.random(), torch.rand(1)) == expected  # the generators are left as they were
    (warning,) = _warnings(caplog)
    assert "holds no random state" in warning and "iter_000000001" in warning


def test_one_process_resumes_a_two_rank_checkpoint_with_rank_0s_state_and_one_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A resume into fewer ranks: rank 0 takes its own state back, rank 1's is not read."""
    save_dir = str(tmp_path / "ck")
    states: dict[str, object] = {}
    saved = {}
    for r in (1, 0):  # two ranks' states in one process, as a two-rank job saves them
        _seed(40 + r)
        saved[r] = (random.random(), float(np.random.rand()), torch.rand(1).item())
        _seed(40 + r)
        states.update(RngState(rank=r, world_size=2).state_dict())

    class TwoRanks:
        def state_dict(self) -> dict[str, object]:
            return states

        def load_state_dict(self, state_dict: dict[str, object]) -> None:
            raise AssertionError("not loaded")

    with CheckpointEngine({"save_dir": save_dir, "rng": False}) as engine:
        engine.save(1, model=nn.Linear(2, 2), extra={"rng": TwoRanks()})
    model = nn.Linear(2, 2)
    _seed(9)
    with (
        caplog.at_level(logging.WARNING, logger="ckpt_engine"),
        CheckpointEngine({"save_dir": save_dir, "strict_unexpected": True}) as engine,
    ):
        assert "rng" in engine.load(model=model).components
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == saved[0]
    (warning,) = _warnings(caplog)
    assert "rank(s) 0, 1, but this job has 1 rank(s)" in warning and "rng: false" in warning
    assert "the state of rank(s) 1 is left unused" in warning and "none" not in warning  # no rank is reseeded


@pytest.mark.dist
def test_two_ranks_restore_their_own_state_and_a_one_rank_checkpoint_grows_to_two(tmp_path: Path) -> None:
    save_dir, one_rank_dir = str(tmp_path / "ck"), str(tmp_path / "one")
    _seed(100)
    with CheckpointEngine({"save_dir": one_rank_dir}) as engine:
        engine.save(1, model=nn.Linear(4, 4))
    one_rank_draws = [random.random(), random.gauss(0.0, 1.0), float(np.random.rand()), float(np.random.randn())]
    one_rank_draws.append(torch.rand(1).item())

    result = run_torchrun("rng_resume.py", save_dir, one_rank_dir, nproc=2)
    assert result.returncode == 0, result.describe()
    by_rank = {rank: lines[0] for rank, lines in result.results().items()}
    assert sorted(by_rank) == [0, 1]
    for rank, got in by_rank.items():
        assert got["after_load"] == got["after_save"], rank
        assert "rng" in got["components"] and "rng" in got["grown_components"]
        assert got["grown"][0] == got["grown"][1], rank  # deterministic: the same on every load
    assert by_rank[0]["after_save"] != by_rank[1]["after_save"]  # each rank read its own keys
    assert by_rank[0]["grown"][0] == one_rank_draws  # the rank the checkpoint has: its own state
    assert by_rank[1]["grown"][0] != one_rank_draws  # the new rank: seeded from it and its rank
    assert [by_rank[0]["warnings"], by_rank[1]["warnings"]] == [0, 2]  # one per load, from one rank
