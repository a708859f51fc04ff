"""4 gloo ranks under torchrun: FSDP2 save at 4 ranks, loaded into 2 ranks and into one process;
one process's checkpoint into 4 ranks; a strict mismatch raising on all 4; an async save at 4.

Bit-exact: every rank reports the full parameters and AdamW ``exp_avg`` it holds, and this
process compares them with what it saved or loaded itself. About a minute on 2 CPU cores, so
the module runs with ``CKPT_ENGINE_SLOW_TESTS=1`` (the 2-rank variants run in every suite:
test_distributed.py, test_async_distributed.py). The 4-rank steps share one launch (:func:`four`);
each test checks its own step's report.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
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


def launch(nproc: int, *steps: str) -> dict[str, list[dict[str, Any]]]:
    """``four_ranks.py`` steps (``NAME:MODE:SAVE_DIR[:async]``) in one launch: by name, each rank's report."""
    run = run_torchrun("four_ranks.py", *steps, nproc=nproc, timeout=TIMEOUT)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == list(range(nproc)), run.describe()
    out: dict[str, list[dict[str, Any]]] = {}
    for rank in range(nproc):
        for report in results[rank]:
            out.setdefault(report["scenario"], []).append(report)
    assert all(len(ranks) == nproc for ranks in out.values()), run.describe()
    return out


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


@dataclass
class FourRanks:
    """The shared 4-rank launch: each step's save_dir and its reports by rank."""

    dirs: dict[str, str]
    ranks: dict[str, list[dict[str, Any]]]
    #: The full parameters and ``exp_avg`` of the one-process checkpoint the ``one`` step loads.
    one_process: tuple[dict[str, Any], dict[str, Any]]


def one_process_save(save_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The checkpoint the ``one`` step loads, trained and saved in this process."""
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
    return expected, exp_avg


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> FourRanks:
    """Every 4-rank step in one launch, in order: the save, the strict refusal of it, the load of a
    one-process checkpoint (saved here first) and, where ``pinned_staging`` imports, the async save."""
    root = tmp_path_factory.mktemp("four")
    dirs = {name: str(root / name) for name in ("save", "one", "async")}
    one_process = one_process_save(dirs["one"])
    steps = [f"save:save:{dirs['save']}", f"strict:strict:{dirs['save']}", f"one:load:{dirs['one']}"]
    with contextlib.suppress(ImportError):
        import ckpt_engine_plugins.pinned_staging  # noqa: F401

        steps.append(f"async:save:{dirs['async']}:async")
    return FourRanks(dirs, launch(4, *steps), one_process)


@pytest.fixture(scope="module")
def saved_at_four(four: FourRanks) -> tuple[str, dict[str, Any]]:
    save_dir = four.dirs["save"]
    ranks = four.ranks["save"]
    assert all(r["saved"] for r in ranks)
    assert all(r["params"] == ranks[0]["params"] and r["exp_avg"] == ranks[0]["exp_avg"] for r in ranks)
    return save_dir, ranks[0]


def test_four_rank_checkpoint_loads_into_one_process_bit_exact(saved_at_four: tuple[str, dict[str, Any]]) -> None:
    save_dir, saved = saved_at_four
    params, exp_avg = single_process_state(save_dir)
    assert params == saved["params"] and exp_avg == saved["exp_avg"]


def test_four_rank_checkpoint_reshards_into_two_ranks(saved_at_four: tuple[str, dict[str, Any]]) -> None:
    save_dir, saved = saved_at_four
    for rank in launch(2, f"load:load:{save_dir}")["load"]:
        assert rank["iteration"] == 2
        assert rank["params"] == saved["params"] and rank["exp_avg"] == saved["exp_avg"]


def test_a_strict_mismatch_raises_on_all_four_ranks(saved_at_four: tuple[str, dict[str, Any]], four: FourRanks) -> None:
    assert [r["error"] for r in four.ranks["strict"]] == ["LoadStrictnessError"] * 4


def test_one_process_checkpoint_loads_into_four_ranks(four: FourRanks) -> None:
    expected, exp_avg = four.one_process  # saved by the fixture (one_process_save) before the launch
    for rank in four.ranks["one"]:
        assert rank["params"] == expected and rank["exp_avg"] == exp_avg


def test_async_save_at_four_ranks_equals_the_sync_one(
    four: FourRanks, saved_at_four: tuple[str, dict[str, Any]]
) -> None:
    pytest.importorskip("ckpt_engine_plugins.pinned_staging")
    save_dir = four.dirs["async"]
    ranks = four.ranks["async"]
    assert all(r["saved"] for r in ranks)
    params, exp_avg = single_process_state(save_dir)
    assert params == saved_at_four[1]["params"] and exp_avg == saved_at_four[1]["exp_avg"]
