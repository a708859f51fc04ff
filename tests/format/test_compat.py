"""``ckpt_engine.compat.DistributedCheckpointer``: the original checkpointer's surface on the engine.

Real DCP checkpoints on disk under ``tmp_path``, single process, no mocks of torch.
"""

from __future__ import annotations

import copy
import importlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

import ckpt_engine.compat as compat
from ckpt_engine import CheckpointSaveError, CkptEngineError, ConfigError, LoadStrictnessError
from ckpt_engine.compat import DistributedCheckpointer, build_engine_config
from ckpt_engine.plugin_manager import installed_plugins
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal

KEYS = {"model", "optim", "scheduler", "trainer"}
FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


# -- helpers ---------------------------------------------------------------------------------


@dataclass
class Run:
    model: nn.Sequential
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler

    def args(
        self,
    ) -> tuple[nn.Sequential, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler]:
        return self.model, self.optimizer, self.scheduler, self.scaler


def make_run(seed: int, *, in_features: int = 4, extra_layer: bool = False, steps: int = 0) -> Run:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(in_features, 8), nn.ReLU(), nn.Linear(8, 3)]
    if extra_layer:
        layers.append(nn.Linear(3, 3))
    model = nn.Sequential(*layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    run = Run(model, optimizer, scheduler, scaler)
    for _ in range(steps):
        loss = model(torch.randn(5, in_features)).pow(2).mean()
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        scheduler.step()
    return run


def param(run: Run, name: str) -> torch.Tensor:
    return run.model.get_parameter(name)


def assert_equal_nested(a: Any, b: Any, where: str = "") -> None:
    """Bit-exact equality of nested state (tensors, dicts, lists, plain values)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{where}: {sorted(map(str, a))} != {sorted(map(str, b))}"
        for k in a:
            assert_equal_nested(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_equal_nested(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def snapshot(run: Run) -> dict[str, Any]:
    return {
        "model": copy.deepcopy(run.model.state_dict()),
        "optim": copy.deepcopy(run.optimizer.state_dict()),
        "scheduler": copy.deepcopy(run.scheduler.state_dict()),
        "scaler": copy.deepcopy(run.scaler.state_dict()),
    }


def make_configs(kind: str, path_local: Path, **fields: Any) -> tuple[Any, Any]:
    job = {"path_local": str(path_local)}
    if kind == "namespace":
        return SimpleNamespace(**fields), SimpleNamespace(**job)
    return dict(fields), job


def checkpointer(tmp_path: Path, kind: str = "namespace", job: str = "job", **fields: Any) -> DistributedCheckpointer:
    callbacks = fields.pop("callbacks", None)
    disable_async = fields.pop("disable_async", False)
    cfg, job_cfg = make_configs(kind, tmp_path / job, **fields)
    return DistributedCheckpointer(cfg, job_cfg, callbacks=callbacks, disable_async=disable_async)


def read_latest_file(save_dirname: str) -> str | None:
    path = os.path.join(save_dirname, "latest_checkpoint.txt")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


class Recorder:
    """Callbacks with the original's signatures; records the call form and when it happened."""

    def __init__(self, save_dirname: str | None = None) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.save_dirname = save_dirname
        self.latest_at_success: str | None = None

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def on_save_checkpoint_start(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("on_save_checkpoint_start", args, kwargs))

    def on_save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("on_save_checkpoint", args, kwargs))

    def on_save_checkpoint_success(self, *args: Any, **kwargs: Any) -> None:
        if self.save_dirname is not None:
            self.latest_at_success = read_latest_file(self.save_dirname)
        self.calls.append(("on_save_checkpoint_success", args, kwargs))

    def on_save_checkpoint_end(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("on_save_checkpoint_end", args, kwargs))

    def on_load_checkpoint_start(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("on_load_checkpoint_start", args, kwargs))

    def on_load_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("on_load_checkpoint", args, kwargs))

    def on_load_checkpoint_end(self, *args: Any, **kwargs: Any) -> None:
        self.calls.append(("on_load_checkpoint_end", args, kwargs))


def write_original_checkpoint(save_dir: str, run: Run, iteration: int) -> str:
    """What the original checkpointer wrote: plain DCP per component, no extra files."""
    ckpt = os.path.join(save_dir, f"iter_{iteration:09}")
    to_save = {
        "model": get_model_state_dict(run.model),
        "optim": get_optimizer_state_dict(run.model, run.optimizer, options=FLAT),
        "scheduler": run.scheduler.state_dict(),
        "trainer": {"grad_scaler": run.scaler.state_dict(), "iteration": iteration},
    }
    for key, sd in to_save.items():
        dcp.save(
            sd,
            storage_writer=FileSystemWriter(os.path.join(ckpt, key)),
            planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True),
        )
    with open(os.path.join(save_dir, "latest_checkpoint.txt"), "w", encoding="utf-8") as f:
        f.write(f"iter_{iteration:09}\n")
    return ckpt


@pytest.fixture(params=["namespace", "dict"])
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


# -- save and resume -------------------------------------------------------------------------


def test_save_writes_original_layout_and_fresh_checkpointer_resumes_bit_exact(tmp_path: Path, kind: str) -> None:
    run = make_run(0, steps=3)
    saved = snapshot(run)
    ckpt = checkpointer(tmp_path, kind)
    assert ckpt.save_dirname == f"{tmp_path / 'job'}/checkpoints"
    ckpt.save(*run.args(), 10)
    ckpt.finalize()

    iter_dir = tmp_path / "job" / "checkpoints" / "iter_000000010"
    for key in KEYS:
        assert (iter_dir / key / ".metadata").is_file(), key
    assert read_latest_file(ckpt.save_dirname) == "iter_000000010\n"

    # The engine's checkpoint reads back with plain DCP, as the original would read it.
    plain = get_model_state_dict(make_run(5).model)
    dcp.load(plain, checkpoint_id=str(iter_dir / "model"))
    assert_equal_nested(saved["model"], plain)

    fresh = make_run(1)
    assert not torch.equal(param(fresh, "0.weight"), saved["model"]["0.weight"])
    ckpt2 = checkpointer(tmp_path, kind)
    assert ckpt2.load(*fresh.args()) == 10
    assert_equal_nested(saved, snapshot(fresh))
    assert ckpt2.last_load_result is not None
    assert ckpt2.last_load_result.source == "latest"
    assert ckpt2.last_load_result.checkpoint_path == str(iter_dir)
    assert set(ckpt2.last_load_result.components) == KEYS | {"rng"}  # rng: on by default
    ckpt2.finalize()


def test_checkpoint_written_by_plain_dcp_in_original_layout_loads(tmp_path: Path, kind: str) -> None:
    run = make_run(0, steps=2)
    saved = snapshot(run)
    save_dir = str(tmp_path / "job" / "checkpoints")
    os.makedirs(save_dir)
    path = write_original_checkpoint(save_dir, run, 7)

    fresh = make_run(3)
    ckpt = checkpointer(tmp_path, kind)
    assert ckpt.keys_to_resume_during_load() == (KEYS, path)
    assert ckpt.load(*fresh.args()) == 7
    assert_equal_nested(saved, snapshot(fresh))

    # The same checkpoint through load_path (another job, no latest_checkpoint.txt).
    other = make_run(4)
    by_path = checkpointer(tmp_path, kind, job="job2", load_path=path, load_training_state=True)
    assert by_path.load(*other.args()) == 7
    assert_equal_nested(saved, snapshot(other))


def test_resumed_training_continues_identically(tmp_path: Path) -> None:
    """Resuming mid-run gives the same weights as never stopping (optimizer, scheduler, scaler state)."""
    reference = make_run(0, steps=2)
    ckpt = checkpointer(tmp_path)
    ckpt.save(*reference.args(), 2)
    resumed = make_run(9)
    assert checkpointer(tmp_path).load(*resumed.args()) == 2
    for run in (reference, resumed):
        torch.manual_seed(42)
        for _ in range(2):
            loss = run.model(torch.randn(5, 4)).pow(2).mean()
            run.optimizer.zero_grad()
            run.scaler.scale(loss).backward()
            run.scaler.step(run.optimizer)
            run.scaler.update()
            run.scheduler.step()
    assert_equal_nested(snapshot(reference), snapshot(resumed))


def test_load_without_checkpoint_starts_from_scratch(tmp_path: Path) -> None:
    run = make_run(0)
    before = snapshot(run)
    ckpt = checkpointer(tmp_path)
    assert ckpt.keys_to_resume_during_load() == (set(), None)
    assert ckpt.load(*run.args()) == 0
    assert ckpt.last_load_result is not None and ckpt.last_load_result.source == "scratch"
    assert_equal_nested(before, snapshot(run))


# -- callbacks -------------------------------------------------------------------------------


def test_callbacks_receive_the_original_calls_in_order(tmp_path: Path) -> None:
    run = make_run(0, steps=1)
    save_dirname = f"{tmp_path / 'job'}/checkpoints"
    rec = Recorder(save_dirname)
    ckpt = checkpointer(tmp_path, callbacks=rec)
    ckpt.save(*run.args(), 10)

    assert rec.names() == [
        "on_save_checkpoint_start",
        "on_save_checkpoint",
        "on_save_checkpoint_success",
        "on_save_checkpoint_end",
    ]
    (_, start_args, start_kw), (_, sd_args, sd_kw), (_, ok_args, ok_kw), (_, end_args, end_kw) = rec.calls
    assert start_args == (run.model, 10) and start_kw == {}
    assert sd_args == (run.model,) and set(sd_kw) == {"state_dict"}
    to_save = sd_kw["state_dict"]
    assert list(to_save) == ["model", "optim", "scheduler", "trainer"]
    for key, (state, output_dirname) in to_save.items():
        assert output_dirname == os.path.join(save_dirname, "iter_000000010", key)
        assert isinstance(state, dict)
    assert_equal_nested(to_save["model"][0], get_model_state_dict(run.model))
    assert_equal_nested(to_save["optim"][0], get_optimizer_state_dict(run.model, run.optimizer, options=FLAT))
    assert_equal_nested(to_save["scheduler"][0], run.scheduler.state_dict())
    assert_equal_nested(to_save["trainer"][0], {"grad_scaler": run.scaler.state_dict(), "iteration": 10})
    assert ok_args == () and set(ok_kw) == {"iteration", "elapsed_time"} and ok_kw["iteration"] == 10
    assert isinstance(ok_kw["elapsed_time"], float) and ok_kw["elapsed_time"] > 0
    assert rec.latest_at_success == "iter_000000010\n"  # success means committed
    assert end_args == () and end_kw == {"model": None, "iteration": 10}

    rec.calls.clear()
    fresh = make_run(1)
    ckpt2 = checkpointer(tmp_path, callbacks=rec)
    assert ckpt2.load(*fresh.args()) == 10
    assert rec.names() == ["on_load_checkpoint_start", "on_load_checkpoint", "on_load_checkpoint_end"]
    (_, ls_args, ls_kw), (_, l_args, l_kw), (_, le_args, le_kw) = rec.calls
    assert ls_args == (fresh.model,) and ls_kw == {}
    assert l_args == (fresh.model,) and set(l_kw) == {"state_dict"}
    assert_equal_nested(l_kw["state_dict"], get_model_state_dict(run.model))  # the loaded weights
    assert le_args == (fresh.model,)
    assert le_kw == {"iteration": 10, "checkpoint_path": os.path.join(save_dirname, "iter_000000010")}


def test_load_from_scratch_skips_on_load_checkpoint(tmp_path: Path) -> None:
    rec = Recorder()
    run = make_run(0)
    assert checkpointer(tmp_path, callbacks=rec).load(run.model) == 0
    assert rec.names() == ["on_load_checkpoint_start", "on_load_checkpoint_end"]
    assert rec.calls[1][2] == {"iteration": 0, "checkpoint_path": None}


def test_callbacks_object_lacking_methods_gets_only_what_it_has(tmp_path: Path) -> None:
    class Partial:
        def __init__(self) -> None:
            self.ends: list[tuple[str, int]] = []

        def on_save_checkpoint_end(self, model: Any = None, iteration: int = 0) -> None:
            self.ends.append(("save", iteration))

        def on_load_checkpoint_end(self, model: Any, iteration: int = 0, checkpoint_path: str | None = None) -> None:
            self.ends.append(("load", iteration))

    run = make_run(0, steps=1)
    cb = Partial()
    ckpt = checkpointer(tmp_path, callbacks=cb)
    ckpt.save(*run.args(), 3)
    assert checkpointer(tmp_path, callbacks=cb).load(*make_run(1).args()) == 3
    assert cb.ends == [("save", 3), ("load", 3)]


def test_failed_save_raises_and_never_reports_success(tmp_path: Path) -> None:
    rec = Recorder()
    ckpt = checkpointer(tmp_path, callbacks=rec)
    # A file where the checkpoint folder should be, once the engine has started (at the start,
    # the engine refuses it with SaveDirError).
    (tmp_path / "job").mkdir(exist_ok=True)
    (tmp_path / "job" / "checkpoints").write_text("a file where the checkpoint folder should be")
    with pytest.raises(CheckpointSaveError, match="iteration 5"):
        ckpt.save(*make_run(0).args(), 5)
    # Unlike the original's sync path, no on_save_checkpoint_success for a failed save.
    assert rec.names() == ["on_save_checkpoint_start", "on_save_checkpoint"]


# -- resume decision -------------------------------------------------------------------------


def _saved_checkpoint(tmp_path: Path, iteration: int = 10, job: str = "src") -> tuple[Run, str]:
    run = make_run(0, steps=3)
    ckpt = checkpointer(tmp_path, job=job)
    ckpt.save(*run.args(), iteration)
    ckpt.finalize()
    return run, os.path.join(ckpt.save_dirname, f"iter_{iteration:09}")


def test_keys_latest_checkpoint_wins_over_load_path(tmp_path: Path) -> None:
    _, other = _saved_checkpoint(tmp_path, 4, job="other")
    _, path = _saved_checkpoint(tmp_path, 10, job="job")
    ckpt = checkpointer(tmp_path, load_path=other)
    assert ckpt.keys_to_resume_during_load() == (KEYS, path)
    assert ckpt.load(*make_run(1).args()) == 10


def test_keys_load_path_loads_model_only(tmp_path: Path) -> None:
    run, path = _saved_checkpoint(tmp_path)
    ckpt = checkpointer(tmp_path, load_path=path)
    assert ckpt.keys_to_resume_during_load() == ({"model"}, path)
    fresh = make_run(1)
    before = snapshot(fresh)
    assert ckpt.load(*fresh.args()) == 0  # trainer not resumed: iteration 0, as in the original
    after = snapshot(fresh)
    assert_equal_nested(run.model.state_dict(), after["model"])
    assert_equal_nested(before["optim"], after["optim"])
    assert_equal_nested(before["scheduler"], after["scheduler"])
    assert_equal_nested(before["scaler"], after["scaler"])


def test_keys_load_training_state_loads_everything(tmp_path: Path) -> None:
    run, path = _saved_checkpoint(tmp_path)
    ckpt = checkpointer(tmp_path, load_path=path, load_training_state=True)
    assert ckpt.keys_to_resume_during_load() == (KEYS, path)
    fresh = make_run(1)
    assert ckpt.load(*fresh.args()) == 10
    assert_equal_nested(snapshot(run), snapshot(fresh))


def test_keys_only_load_scheduler_state(tmp_path: Path) -> None:
    run, path = _saved_checkpoint(tmp_path)
    ckpt = checkpointer(tmp_path, load_path=path, only_load_scheduler_state=True)
    assert ckpt.keys_to_resume_during_load() == ({"model", "scheduler"}, path)
    fresh = make_run(1)
    before = snapshot(fresh)
    assert ckpt.load(*fresh.args()) == 0
    after = snapshot(fresh)
    assert_equal_nested(run.scheduler.state_dict(), after["scheduler"])
    assert_equal_nested(run.model.state_dict(), after["model"])
    assert_equal_nested(before["optim"], after["optim"])


def test_load_training_state_takes_precedence_over_only_load_scheduler_state(tmp_path: Path) -> None:
    _, path = _saved_checkpoint(tmp_path)
    ckpt = checkpointer(tmp_path, load_path=path, load_training_state=True, only_load_scheduler_state=True)
    assert ckpt.keys_to_resume_during_load() == (KEYS, path)
    assert ckpt.engine.config.load_training_state and not ckpt.engine.config.only_load_scheduler_state
    assert ckpt.load(*make_run(1).args()) == 10


def test_keys_not_to_resume(tmp_path: Path) -> None:
    run, path = _saved_checkpoint(tmp_path, job="job")
    ckpt = checkpointer(tmp_path, keys_not_to_resume=["optim", "trainer"])
    assert ckpt.keys_to_resume_during_load() == ({"model", "scheduler"}, path)
    fresh = make_run(1)
    before = snapshot(fresh)
    assert ckpt.load(*fresh.args()) == 0  # trainer not resumed
    after = snapshot(fresh)
    assert_equal_nested(run.model.state_dict(), after["model"])
    assert_equal_nested(run.scheduler.state_dict(), after["scheduler"])
    assert_equal_nested(before["optim"], after["optim"])
    assert_equal_nested(before["scaler"], after["scaler"])


def test_invalid_key_not_to_resume_is_a_config_error(tmp_path: Path, kind: str) -> None:
    with pytest.raises(ConfigError, match="'optimizer'"):
        checkpointer(tmp_path, kind, keys_not_to_resume=["model", "optimizer"]).keys_to_resume_during_load()


def test_pt_load_path_means_from_scratch(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pt = tmp_path / "pretrained.pt"
    torch.save(make_run(7).model.state_dict(), pt)
    with caplog.at_level(logging.INFO, logger="ckpt_engine.compat"):
        ckpt = checkpointer(tmp_path, load_path=str(pt), load_training_state=True)
    assert any(".pt" in r.getMessage() and "scratch" in r.getMessage() for r in caplog.records)
    assert ckpt.engine.config.load_path is None
    assert ckpt.keys_to_resume_during_load() == (set(), None)
    run = make_run(0)
    before = snapshot(run)
    assert ckpt.load(*run.args()) == 0
    assert_equal_nested(before, snapshot(run))


def test_pth_load_path_loads_a_plain_model_state_dict(tmp_path: Path) -> None:
    source = make_run(7)
    pth = tmp_path / "weights.pth"
    torch.save(source.model.state_dict(), pth)
    ckpt = checkpointer(tmp_path, load_path=str(pth))
    assert ckpt.keys_to_resume_during_load() == ({"model"}, str(pth))
    fresh = make_run(0)
    assert ckpt.load(*fresh.args()) == 0
    assert_equal_nested(source.model.state_dict(), fresh.model.state_dict())
    assert ckpt.last_load_result is not None and ckpt.last_load_result.source == "pth"


# -- strictness ------------------------------------------------------------------------------


def test_strict_resume_false_tolerates_and_reports_a_missing_key(tmp_path: Path) -> None:
    run, _ = _saved_checkpoint(tmp_path, job="job")
    bigger = make_run(1, extra_layer=True)
    new_layer = param(bigger, "3.weight").detach().clone()
    ckpt = checkpointer(tmp_path)
    assert ckpt.load(bigger.model) == 10
    assert torch.equal(param(bigger, "0.weight"), param(run, "0.weight"))
    assert torch.equal(param(bigger, "3.weight"), new_layer)
    assert ckpt.last_load_result is not None
    assert set(ckpt.last_load_result.report["model"].missing) == {"3.weight", "3.bias"}


def test_strict_resume_true_raises_on_a_missing_key(tmp_path: Path) -> None:
    _saved_checkpoint(tmp_path, job="job")
    bigger = make_run(1, extra_layer=True)
    before = copy.deepcopy(bigger.model.state_dict())
    with pytest.raises(LoadStrictnessError) as info:
        checkpointer(tmp_path, strict_resume=True).load(bigger.model)
    assert set(info.value.missing) == {"3.weight", "3.bias"}
    assert_equal_nested(before, bigger.model.state_dict())  # nothing half-loaded


def test_strict_resume_false_skips_a_size_mismatch(tmp_path: Path) -> None:
    run, _ = _saved_checkpoint(tmp_path, job="job")
    wider = make_run(1, in_features=6)
    initial = param(wider, "0.weight").detach().clone()
    ckpt = checkpointer(tmp_path)
    assert ckpt.load(wider.model) == 10
    assert torch.equal(param(wider, "0.weight"), initial)
    assert torch.equal(param(wider, "0.bias"), param(run, "0.bias"))
    assert ckpt.last_load_result is not None
    assert "0.weight" in ckpt.last_load_result.report["model"].skipped


# -- plugins ---------------------------------------------------------------------------------


def test_dcp_allow_mismatched_size_loads_the_overlap(tmp_path: Path) -> None:
    run, _ = _saved_checkpoint(tmp_path, job="job")
    wider = make_run(1, in_features=6)
    initial = param(wider, "0.weight").detach().clone()
    ckpt = checkpointer(tmp_path, dcp_allow_mismatched_size=True, strict_resume=True)
    assert "size_mismatch" in ckpt.engine.plugin_names
    assert ckpt.load(wider.model) == 10
    weight = param(wider, "0.weight")
    assert torch.equal(weight[:, :4], param(run, "0.weight"))
    assert torch.equal(weight[:, 4:], initial[:, 4:])
    assert torch.equal(param(wider, "2.weight"), param(run, "2.weight"))
    assert ckpt.last_load_result is not None
    overlap = ckpt.last_load_result.report["model"].overlap["0.weight"]
    assert (overlap.saved_shape, overlap.target_shape) == ((8, 4), (8, 6))


class Diffusion(nn.Module):
    def __init__(self, seed: int, ema: bool) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Linear(4, 4)
        if ema:
            self.net_ema = nn.Linear(4, 4)


def test_load_ema_to_reg(tmp_path: Path) -> None:
    trained = Diffusion(0, ema=True)
    assert not torch.equal(trained.net.weight, trained.net_ema.weight)
    src = checkpointer(tmp_path, job="src")
    src.save(trained, None, None, None, 20)
    path = os.path.join(src.save_dirname, "iter_000000020")

    # EMA disabled in the new model: net.* is read from net_ema.*.
    plain = Diffusion(1, ema=False)
    ckpt = checkpointer(tmp_path, load_path=path, load_ema_to_reg=True, strict_resume=True)
    assert "ema" in ckpt.engine.plugin_names
    ckpt.load(plain)
    assert_equal_nested(dict(trained.net_ema.state_dict()), dict(plain.net.state_dict()))
    assert ckpt.last_load_result is not None
    assert ckpt.last_load_result.report["model"].renamed == {"net.weight": "net_ema.weight", "net.bias": "net_ema.bias"}

    # EMA enabled: both copies come from net_ema.*.
    with_ema = Diffusion(2, ema=True)
    checkpointer(tmp_path, load_path=path, load_ema_to_reg=True).load(with_ema)
    assert_equal_nested(dict(trained.net_ema.state_dict()), dict(with_ema.net.state_dict()))
    assert_equal_nested(dict(trained.net_ema.state_dict()), dict(with_ema.net_ema.state_dict()))

    # Control: without the flag, net.* is net.*.
    control = Diffusion(3, ema=False)
    checkpointer(tmp_path, load_path=path).load(control)
    assert_equal_nested(dict(trained.net.state_dict()), dict(control.net.state_dict()))


# -- async -----------------------------------------------------------------------------------

FAKE_ASYNC_MODULE = '''
"""Test stand-in for an async staging plugin: copies the state, writes in a background thread."""
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp

from ckpt_engine import StagedState, WriteResult, hookimpl

RELEASE = threading.Event()
_POOL = ThreadPoolExecutor(1, thread_name_prefix="compat-test-writer")


def _copy(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _copy(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_copy(v) for v in obj]
    return copy.deepcopy(obj)


class FakeAsyncPlugin:
    @hookimpl
    def stage(self, ctx, state):
        return StagedState(components={k: _copy(v) for k, v in state.items()}, is_copy=True)

    @hookimpl
    def write(self, ctx, state_dict):
        def run():
            if not RELEASE.wait(30):
                raise TimeoutError("the test never released the write")
            dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(ctx.path), planner=ctx.planner)
            return WriteResult(component=ctx.component, bytes_written=0, seconds=0.0)

        return _POOL.submit(run)
'''


@pytest.fixture
def fake_async_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Install an async plugin under a test-only entry-point name and point compat at it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "compat_test_async_mod.py").write_text(FAKE_ASYNC_MODULE)
    dist = site / "compat_test_async-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: compat-test-async\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[ckpt_engine]\ncompat_test_async = compat_test_async_mod:FakeAsyncPlugin\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setattr(compat, "ASYNC_PLUGIN", "compat_test_async")
    assert "compat_test_async" in installed_plugins()
    module = importlib.import_module("compat_test_async_mod")
    module.RELEASE.clear()
    yield module
    module.RELEASE.set()


def test_async_save_reports_success_only_when_committed(tmp_path: Path, fake_async_plugin: Any) -> None:
    run = make_run(0, steps=1)
    saved = snapshot(run)
    save_dirname = f"{tmp_path / 'job'}/checkpoints"
    rec = Recorder(save_dirname)
    ckpt = checkpointer(tmp_path, dcp_async_mode_enabled=True, callbacks=rec)
    assert "compat_test_async" in ckpt.engine.plugin_names
    handle = ckpt.save(*run.args(), 10)
    assert not handle.done()
    assert read_latest_file(save_dirname) is None
    assert rec.names() == ["on_save_checkpoint_start", "on_save_checkpoint", "on_save_checkpoint_end"]

    fake_async_plugin.RELEASE.set()
    ckpt.finalize()
    assert rec.names()[-1] == "on_save_checkpoint_success"
    assert rec.calls[-1][2]["iteration"] == 10
    assert rec.latest_at_success == "iter_000000010\n"

    fresh = make_run(1)
    assert checkpointer(tmp_path).load(*fresh.args()) == 10
    assert_equal_nested(saved, snapshot(fresh))


def test_disable_async_saves_synchronously_even_when_the_plugin_is_installed(
    tmp_path: Path, fake_async_plugin: Any
) -> None:
    ckpt = checkpointer(tmp_path, dcp_async_mode_enabled=True, disable_async=True)
    assert "compat_test_async" not in ckpt.engine.plugin_names
    handle = ckpt.save(*make_run(0).args(), 1)
    assert handle.done()  # the fake writer was never used: its writes block until released
    assert read_latest_file(ckpt.save_dirname) == "iter_000000001\n"


def test_async_requested_without_plugin_warns_once_and_saves_synchronously(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(compat, "ASYNC_PLUGIN", "compat_test_not_installed")
    run = make_run(0)
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        ckpt = checkpointer(tmp_path, dcp_async_mode_enabled=True)
        h1 = ckpt.save(*run.args(), 1)
        h2 = ckpt.save(*run.args(), 2)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "synchronously" in warnings[0].getMessage()
    assert h1.done() and h2.done()
    assert read_latest_file(ckpt.save_dirname) == "iter_000000002\n"


# -- configuration ---------------------------------------------------------------------------


def test_config_mapping_from_namespace_and_dict_agree(tmp_path: Path) -> None:
    fields = {
        "load_path": "/ckpts/run1/iter_000000100",
        "load_training_state": False,
        "only_load_scheduler_state": True,
        "strict_resume": True,
        "keys_not_to_resume": ["optim"],
        "load_ema_to_reg": True,
        "dcp_allow_mismatched_size": True,
        "dcp_async_mode_enabled": False,
        "verbose": True,
    }
    configs = [make_configs(kind, tmp_path / "job", **fields) for kind in ("namespace", "dict")]
    a, b = (build_engine_config(cfg, job) for cfg, job in configs)
    assert a == b
    assert a.save_dir == f"{tmp_path / 'job'}/checkpoints"
    assert a.load_path == "/ckpts/run1/iter_000000100"
    assert a.strict is True
    assert a.only_load_scheduler_state and not a.load_training_state
    assert a.keys_not_to_resume == ("optim",)
    assert [p.name for p in a.plugins] == ["te_extra_state", "ema", "size_mismatch"]
    assert a.plugins[2].options == {"policy": "overlap"}


def test_missing_fields_take_the_original_defaults(tmp_path: Path, kind: str) -> None:
    cfg, job = make_configs(kind, tmp_path / "job")
    config = build_engine_config(cfg, job)
    assert config.strict is False  # the original's loads were non-strict
    assert config.load_path is None
    assert not config.load_training_state and not config.only_load_scheduler_state
    assert config.keys_not_to_resume == ()
    assert [p.name for p in config.plugins] == ["te_extra_state"]


def _credentials_file(tmp_path: Path, **doc: Any) -> str:
    path = tmp_path / "s3_credentials.json"
    path.write_text(json.dumps(doc))
    return str(path)


def test_object_store_fields_map_to_urls_and_storage(tmp_path: Path, kind: str) -> None:
    creds = _credentials_file(
        tmp_path, aws_access_key_id="AKIA1", aws_secret_access_key="s3cr3t", endpoint_url="http://e", region_name="r"
    )
    store: Any = {"enabled": True, "bucket": "ckpts", "credentials": creds}
    if kind == "namespace":
        store = SimpleNamespace(**store)
    cfg, job = make_configs(kind, tmp_path / "job", save_to_object_store=store)
    job = (
        SimpleNamespace(path_local=str(tmp_path / "job"), path="proj/exp1")
        if kind == "namespace"
        else {
            "path_local": str(tmp_path / "job"),
            "path": "proj/exp1",
        }
    )
    config = build_engine_config(cfg, job)
    # As in the original: saves go to the bucket; without load_from_object_store, loads stay local.
    assert config.save_dir == "s3://ckpts/proj/exp1/checkpoints"
    assert config.load_dir == f"{tmp_path / 'job'}/checkpoints"
    assert config.storage.endpoint_url == "http://e" and config.storage.region == "r"
    assert config.storage.secret_access_key is not None
    assert config.storage.secret_access_key.get_secret_value() == "s3cr3t" and "s3cr3t" not in repr(config)

    cfg, _ = make_configs(kind, tmp_path / "job", save_to_object_store=store, load_from_object_store=store)
    both = build_engine_config(cfg, job)
    assert both.save_dir == "s3://ckpts/proj/exp1/checkpoints" and both.load_dir is None


@pytest.mark.parametrize(
    ("section", "creds", "message"),
    [
        ({"enabled": True, "bucket": ""}, None, "bucket must be a bucket name"),
        ({"enabled": True, "bucket": "a/b"}, None, "bucket must be a bucket name"),
        ({"enabled": True, "bucket": "b", "credentials": "/nonexistent/creds.json"}, None, "cannot read"),
        ({"enabled": True, "bucket": "b"}, {"aws_secret": "x"}, r"unknown key\(s\) \['aws_secret'\]"),
    ],
)
def test_bad_object_store_fields_are_config_errors(
    tmp_path: Path, section: dict[str, Any], creds: dict[str, Any] | None, message: str
) -> None:
    if creds is not None:
        section = {**section, "credentials": _credentials_file(tmp_path, **creds)}
    cfg, _ = make_configs("dict", tmp_path / "job", save_to_object_store=section)
    with pytest.raises(ConfigError, match=message):
        build_engine_config(cfg, {"path_local": str(tmp_path / "job"), "path": "p"})
    cfg, _ = make_configs("dict", tmp_path / "job", save_to_object_store={"enabled": True, "bucket": "b"})
    with pytest.raises(ConfigError, match=r"config_job\.path"):
        build_engine_config(cfg, {"path_local": str(tmp_path / "job")})
    checkpointer(tmp_path, "dict", "job", save_to_object_store={"enabled": False})  # disabled: local


def test_compat_saves_to_and_resumes_from_s3(tmp_path: Path, s3_bucket: Any) -> None:
    from _s3 import KEY_ID, SECRET

    creds = _credentials_file(
        tmp_path,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        endpoint_url=s3_bucket.server.endpoint,
        region_name="us-east-1",
    )
    section = {"enabled": True, "bucket": s3_bucket.name, "credentials": creds}
    fields = {"save_to_object_store": section, "load_from_object_store": section}
    job = {"path_local": str(tmp_path / "job"), "path": "run"}
    state = TinyTrainingState.create(seed=1)
    with DistributedCheckpointer(dict(fields), job) as saver:
        assert saver.save_dirname == saver.load_dirname == f"s3://{s3_bucket.name}/run/checkpoints"
        saver.save(state.model, state.optimizer, state.scheduler, state.grad_scaler, 7)
    assert "checkpoints/iter_000000007/model/.metadata" in s3_bucket.objects()
    fresh = TinyTrainingState.create(seed=2)
    with DistributedCheckpointer(dict(fields), job) as loader:
        assert loader.keys_to_resume_during_load() == (
            set(loader.KEYS_TO_SAVE),
            f"s3://{s3_bucket.name}/run/checkpoints/iter_000000007",
        )
        assert loader.load(fresh.model, fresh.optimizer, fresh.scheduler, fresh.grad_scaler) == 7
    assert_state_dicts_equal(fresh.model.state_dict(), state.model.state_dict())


def test_bad_field_types_and_missing_path_local_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="strict_resume"):
        checkpointer(tmp_path, strict_resume="yes")
    with pytest.raises(ConfigError, match="path_local"):
        DistributedCheckpointer(SimpleNamespace(), SimpleNamespace())


def test_context_manager_and_finalize_close_the_engine(tmp_path: Path) -> None:
    run = make_run(0)
    with checkpointer(tmp_path) as ckpt:
        ckpt.save(*run.args(), 1)
    with pytest.raises(CkptEngineError, match="closed"):
        ckpt.save(*run.args(), 2)
    ckpt.finalize()  # idempotent
    assert read_latest_file(ckpt.save_dirname) == "iter_000000001\n"


def test_success_callback_runs_on_every_save(tmp_path: Path) -> None:
    rec = Recorder()
    ckpt = checkpointer(tmp_path, callbacks=rec)
    run = make_run(0)
    for it in (1, 2, 3):
        ckpt.save(*run.args(), it)
    done = [kw["iteration"] for name, _, kw in rec.calls if name == "on_save_checkpoint_success"]
    assert done == [1, 2, 3]
