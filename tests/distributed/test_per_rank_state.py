"""Per-rank state (DESIGN section 12): what DCP keeps one copy of is never silently reduced to rank
0's copy. One torchrun launch of 2 gloo ranks (tests/dist_scripts/per_rank_state.py) saves each
case; this process checks what they reported and loads their checkpoints into one process.
"""

from __future__ import annotations

import glob
import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _torchrun import run_torchrun
from per_rank_state import Position, Shards
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from ckpt_engine import CheckpointEngine
from ckpt_engine.errors import CheckpointLoadError, PerRankStateError

pytestmark = [pytest.mark.dist, pytest.mark.full]


def model() -> nn.Module:
    m = nn.Linear(4, 4)
    m.register_buffer("expert", torch.zeros(3))
    return m


def stored(save_dir: str) -> dict[str, tuple[list[str], list[str]]]:
    """Per component of the checkpoint in ``save_dir``: its storage keys and its files."""
    (folder,) = glob.glob(os.path.join(save_dir, "iter_*"))
    out = {}
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if os.path.isdir(path):
            keys = sorted(FileSystemReader(path).read_metadata().state_dict_metadata)
            out[name] = (keys, sorted(os.listdir(path)))
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("per_rank")
    run = run_torchrun("per_rank_state.py", str(root), nproc=2)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == [0, 1], run.describe()
    return root, {rank: lines[0] for rank, lines in results.items()}


def test_a_differing_plain_tensor_fails_the_save_on_every_rank_naming_key_and_ranks(launched: Any) -> None:
    root, by_rank = launched
    for rank in (0, 1):
        got = by_rank[rank]["mismatch"]
        assert got["type"] == "ReplicatedStateMismatchError", got
        assert "component 'model' key 'expert'" in got["message"]
        assert "rank(s) [0] hold value 1; rank(s) [1] hold value 2" in got["message"]
        assert "per_rank_keys" in got["message"]
        assert not [n for n in got["latest"] if n.startswith("iter_")]  # nothing committed
    assert not glob.glob(os.path.join(root, "mismatch", "iter_*"))


def test_per_rank_keys_and_differing_extras_are_saved_and_restored_per_rank(launched: Any) -> None:
    root, by_rank = launched
    for rank in (0, 1):
        got = by_rank[rank]["per_rank"]
        assert got["expert"] == [float(rank)] * 3
        assert got["loader"] == [2, 100 + rank]
        assert got["temperature"] == [rank + 1.0] * 2  # an nn.Parameter: was rank 0's on both
        assert got["tagged"] == [rank + 5.0] * 2  # a subclass of one: was rank 0's on both
    keys = stored(str(root / "per_rank"))
    assert keys["model"][0] == ["bias", "expert@rank0", "expert@rank1", "weight"]
    assert keys["loader"][0] == ["epoch@rank0", "epoch@rank1", "index@rank0", "index@rank1"]
    assert keys["temperature"][0] == keys["tagged"][0] == ["t@rank0", "t@rank1"]


def test_a_per_rank_extra_refuses_another_world_size_unless_it_repartitions(launched: Any) -> None:
    root, _ = launched
    save_dir = str(root / "extras")
    with (
        CheckpointEngine({"save_dir": save_dir}) as engine,
        pytest.raises(PerRankStateError, match=r"component 'loader'.*saved per rank by 2 rank.*this job has 1") as info,
    ):
        engine.load(model=model(), extra={"loader": Position()})
    assert isinstance(info.value, CheckpointLoadError)
    shards = Shards()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.load(model=model(), extra={"shards": shards})
    assert (shards.epoch, shards.index) == (5, 10)  # rank 0's copy, to re-partition from


def test_identical_state_keeps_the_format_of_a_save_without_the_check(launched: Any) -> None:
    root, _ = launched
    checked, unchecked = stored(str(root / "same")), stored(str(root / "same_off"))
    assert checked == unchecked
    assert checked["model"][0] == ["bias", "expert", "weight"]
    assert checked["loader"][0] == ["epoch", "index"]
    position = Position()
    with CheckpointEngine({"save_dir": str(root / "same")}) as engine:
        engine.load(model=model(), extra={"loader": position})
    assert (position.epoch, position.index) == (2, 100)


def test_an_async_save_checks_its_staged_copy_before_the_commit(launched: Any) -> None:
    _, by_rank = launched
    for rank in (0, 1):
        got = by_rank[rank]["async"]
        assert got["async_mismatch"]["error"] == "CheckpointSaveError", got
        assert "component 'model' key 'expert'" in got["async_mismatch"]["message"]
        assert got["async_mismatch"]["committed"] == []
        assert got["async_same"] == {"error": None, "committed": ["iter_000000001"]}
        # The check gates every tier's commit: a tier-only save skipped it (the resume then took
        # rank 0's copy), and a save into both tiers failed but stayed committed in the tier.
        for case in ("async_mismatch_tier", "async_mismatch_both_tiers"):
            assert got[case]["error"] == "CheckpointSaveError", got[case]
            assert "component 'model' key 'expert'" in got[case]["message"]
            assert got[case]["committed"] == [] and got[case]["committed_in_tier"] == [], got[case]


def test_a_tier_step_holding_per_rank_state_is_not_resharded_into_another_world_size(
    launched: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Step 6 is in the node-local tier only, each rank's data position its own; node 0 holds
    both parts (its own and rank 1's replica). A resume on one rank resharded it and gave rank 0's
    position as the job's, silently. It must read save_dir instead, whose load refuses it."""
    root, _ = launched
    config = {"save_dir": str(root / "tier"), "local_dir": str(root / "tier_nodes" / "node0"), "ranks_per_node": 1}
    with (
        caplog.at_level(logging.WARNING, logger="ckpt_engine"),
        CheckpointEngine(config) as engine,
        pytest.raises(PerRankStateError, match=r"iter_000000005/loader: component 'loader'.*this job has 1"),
    ):
        engine.load(model=model(), extra={"loader": Position()})
    assert "not resharding the steps that hold state saved per rank, step(s) 6 (loader)" in caplog.text


def test_plan_into_another_world_size_fails_as_the_load_would(
    launched: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ckpt-engine plan`` of a checkpoint holding state saved per rank into one process: the
    load refuses it (PerRankStateError), so the plan must report the load as failing (exit 1)
    naming the component; it ended with a one-line error and exit 2, as for bad arguments."""
    from ckpt_engine.cli import main as cli

    root, _ = launched
    (tmp_path / "per_rank_factory.py").write_text(
        "import torch\nfrom torch import nn\n\n\ndef model():\n    m = nn.Linear(4, 4)\n"
        "    m.register_buffer('expert', torch.zeros(3))\n    return m\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    code = cli(["plan", str(root / "per_rank"), "--model", "per_rank_factory:model"])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "FAILED: the load would fail" in out and "model: " in out and "saved per rank by 2 rank(s)" in out


def test_ddp_broadcast_buffers_are_saved_from_rank_0_and_others_that_differ_refused(launched: Any) -> None:
    """DDP with ``broadcast_buffers`` (its default) and BatchNorm: after a step each rank holds its
    own running statistics, which DDP replaces with rank 0's at the next forward. The save was
    refused as diverged ranks (ReplicatedStateMismatchError); it saves rank 0's. Without
    ``broadcast_buffers`` the statistics really are per rank, and the save is still refused."""
    root, results = launched
    ranks = [results[r]["ddp"] for r in (0, 1)]
    assert all(r["ddp_bn_broadcast"]["error"] is None for r in ranks), ranks
    assert ranks[0]["ddp_bn_broadcast"]["running_mean"] != ranks[1]["ddp_bn_broadcast"]["running_mean"]
    loaded = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    with CheckpointEngine({"save_dir": str(root / "ddp_bn_broadcast")}) as engine:
        engine.load(model=loaded)
    assert loaded[1].running_mean.tolist() == ranks[0]["ddp_bn_broadcast"]["running_mean"]
    for r in ranks:
        assert r["ddp_bn_own"]["error"] == "ReplicatedStateMismatchError", r
        assert "running_mean" in r["ddp_bn_own"]["message"]
    keys, _ = stored(str(root / "ddp_bn_per_rank"))["model"]
    assert {"1.running_mean@rank0", "1.running_mean@rank1"} <= set(keys), keys  # per_rank_keys still apply
