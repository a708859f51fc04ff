"""An ``optim`` load reads each parameter group's hyper-parameters once, from the group's first
parameter, as torch's ``set_optimizer_state_dict`` uses them: the other parameters' copies stay on
disk (a save still writes them all, for plain ``dcp.load``), are neither missing nor unexpected,
and what the optimizer ends with is what torch's own path gives, group by group."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from ckpt_engine import CheckpointEngine
from ckpt_engine._dcpio.planner import EngineLoadPlanner
from ckpt_engine.testing import assert_state_dicts_equal

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)
NAMES = ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias")
#: Three groups, each with its own options; a group's first parameter is not the first by name.
GROUPS = (("2.weight", "0.weight"), ("0.bias", "2.bias", "4.bias"), ("4.weight",))
OPTIONS = (
    {"lr": 3e-2, "betas": (0.8, 0.95), "weight_decay": 0.1},
    {"lr": 2e-3, "eps": 1e-6, "weight_decay": 0.0},
    {"lr": 7e-4, "eps": 1e-7, "betas": (0.85, 0.9)},
)
DATA = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


def _optimizer(
    model: nn.Module, groups: Sequence[Sequence[str]], options: Sequence[dict[str, Any]]
) -> torch.optim.AdamW:
    params = dict(model.named_parameters())
    return torch.optim.AdamW([{"params": [params[n] for n in g], **o} for g, o in zip(groups, options, strict=True)])


def _step(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    model(DATA).square().mean().backward()
    optimizer.step()


def _trained(groups: Sequence[Sequence[str]] = GROUPS, frozen: Sequence[str] = ()) -> tuple[nn.Module, Any]:
    model = _model()
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    optimizer = _optimizer(model, groups, OPTIONS[: len(groups)])
    for _ in range(3):
        _step(model, optimizer)
    return model, optimizer


def _fresh(groups: Sequence[Sequence[str]] = GROUPS, frozen: Sequence[str] = ()) -> tuple[nn.Module, Any]:
    """Another model with other weights and an optimizer with torch's default options."""
    model = _model(seed=1)
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    return model, _optimizer(model, groups, [{} for _ in groups])


def _by_torch(model: nn.Module, optimizer: Any, groups: Sequence[Sequence[str]], frozen: Sequence[str] = ()) -> Any:
    """What torch's own path gives: a fresh optimizer of ``groups`` set from the saved one's
    flattened state dict, every key of it present."""
    target, target_optim = _fresh(groups, frozen)
    full = get_optimizer_state_dict(model, optimizer, options=FLAT)
    set_optimizer_state_dict(target, target_optim, optim_state_dict=full, options=FLAT)
    return target_optim


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """The number of read items each component's load plans."""
    counts: dict[str, int] = {}
    real = EngineLoadPlanner.create_local_plan

    def counted(self: EngineLoadPlanner) -> Any:
        plan = real(self)
        counts[self.component] = len(plan.items)
        return plan

    monkeypatch.setattr(EngineLoadPlanner, "create_local_plan", counted)
    return counts


def _save(save_dir: str, model: nn.Module, optimizer: Any) -> str:
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        assert engine.save(1, model=model, optimizer=optimizer).result().succeeded
    return os.path.join(save_dir, "iter_000000001", "optim")


def _load(save_dir: str, model: nn.Module, optimizer: Any) -> Any:
    with CheckpointEngine({"save_dir": save_dir, "strict": True, "strict_unexpected": True}) as engine:
        return engine.load(model=model, optimizer=optimizer)


def test_each_group_reads_its_first_parameters_options_alone_and_resumes_bit_exact(
    save_dir: str, planned: dict[str, int]
) -> None:
    model, optimizer = _trained()
    folder = _save(save_dir, model, optimizer)
    options = [k for k in optimizer.param_groups[0] if k != "params"]  # AdamW's 11
    saved = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    assert {k for k in saved if k.startswith("param_groups.")} == {
        f"param_groups.{n}.{k}" for n in NAMES for k in options
    }  # the format is unchanged: every parameter's copy is written

    target, target_optim = _fresh()
    report = _load(save_dir, target, target_optim).report["optim"]
    assert sorted(k for k in report.loaded if k.startswith("param_groups.")) == sorted(
        f"param_groups.{g[0]}.{k}" for g in GROUPS for k in options
    )
    assert not report.missing and not report.unexpected and not report.skipped  # strict_unexpected held
    assert planned["optim"] == 3 * len(NAMES) + len(GROUPS) * len(options)  # step, exp_avg(_sq); one set a group
    for group, want in zip(target_optim.param_groups, OPTIONS, strict=True):
        assert {k: group[k] for k in want} == want
    assert_state_dicts_equal(target_optim.state_dict(), optimizer.state_dict())

    target.load_state_dict(model.state_dict())  # the model is loaded too; make sure, then train on
    _step(model, optimizer)
    _step(target, target_optim)
    assert_state_dicts_equal(target.state_dict(), model.state_dict())
    assert_state_dicts_equal(target_optim.state_dict(), optimizer.state_dict())


def test_the_saved_component_still_loads_with_plain_dcp(save_dir: str) -> None:
    model, optimizer = _trained()
    folder = _save(save_dir, model, optimizer)
    target, target_optim = _fresh()
    _step(target, target_optim)  # state to load into
    osd = get_optimizer_state_dict(target, target_optim, options=FLAT)
    dcp.load(osd, checkpoint_id=folder)
    set_optimizer_state_dict(target, target_optim, optim_state_dict=osd, options=FLAT)
    assert_state_dicts_equal(target_optim.state_dict(), optimizer.state_dict())


def test_a_target_grouped_otherwise_ends_as_torchs_own_path_leaves_it(save_dir: str) -> None:
    """Saved in three groups, loaded into two whose first parameters were no group's first at
    save: each target group takes its first parameter's saved options, as torch does."""
    regrouped = (("0.weight", "0.bias", "2.weight"), ("2.bias", "4.weight", "4.bias"))
    model, optimizer = _trained()
    _save(save_dir, model, optimizer)
    target, target_optim = _fresh(regrouped)
    report = _load(save_dir, target, target_optim).report["optim"]
    assert not report.missing and not report.unexpected
    assert_state_dicts_equal(target_optim.state_dict(), _by_torch(model, optimizer, regrouped).state_dict())
    assert target_optim.param_groups[0]["lr"] == OPTIONS[0]["lr"]  # 0.weight's group at save
    assert target_optim.param_groups[1]["lr"] == OPTIONS[1]["lr"]  # 2.bias's


def test_frozen_parameters_load_as_torch_loads_them(save_dir: str) -> None:
    """A frozen parameter first in its group gives the group's options; one inside a group has no
    state; both load as torch's path loads them."""
    frozen = ("2.weight", "2.bias")
    model, optimizer = _trained(frozen=frozen)
    _save(save_dir, model, optimizer)
    target, target_optim = _fresh(frozen=frozen)
    report = _load(save_dir, target, target_optim).report["optim"]
    assert "param_groups.2.weight.lr" in report.loaded and "param_groups.0.weight.lr" not in report.loaded
    assert not any(k.startswith("state.2.") for k in report.loaded)
    assert_state_dicts_equal(target_optim.state_dict(), _by_torch(model, optimizer, GROUPS, frozen).state_dict())
    assert_state_dicts_equal(target_optim.state_dict(), optimizer.state_dict())


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(6, 4)
        self.mid = nn.Linear(4, 4)
        self.head = nn.Linear(4, 6, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.mid(self.embed(x)))
        return out


def _tied_trained(seed: int, steps: int) -> tuple[_Tied, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = _Tied()
    p = dict(model.named_parameters())
    optimizer = torch.optim.AdamW([p["mid.weight"], p["embed.weight"], p["mid.bias"]], lr=5e-3)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.arange(6)).square().mean().backward()
        optimizer.step()
    return model, optimizer


def test_a_tied_parameter_inside_a_group_keeps_its_options(save_dir: str) -> None:
    """torch tells which name of a tied parameter was saved by looking for its options' keys:
    those are read though the parameter is not its group's first."""
    model, optimizer = _tied_trained(0, 2)
    _save(save_dir, model, optimizer)
    target, target_optim = _tied_trained(1, 0)
    report = _load(save_dir, target, target_optim).report["optim"]
    assert "param_groups.embed.weight.lr" in report.loaded and "param_groups.mid.bias.lr" not in report.loaded
    assert_state_dicts_equal(target_optim.state_dict(), optimizer.state_dict())


def test_an_optimizer_named_otherwise_by_a_wrapper_reads_every_parameters_options(save_dir: str) -> None:
    """A compiled module's parameters are ``_orig_mod.*`` to it and not to DCP: which name torch
    takes as a group's first is not known here, so the load reads them all, as before."""
    model, optimizer = _trained()
    _save(save_dir, model, optimizer)
    target, target_optim = _fresh()
    compiled = torch.compile(target)
    report = _load(save_dir, compiled, target_optim).report["optim"]
    assert {k for k in report.loaded if k.startswith("param_groups.")} == {
        f"param_groups.{n}.{k}" for n in NAMES for k in optimizer.param_groups[0] if k != "params"
    }
    assert_state_dicts_equal(target_optim.state_dict(), optimizer.state_dict())
