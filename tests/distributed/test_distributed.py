"""The core engine under ``torchrun``: 2 gloo ranks on CPU, FSDP2 and DTensor models.

Every scenario (``tests/dist_scripts/core_<name>.py``) runs in one shared torchrun launch
(``tests/dist_scripts/core.py``, from the module fixture :func:`core`): a 2-rank launch costs
more CPU than the scenarios it runs. The ranks report what they hold (full parameters gathered
with ``full_tensor()``, local shards with ``to_local()``, errors they caught) under the
scenario's name, and each test checks its own scenario's report, bit-exact, against what this
process saved or loaded itself in a single process without a process group. A scenario that
fails ends the launch: its tests and those of the scenarios after it fail with its traceback.
Under pytest-xdist the module's tests go to one worker (tests/conftest.py), so the launch runs
once per session.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _common import make_model, train_inputs
from _torchrun import TorchrunResult, run_torchrun
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from ckpt_engine import CheckpointEngine

pytestmark = pytest.mark.dist

WORLD = 2
#: Generous for the shared launch of 2 ranks on 2 CPU cores (its 5 scenarios took 3 to 10 s each
#: as launches of their own); a hang fails the tests. Below the ranks' default collective timeout
#: (600 s), which the strict and rank-failure tests rely on.
TIMEOUT = 300.0
#: The scenarios of the shared launch, in the order they run (``core_<name>.py``).
SCENARIOS = ("fsdp_save", "fsdp_load", "reshard", "strict", "rank_failure")
COMPONENTS = ("model", "optim", "scheduler", "trainer")
PARAM_NAMES = [f"{i}.{a}" for i in (0, 2, 3) for a in ("weight", "bias")]


@dataclass
class CoreLaunch:
    """The shared launch: each scenario's save_dir and its reports by rank, and what ended it."""

    run: TorchrunResult
    dirs: dict[str, Path]
    #: The training objects of the one-process save that the ``fsdp_load`` scenario loads.
    one_process: tuple[nn.Module, torch.optim.Optimizer, Any, Any]

    def results(self, name: str) -> dict[int, list[Any]]:
        """Scenario ``name``'s payloads by rank (as a launch of its own reported them); fails the
        test, naming the scenario, where a rank did not report it or raised in it."""
        results: dict[int, list[Any]] = {}
        errors: list[str] = []
        unfinished = set()
        for rank, reports in self.run.results().items():
            done = {r["scenario"] for r in reports if "payloads" in r}
            unfinished |= set(SCENARIOS) - done
            for r in reports:
                if r["scenario"] == name and "payloads" in r:
                    results[rank] = r["payloads"]
                elif "error" in r:
                    errors.append(f"scenario {r['scenario']!r} raised on rank {rank}:\n{r['error']}")
        problems = "\n".join(errors) + f"\n{self.run.describe()}"
        assert sorted(results) == list(range(WORLD)), f"scenario {name!r}: not every rank reported\n{problems}"
        # A launch that failed after every scenario reported is every test's failure.
        assert self.run.returncode == 0 or unfinished, f"the launch failed after scenario {name!r}\n{problems}"
        return results


def one_process_save(save_dir: str) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    """The checkpoint the ``fsdp_load`` scenario loads: 2 steps trained and saved in this process."""
    model, optim, sched, scaler = fresh_training_objects(seed=11)
    x = train_inputs()
    for _ in range(2):
        scaler.scale(model(x).pow(2).mean()).backward()
        scaler.step(optim)
        scaler.update()
        sched.step()
        optim.zero_grad()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(7, model=model, optimizer=optim, scheduler=sched, grad_scaler=scaler)
    return model, optim, sched, scaler


@pytest.fixture(scope="module")
def core(tmp_path_factory: pytest.TempPathFactory) -> CoreLaunch:
    """Every scenario in one launch; the one-process save for ``fsdp_load`` is written first."""
    dirs = {name: tmp_path_factory.mktemp(name) / "checkpoints" for name in SCENARIOS}
    one_process = one_process_save(str(dirs["fsdp_load"]))
    run = run_torchrun("core.py", *(f"{n}={d}" for n, d in dirs.items()), nproc=WORLD, timeout=TIMEOUT)
    return CoreLaunch(run, dirs, one_process)


def as_tensor(values: Any) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def assert_bit_equal(actual: torch.Tensor, expected: Any, what: str) -> None:
    expected = expected if isinstance(expected, torch.Tensor) else as_tensor(expected)
    assert actual.dtype == expected.dtype, what
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.equal(actual, expected), f"{what}: values differ"


def shard0_rows(n: int, rank: int) -> slice:
    """The rows FSDP2 (``Shard(0)``, torch.chunk semantics) gives ``rank`` of a dim-0 size ``n``."""
    size = -(-n // WORLD)
    return slice(min(rank * size, n), min((rank + 1) * size, n))


class RankStateTemplate:
    """Single-process stand-in for the ranks' per-rank ``extra`` component (rank-specific keys)."""

    def __init__(self) -> None:
        self.sd: dict[str, Any] = {}
        for r in range(WORLD):
            self.sd[f"rng_rank{r}"] = torch.zeros_like(torch.get_rng_state())
            self.sd[f"pos_rank{r}"] = -1
            self.sd[f"name_rank{r}"] = ""

    def state_dict(self) -> dict[str, Any]:
        return dict(self.sd)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = dict(sd)


def fresh_training_objects(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, Any]:
    model = make_model(seed=seed)
    optim = torch.optim.AdamW(model.parameters(), lr=0.7)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu")
    return model, optim, sched, scaler


# -- 1. FSDP2 save (2 ranks) -> load in one process ---------------------------------------------


@pytest.fixture(scope="module")
def fsdp_saved(core: CoreLaunch) -> tuple[str, dict[int, dict[str, Any]]]:
    results = core.results("fsdp_save")
    return str(core.dirs["fsdp_save"]), {rank: payloads[0] for rank, payloads in results.items()}


def test_fsdp2_save_reports_consistent_state_on_every_rank(fsdp_saved):
    _, ranks = fsdp_saved
    r0, r1 = ranks[0], ranks[1]
    # Gathered values are the same on both ranks; the per-rank extra state is not.
    for key in ("params", "exp_avg", "exp_avg_sq", "step", "lr", "scheduler", "scaler"):
        assert r0[key] == r1[key], key
    assert r0["extra"]["rng_sha"] != r1["extra"]["rng_sha"]
    assert [r0["extra"]["pos"], r1["extra"]["pos"]] == [1000, 1007]
    # The model really was sharded (rank-local shard of 0.weight [16, 8] is [8, 8]) and trained.
    assert r0["local_shape"] == r1["local_shape"] == [8, 8]
    assert r0["step"] == [2.0] * len(PARAM_NAMES)
    assert r0["lr"] == pytest.approx(0.1 * 0.5**2)
    assert r0["scaler"]["scale"] == 4096.0  # 1024, grown after each of the 2 steps
    assert r0["saved"]["succeeded"] and r0["saved"]["bytes"] > 0
    assert r0["saved"]["path"] == r1["saved"]["path"]


def test_fsdp2_checkpoint_layout(fsdp_saved):
    save_dir, ranks = fsdp_saved
    root = Path(save_dir)
    ckpt = root / "iter_000000002"
    assert ranks[0]["saved"]["path"] == str(ckpt)
    assert (root / "latest_checkpoint.txt").read_text() == "iter_000000002\n"
    assert not [p.name for p in root.iterdir() if p.name.startswith(".")], "an uncommitted folder was left"
    subdirs = sorted(p.name for p in ckpt.iterdir() if p.is_dir())
    assert subdirs == sorted([*COMPONENTS, "ranks", "rng"])
    for name in subdirs:
        assert (ckpt / name / ".metadata").is_file(), name
    # Sharded tensors: both ranks wrote their own shards of the model.
    model_files = {f.name for f in (ckpt / "model").iterdir()}
    assert {"__0_0.distcp", "__1_0.distcp"} <= model_files

    def data_files(component: str) -> dict[str, set[str]]:
        md = dcp.FileSystemReader(str(ckpt / component)).read_metadata()
        out: dict[str, set[str]] = {}
        for index, info in md.storage_data.items():
            out.setdefault(index.fqn, set()).add(info.relative_path)
        return out

    # Replicated values (same on every rank) are written once, by rank 0.
    assert set().union(*data_files("scheduler").values()) == {"__0_0.distcp"}
    assert set().union(*data_files("trainer").values()) == {"__0_0.distcp"}
    # Rank-specific keys land in the file of the rank that owns them.
    ranks_files = data_files("ranks")
    for r in range(WORLD):
        for key in (f"rng_rank{r}", f"pos_rank{r}", f"name_rank{r}"):
            assert ranks_files[key] == {f"__{r}_0.distcp"}, key
    # A dim-0-sharded weight is stored as one chunk of rows per rank (ignoring the empty chunk
    # of 3.weight [1, 5] on rank 1).
    md = dcp.FileSystemReader(str(ckpt / "model")).read_metadata()
    chunks = {
        k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks if all(c.sizes))
        for k, v in md.state_dict_metadata.items()
    }
    assert chunks["0.weight"] == [((0, 0), (8, 8)), ((8, 0), (8, 8))]
    assert chunks["2.weight"] == [((0, 0), (3, 16)), ((3, 0), (2, 16))]
    assert chunks["3.weight"] == [((0, 0), (1, 5))]


def test_fsdp2_checkpoint_loads_into_one_unsharded_process(fsdp_saved):
    save_dir, ranks = fsdp_saved
    saved = ranks[0]
    model, optim, sched, scaler = fresh_training_objects(seed=1)
    extra = RankStateTemplate()
    for name, p in model.named_parameters():  # the load must change every parameter
        assert not torch.equal(p.detach(), as_tensor(saved["params"][name])), name

    with CheckpointEngine({"save_dir": save_dir}) as engine:
        result = engine.load(model=model, optimizer=optim, scheduler=sched, grad_scaler=scaler, extra={"ranks": extra})

    assert result.iteration == 2
    assert result.checkpoint_path == os.path.join(save_dir, "iter_000000002")
    assert result.source == "latest"
    assert set(result.components) == {*COMPONENTS, "ranks", "rng"}  # rng: 2 ranks' state into 1, with a warning
    model_report = result.report["model"]
    assert sorted(model_report.loaded) == sorted(PARAM_NAMES)
    assert not model_report.missing and not model_report.unexpected and not model_report.skipped

    params = dict(model.named_parameters())
    for name in PARAM_NAMES:
        p = params[name]
        assert type(p.data) is torch.Tensor
        assert_bit_equal(p.detach(), saved["params"][name], f"param {name}")
        assert_bit_equal(optim.state[p]["exp_avg"], saved["exp_avg"][name], f"exp_avg {name}")
        assert_bit_equal(optim.state[p]["exp_avg_sq"], saved["exp_avg_sq"][name], f"exp_avg_sq {name}")
        assert float(optim.state[p]["step"]) == 2.0
    assert optim.param_groups[0]["lr"] == saved["lr"]
    assert optim.param_groups[0]["weight_decay"] == 0.05  # the saved hyper-parameter (default: 0.01)
    assert sched.last_epoch == saved["scheduler"]["last_epoch"] == 2
    assert sched.get_last_lr() == saved["scheduler"]["_last_lr"]
    assert sched.step_size == 1 and sched.gamma == 0.5
    assert scaler.state_dict() == saved["scaler"]

    # Per-rank state: each rank's own values came back under its own keys.
    for r in range(WORLD):
        rng = extra.sd[f"rng_rank{r}"]
        assert rng.numel() == ranks[r]["extra"]["rng_numel"]
        assert hashlib.sha256(rng.numpy().tobytes()).hexdigest() == ranks[r]["extra"]["rng_sha"]
        assert extra.sd[f"pos_rank{r}"] == ranks[r]["extra"]["pos"]
        assert extra.sd[f"name_rank{r}"] == f"worker-{r}"

    # The restored model trains on: one more step runs and changes the parameters.
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(train_inputs()).pow(2).mean().backward()
    optim.step()
    assert all(not torch.equal(before[n], p.detach()) for n, p in model.named_parameters())


def test_fsdp2_checkpoint_loads_with_plain_dcp(fsdp_saved):
    save_dir, ranks = fsdp_saved
    saved = ranks[0]
    ckpt = Path(save_dir) / "iter_000000002"

    model_sd = make_model(seed=2).state_dict()
    dcp.load(model_sd, checkpoint_id=str(ckpt / "model"))
    for name in PARAM_NAMES:
        assert_bit_equal(model_sd[name], saved["params"][name], f"dcp model {name}")

    model, optim, sched, scaler = fresh_training_objects(seed=2)
    optim_sd = get_optimizer_state_dict(model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.load(optim_sd, checkpoint_id=str(ckpt / "optim"))
    for name in PARAM_NAMES:
        assert_bit_equal(optim_sd[f"state.{name}.exp_avg"], saved["exp_avg"][name], f"dcp exp_avg {name}")
        assert_bit_equal(optim_sd[f"state.{name}.exp_avg_sq"], saved["exp_avg_sq"][name], f"dcp exp_avg_sq {name}")
        assert optim_sd[f"param_groups.{name}.lr"] == saved["lr"]

    sched_sd = sched.state_dict()
    dcp.load(sched_sd, checkpoint_id=str(ckpt / "scheduler"))
    assert sched_sd["last_epoch"] == 2 and sched_sd["_last_lr"] == saved["scheduler"]["_last_lr"]

    trainer_sd = {"iteration": -1, "grad_scaler": scaler.state_dict()}
    dcp.load(trainer_sd, checkpoint_id=str(ckpt / "trainer"))
    assert trainer_sd == {"iteration": 2, "grad_scaler": saved["scaler"]}

    ranks_sd = RankStateTemplate().state_dict()
    dcp.load(ranks_sd, checkpoint_id=str(ckpt / "ranks"))
    for r in range(WORLD):
        assert hashlib.sha256(ranks_sd[f"rng_rank{r}"].numpy().tobytes()).hexdigest() == ranks[r]["extra"]["rng_sha"]
        assert ranks_sd[f"pos_rank{r}"] == ranks[r]["extra"]["pos"]


# -- 2. one-process save -> FSDP2 load (2 ranks) ------------------------------------------------


def test_single_process_checkpoint_loads_into_fsdp2(core):
    # The fixture saved the checkpoint in this process (one_process_save) before the launch.
    save_dir = str(core.dirs["fsdp_load"])
    model, optim, sched, scaler = core.one_process
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    expected_avg = {n: optim.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}

    results = core.results("fsdp_load")
    for rank in range(WORLD):
        got = results[rank][0]
        assert got["iteration"] == 7
        assert got["path"] == os.path.join(save_dir, "iter_000000007")
        assert got["components"] == [*COMPONENTS, "rng"]  # 1 rank's state into 2: rank 1 seeded from it
        assert got["loaded"] == sorted(PARAM_NAMES)
        assert got["step"] == [2.0] * len(PARAM_NAMES)
        assert got["lr"] == optim.param_groups[0]["lr"]
        assert got["last_epoch"] == sched.last_epoch == 2
        assert got["scale"] == scaler.get_scale()
        for name in PARAM_NAMES:
            what = f"rank {rank} {name}"
            param = got["params"][name]
            assert param["placements"] == ["S(0)"], what
            rows = shard0_rows(expected[name].shape[0], rank)
            assert param["local_shape"] == list(expected[name][rows].shape), what
            assert_bit_equal(as_tensor(param["full"]), expected[name], f"{what} full")
            assert_bit_equal(
                as_tensor(param["local"]).reshape(expected[name][rows].shape), expected[name][rows], f"{what} local"
            )
            avg = got["exp_avg"][name]
            assert_bit_equal(as_tensor(avg["full"]), expected_avg[name], f"{what} exp_avg full")
            assert_bit_equal(
                as_tensor(avg["local"]).reshape(expected_avg[name][rows].shape),
                expected_avg[name][rows],
                f"{what} exp_avg local",
            )
    # Uneven and empty shards were exercised: 2.weight splits 3 + 2 rows, 3.weight 1 + 0.
    assert results[1][0]["params"]["2.weight"]["local_shape"] == [2, 16]
    assert results[1][0]["params"]["3.weight"]["local_shape"] == [0, 5]


# -- 3. 2-rank save (FSDP2) -> 2-rank load with other placements --------------------------------


def test_fsdp2_checkpoint_reshards_into_other_placements(core):
    results = core.results("reshard")
    expected_placements = {
        "0.weight": ["S(1)"],
        "0.bias": ["S(0)"],
        "2.weight": None,
        "2.bias": None,
        "3.weight": ["S(1)"],
        "3.bias": ["R"],
    }
    saved = results[0][0]
    assert results[1][0] == saved
    for rank in range(WORLD):
        got = results[rank][1]
        assert got["iteration"] == 5
        assert got["components"] == ["model", "optim", "trainer", "rng"]
        assert got["loaded"] == sorted(PARAM_NAMES)
        assert got["optim_loaded"] > 0
        for name in PARAM_NAMES:
            what = f"rank {rank} {name}"
            p = got["params"][name]
            assert p["placements"] == expected_placements[name], what
            assert p["is_dtensor"] == (expected_placements[name] is not None), what
            assert p["state_placements"] == expected_placements[name], what
            assert p["step"] == 2.0, what
            full = as_tensor(saved["saved_params"][name])
            full_avg = as_tensor(saved["saved_exp_avg"][name])
            assert_bit_equal(as_tensor(p["full"]), full, f"{what} full")
            assert_bit_equal(as_tensor(p["exp_avg_full"]), full_avg, f"{what} exp_avg full")
            if expected_placements[name] == ["S(1)"]:
                cols = shard0_rows(full.shape[1], rank)
                want, want_avg = full[:, cols], full_avg[:, cols]
            elif expected_placements[name] == ["S(0)"]:
                rows = shard0_rows(full.shape[0], rank)
                want, want_avg = full[rows], full_avg[rows]
            else:  # plain tensor or Replicate(): every rank holds all of it
                want, want_avg = full, full_avg
            assert_bit_equal(as_tensor(p["local"]).reshape(want.shape), want, f"{what} local")
            assert_bit_equal(as_tensor(p["exp_avg_local"]).reshape(want_avg.shape), want_avg, f"{what} exp_avg local")
    # The 3.weight [1, 5] columns split unevenly: 3 on rank 0, 2 on rank 1.
    assert [len(results[r][1]["params"]["3.weight"]["local"][0]) for r in range(WORLD)] == [3, 2]


# -- 4. strict mismatch fails on every rank -----------------------------------------------------


def test_strict_mismatch_raises_on_every_rank(core):
    # The ranks keep the default collective_timeout_s (600 s): a rank left waiting for another
    # would outlast the launch's hang guard, so finishing at all shows that nobody waited.
    results = core.results("strict")
    for rank in range(WORLD):
        got = results[rank][0]
        what = f"rank {rank}"
        assert got["raised"] == "LoadStrictnessError", what
        assert got["is_strictness"] and got["component"] == "model", what
        # Every problem is collected into one error: 2 missing keys and 3 shape mismatches.
        assert got["missing"] == ["4.bias", "4.weight"], what
        assert [m.split(":")[0] for m in got["mismatched"]] == ["2.bias", "2.weight", "3.weight"], what
        assert "stored float32[5, 16], target float32[6, 16]" in got["mismatched"][1], what
        msg = got["message"]
        assert "'model'" in msg and "2.weight" in msg and "3.weight" in msg and "4.bias" in msg, what
        assert "strict: false" in msg, what  # tells how to fix it
        assert got["untouched"], f"{what}: the failed strict load changed the target model"
        assert got["recovered_iteration"] == 1 and got["recovered_equal"], what


# -- 5. one rank fails while planning: every rank raises, nobody hangs ------------------------


def test_one_rank_failures_raise_on_every_rank(core):
    save_dir = core.dirs["rank_failure"]
    # As in the strict test: with the default 600 s collective timeout, finishing within the
    # launch's hang guard shows that no rank waited for the one that failed.
    results = core.results("rank_failure")
    for rank in range(WORLD):
        got = results[rank][0]
        what = f"rank {rank}"
        assert got["plugins"] == ["te_extra_state", "fail_plan_on_rank"], what

        load = got["load"]
        assert load["raised"] == "CheckpointLoadError", f"{what}: {load}"
        assert "planned pre_load_plan failure on rank 1 (model)" in load["message"], what
        assert "'model'" in load["message"] and "rank(s) [1]" in load["message"], what

        save = got["save"]
        assert save["raised"] == "CheckpointSaveError", f"{what}: {save}"
        assert "iteration 2" in save["message"], what
        assert "planned remap_keys failure on rank 1 (model)" in save["message"], what
        # Nothing of the failed save is left or named latest.
        assert save["listing"] == ["iter_000000001", "latest_checkpoint.txt"], what
        assert save["latest"] == "iter_000000001\n", what

        # A write provider that raised on rank 1 alone, outside any collective: rank 0 is told at
        # its next collective instead of waiting out the 600 s timeout (which the launch's hang
        # guard is below), and the same engine's next save succeeds on both ranks.
        write = got["write"]
        if rank == 1:
            assert write["raised"] == "CheckpointSaveError", f"{what}: {write}"
        else:
            assert write["raised"] == "RankFailedError", f"{what}: {write}"
            assert "rank 1 failed this save on its own" in write["message"], what
        assert "No space left on device" in write["message"], what
        # (rank 0 removes the failed save's partial folder: rank 1 may list it before then)
        assert not [n for n in write["listing"] if n.startswith("iter_") or n == "latest_checkpoint.txt"], what
        assert got["write_again"]["raised"] is None and got["write_again"]["latest"] == "iter_000000001\n", what

        # A pre_load_plan that skips 0.bias on rank 1 only: both ranks refuse before reading.
        diverge = got["diverge"]
        assert diverge["raised"] == "CheckpointDisagreementError", f"{what}: {diverge}"
        assert "the ranks planned this load differently" in diverge["message"], what
        assert "'0.bias': rank 0 load into '0.bias'; rank 1 skip into '0.bias'" in diverge["message"], what
        assert diverge["unchanged"], what

        # The ranks are still in step: a load right after both failures succeeds.
        assert got["recover"] == {"iteration": 1, "equal": True}, what
    # The rank that did not fail is told which rank did.
    assert "rank 1 failed" in results[0][0]["save"]["message"]
    assert sorted(os.listdir(save_dir)) == ["iter_000000001", "latest_checkpoint.txt"]
