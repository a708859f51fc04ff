"""Single-process tests of the built-in plugins: te_extra_state, ema and size_mismatch.

Every test saves a real DCP checkpoint with the engine and loads it back; nothing is mocked
except a counting wrapper around the storage reader where the number of reads matters.
"""

from __future__ import annotations

import io
import logging
import re
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from _paths import ROOT
from ckpt_engine_plugins.ema import EmaKeysNotFoundError, EmaPlugin
from ckpt_engine_plugins.size_mismatch import SizeMismatchPlugin
from ckpt_engine_plugins.te_extra_state import TeExtraStatePlugin
from torch import nn
from torch.distributed.checkpoint.planner import LoadPlan

from ckpt_engine import (
    CheckpointEngine,
    CheckpointLoadError,
    LoadStrictnessError,
    PluginConfigError,
    RemapContext,
    UnsafeCheckpointError,
)
from ckpt_engine._dcpio.planner import EngineLoadPlanner
from ckpt_engine.testing import assert_state_dicts_equal

# -- helpers -----------------------------------------------------------------------------------


def engine(save_dir: str, *plugins: Any, **config: Any) -> CheckpointEngine:
    """An engine with plugin entries (names, or dicts with options) in this order."""
    return CheckpointEngine({"save_dir": save_dir, "plugins": list(plugins), **config})


def warm(save_dir: str, *plugins: Any, **config: Any) -> CheckpointEngine:
    """An engine of a new run that starts from ``save_dir``'s latest (``load_path``: a warm
    start, where the ``ema`` plugin applies), with plugin entries in this order."""
    run = str(Path(save_dir).parent / (Path(save_dir).name + "_run"))
    return CheckpointEngine({"save_dir": run, "load_path": save_dir, "plugins": list(plugins), **config})


def save(save_dir: str, model: nn.Module, iteration: int = 1) -> None:
    with CheckpointEngine({"save_dir": save_dir}) as eng:
        eng.save(iteration, model=model)


def model_dir(save_dir: str, iteration: int = 1) -> str:
    return str(Path(save_dir) / f"iter_{iteration:09}" / "model")


@pytest.fixture
def read_counter(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counter[str]]:
    """Counts read items per storage key for every load the engine runs.

    It records the final plan DCP hands to ``finish_plan``: the items the storage reader reads.
    """
    counts: Counter[str] = Counter()
    original = EngineLoadPlanner.finish_plan

    def finish_plan(self: EngineLoadPlanner, plan: LoadPlan) -> LoadPlan:
        final = original(self, plan)
        counts.update(item.storage_index.fqn for item in final.items)
        return final

    monkeypatch.setattr(EngineLoadPlanner, "finish_plan", finish_plan)
    yield counts


def fill(module: nn.Module, start: float) -> nn.Module:
    """Give every parameter and float buffer distinct, recognisable values."""
    with torch.no_grad():
        for i, t in enumerate([*module.parameters(), *module.buffers()]):
            if t.is_floating_point():
                t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) / 7 + start + 100 * i)
    return module


# -- te_extra_state ----------------------------------------------------------------------------


class TeLike(nn.Module):
    """A linear layer with Transformer-Engine-style extra state of a configurable size.

    ``kind``: ``bytes`` (a ``BytesIO``, as older TE returns), ``tensor`` (a uint8 tensor, as newer
    TE returns) or ``dict`` (which DCP flattens to ``_extra_state.<field>``).
    """

    def __init__(self, size: int, kind: str, seed: int = 0) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2)
        self.kind = kind
        self.extra: Any = self.make_extra(size, seed)
        self.set_calls: list[Any] = []

    def make_extra(self, size: int, seed: int) -> Any:
        payload = torch.arange(size, dtype=torch.uint8) + seed
        if self.kind == "bytes":
            buf = io.BytesIO()
            torch.save(payload, buf)
            buf.seek(0)
            return buf
        if self.kind == "tensor":
            return payload
        return {"version": size, "amax": payload.float()}

    def get_extra_state(self) -> Any:
        return self.extra

    def set_extra_state(self, state: Any) -> None:
        self.set_calls.append(state)
        self.extra = state


def extra_payload(extra: Any) -> Any:
    if isinstance(extra, io.BytesIO):
        extra.seek(0)
        return torch.load(extra, weights_only=True).tolist()
    if isinstance(extra, torch.Tensor):
        return extra.tolist()
    return {"version": extra["version"], "amax": extra["amax"].tolist()}


def te_model(size: int, kind: str, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(TeLike(size, kind, seed), nn.ReLU(), TeLike(size + 1, kind, seed))


@pytest.mark.parametrize("kind", ["bytes", "tensor", "dict"])
def test_te_extra_state_skipped_in_strict_mode_with_size_change(save_dir: str, kind: str) -> None:
    saved = te_model(3, kind, seed=1)
    save(save_dir, saved)
    target = te_model(7, kind, seed=2)  # extra state sizes differ from the checkpoint's
    before = [extra_payload(m.extra) for m in (target[0], target[2])]

    result = engine(save_dir).load(model=target)  # te_extra_state is on by default; strict default

    rep = result.report["model"]
    extra_keys = {k for k in rep.skipped if "_extra_state" in k}
    expected = (
        {"0._extra_state.version", "0._extra_state.amax", "2._extra_state.version", "2._extra_state.amax"}
        if kind == "dict"
        else {"0._extra_state", "2._extra_state"}
    )
    assert extra_keys == expected
    for key in expected:
        assert rep.skipped[key].plugin == "te_extra_state"
        assert "Transformer-Engine" in rep.skipped[key].reason
    # skipped entries read their storage key: they are not "unexpected", nor missing
    assert rep.unexpected == () and rep.missing == ()
    assert set(rep.loaded) == {"0.lin.weight", "0.lin.bias", "2.lin.weight", "2.lin.bias"}
    for i in (0, 2):
        assert torch.equal(target[i].lin.weight, saved[i].lin.weight)
        assert torch.equal(target[i].lin.bias, saved[i].lin.bias)
    # the module's own extra state is left as it was
    assert [extra_payload(m.extra) for m in (target[0], target[2])] == before


@pytest.mark.parametrize("kind", ["tensor", "dict"])
def test_te_extra_state_disabled_mismatch_fails_strict_load(save_dir: str, kind: str) -> None:
    save(save_dir, te_model(3, kind, seed=1))
    eng = engine(save_dir, {"name": "te_extra_state", "enabled": False})
    with pytest.raises(LoadStrictnessError) as info:
        eng.load(model=te_model(7, kind, seed=2))
    err = info.value
    assert err.component == "model"
    suffix = ".amax" if kind == "dict" else ""
    assert sorted(m.split(":")[0] for m in err.mismatched) == [f"0._extra_state{suffix}", f"2._extra_state{suffix}"]
    assert "2 mismatch(es)" in str(err)


@pytest.mark.parametrize("kind", ["tensor", "dict"])
def test_te_extra_state_disabled_loads_extra_state_like_any_value(save_dir: str, kind: str) -> None:
    saved = te_model(3, kind, seed=1)
    save(save_dir, saved)
    target = te_model(3, kind, seed=5)  # same sizes, other values
    result = engine(save_dir, {"name": "te_extra_state", "enabled": False}).load(model=target)
    rep = result.report["model"]
    assert rep.skipped == {}
    assert any("_extra_state" in k for k in rep.loaded)
    assert extra_payload(target[0].extra) == extra_payload(saved[0].extra)
    assert extra_payload(target[2].extra) == extra_payload(saved[2].extra)
    assert target[0].set_calls, "set_extra_state was not called with the loaded value"


def test_te_extra_state_disabled_bytesio_needs_trust(save_dir: str) -> None:
    saved = te_model(3, "bytes", seed=1)
    save(save_dir, saved)
    # A BytesIO is not a weights_only value: refused unless the checkpoint is trusted ...
    with pytest.raises(UnsafeCheckpointError, match="trust_checkpoint"):
        engine(save_dir, {"name": "te_extra_state", "enabled": False}).load(model=te_model(3, "bytes", 5))
    # ... and loaded like any other value when it is.
    target = te_model(3, "bytes", seed=5)
    engine(save_dir, {"name": "te_extra_state", "enabled": False}, trust_checkpoint=True).load(model=target)
    assert extra_payload(target[0].extra) == extra_payload(saved[0].extra) == [1, 2, 3]


def test_te_extra_state_disabled_non_strict_skips_and_reports(save_dir: str) -> None:
    save(save_dir, te_model(3, "tensor", seed=1))
    target = te_model(7, "tensor", seed=2)
    before = extra_payload(target[0].extra)
    result = engine(save_dir, {"name": "te_extra_state", "enabled": False}, strict=False).load(model=target)
    rec = result.report["model"].skipped["0._extra_state"]
    assert rec.plugin is None and "uint8[3]" in rec.reason and "uint8[7]" in rec.reason
    assert extra_payload(target[0].extra) == before


def test_te_extra_state_only_touches_extra_state_segments(save_dir: str) -> None:
    class Named(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.my_extra_state_proj = nn.Linear(2, 2)  # contains the word, but not as a segment

    saved = Named()
    save(save_dir, saved)
    target = Named()
    rep = engine(save_dir).load(model=target).report["model"]
    assert rep.skipped == {}
    assert torch.equal(target.my_extra_state_proj.weight, saved.my_extra_state_proj.weight)


# -- ema ---------------------------------------------------------------------------------------


class Net(nn.Module):
    def __init__(self, width: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.BatchNorm1d(width)  # buffers are remapped too


class Diffusion(nn.Module):
    def __init__(self, ema: bool, depth: int = 2, ema_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.net = Net(depth=depth)
        if ema:
            self.net_ema = Net(depth=depth)
            if ema_dtype is not None:
                self.net_ema.to(ema_dtype)
        self.logvar = nn.Parameter(torch.zeros(1))  # outside both prefixes: loads as itself


def trained_checkpoint(save_dir: str, depth: int = 2) -> Diffusion:
    src = Diffusion(ema=True, depth=depth)
    fill(src.net, 0.25)
    fill(src.net_ema, -50.5)
    with torch.no_grad():
        src.logvar.fill_(3.0)
    save(save_dir, src)
    return src


def assert_net_equal(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k].to(sa[k].dtype)), k


def test_ema_into_model_without_ema_copy(save_dir: str, read_counter: Counter[str]) -> None:
    src = trained_checkpoint(save_dir)
    target = Diffusion(ema=False)
    rep = warm(save_dir, "ema").load(model=target).report["model"]

    assert_net_equal(target.net, src.net_ema)
    assert torch.equal(target.logvar, src.logvar)
    assert rep.renamed == {k: "net_ema." + k.removeprefix("net.") for k in rep.loaded if k.startswith("net.")}
    assert len(rep.renamed) == len(target.net.state_dict())
    # the checkpoint's regular weights are read by nobody: reported as unexpected
    assert set(rep.unexpected) == {"net." + k for k in src.net.state_dict()}
    assert not any(k.startswith("net.") for k in read_counter)
    assert "  renamed net.* <- net_ema.*" in rep.summary_lines()


def test_ema_into_model_with_ema_copy_reads_each_key_once(save_dir: str, read_counter: Counter[str]) -> None:
    src = trained_checkpoint(save_dir)
    target = Diffusion(ema=True)
    fill(target, 9.0)
    rep = warm(save_dir, "ema").load(model=target).report["model"]

    assert_net_equal(target.net, src.net_ema)
    assert_net_equal(target.net_ema, src.net_ema)
    ema_keys = {"net_ema." + k for k in src.net_ema.state_dict()}
    model_counts = {k: n for k, n in read_counter.items() if k.startswith(("net.", "net_ema."))}
    assert model_counts == dict.fromkeys(ema_keys, 1), "each net_ema.* storage key must be read exactly once"
    assert set(rep.loaded) >= {"net." + k for k in src.net.state_dict()} | ema_keys
    assert set(rep.unexpected) == {"net." + k for k in src.net.state_dict()}


def test_ema_mixed_dtypes_cast_from_the_stored_values(save_dir: str, read_counter: Counter[str]) -> None:
    # An fp32 checkpoint loaded into a bf16 network with an fp64 EMA copy: both destinations
    # share one read, and each must be the stored value cast to its own dtype (not bf16-rounded).
    src = trained_checkpoint(save_dir)
    target = Diffusion(ema=True, ema_dtype=torch.float64)
    target.net.to(torch.bfloat16)
    warm(save_dir, "ema").load(model=target)
    for key, stored in src.net_ema.state_dict().items():
        got_reg, got_ema = target.net.state_dict()[key], target.net_ema.state_dict()[key]
        assert torch.equal(got_reg, stored.to(got_reg.dtype)), key
        assert torch.equal(got_ema, stored.to(got_ema.dtype)), key
    assert all(n == 1 for k, n in read_counter.items() if k.startswith("net_ema."))


def test_ema_missing_ema_keys_is_an_error_naming_the_prefix(save_dir: str) -> None:
    save(save_dir, fill(Diffusion(ema=False), 1.0))
    with pytest.raises(EmaKeysNotFoundError, match=r"no key under 'net_ema\.'") as info:
        warm(save_dir, "ema").load(model=Diffusion(ema=False))
    assert "ema_prefix" in str(info.value) and "'net.'" in str(info.value)
    assert isinstance(info.value, CheckpointLoadError)


def test_ema_model_without_either_prefix_is_an_error(save_dir: str) -> None:
    trained_checkpoint(save_dir)
    with pytest.raises(EmaKeysNotFoundError, match=r"the model has no key under 'net\.' or 'net_ema\.'"):
        warm(save_dir, "ema", strict=False).load(model=nn.Sequential(nn.Linear(2, 2)))


def test_ema_partial_ema_in_checkpoint_is_listed_as_missing(save_dir: str) -> None:
    src = Diffusion(ema=True)
    src.net_ema.norm = nn.Identity()  # type: ignore[assignment]  # the EMA copy lacks the norm
    fill(src, 2.0)
    save(save_dir, src)
    with pytest.raises(LoadStrictnessError) as info:
        warm(save_dir, "ema").load(model=Diffusion(ema=False))
    missing = set(info.value.missing)
    assert "net.norm.weight (reads net_ema.norm.weight)" in missing
    assert "net.norm.running_mean (reads net_ema.norm.running_mean)" in missing
    assert len(missing) == len([k for k in Diffusion(ema=False).state_dict() if k.startswith("net.norm.")])


def test_ema_reg_to_ema_starts_ema_from_pretrained(save_dir: str, read_counter: Counter[str]) -> None:
    pretrained = fill(Diffusion(ema=False), 4.5)
    save(save_dir, pretrained)
    target = fill(Diffusion(ema=True), -1.0)
    rep = warm(save_dir, {"name": "ema", "options": {"direction": "reg_to_ema"}}).load(model=target).report["model"]
    assert_net_equal(target.net, pretrained.net)
    assert_net_equal(target.net_ema, pretrained.net)
    assert rep.unexpected == () and rep.missing == ()
    assert all(n == 1 for k, n in read_counter.items() if k.startswith("net."))
    assert not any(k.startswith("net_ema.") for k in read_counter)


def test_ema_reg_to_ema_needs_regular_weights(tmp_path: Path) -> None:
    # a checkpoint holding EMA weights only, written with plain DCP (as another tool might)
    ckpt = tmp_path / "iter_000000007"
    only_ema = {"net_ema." + k: v for k, v in Diffusion(ema=True).net_ema.state_dict().items()}
    dcp.save(only_ema, checkpoint_id=str(ckpt / "model"))
    eng = CheckpointEngine(
        {
            "save_dir": str(tmp_path / "new"),
            "load_path": str(ckpt),
            "plugins": [{"name": "ema", "options": {"direction": "reg_to_ema"}}],
        }
    )
    with pytest.raises(EmaKeysNotFoundError, match=r"no key under 'net\.'.*reg_prefix"):
        eng.load(model=Diffusion(ema=True))


def test_ema_reg_to_ema_needs_a_model_with_an_ema_copy(save_dir: str) -> None:
    save(save_dir, fill(Diffusion(ema=True), 1.0))
    eng = warm(save_dir, {"name": "ema", "options": {"direction": "reg_to_ema"}})
    with pytest.raises(EmaKeysNotFoundError, match=r"the model has no key under 'net_ema\.'"):
        eng.load(model=Diffusion(ema=False))


def test_ema_custom_prefixes(save_dir: str) -> None:
    class Custom(nn.Module):
        def __init__(self, ema: bool) -> None:
            super().__init__()
            self.student = nn.Linear(3, 3)
            if ema:
                self.teacher = nn.Linear(3, 3)

    src = fill(Custom(ema=True), 1.0)
    save(save_dir, src)
    target = Custom(ema=False)
    opts = {"reg_prefix": "student.", "ema_prefix": "teacher."}
    warm(save_dir, {"name": "ema", "options": opts}).load(model=target)
    assert torch.equal(target.student.weight, src.teacher.weight)
    assert torch.equal(target.student.bias, src.teacher.bias)


def test_ema_does_not_touch_saves_or_other_components(save_dir: str) -> None:
    model = fill(Diffusion(ema=False), 1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.net.blocks[0].weight.sum().backward()
    opt.step()
    with engine(save_dir, "ema") as eng:
        eng.save(3, model=model, optimizer=opt)
    stored = set(dcp.FileSystemReader(model_dir(save_dir, 3)).read_metadata().state_dict_metadata)
    assert stored == set(model.state_dict())  # saved under the model's own keys
    # loading the optimizer is not remapped (the plugin applies to `model` only by default)
    src = fill(Diffusion(ema=True), 0.0)
    save(save_dir, src, iteration=4)  # newer checkpoint with EMA weights, no optimizer
    target = Diffusion(ema=False)
    result = warm(save_dir, "ema").load(model=target)
    assert_net_equal(target.net, src.net_ema)
    assert result.checkpoint_path.endswith("iter_000000004")  # load_path: save_dir's latest


@pytest.mark.parametrize(
    "options, message",
    [
        ({"reg_prefix": "net", "ema_prefix": "net_ema"}, "overlap"),
        ({"direction": "both"}, "direction"),
        ({"prefix": "net."}, "prefix"),
    ],
)
def test_ema_invalid_options(save_dir: str, options: dict[str, Any], message: str) -> None:
    with pytest.raises(PluginConfigError, match=message) as info:
        warm(save_dir, {"name": "ema", "options": options})
    assert "'ema'" in str(info.value)


def test_ema_summary_collapses_hundreds_of_keys(save_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    trained_checkpoint(save_dir, depth=60)  # 2 * 60 + 5 keys per network
    target = Diffusion(ema=True, depth=60)
    with caplog.at_level(logging.INFO, logger="ckpt_engine"):
        rep = warm(save_dir, "ema").load(model=target).report["model"]
    assert len(rep.unexpected) == 125
    lines = rep.summary_lines()
    assert "  unexpected: net.* (125 keys)" in lines
    assert "  renamed net.* <- net_ema.*" in lines
    assert len(lines) < 10
    summaries = [r for r in caplog.records if "loaded " in r.getMessage() and "unexpected" in r.getMessage()]
    assert len(summaries) == 1, "the load summary is logged exactly once"
    assert "net.* (125 keys)" in summaries[0].getMessage()
    assert "net.blocks.17.weight" not in summaries[0].getMessage()


# -- size_mismatch -----------------------------------------------------------------------------


class Vision(nn.Module):
    def __init__(self, in_ch: int = 4, head: int = 10) -> None:
        super().__init__()
        self.enc = nn.Module()
        self.enc.stem = nn.Conv2d(in_ch, 8, 3)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, head)


def poison(module: nn.Module, value: float = -999.0) -> dict[str, torch.Tensor]:
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(value)
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_size_mismatch_default_error_lists_every_problem_in_one_error(save_dir: str) -> None:
    save(save_dir, Vision(in_ch=4, head=10))
    target = Vision(in_ch=6, head=12)
    target.extra = nn.Linear(2, 2)  # missing from the checkpoint
    with pytest.raises(LoadStrictnessError) as info:
        engine(save_dir, "size_mismatch").load(model=target)
    err = info.value
    assert sorted(m.split(":")[0] for m in err.mismatched) == ["enc.stem.weight", "head.bias", "head.weight"]
    assert sorted(err.missing) == ["extra.bias", "extra.weight"]
    text = str(err)
    first = text.splitlines()[0]
    assert "2 missing key(s)" in first and "3 mismatch(es)" in first  # counts, then the keys
    for key in ("enc.stem.weight", "head.bias", "head.weight", "extra.bias", "extra.weight"):
        assert key in text
    assert "float32[8, 4, 3, 3]" in text and "float32[8, 6, 3, 3]" in text


def test_size_mismatch_error_policy_non_strict_skips_and_reports(save_dir: str) -> None:
    src = fill(Vision(in_ch=4), 1.0)
    save(save_dir, src)
    target = Vision(in_ch=6)
    before = poison(target)
    rep = engine(save_dir, "size_mismatch", strict=False).load(model=target).report["model"]
    assert set(rep.skipped) == {"enc.stem.weight"}
    assert rep.skipped["enc.stem.weight"].plugin is None  # unresolved: skipped by the engine
    assert torch.equal(target.enc.stem.weight, before["enc.stem.weight"])
    assert torch.equal(target.body.weight, src.body.weight)


def test_size_mismatch_skip_keeps_destination_and_reports_shapes(save_dir: str) -> None:
    src = fill(Vision(in_ch=4, head=10), 1.0)
    save(save_dir, src)
    target = Vision(in_ch=6, head=12)
    before = poison(target)
    rep = engine(save_dir, {"name": "size_mismatch", "options": {"policy": "skip"}}).load(model=target).report["model"]
    assert set(rep.skipped) == {"enc.stem.weight", "head.weight", "head.bias"}
    rec = rep.skipped["head.weight"]
    assert rec.plugin == "size_mismatch"
    assert "'skip'" in rec.reason and "float32[10, 8]" in rec.reason and "float32[12, 8]" in rec.reason
    for key in rep.skipped:
        assert torch.equal(target.state_dict()[key], before[key])
    assert torch.equal(target.body.weight, src.body.weight)
    assert torch.equal(target.enc.stem.bias, src.enc.stem.bias)


@pytest.mark.parametrize("new_ch", [6, 3])
def test_size_mismatch_overlap_conv_input_channels(save_dir: str, new_ch: int) -> None:
    src = fill(Vision(in_ch=4), 1.0)
    save(save_dir, src)
    target = Vision(in_ch=new_ch)
    before = poison(target)
    rep = engine(save_dir, {"name": "size_mismatch", "options": {"policy": "overlap"}}).load(model=target)
    rec = rep.report["model"].overlap["enc.stem.weight"]
    assert rec.saved_shape == (8, 4, 3, 3) and rec.target_shape == (8, new_ch, 3, 3)
    assert rec.plugin == "size_mismatch"
    got, old = target.enc.stem.weight, src.enc.stem.weight
    shared = min(4, new_ch)
    assert torch.equal(got[:, :shared], old[:, :shared])  # old channels keep their weights
    assert torch.equal(got[:, shared:], before["enc.stem.weight"][:, shared:])  # the rest is untouched
    assert torch.equal(target.enc.stem.bias, src.enc.stem.bias)
    summary = rep.report.summary()
    assert f"overlap: enc.stem.weight saved [8, 4, 3, 3] -> target [8, {new_ch}, 3, 3]" in summary


def test_size_mismatch_overlap_limited_by_pattern(save_dir: str) -> None:
    src = fill(Vision(in_ch=4, head=10), 1.0)
    save(save_dir, src)
    opts = {"policy": "overlap", "patterns": ["*.stem.weight"]}
    # strict: the head still fails, and the error names only the head
    with pytest.raises(LoadStrictnessError) as info:
        engine(save_dir, {"name": "size_mismatch", "options": opts}).load(model=Vision(in_ch=6, head=12))
    assert sorted(m.split(":")[0] for m in info.value.mismatched) == ["head.bias", "head.weight"]
    # non-strict: stem overlapped, head skipped by the engine
    target = Vision(in_ch=6, head=12)
    rep = engine(save_dir, {"name": "size_mismatch", "options": opts}, strict=False).load(model=target)
    assert set(rep.report["model"].overlap) == {"enc.stem.weight"}
    assert set(rep.report["model"].skipped) == {"head.weight", "head.bias"}
    assert torch.equal(target.enc.stem.weight[:, :4], src.enc.stem.weight)


def test_size_mismatch_rules_first_match_wins(save_dir: str) -> None:
    save(save_dir, fill(Vision(in_ch=4, head=10), 1.0))
    opts = {
        "policy": "error",
        "rules": [
            {"pattern": "head.bias", "policy": "skip"},
            {"pattern": "head.*", "policy": "overlap"},
            {"pattern": "*", "policy": "skip"},
        ],
    }
    target = Vision(in_ch=6, head=12)
    rep = engine(save_dir, {"name": "size_mismatch", "options": opts}).load(model=target).report["model"]
    assert set(rep.overlap) == {"head.weight"}
    assert set(rep.skipped) == {"head.bias", "enc.stem.weight"}
    plugin = SizeMismatchPlugin(SizeMismatchPlugin.Options.model_validate(opts))
    assert [plugin.policy_for(k) for k in ("head.bias", "head.weight", "x")] == ["skip", "overlap", "skip"]


def test_size_mismatch_overlap_impossible_is_skipped_with_reason(save_dir: str) -> None:
    class Odd(nn.Module):
        def __init__(self, flat: bool) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(6) if flat else torch.full((2, 3), -1.0))
            self.v = nn.Parameter(torch.full((4,), 2.0) if flat else torch.zeros(6))

    save(save_dir, Odd(flat=True))
    target = Odd(flat=False)
    rep = engine(save_dir, {"name": "size_mismatch", "options": {"policy": "overlap"}}).load(model=target)
    skipped = rep.report["model"].skipped
    assert set(skipped) == {"w"}
    assert "number of dimensions" in skipped["w"].reason and skipped["w"].plugin == "size_mismatch"
    assert "float32[6]" in skipped["w"].reason and "float32[2, 3]" in skipped["w"].reason
    assert torch.equal(target.w, torch.full((2, 3), -1.0))
    assert torch.equal(target.v, torch.tensor([2.0, 2, 2, 2, 0, 0]))  # same ndim: overlapped


def test_size_mismatch_tensor_vs_value_is_skipped_by_overlap(save_dir: str) -> None:
    class Holder(nn.Module):
        def __init__(self, tensor: bool) -> None:
            super().__init__()
            self.tensor = tensor

        def get_extra_state(self) -> Any:
            return torch.arange(3.0) if self.tensor else 7

        def set_extra_state(self, state: Any) -> None:
            self.loaded = state

    save(save_dir, nn.Sequential(Holder(tensor=False)))
    target = nn.Sequential(Holder(tensor=True))
    eng = engine(
        save_dir,
        {"name": "te_extra_state", "enabled": False},
        {"name": "size_mismatch", "options": {"policy": "overlap"}},
    )
    rep = eng.load(model=target).report["model"]
    rec = rep.skipped["0._extra_state"]
    assert "needs two tensors" in rec.reason and "<bytes>" in rec.reason and "float32[3]" in rec.reason


def test_dtype_mismatch_is_cast_on_load_and_reported(save_dir: str) -> None:
    src = fill(Vision(in_ch=4), 0.3)
    save(save_dir, src)
    target = Vision(in_ch=6).to(torch.bfloat16)
    opts = {"policy": "overlap"}
    rep = engine(save_dir, {"name": "size_mismatch", "options": opts}).load(model=target).report["model"]
    assert torch.equal(target.body.weight, src.body.weight.to(torch.bfloat16))
    assert torch.equal(target.enc.stem.weight[:, :4], src.enc.stem.weight.to(torch.bfloat16))
    assert rep.cast["body.weight"] == ("float32", "bfloat16")
    assert rep.cast["enc.stem.weight"] == ("float32", "bfloat16")  # overlap reads are cast too
    assert "cast float32 -> bfloat16" in "\n".join(rep.summary_lines())


def test_size_mismatch_applies_to_configured_components_only(save_dir: str) -> None:
    torch.manual_seed(0)
    src = Vision(head=10)
    opt = torch.optim.Adam(src.parameters())
    sum(p.sum() for p in src.parameters()).backward()
    opt.step()
    with engine(save_dir) as eng:
        eng.save(1, model=src, optimizer=opt)
    target = Vision(head=12)
    topt = torch.optim.Adam(target.parameters())
    # model mismatches are resolved, optimizer state mismatches are not (components=("model",))
    with pytest.raises(LoadStrictnessError) as info:
        engine(save_dir, {"name": "size_mismatch", "options": {"policy": "skip"}}).load(model=target, optimizer=topt)
    assert info.value.component == "optim"
    target = Vision(head=12)
    topt = torch.optim.Adam(target.parameters())
    opts = {"policy": "skip", "components": ["model", "optim"]}
    result = engine(save_dir, {"name": "size_mismatch", "options": opts}).load(model=target, optimizer=topt)
    assert any("head.weight" in k for k in result.report["optim"].skipped)


def test_size_mismatch_invalid_policy_names_the_option(save_dir: str) -> None:
    with pytest.raises(PluginConfigError, match=r"(?s)'size_mismatch'.*policy") as info:
        engine(save_dir, {"name": "size_mismatch", "options": {"policy": "pad"}})
    assert "'error', 'skip' or 'overlap'" in str(info.value)
    with pytest.raises(PluginConfigError, match="polcy"):
        engine(save_dir, {"name": "size_mismatch", "options": {"polcy": "skip"}})


# -- plugins together --------------------------------------------------------------------------


def test_ema_and_size_mismatch_compose(save_dir: str) -> None:
    """EMA weights of an older, narrower stem: remap first, then overlap on the remapped key."""
    src = Diffusion(ema=True)
    fill(src, 1.0)
    save(save_dir, src)
    target = Diffusion(ema=False)
    target.net.blocks[0] = nn.Linear(6, 4)  # gained input features
    before = poison(target.net.blocks[0])
    opts = {"policy": "overlap", "patterns": ["net.blocks.0.weight"]}
    rep = warm(save_dir, "ema", {"name": "size_mismatch", "options": opts}).load(model=target).report["model"]
    assert rep.renamed["net.blocks.0.weight"] == "net_ema.blocks.0.weight"
    assert rep.overlap["net.blocks.0.weight"].saved_shape == (4, 4)
    w = target.net.blocks[0].weight
    assert torch.equal(w[:, :4], src.net_ema.blocks[0].weight)
    assert torch.equal(w[:, 4:], before["weight"][:, 4:])
    assert torch.equal(target.net.blocks[1].weight, src.net_ema.blocks[1].weight)


def test_report_partitions_keys_with_all_plugins(save_dir: str) -> None:
    src = nn.Sequential(TeLike(3, "dict"), Vision(in_ch=4))
    save(save_dir, src)
    target = nn.Sequential(TeLike(5, "dict"), Vision(in_ch=6))
    target.add_module("new", nn.Linear(1, 1))
    opts = {"policy": "overlap"}
    rep = engine(save_dir, {"name": "size_mismatch", "options": opts}, strict=False).load(model=target)
    r = rep.report["model"]
    groups = [set(r.loaded), set(r.overlap), set(r.skipped), set(r.missing)]
    dest = set(target.state_dict()) - {"0._extra_state"} | {"0._extra_state.version", "0._extra_state.amax"}
    assert set().union(*groups) == dest
    assert sum(len(g) for g in groups) == len(dest)
    assert set(r.missing) == {"new.weight", "new.bias"}
    assert re.search(r"model: \d+ loaded, 1 overlap, 2 skipped, 2 missing, 0 unexpected", rep.report.summary())


# -- docs/plugins.md ---------------------------------------------------------------------------

DOCS = ROOT / "docs" / "plugins.md"


def doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", DOCS.read_text(encoding="utf-8"), flags=re.DOTALL)


@pytest.fixture
def docs_plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The documented custom plugin, written to my_project/ckpt_plugins.py and importable."""
    (code,) = [b for b in doc_blocks("python") if "class StripWrapperPrefixes" in b]
    pkg = tmp_path / "docs_src" / "my_project"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "ckpt_plugins.py").write_text(code)
    monkeypatch.syspath_prepend(str(pkg.parent))
    for name in ("my_project", "my_project.ckpt_plugins"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield "my_project.ckpt_plugins:StripWrapperPrefixes"
    for name in ("my_project", "my_project.ckpt_plugins"):
        sys.modules.pop(name, None)


def test_docs_yaml_examples_are_valid_configs(docs_plugin_module: str) -> None:
    blocks = doc_blocks("yaml")
    assert len(blocks) >= 5
    for block in blocks:
        config = yaml.safe_load(block)
        with CheckpointEngine(config) as eng:  # validates every plugin's options, imports `path`
            listed = [p if isinstance(p, str) else p["name"] for p in config.get("plugins", [])]
            enabled = [p for p in config.get("plugins", []) if not (isinstance(p, dict) and not p.get("enabled", 1))]
            assert set(eng.plugin_names) >= {p if isinstance(p, str) else p["name"] for p in enabled}
            assert set(listed) <= {*eng.plugin_names, "te_extra_state"}


def test_docs_custom_remap_plugin_loads_prefixed_checkpoint(tmp_path: Path, docs_plugin_module: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    ckpt = tmp_path / "old_ddp_run" / "iter_000001000"
    stored = {f"module._orig_mod.{k}": v.clone() + 1 for k, v in model.state_dict().items()}
    stored["module._orig_mod.unused"] = torch.zeros(1)
    dcp.save(stored, checkpoint_id=str(ckpt / "model"))

    config = {
        "save_dir": str(tmp_path / "new"),
        "load_path": str(ckpt),
        "plugins": [{"name": "strip_wrapper_prefixes", "path": docs_plugin_module, "options": {}}],
    }
    result = CheckpointEngine(config).load(model=model)
    for k, v in model.state_dict().items():
        assert torch.equal(v, stored[f"module._orig_mod.{k}"]), k
    rep = result.report["model"]
    assert rep.renamed == {k: f"module._orig_mod.{k}" for k in model.state_dict()}
    assert rep.unexpected == ("module._orig_mod.unused",)
    assert "  renamed 0.* <- module._orig_mod.0.*" in rep.summary_lines()
    # without the plugin the same load fails, listing every key as missing
    with pytest.raises(LoadStrictnessError) as info:
        CheckpointEngine({**config, "plugins": []}).load(model=model)
    assert len(info.value.missing) == len(model.state_dict())


def test_docs_custom_remap_plugin_leaves_ambiguous_and_exact_keys(tmp_path: Path, docs_plugin_module: str) -> None:
    from my_project.ckpt_plugins import StripWrapperPrefixes  # type: ignore[import-not-found]

    plugin = StripWrapperPrefixes(StripWrapperPrefixes.Options())
    ctx = RemapContext(
        component="model",
        direction="load",
        storage_keys=frozenset({"module.a", "_orig_mod.a", "b", "module.b", "module.c"}),
        checkpoint_path="x",
        rank=0,
        world_size=1,
    )
    out = plugin.remap_keys(ctx=ctx, key_map={"a": "a", "b": "b", "c": "c", "d": "d"})
    assert out == {"a": "a", "b": "b", "c": "module.c", "d": "d"}  # ambiguous a, exact b, absent d
    save_ctx = RemapContext(
        component="model", direction="save", storage_keys=None, checkpoint_path="x", rank=0, world_size=1
    )
    assert plugin.remap_keys(ctx=save_ctx, key_map={"a": "a"}) is None


@pytest.mark.parametrize(
    "name, options",
    [
        ("te_extra_state", TeExtraStatePlugin.Options),
        ("ema", EmaPlugin.Options),
        ("size_mismatch", SizeMismatchPlugin.Options),
    ],
)
def test_docs_describe_every_builtin_option(name: str, options: type[Any]) -> None:
    text = DOCS.read_text(encoding="utf-8")
    section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
    for option in options.model_fields:
        assert f"| `{option}` |" in section, f"docs/plugins.md does not document {name}'s option {option!r}"


def test_ema_warm_start_then_a_restart_resumes_the_weights_as_saved(save_dir: str) -> None:
    """The documented fine-tune config (``save_dir``, ``load_path``, ``ema``): the first start
    reads the pretrained EMA weights into ``net``; after the run saved, a restart resumes its own
    ``latest`` and must restore the trained ``net`` with its optimizer state, not the EMA copy
    again (the original applies ``load_ema_to_reg`` on a warm start only)."""
    src = trained_checkpoint(save_dir)
    run = str(Path(save_dir).parent / "finetune")
    config = {"save_dir": run, "load_path": save_dir, "plugins": ["ema"], "strict": True}
    model = Diffusion(ema=True)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    with CheckpointEngine(config) as eng:
        assert eng.load(model=model, optimizer=opt).iteration == 0
        assert_net_equal(model.net, src.net_ema)
        # a step that moves ``net`` only (every parameter gets a gradient: the optimizer has state for all)
        (sum(p.sum() for p in model.net.parameters()) + 0 * sum(p.sum() for p in model.parameters())).backward()
        opt.step()
        eng.save(1, model=model, optimizer=opt)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(trained["net.blocks.0.weight"], trained["net_ema.blocks.0.weight"])

    restarted = Diffusion(ema=True)
    opt2 = torch.optim.AdamW(restarted.parameters(), lr=0.1)
    with CheckpointEngine(config) as eng:
        result = eng.load(model=restarted, optimizer=opt2)
    assert result.iteration == 1 and not result.report["model"].renamed
    assert any("not applied" in n for n in result.report["model"].notes)
    assert_state_dicts_equal(restarted.state_dict(), trained)
    # the run's own checkpoint named exactly (as the integrations resume one) is resumed, not remapped
    own = Diffusion(ema=True)
    with CheckpointEngine({**config, "load_path": str(Path(run) / "iter_000000001")}) as eng:
        assert not eng.load(model=own).report["model"].renamed
    assert_state_dicts_equal(own.state_dict(), trained)
    # every_load keeps the old behaviour for those who ask for it
    every = {**config, "plugins": [{"name": "ema", "options": {"when": "every_load"}}]}
    again = Diffusion(ema=True)
    with CheckpointEngine(every) as eng:
        eng.load(model=again)
    assert torch.equal(again.net.blocks[0].weight, trained["net_ema.blocks.0.weight"])
