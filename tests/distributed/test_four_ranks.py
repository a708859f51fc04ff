"""4 gloo ranks under torchrun: FSDP2 save at 4 ranks, loaded into 2 ranks and into one process;
one process's checkpoint into 4 ranks; a strict mismatch raising on all 4; an async save at 4.

Bit-exact: every rank reports the full parameters and AdamW ``exp_avg`` it holds, and this
process compares them with what it saved or loaded itself. About a minute on 2 CPU cores, so
the module runs with ``CKPT_ENGINE_SLOW_TESTS=1`` (the 2-rank variants run in every suite:
test_distributed.py, test_async_distributed.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _common import make_model
from _torchrun import run_torchrun

from ckpt_engine import CheckpointEngine

pytestmark = [
    pytest.mark.dist,
    pytest.mark.slow,
    pytest.mark.skipif(not os.environ.get("CKPT_ENGINE_SLOW_TESTS"), reason="4 ranks: set CKPT_ENGINE_SLOW_TESTS=1"),
]

TIMEOUT = 240.0


def launch(nproc: int, *args: str) -> list[dict[str, Any]]:
    run = run_torchrun("four_ranks.py", *args, nproc=nproc, timeout=TIMEOUT)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == list(range(nproc)), run.describe()
    return [results[r][0] for r in range(nproc)]


def single_process_state(save_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load ``save_dir`` into one process: full parameters and ``exp_avg`` by parameter name."""
    model = make_model(seed=99)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        assert engine.load(model=model, optimizer=optim).iteration == 2
    names = dict(model.named_parameters())
    return (
        {n: p.detach().tolist() for n, p in names.items()},
        {n: optim.state[p]["exp_avg"].tolist() for n, p in names.items()},
    )


@pytest.fixture(scope="module")
def saved_at_four(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    save_dir = str(tmp_path_factory.mktemp("four") / "ckpt")
    ranks = launch(4, "save", save_dir)
    assert all(r["saved"] for r in ranks)
    assert all(r["params"] == ranks[0]["params"] and r["exp_avg"] == ranks[0]["exp_avg"] for r in ranks)
    return save_dir, ranks[0]


def test_four_rank_checkpoint_loads_into_one_process_bit_exact(saved_at_four: tuple[str, dict[str, Any]]) -> None:
    save_dir, saved = saved_at_four
    params, exp_avg = single_process_state(save_dir)
    assert params == saved["params"] and exp_avg == saved["exp_avg"]


def test_four_rank_checkpoint_reshards_into_two_ranks(saved_at_four: tuple[str, dict[str, Any]]) -> None:
    save_dir, saved = saved_at_four
    for rank in launch(2, "load", save_dir):
        assert rank["iteration"] == 2
        assert rank["params"] == saved["params"] and rank["exp_avg"] == saved["exp_avg"]


def test_a_strict_mismatch_raises_on_all_four_ranks(saved_at_four: tuple[str, dict[str, Any]]) -> None:
    assert [r["error"] for r in launch(4, "strict", saved_at_four[0])] == ["LoadStrictnessError"] * 4


def test_one_process_checkpoint_loads_into_four_ranks(tmp_path: Path) -> None:
    save_dir = str(tmp_path / "one")
    model = make_model(seed=0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1234))
    for _ in range(2):
        model(x).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(2, model=model, optimizer=optim)
    expected = {n: p.detach().tolist() for n, p in model.named_parameters()}
    exp_avg = {n: optim.state[p]["exp_avg"].tolist() for n, p in model.named_parameters()}
    for rank in launch(4, "load", save_dir):
        assert rank["params"] == expected and rank["exp_avg"] == exp_avg


def test_async_save_at_four_ranks_equals_the_sync_one(
    tmp_path: Path, saved_at_four: tuple[str, dict[str, Any]]
) -> None:
    pytest.importorskip("ckpt_engine_plugins.pinned_staging")
    save_dir = str(tmp_path / "async")
    ranks = launch(4, "save", save_dir, "--async")
    assert all(r["saved"] for r in ranks)
    params, exp_avg = single_process_state(save_dir)
    assert params == saved_at_four[1]["params"] and exp_avg == saved_at_four[1]["exp_avg"]
