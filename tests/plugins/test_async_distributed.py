"""``pinned_staging`` under ``torchrun``: 2 gloo ranks, an FSDP2 model, async saves, resharded load.

The ranks (``tests/dist_scripts/async_fsdp_save.py``) save twice through the plugin, enabled by
name (its entry point), and overwrite their live parameters and optimizer state right after
each ``save()`` returns; then one rank's writer is killed mid-save. This process loads the
checkpoints into one unsharded model and checks them bit-exact against what the ranks held at
each ``save()``.
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

pytestmark = pytest.mark.dist

WORLD = 2
PARAM_NAMES = [f"{i}.{a}" for i in (0, 2, 3) for a in ("weight", "bias")]


Saved = tuple[Path, dict[int, dict[str, Any]]]


@pytest.fixture(scope="module")
def async_saved(tmp_path_factory: pytest.TempPathFactory) -> Saved:
    save_dir = tmp_path_factory.mktemp("async_fsdp") / "checkpoints"
    run = run_torchrun("async_fsdp_save.py", str(save_dir), nproc=WORLD, timeout=150.0)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == list(range(WORLD)), f"not every rank reported\n{run.describe()}"
    return save_dir, {rank: payloads[0] for rank, payloads in results.items()}


def test_every_rank_saved_asynchronously_with_its_own_writer(async_saved: Saved) -> None:
    save_dir, ranks = async_saved
    for rank, report in ranks.items():
        saves = report["saves"]
        assert [s["iteration"] for s in saves] == [2, 3]
        for s in saves:
            assert s["succeeded"], (rank, s)
            assert 0 < s["blocked"] < s["total"], (rank, s)
        # One writer per rank for the whole run, buffers allocated once and reused.
        assert saves[0]["writer_pid"] == saves[1]["writer_pid"]
        assert saves[0]["buffers"] == saves[1]["buffers"] and len(saves[0]["buffers"]) == 1
        assert report["writer_gone"]
    assert ranks[0]["saves"][0]["writer_pid"] != ranks[1]["saves"][0]["writer_pid"]
    # Gathered values agree across ranks: both ranks took part in the same two saves.
    for i in range(2):
        assert ranks[0]["saves"][i]["params"] == ranks[1]["saves"][i]["params"]

    assert not [p.name for p in save_dir.iterdir() if p.name.startswith(".iter")]
    for iteration in (2, 3, 5):
        model_dir = save_dir / f"iter_{iteration:09}" / "model"
        # Per-rank shards, written by each rank's writer process.
        assert {"__0_0.distcp", "__1_0.distcp"} <= {f.name for f in model_dir.iterdir()}


def test_a_writer_killed_on_one_rank_fails_the_save_everywhere_and_every_rank_recovers(async_saved: Saved) -> None:
    save_dir, ranks = async_saved
    r0, r1 = ranks[0], ranks[1]
    # Rank 1 lost its own writer; rank 0's writer saw its peer vanish mid-collective.
    assert f"pid {r1['old_writer']}, rank 1" in r1["failure"] and "SIGKILL" in r1["failure"], r1["failure"]
    assert "iteration 4" in r1["failure"] and "not committed" in r1["failure"], r1["failure"]
    assert r0["failure"] is not None and f"pid {r0['old_writer']}, rank 0" in r0["failure"], r0["failure"]
    # The next save() proceeds on both ranks (it no longer raises the failure again: the caller saw
    # it through the handle), both replaced their writer, and save 5 worked.
    assert not r0["reported_again"] and not r1["reported_again"]
    assert r0["recovered"]["succeeded"] and r1["recovered"]["succeeded"]
    assert r0["recovered"]["params"] == r1["recovered"]["params"]
    assert (save_dir / "latest_checkpoint.txt").read_text() == "iter_000000005\n"
    assert not [p.name for p in save_dir.iterdir() if "iter_000000004" in p.name]


def _expected(ranks: dict[int, dict[str, Any]], iteration: int) -> dict[str, Any]:
    if iteration == 5:
        return {"iteration": 5, **ranks[0]["recovered"]}
    return next(s for s in ranks[0]["saves"] if s["iteration"] == iteration)


@pytest.mark.parametrize("iteration", [2, 3, 5])
def test_async_fsdp2_checkpoint_reshards_into_one_process(async_saved: Saved, tmp_path: Path, iteration: int) -> None:
    save_dir, ranks = async_saved
    saved = _expected(ranks, iteration)
    model = make_model(seed=5)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = {
        "save_dir": str(tmp_path / "unused"),
        "load_path": os.fspath(save_dir / f"iter_{iteration:09}"),
        "load_training_state": True,
    }
    with CheckpointEngine(config) as engine:
        result = engine.load(model=model, optimizer=optim)
    assert result.iteration == iteration
    assert sorted(result.report["model"].loaded) == sorted(PARAM_NAMES)
    params = dict(model.named_parameters())
    for name in PARAM_NAMES:
        expected = torch.tensor(saved["params"][name], dtype=torch.float32)
        assert torch.equal(params[name].detach(), expected), f"iteration {iteration} param {name}"
        exp_avg = torch.tensor(saved["exp_avg"][name], dtype=torch.float32)
        assert torch.equal(optim.state[params[name]]["exp_avg"], exp_avg), f"iteration {iteration} exp_avg {name}"
        # The -1000 written into the live state right after save() returned never reached it.
        assert not torch.any(params[name].detach() == -1000.0)
