"""``EngineCheckpointIO`` under Lightning's strategies: DDP and ``ModelParallelStrategy`` (FSDP2) on
2 CPU processes, every rank in every save, and a refusal when the ``Trainer`` is built for the
strategies it cannot run under.

Before this, the IO worked in one process only: ``Trainer(strategy="ddp", devices=2)`` trained
until the first ``ModelCheckpoint`` save and then died on both ranks (Lightning calls a
``CheckpointIO`` on rank 0 alone; an engine save is collective). The distributed tests start the
job as a user does (``python fit.py``; Lightning starts the second process), SIGKILL the whole job
in the middle of a save, restart it with ``ckpt_path="last"`` and compare every rank's final
weights, optimizer state and losses with an uninterrupted run's, bit for bit
(``tests/lightning_scripts/fit_dist.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import _forked
import pytest
import torch
from _paths import LIGHTNING_SCRIPTS

pytest.importorskip("lightning")

import lightning as L
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)

from ckpt_engine.cli import main as cli
from ckpt_engine.integrations._lightning_strategies import install, saves_sharded, start_method
from ckpt_engine.integrations._state_tree import flatten, skeleton
from ckpt_engine.integrations.lightning import LAST_ALIAS, EngineCheckpointIO, UnsupportedStrategyError, read_pointer

SCRIPT = LIGHTNING_SCRIPTS / "fit_dist.py"
#: What the fork server imports before forking rank 0 of a job.
LIGHTNING = ("lightning", "ckpt_engine.integrations.lightning")
STEPS, KILL_AT = 12, 8  # checkpoints at 4, 8 and 12; the job is killed in the save of 8


def _io(tmp_path: Path) -> EngineCheckpointIO:
    return EngineCheckpointIO({"save_dir": str(tmp_path / "engine")})


# -- refused when the Trainer is built -------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "fix"),
    [
        ("ddp_spawn", "use strategy='ddp'"),
        ("ddp_fork", "use strategy='ddp'"),
        ("ddp_notebook", "use strategy='ddp'"),
        (lambda: ModelParallelStrategy(save_distributed_checkpoint=False), "keep save_distributed_checkpoint=True"),
    ],
    ids=["ddp_spawn", "ddp_fork", "ddp_notebook", "model_parallel_full_state"],
)
def test_a_strategy_it_cannot_run_under_is_refused_when_the_trainer_is_built(
    tmp_path: Path, strategy: Any, fix: str
) -> None:
    flag = strategy() if callable(strategy) else strategy
    with pytest.raises(UnsupportedStrategyError) as info:
        L.Trainer(strategy=flag, accelerator="cpu", devices=2, plugins=[_io(tmp_path)], logger=False)
    message = str(info.value)
    assert "\n" not in message and message.startswith("EngineCheckpointIO cannot run under ") and fix in message


class _Custom(Strategy):
    """A strategy of the user's own: the integration cannot know how it saves."""

    root_device = torch.device("cpu")
    is_global_zero = True

    def model_to_device(self) -> None: ...

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return tensor

    def barrier(self, name: str | None = None) -> None: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather(self, tensor: Any, group: Any = None, sync_grads: bool = False) -> Any:
        return tensor


def _bare(cls: type[Strategy]) -> Strategy:
    """An instance without ``__init__``: DeepSpeedStrategy's refuses to run without deepspeed
    installed, and what decides the refusal is the strategy's class."""
    return cls.__new__(cls)


@pytest.mark.parametrize(
    ("make", "fix"),
    [
        (lambda: _bare(DeepSpeedStrategy), "leave out EngineCheckpointIO"),
        (FSDPStrategy, "shard with ModelParallelStrategy and fully_shard in configure_model"),
        (_Custom, "use one of them, or leave out EngineCheckpointIO"),
    ],
    ids=["deepspeed", "fsdp1", "custom"],
)
def test_strategies_lightning_builds_only_elsewhere_are_refused_when_connected(
    tmp_path: Path, make: Any, fix: str
) -> None:
    """Lightning builds FSDPStrategy only with a GPU and DeepSpeedStrategy only with deepspeed:
    here the refusal is shown where it happens while a Trainer is built, when Lightning connects
    the plugin (``strategy.checkpoint_io = io``)."""
    strategy = make()
    with pytest.raises(UnsupportedStrategyError) as info:
        strategy.checkpoint_io = _io(tmp_path)
    assert "\n" not in str(info.value) and fix in str(info.value)
    assert type(strategy).__name__ in str(info.value)


def test_the_strategies_it_runs_under_are_built_and_other_trainers_are_untouched(tmp_path: Path) -> None:
    for flag in ("ddp", ModelParallelStrategy(), "auto"):
        trainer = L.Trainer(strategy=flag, accelerator="cpu", devices=2, plugins=[_io(tmp_path)], logger=False)
        # the strategy object itself saves and loads through the IO on every rank
        assert {"save_checkpoint", "load_checkpoint"} <= set(vars(trainer.strategy))
    single = L.Trainer(accelerator="cpu", devices=1, plugins=[_io(tmp_path)], logger=False)
    assert isinstance(single.strategy, SingleDeviceStrategy) and "save_checkpoint" not in vars(single.strategy)
    # a Trainer without the IO keeps Lightning's own save and load, on rank 0 and every rank
    plain = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, logger=False)
    assert "save_checkpoint" not in vars(plain.strategy) and "load_checkpoint" not in vars(plain.strategy)
    io = _io(tmp_path)
    strategy = SingleDeviceStrategy()
    strategy.checkpoint_io = io  # the wrapped setter still sets
    assert strategy.checkpoint_io is io


def test_installing_again_wraps_lightnings_setter_once(tmp_path: Path) -> None:
    """A reloaded integration module installs its own callback, never a wrapper of a wrapper."""
    connected: list[Strategy] = []
    prop = Strategy.__dict__["checkpoint_io"]
    try:
        install(lambda strategy, io: connected.append(strategy))
        assert Strategy.__dict__["checkpoint_io"].original is prop.original
        strategy = DDPStrategy()
        strategy.checkpoint_io = _io(tmp_path)
        assert connected == [strategy] and "save_checkpoint" not in vars(strategy)  # only the new callback ran
    finally:
        setattr(Strategy, "checkpoint_io", prop)  # noqa: B010


def test_model_parallel_teardown_tears_the_io_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """ModelParallelStrategy.teardown never calls its CheckpointIO's (Strategy.teardown does): the
    end of fit would not wait for a background save of the last step, nor close the engine."""
    torn: list[str] = []

    class Recording(EngineCheckpointIO):
        def teardown(self) -> None:
            torn.append("io")
            super().teardown()

    trainer = L.Trainer(
        strategy=ModelParallelStrategy(),
        accelerator="cpu",
        devices=2,
        plugins=[Recording({"save_dir": str(tmp_path)})],
        logger=False,
    )
    monkeypatch.setenv("WORLD_SIZE", "2")  # the cluster environment's teardown removes it
    trainer.strategy.teardown()
    assert torn == ["io"]


def test_lightnings_private_settings_read_as_constructed() -> None:
    """Pins the two private Lightning attributes the refusal reads (``_lightning_strategies``)."""
    for method in ("popen", "spawn", "fork", "forkserver"):
        assert start_method(DDPStrategy(start_method=method)) == method
    assert saves_sharded(ModelParallelStrategy()) is True
    assert saves_sharded(ModelParallelStrategy(save_distributed_checkpoint=False)) is False


def test_a_load_reads_into_the_live_tensors_of_the_stored_dtype_and_shape() -> None:
    """How a sharded model's DTensors receive their shard: the skeleton is the live tensor itself."""
    structure, _ = flatten({"optimizer_states": [{"state": {"w": {"exp_avg": torch.zeros(4, 2), "step": 3}}}]})
    live = torch.ones(4, 2)
    targets = skeleton(structure, "here", like={"optimizer_states": [{"state": {"w": {"exp_avg": live}}}]})
    assert targets["optimizer_states.0.state.w.exp_avg"] is live
    for other in (torch.ones(4, 2, dtype=torch.float64), torch.ones(2, 4), None):
        targets = skeleton(structure, "here", like={"optimizer_states": [{"state": {"w": {"exp_avg": other}}}]})
        assert targets["optimizer_states.0.state.w.exp_avg"] is not other
        assert targets["optimizer_states.0.state.w.exp_avg"].shape == (4, 2)


# -- 2 processes: killed in a save, resumed bit for bit ---------------------------------------


def _env(*, cuda: bool = False, background: bool = False, ranks: int = 2, tier: bool = False) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CKPT_TEST_LIGHTNING_RANKS": str(ranks)})
    env.update({"CKPT_TEST_LIGHTNING_CUDA": "1"} if cuda else {"CUDA_VISIBLE_DEVICES": ""})
    if background:
        env["CKPT_TEST_LIGHTNING_ASYNC"] = "1"
    if tier:
        env["CKPT_TEST_LIGHTNING_TIER"] = "1"
    for name in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK"):
        env.pop(name, None)  # Lightning starts the job and picks its own port
    return env


def _kill_mid_save(root: Path, strategy: str, ranks: int, env: dict[str, str]) -> str:
    """Start the job, and SIGKILL all of it once every rank is inside the save of ``KILL_AT``.
    Bounded by progress: the ranks report ``MIDSAVE`` or the job ends."""
    args = [str(root), strategy, str(STEPS), "kill", str(KILL_AT)]
    proc: Any
    if env.get("CKPT_TEST_LIGHTNING_CUDA") == "1":  # a GPU job starts as users' do
        cmd = [sys.executable, str(SCRIPT), *args]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
    else:  # rank 0 forked from a process that imported Lightning; Lightning starts rank 1 itself
        pipes: dict[str, Any] = {"stdout": _forked.PIPE, "stderr": _forked.PIPE}
        proc = _forked.popen(
            SCRIPT, *args, env=env, inherit_env=False, start_new_session=True, preload=LIGHTNING, **pipes
        )
    assert proc.stdout is not None
    err: list[str] = []
    drain = threading.Thread(target=lambda: err.extend(proc.stderr or []), daemon=True)
    drain.start()
    out = ""
    try:
        for line in proc.stdout:
            out += line
            if len(re.findall(rf"MIDSAVE {KILL_AT} \d", out)) == ranks:
                os.killpg(proc.pid, signal.SIGKILL)  # the whole job: both ranks
                break
        else:
            proc.wait()
            drain.join(5)
            pytest.fail(f"the job ended (rc={proc.returncode}) before the save of {KILL_AT}:\n{out}\n{''.join(err)}")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        if isinstance(proc, _forked.ForkedProcess):
            proc.close()
    assert proc.returncode == -signal.SIGKILL
    return out


def _saves(out: str, run: str) -> Counter[int]:
    """How many ranks reported each committed iteration of ``run``."""
    return Counter(int(it) for it, _ in re.findall(rf"SAVED {run} (\d+) (\d)", out))


def _assert_same(reference: Any, resumed: Any, where: str) -> None:
    if isinstance(reference, torch.Tensor):
        assert isinstance(resumed, torch.Tensor) and torch.equal(reference, resumed), where
        assert reference.dtype == resumed.dtype, where
    elif isinstance(reference, dict):
        assert isinstance(resumed, dict) and reference.keys() == resumed.keys(), where
        for key in reference:
            _assert_same(reference[key], resumed[key], f"{where}.{key}")
    elif isinstance(reference, (list, tuple)):
        assert len(reference) == len(resumed), where
        for i, (a, b) in enumerate(zip(reference, resumed, strict=True)):
            _assert_same(a, b, f"{where}.{i}")
    else:
        assert reference == resumed, where


def _killed_then_resumed(root: Path, strategy: str, ranks: int, env: dict[str, str]) -> None:
    """The scenario, for ``ranks`` processes: killed mid-save, restarted, compared bit for bit."""
    out = _kill_mid_save(root, strategy, ranks, env)
    engine = root / "killed" / "engine"
    latest = (engine / "latest_checkpoint.txt").read_text().strip()
    if env.get("CKPT_TEST_LIGHTNING_ASYNC") == "1":
        assert latest in ("iter_000000004", "iter_000000008")  # the writer processes may have committed
    else:
        assert _saves(out, "killed") == {4: ranks}  # every rank committed step 4, none step 8
        assert latest == "iter_000000004"
        assert (engine / ".iter_000000008.partial" / "model" / ".metadata").exists()
        assert not (engine / "iter_000000008").exists()
        assert not (root / "killed" / "ckpts" / "epoch=1-step=8.ckpt").exists()  # its pointer waits for the commit
    resumed_from = int(latest.removeprefix("iter_"))

    args = [str(root), strategy, str(STEPS), "resume"]
    if env.get("CKPT_TEST_LIGHTNING_CUDA") == "1":
        done = subprocess.run(
            [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=300
        )
    else:
        done = _forked.run(SCRIPT, *args, env=env, inherit_env=False, timeout=300, preload=LIGHTNING)
    assert done.returncode == 0 and done.stdout.count("RESUMED") == ranks, done.stdout[-3000:] + done.stderr[-6000:]
    assert _saves(done.stdout, "reference") == {4: ranks, 8: ranks, 12: ranks}
    assert _saves(done.stdout, "killed") == {step: ranks for step in (8, 12) if step > resumed_from}
    for rank in range(ranks):
        reference = torch.load(root / "reference" / f"final_{rank}.pt", weights_only=False)
        resumed = torch.load(root / "killed" / f"final_{rank}.pt", weights_only=False)
        assert sorted(resumed["losses"]) == list(range(resumed_from, STEPS))
        _assert_same({s: reference["losses"][s] for s in resumed["losses"]}, resumed["losses"], f"rank {rank} losses")
        _assert_same(reference["model"], resumed["model"], f"rank {rank} model")
        _assert_same(reference["optimizer"], resumed["optimizer"], f"rank {rank} optimizer")
        # a callback whose state differs by rank is saved per rank: every rank resumed its own
        own = {"saved_by": rank, "marker": torch.full((3,), float(rank))}
        _assert_same(resumed["rank_state_loaded"], own, f"rank {rank} callback state")
    for run in ("reference", "killed"):
        ckpts = root / run / "ckpts"
        for name, step in (("epoch=0-step=4.ckpt", 4), ("epoch=1-step=8.ckpt", 8), ("epoch=2-step=12.ckpt", 12)):
            pointer = read_pointer(ckpts / name)  # written once, by global rank 0, after the commit
            assert pointer is not None and pointer.iteration == step
        assert (ckpts / LAST_ALIAS).is_file()
        assert cli(["verify", str(root / run / "engine"), "--level", "checksums"]) == 0


@pytest.mark.dist
@pytest.mark.parametrize("strategy", ["ddp", "model_parallel"])
def test_a_two_process_job_killed_mid_save_resumes_bit_identical(tmp_path: Path, strategy: str) -> None:
    _killed_then_resumed(tmp_path, strategy, 2, _env())
    model = tmp_path / "reference" / "engine" / "iter_000000012" / "model"
    sizes = {p.name: p.stat().st_size for p in model.glob("__*_0.distcp")}
    if strategy == "ddp":  # DDP's replicated weights are written once, by rank 0
        assert sizes["__0_0.distcp"] > 0 and sizes.get("__1_0.distcp", 0) == 0, sizes
        return
    assert set(sizes) == {"__0_0.distcp", "__1_0.distcp"} and min(sizes.values()) > 0, sizes  # a shard each
    # the sharded checkpoint resumes on one process: it holds both ranks' shards, joined
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), strategy, str(STEPS), "reshard"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(ranks=1), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    shards = [torch.load(tmp_path / "killed" / f"final_{r}.pt", weights_only=False) for r in range(2)]
    whole = torch.load(tmp_path / "resharded" / "final_0.pt", weights_only=False)
    assert whole["losses"] == {}  # resumed at its last step: what it holds is what it loaded
    _assert_same(_joined([s["model"] for s in shards]), whole["model"], "model")
    _assert_same(_joined([s["optimizer"] for s in shards]), whole["optimizer"], "optimizer")


@pytest.mark.dist
def test_a_ddp_job_saved_only_to_the_node_local_tier_resumes_on_one_process(tmp_path: Path) -> None:
    """Two DDP ranks save every step into the node-local tier only; ``ckpt_path="last"`` on one
    process then reads the tier's copies, resharded. Each rank put its own random save id in the
    checkpoint's structure, so every Lightning step held state saved per rank, which the tier
    does not reshard: the resume found nothing in ``save_dir`` and failed."""
    args = [str(tmp_path), "ddp", str(STEPS)]
    done = _forked.run(SCRIPT, *args, "fit", env=_env(tier=True), inherit_env=False, timeout=300, preload=LIGHTNING)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert not list((tmp_path / "killed" / "engine").glob("iter_*")), "the fit saved to save_dir"
    for manifest in (tmp_path / "killed" / "local").glob("rank_*/iter_*/ckpt_engine_manifest.json"):
        # the ranks' checkpoint dicts are alike: nothing is saved per rank (each rank's own random
        # save id in the structure made the whole lightning component differ, and kept the tier
        # from resharding any step of a Lightning job)
        assert json.loads(manifest.read_text()).get("per_rank", []) == [], manifest
    cmd = [sys.executable, str(SCRIPT), *args, "reshard"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=_env(ranks=1, tier=True), timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    shards = [torch.load(tmp_path / "killed" / f"final_{r}.pt", weights_only=False) for r in range(2)]
    whole = torch.load(tmp_path / "resharded" / "final_0.pt", weights_only=False)
    assert whole["losses"] == {}  # resumed at its last step: what it holds is what it loaded
    for rank, shard in enumerate(shards):  # DDP: every rank holds the whole state
        _assert_same(shard["model"], whole["model"], f"model (rank {rank})")
        _assert_same(shard["optimizer"], whole["optimizer"], f"optimizer (rank {rank})")


def _joined(shards: list[Any]) -> Any:
    """The whole state of ranks' ``fully_shard`` shards (dim 0); what is replicated, once."""
    first = shards[0]
    if isinstance(first, torch.Tensor):
        return first if first.dim() == 0 else torch.cat(shards)
    if isinstance(first, dict):
        return {k: _joined([s[k] for s in shards]) for k in first}
    if isinstance(first, list):
        return [_joined([s[i] for s in shards]) for i in range(len(first))]
    return first


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("CKPT_ENGINE_SLOW_TESTS"),
    reason="about a minute (four pinned_staging writer start-ups a job): set CKPT_ENGINE_SLOW_TESTS=1",
)
def test_a_two_process_job_with_background_saves_killed_mid_save_resumes_bit_identical(tmp_path: Path) -> None:
    _killed_then_resumed(tmp_path, "ddp", 2, _env(background=True))


@pytest.mark.cuda
def test_model_parallel_on_a_gpu_killed_mid_save_resumes_bit_identical(tmp_path: Path) -> None:
    """FSDP2 on CUDA (NCCL, one process): Lightning hands the IO CPU-offloaded DTensors, and the
    load reads into the model's CUDA DTensors (run by scripts/gpu_check.sh)."""
    _killed_then_resumed(tmp_path, "model_parallel", 1, _env(cuda=True))
