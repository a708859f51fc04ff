"""The built-in ``rename`` plugin: prefix and regex rules, for model and optimizer keys alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given
from torch import nn

from ckpt_engine import CheckpointEngine, LoadStrictnessError, PluginConfigError
from ckpt_engine import strategies as cst
from ckpt_engine.testing import assert_state_dicts_equal, plan_load

NO_TE = {"name": "te_extra_state", "enabled": False}  # random keys may end in _extra_state


def rename(*rules: dict[str, str], **options: Any) -> dict[str, Any]:
    return {"name": "rename", "options": {"rules": list(rules), **options}}


def meta(*keys: str) -> dict[str, torch.Tensor]:
    return {k: torch.empty(2, device="meta") for k in keys}


def described(*keys: str) -> dict[str, Any]:
    return {k: ((2,), torch.float32) for k in keys}


# -- resumes through a real engine -------------------------------------------------------------


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    """``<name>.*`` around an encoder, plus a head outside it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        setattr(self, name, Encoder())
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(getattr(self, self.name)(x))
        return out


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(torch.randn(8, 4, generator=gen)), torch.randn(8, 2, generator=gen))
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        losses.append(loss.item())
    return losses


def fresh(name: str, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = Net(name)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


@pytest.mark.parametrize(
    ("saved_as", "loaded_as", "rule"),
    [
        ("encoder", "backbone", {"checkpoint": "encoder.", "model": "backbone."}),
        ("encoder", "backbone", {"model_regex": r"^backbone\.", "checkpoint": "encoder."}),
    ],
)
def test_model_and_adamw_resume_exactly_under_new_names(
    tmp_path: Path, saved_as: str, loaded_as: str, rule: dict[str, str]
) -> None:
    model, opt = fresh(saved_as, seed=0)
    train(model, opt, 3, seed=1)
    with CheckpointEngine({"save_dir": str(tmp_path / "a")}) as engine:
        engine.save(3, model=model, optimizer=opt)
    expected_next = train(model, opt, 2, seed=2)  # what the original run does next

    twin, twin_opt = fresh(loaded_as, seed=99)  # other weights, no optimizer state yet
    config = {"save_dir": str(tmp_path / "a"), "plugins": [rename(rule)], "strict_unexpected": True}
    with CheckpointEngine(config) as engine:  # no stored key unread by name: the renames cover them all
        result = engine.load(model=twin, optimizer=twin_opt)
    assert result.iteration == 3
    for comp in ("model", "optim"):
        rep = result.report[comp]
        assert not (rep.missing or rep.skipped or rep.notes), rep
        assert rep.renamed and all(loaded_as in d and saved_as in s for d, s in rep.renamed.items())
    assert result.report["model"].renamed["backbone.a.weight"] == "encoder.a.weight"
    assert result.report["optim"].renamed["state.backbone.a.weight.exp_avg"] == "state.encoder.a.weight.exp_avg"
    assert result.report["optim"].renamed["param_groups.backbone.a.weight.lr"] == "param_groups.encoder.a.weight.lr"
    assert "param_groups.backbone.b.bias.lr" not in result.report["optim"].loaded  # torch reads the group's first
    assert "head.weight" not in result.report["model"].renamed
    assert train(twin, twin_opt, 2, seed=2) == expected_next  # bit-exact continuation


class Wrapped(nn.Module):
    """A model whose keys carry DDP's ``module.`` prefix (what a DDP-wrapped model saved)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.module = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.module(x)
        return out


def test_ddp_prefix_is_stripped_for_model_and_optimizer(tmp_path: Path) -> None:
    inner, _ = fresh("encoder", seed=0)
    wrapped = Wrapped(inner)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    train(wrapped, opt, 2, seed=1)
    with CheckpointEngine({"save_dir": str(tmp_path / "ddp")}) as engine:
        engine.save(2, model=wrapped, optimizer=opt)
    expected_next = train(wrapped, opt, 2, seed=2)

    bare, bare_opt = fresh("encoder", seed=5)
    config = {"save_dir": str(tmp_path / "ddp"), "plugins": [rename({"checkpoint": "module.", "model": ""})]}
    with CheckpointEngine(config) as engine:
        result = engine.load(model=bare, optimizer=bare_opt)
    assert result.report["model"].renamed["encoder.a.weight"] == "module.encoder.a.weight"
    assert set(result.report["optim"].renamed) == {k for k in result.report["optim"].loaded}
    assert train(bare, bare_opt, 2, seed=2) == expected_next

    # without the plugin the same resume fails for both components, naming the keys
    with CheckpointEngine({"save_dir": str(tmp_path / "ddp")}) as engine, pytest.raises(LoadStrictnessError) as info:
        engine.load(model=fresh("encoder", seed=5)[0])
    assert "encoder.a.weight" in str(info.value)


def test_model_state_is_equal_after_rename_resume(tmp_path: Path) -> None:
    model, opt = fresh("encoder", seed=0)
    train(model, opt, 1, seed=1)
    with CheckpointEngine({"save_dir": str(tmp_path / "c")}) as engine:
        engine.save(1, model=model)
    twin, _ = fresh("backbone", seed=3)
    with CheckpointEngine(
        {"save_dir": str(tmp_path / "c"), "plugins": [rename({"checkpoint": "encoder.", "model": "backbone."})]}
    ) as engine:
        engine.load(model=twin)
    renamed = {k.replace("encoder.", "backbone."): v for k, v in model.state_dict().items()}
    assert_state_dicts_equal(twin.state_dict(), renamed)


# -- rule semantics, through plan_load ----------------------------------------------------------


def test_rules_apply_in_order_first_match_wins() -> None:
    target = meta("backbone.head.w", "backbone.x.w", "lm_head.w", "other.w")
    stored = described("enc.head_v2.w", "enc.x.w", "lm_head.w", "other.w")
    rep = plan_load(
        target,
        stored,
        strict=True,
        plugins=[
            rename(
                {"checkpoint": "lm_head.", "model": "lm_head."},  # shields lm_head from the catch-all
                {"checkpoint": "enc.head_v2.", "model": "backbone.head."},
                {"checkpoint": "enc.", "model": "backbone."},
                {"checkpoint": "never.", "model": "lm_"},  # would match lm_head, but rule 1 came first
            )
        ],
    )
    assert dict(rep.renamed) == {"backbone.head.w": "enc.head_v2.w", "backbone.x.w": "enc.x.w"}
    assert set(rep.loaded) == set(target)
    assert rep.notes == ("rename: rule 4 (model 'lm_' <- checkpoint 'never.') matched no key of component 'model'",)


def test_a_rule_whose_renamed_keys_the_checkpoint_lacks_is_reported_and_strict_fails() -> None:
    target = meta("backbone.w")
    plugins = [rename({"checkpoint": "encoder.", "model": "backbone."})]
    rep = plan_load(target, described("enc.w"), plugins=plugins)
    assert rep.missing == ("backbone.w",) and rep.unexpected == ("enc.w",)
    (note,) = rep.notes
    assert "rule 1" in note and "backbone.w reads encoder.w" in note and note.startswith("rename: ")
    assert any(line.startswith("  note: rename: rule 1") for line in rep.summary_lines())
    with pytest.raises(LoadStrictnessError, match=r"backbone\.w \(reads encoder\.w\)"):
        plan_load(target, described("enc.w"), plugins=plugins, strict=True)


def test_regex_rule_with_groups() -> None:
    target = meta("layers.0.attn.q", "layers.11.attn.k", "layers.3.mlp.w")
    stored = described("model.layers.0.self_attn.q", "model.layers.11.self_attn.k", "model.layers.3.mlp.w")
    rep = plan_load(
        target,
        stored,
        strict=True,
        plugins=[
            rename(
                {"model_regex": r"^layers\.(\d+)\.attn\.", "checkpoint": r"model.layers.\1.self_attn."},
                {"checkpoint": "model.", "model": ""},
            )
        ],
    )
    assert dict(rep.renamed) == dict(zip(target, stored, strict=True))
    assert not rep.notes


def test_components_option_and_other_optim_keys() -> None:
    target = {"state.net.w.exp_avg": torch.empty(2, device="meta"), "extra_key": 1}
    stored = {"state.enc.w.exp_avg": ((2,), torch.float32), "extra_key": 1}
    plugins = [rename({"checkpoint": "enc.", "model": "net."})]
    rep = plan_load(target, stored, plugins=plugins, component="optim", strict=True)
    assert dict(rep.renamed) == {"state.net.w.exp_avg": "state.enc.w.exp_avg"}
    # not listed in `components`: untouched
    rep = plan_load(
        target,
        stored,
        plugins=[rename({"checkpoint": "enc.", "model": "net."}, components=["model"])],
        component="optim",
    )
    assert not rep.renamed and rep.missing == ("state.net.w.exp_avg",)


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({"checkpoint": "a."}, "exactly one of `model`"),
        ({"checkpoint": "a.", "model": "b.", "model_regex": "c"}, "exactly one of `model`"),
        ({"checkpoint": "a.", "model_regex": "("}, "not a valid regular expression"),
        ({"checkpoint": "", "model": ""}, "renames nothing"),
        ({"checkpoint": "a.", "model": "b.", "typo": 1}, "typo"),
    ],
)
def test_bad_rules_name_the_plugin_and_the_problem(rule: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match="rename") as info:
        plan_load({}, {}, plugins=[rename(rule)])
    assert message in str(info.value)


# -- properties ---------------------------------------------------------------------------------


@given(case=cst.renamed_keys())
def test_a_rename_is_reversible(case: cst.KeyRenames) -> None:
    """Loading checkpoint keys into model keys by a rule, then back by the swapped rule, is the identity."""
    forward = plan_load(
        meta(*case.model_keys), described(*case.checkpoint_keys), strict=True, plugins=[NO_TE, rename(dict(case.rule))]
    )
    assert set(forward.loaded) == set(case.model_keys) and not forward.unexpected
    there = {m: forward.renamed.get(m, m) for m in case.model_keys}
    assert there == dict(case.mapping)
    swapped = {"checkpoint": case.rule["model"], "model": case.rule["checkpoint"]}
    back = plan_load(
        meta(*case.checkpoint_keys), described(*case.model_keys), strict=True, plugins=[NO_TE, rename(swapped)]
    )
    assert {c: back.renamed.get(c, c) for c in case.checkpoint_keys} == {c: m for m, c in there.items()}


@given(case=cst.renamed_keys())
def test_one_rule_renames_optimizer_keys_like_model_keys(case: cst.KeyRenames) -> None:
    stats = ("exp_avg", "step")
    target = {f"state.{m}.{s}": torch.empty(2, device="meta") for m in case.model_keys for s in stats}
    target |= {f"param_groups.{m}.lr": 0.1 for m in case.model_keys}
    stored: dict[str, Any] = {f"state.{c}.{s}": ((2,), torch.float32) for c in case.checkpoint_keys for s in stats}
    stored |= {f"param_groups.{c}.lr": 0.1 for c in case.checkpoint_keys}
    rep = plan_load(target, stored, strict=True, plugins=[NO_TE, rename(dict(case.rule))], component="optim")
    assert set(rep.loaded) == set(target) and not rep.unexpected
    for m, c in case.mapping.items():
        assert rep.renamed.get(f"state.{m}.exp_avg", f"state.{m}.exp_avg") == f"state.{c}.exp_avg"
        assert rep.renamed.get(f"param_groups.{m}.lr", f"param_groups.{m}.lr") == f"param_groups.{c}.lr"


@pytest.mark.parametrize("strict", [True, False])
def test_a_warm_start_renames_and_a_restart_resumes_the_new_names_as_saved(tmp_path: Path, strict: bool) -> None:
    """The documented rename config (``load_path`` of a checkpoint with ``encoder.*``, a model
    with ``backbone.*``): after the run saved under its own names, a restart resumes them. With
    the rules applied again the resume read ``encoder.*`` the checkpoint no longer has: a strict
    error, or (``strict: false``) ``backbone`` silently left at its fresh values."""
    model, opt = fresh("encoder", seed=0)
    train(model, opt, 2, seed=1)
    with CheckpointEngine({"save_dir": str(tmp_path / "pretrain")}) as engine:
        engine.save(2, model=model, optimizer=opt)
    config = {
        "save_dir": str(tmp_path / "run"),
        "load_path": str(tmp_path / "pretrain"),
        "load_training_state": True,
        "plugins": [rename({"checkpoint": "encoder.", "model": "backbone."})],
        "strict": strict,
    }
    twin, twin_opt = fresh("backbone", seed=99)
    with CheckpointEngine(config) as engine:
        assert engine.load(model=twin, optimizer=twin_opt).report["model"].renamed
        train(twin, twin_opt, 2, seed=2)
        engine.save(4, model=twin, optimizer=twin_opt)
    expected_next = train(twin, twin_opt, 2, seed=3)

    again, again_opt = fresh("backbone", seed=7)
    with CheckpointEngine(config) as engine:
        result = engine.load(model=again, optimizer=again_opt)
    assert result.iteration == 4
    for comp in ("model", "optim"):
        rep = result.report[comp]
        assert not (rep.renamed or rep.missing), rep
        assert any("read under their own names" in n for n in rep.notes), rep.notes
    assert train(again, again_opt, 2, seed=3) == expected_next  # bit-exact continuation


def test_an_optimizer_saved_before_its_first_step_loads_under_new_names_without_state(tmp_path: Path) -> None:
    """A step-0 checkpoint of a DDP-wrapped model holds the optimizer's groups and no state: the
    renamed load gives the bare model's optimizer the saved groups and no state (the rename and
    the first-step rule decide together; a stepped one keeps its state, as the test above shows)."""
    inner, _ = fresh("encoder", seed=0)
    wrapped = Wrapped(inner)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=3e-3)
    with CheckpointEngine({"save_dir": str(tmp_path / "ddp")}) as engine:
        engine.save(0, model=wrapped, optimizer=opt)
    bare, bare_opt = fresh("encoder", seed=5)
    config = {"save_dir": str(tmp_path / "ddp"), "plugins": [rename({"checkpoint": "module.", "model": ""})]}
    with CheckpointEngine(config) as engine:
        result = engine.load(model=bare, optimizer=bare_opt)
    assert not result.report["optim"].missing and not bare_opt.state
    assert bare_opt.param_groups[0]["lr"] == 3e-3
