"""Component state dicts: the model's own ``state_dict()`` stands in for DCP's
``get_model_state_dict``, and the optimizer's own ``state_dict()`` for
``get_optimizer_state_dict``, only where the two were shown equal (for a module, by its tree
holding nothing DCP renames, or by comparing the two), and never after a change."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ckpt_engine import CheckpointEngine
from ckpt_engine._engine import state as state_mod
from ckpt_engine._engine.state import TrainingObjects, apply_component, model_state_dict, optim_state_dict
from ckpt_engine._engine.state import optim as optim_mod
from ckpt_engine.testing import assert_state_dicts_equal


class _WithEverything(nn.Module):
    """Buffers (one not persistent), a frozen parameter, tied weights and an extra state."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.block = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.block[0].bias.requires_grad_(False)
        self.register_buffer("steps", torch.tensor(3))
        self.register_buffer("scratch", torch.zeros(2), persistent=False)
        self.note = "kept"

    def get_extra_state(self) -> Any:
        return {"note": self.note}

    def set_extra_state(self, state: Any) -> None:
        self.note = state["note"]


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if list(a) != list(b):
        return False
    for k, x in a.items():
        y = b[k]
        if isinstance(x, torch.Tensor):
            if type(x) is not type(y) or x.data_ptr() != y.data_ptr() or x.shape != y.shape:
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("make", [_WithEverything, lambda: nn.Linear(3, 2)])
def test_plain_modules_give_what_dcp_gives_on_every_call(make: Any) -> None:
    module = make()
    first = model_state_dict([module])
    assert _same(first, get_model_state_dict(module))
    second = model_state_dict([module])  # the proven path
    assert module in state_mod._PLAIN
    assert _same(second, get_model_state_dict(module))


@pytest.fixture
def dcp_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of DCP's ``get_model_state_dict`` from the engine's state code."""
    calls: list[int] = []
    real = get_model_state_dict

    def counted(m: nn.Module) -> Any:
        calls.append(1)
        return real(m)

    monkeypatch.setattr(state_mod, "get_model_state_dict", counted)
    return calls


def test_a_wrapper_that_renames_keys_goes_to_dcp(dcp_calls: list[int]) -> None:
    inner = nn.Linear(3, 2)
    compiled = torch.compile(inner)  # state_dict() says `_orig_mod.weight`, DCP says `weight`
    sd = model_state_dict([compiled])
    assert list(sd) == ["weight", "bias"] and compiled not in state_mod._PLAIN
    model_state_dict([compiled])
    assert dcp_calls == [1, 1]  # asked again: never cached as plain
    assert compiled in state_mod._DCP_ONLY  # and its own state_dict() is no longer built to compare


def test_a_changed_module_is_shown_again(dcp_calls: list[int]) -> None:
    module = nn.Sequential(nn.Linear(3, 2))
    model_state_dict([module])
    assert module in state_mod._PLAIN and dcp_calls == []  # nothing in its tree that DCP renames
    model_state_dict([module])
    assert dcp_calls == []  # unchanged: DCP's walk skipped
    module[0].weight = nn.Parameter(torch.zeros(2, 3))  # new memory: shown again
    assert _same(model_state_dict([module]), get_model_state_dict(module))
    module.add_module("extra", nn.Linear(2, 2))  # new keys: shown again
    assert _same(model_state_dict([module]), get_model_state_dict(module))
    module.add_module("late", torch.compile(nn.Linear(2, 2)))  # a wrapper inside: DCP decides
    assert _same(model_state_dict([module]), get_model_state_dict(module)) and dcp_calls == [1]
    compiled = torch.compile(module)
    assert list(model_state_dict([compiled])) == list(get_model_state_dict(module))


def test_a_module_whose_tree_dcp_cannot_vouch_for_is_compared_once(
    dcp_calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the tree check cannot tell (``dcp_state_dict_is_own`` says no), the first call
    compares the module's own result with DCP's, and a module shown equal skips DCP after."""
    monkeypatch.setattr(state_mod, "dcp_state_dict_is_own", lambda module, sd: False)
    module = nn.Sequential(nn.Linear(3, 2))
    assert _same(model_state_dict([module]), get_model_state_dict(module)) and dcp_calls == [1]
    assert module in state_mod._PLAIN
    model_state_dict([module])
    assert dcp_calls == [1]


def test_applying_a_loaded_state_fills_plain_and_wrapped_modules_alike() -> None:
    for wrap in (lambda m: m, torch.compile):
        src, dst = _WithEverything(), _WithEverything()
        src.note = "loaded"
        with torch.no_grad():
            for p in src.parameters():
                p.add_(1.0)
        target = wrap(dst)
        objs = TrainingObjects(modules=[target])
        template = model_state_dict([target])
        loaded = model_state_dict([src])
        for k, v in template.items():
            if isinstance(v, torch.Tensor):
                v.copy_(loaded[k])  # what the in-place read does
            else:
                template[k] = loaded[k]
        apply_component(objs, "model", template, set())
        for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, k
        assert dst.note == "loaded"


def _load_in_place(dst: nn.Module, src: nn.Module) -> None:
    """What a load does: the template's tensors filled in place as the direct reader fills them
    (through their memory, which torch's version counters do not see), then handed back."""
    template = model_state_dict([dst])
    before = tuple(template.values())
    for k, v in src.state_dict().items():
        template[k].numpy()[...] = v.numpy()
    apply_component(TrainingObjects(modules=[dst]), "model", template, set(), before)


class _Hooked(nn.Linear):
    """Loads differently from a plain copy: a pre-hook counts, ``_load_from_state_dict`` scales."""

    def __init__(self) -> None:
        super().__init__(3, 2)
        self.calls = 0
        self._register_load_state_dict_pre_hook(self._count)

    def _count(self, *args: Any) -> None:
        self.calls += 1


class _Scaled(nn.Linear):
    def __init__(self) -> None:
        super().__init__(3, 2)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        with torch.no_grad():
            self.weight.mul_(2)


def test_a_load_filled_in_place_skips_the_self_copies_but_not_their_version_bump(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, dst = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)), nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model_state_dict([dst])  # shown plain
    called: list[int] = []
    real = nn.Module._load_from_state_dict

    def counted(self: nn.Module, *args: Any) -> None:
        called.append(1)
        real(self, *args)

    monkeypatch.setattr(nn.Module, "_load_from_state_dict", counted)  # still every class's own
    out = dst(torch.ones(1, 3)).sum()  # autograd saved the weights for backward
    versions = [p._version for p in dst.parameters()]
    _load_in_place(dst, src)
    assert not called
    for a, b in zip(src.parameters(), dst.parameters(), strict=True):
        assert torch.equal(a, b)
    assert all(p._version > v for p, v in zip(dst.parameters(), versions, strict=True))
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()  # as after load_state_dict: the saved weights changed


@pytest.mark.parametrize("make", [_Hooked, _Scaled, _WithEverything])
def test_a_module_that_loads_otherwise_still_gets_load_state_dict(make: Any) -> None:
    src, dst = make(), make()
    model_state_dict([dst])
    if isinstance(src, _WithEverything):  # a non-tensor extra state: set_extra_state must run
        src.note = "loaded"
        template = model_state_dict([dst])
        before = tuple(template.values())
        for k, v in model_state_dict([src]).items():
            if isinstance(v, torch.Tensor):
                template[k].copy_(v)
            else:
                template[k] = v
        apply_component(TrainingObjects(modules=[dst]), "model", template, set(), before)
        assert dst.note == "loaded"
        return
    with torch.no_grad():
        src.weight.fill_(1.0)
    _load_in_place(dst, src)
    if isinstance(dst, _Hooked):
        assert dst.calls == 1
    else:
        assert torch.equal(dst.weight, torch.full_like(dst.weight, 2.0))


# -- optimizers: the optimizer's own state_dict() named by the module's parameter names --------

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _stepped(module: nn.Module, optimizer: torch.optim.Optimizer, steps: int = 2) -> None:
    for _ in range(steps):
        optimizer.zero_grad()
        sum(p.float().sum() for p in module.parameters() if p.requires_grad).backward()  # type: ignore[union-attr]
        optimizer.step()


def _same_values(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Keys in order, the very same tensors, equal other values of the same type."""
    if list(a) != list(b):
        return False
    return all(
        (x is y) if isinstance(x, torch.Tensor) else (type(x) is type(y) and x == y)
        for x, y in zip(a.values(), b.values(), strict=True)
    )


@pytest.fixture
def dcp_optim_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """One entry per call of DCP's ``get_optimizer_state_dict`` from the engine's state code."""
    calls: list[int] = []
    real = get_optimizer_state_dict

    def counted(m: nn.Module, o: torch.optim.Optimizer, **kw: Any) -> Any:
        calls.append(1)
        return real(m, o, **kw)

    monkeypatch.setattr(optim_mod, "get_optimizer_state_dict", counted)
    return calls


def _groups(module: _WithEverything) -> list[dict[str, Any]]:
    """Two groups with their own hyperparameters; the frozen bias is in neither."""
    head = [p for n, p in module.named_parameters() if n.startswith("block.1")]
    rest = [p for n, p in module.named_parameters() if p.requires_grad and not n.startswith("block.1")]
    return [{"params": rest}, {"params": head, "lr": 0.5, "weight_decay": 0.0}]


@pytest.mark.parametrize(
    "make",
    [
        lambda m: torch.optim.AdamW(_groups(m), lr=1e-3),
        lambda m: torch.optim.SGD(_groups(m), lr=0.1, momentum=0.9),
        lambda m: torch.optim.Adagrad(_groups(m), lr=0.1),
        lambda m: torch.optim.Adam(_groups(m), lr=torch.tensor(1e-3), amsgrad=True),
    ],
)
def test_an_optimizer_of_a_plain_module_gives_what_dcp_gives_on_every_call(
    make: Any, dcp_optim_calls: list[int]
) -> None:
    module = _WithEverything()
    optimizer = make(module)
    _stepped(module, optimizer)
    first = optim_state_dict([module], [optimizer])
    assert dcp_optim_calls == [1] and optimizer in optim_mod._OWN_NAMES
    reference = get_optimizer_state_dict(module, optimizer, options=FLAT)
    assert _same_values(first, reference)
    _stepped(module, optimizer)
    second = optim_state_dict([module], [optimizer])  # the shown path: DCP not asked
    assert dcp_optim_calls == [1]
    assert _same_values(second, get_optimizer_state_dict(module, optimizer, options=FLAT))


def test_a_wrapper_that_renames_parameters_keeps_dcps_names(dcp_optim_calls: list[int]) -> None:
    inner = nn.Sequential(nn.Linear(3, 2))
    compiled = torch.compile(inner)  # named_parameters() says `_orig_mod.0.weight`, DCP says `0.weight`
    optimizer = torch.optim.AdamW(compiled.parameters())
    _stepped(compiled, optimizer)
    sd = optim_state_dict([compiled], [optimizer])
    assert "state.0.weight.exp_avg" in sd and not any("_orig_mod" in k for k in sd)
    optim_state_dict([compiled], [optimizer])
    assert dcp_optim_calls == [1, 1] and optimizer in optim_mod._OPTIM_DCP_ONLY


def test_a_changed_optimizer_or_module_is_shown_again(dcp_optim_calls: list[int]) -> None:
    module = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
    optimizer = torch.optim.AdamW(module[0].parameters())
    _stepped(module, optimizer)
    optim_state_dict([module], [optimizer])
    optim_state_dict([module], [optimizer])
    assert dcp_optim_calls == [1]
    optimizer.add_param_group({"params": list(module[1].parameters()), "lr": 0.5})  # new parameters
    _stepped(module, optimizer)
    sd = optim_state_dict([module], [optimizer])
    assert dcp_optim_calls == [1, 1] and "param_groups.1.weight.lr" in sd
    assert _same_values(sd, get_optimizer_state_dict(module, optimizer, options=FLAT))
    renamed = nn.ModuleDict({"first": module[0], "second": module[1]})  # the same tensors, new names
    sd = optim_state_dict([renamed], [optimizer])
    assert dcp_optim_calls == [1, 1, 1] and "state.first.weight.step" in sd
    assert _same_values(sd, get_optimizer_state_dict(renamed, optimizer, options=FLAT))


def test_a_stateless_optimizer_is_flattened_without_dcp_once_shown_equal(dcp_optim_calls: list[int]) -> None:
    """Plain SGD keeps no state: once DCP's result (taken without its fake step) was shown to be
    its own ``param_groups`` under the module's names, later saves build that directly, touch no
    gradient and bump no version counter."""
    module = _WithEverything()
    optimizer = torch.optim.SGD(_groups(module), lr=0.1)
    first = optim_state_dict([module], [optimizer])  # DCP without its state initialisation
    second = optim_state_dict([module], [optimizer])  # shown equal to our own: DCP not asked
    assert dcp_optim_calls == [1] and optimizer in optim_mod._OWN_NAMES
    versions = [p._version for p in module.parameters()]
    third = optim_state_dict([module], [optimizer])
    assert dcp_optim_calls == [1] and not optimizer.state
    assert [p._version for p in module.parameters()] == versions and all(p.grad is None for p in module.parameters())
    reference = get_optimizer_state_dict(module, optimizer, options=FLAT)
    for sd in (first, second, third):
        assert _same_values(sd, reference)
    optimizer.param_groups[1]["lr"] = 0.25  # hyper-parameters are read on every save
    assert optim_state_dict([module], [optimizer])["param_groups.block.1.weight.lr"] == 0.25
    renamed = nn.ModuleDict({"inner": module})  # new names: shown again
    sd = optim_state_dict([renamed], [optimizer])
    assert dcp_optim_calls == [1, 1] and "param_groups.inner.block.1.weight.lr" in sd


class _Nested(torch.optim.Optimizer):
    """Per-parameter state nested two levels deep (as Shampoo keeps it), and an int key."""

    def __init__(self, params: Any, note: Any = 1) -> None:
        super().__init__(params, {"lr": 0.1})
        self.note = note

    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                st.setdefault("step", 0)
                st["step"] += 1
                st["blocks"] = {0: {"left": torch.ones(2)}, "right": torch.zeros(1), "scale": 2.0}
                st["note"] = self.note


def test_nested_state_is_flattened_as_dcp_flattens_it_and_refused_values_raise_dcps_error(
    dcp_optim_calls: list[int],
) -> None:
    module = nn.Linear(2, 2)
    optimizer = _Nested(module.parameters())
    _stepped(module, optimizer)
    sd = optim_state_dict([module], [optimizer])
    optim_state_dict([module], [optimizer])
    assert dcp_optim_calls == [1] and "state.weight.blocks.0.left" in sd
    assert _same_values(sd, get_optimizer_state_dict(module, optimizer, options=FLAT))
    optimizer.note = "text"  # DCP's flattening refuses strings: its own error, not a silent save
    _stepped(module, optimizer)
    with pytest.raises(NotImplementedError, match="only supports"):
        optim_state_dict([module], [optimizer])


_BEFORE_ITS_FIRST_STEP = [
    lambda ps: torch.optim.AdamW(ps, lr=0.1),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5),
    lambda ps: torch.optim.RMSprop(ps, lr=0.01),
]


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(5, 4, generator=gen)).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("make", _BEFORE_ITS_FIRST_STEP, ids=["adamw", "sgd_momentum", "rmsprop"])
@pytest.mark.parametrize("staging", ["sync", "pinned_staging"])
def test_a_save_before_the_first_step_changes_nothing_and_resumes_exactly(
    tmp_path: Path, make: Any, staging: str
) -> None:
    """A save before the optimizer's first step (a step-0 checkpoint) ran DCP's state
    initialisation, a step with lr 0: AdamW came out of save() with step 1 and zero moments, so
    every later update's bias correction moved (momentum SGD and RMSprop likewise), and the
    checkpoint recorded a step never taken. The save must leave the optimizer as it was, and a
    resume from it must train as the uninterrupted run does."""
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    twin = copy.deepcopy(model)
    optimizer, twin_opt = make(model.parameters()), make(twin.parameters())
    config: dict[str, Any] = {"save_dir": str(tmp_path / "ckpt")}
    if staging == "pinned_staging":
        config["plugins"] = ["pinned_staging"]
    with CheckpointEngine(config) as engine:
        engine.save(0, model=model, optimizer=optimizer).result()
    assert not optimizer.state
    _train(model, optimizer, 3)
    _train(twin, twin_opt, 3)
    assert_state_dicts_equal(model.state_dict(), twin.state_dict())
    assert_state_dicts_equal(optimizer.state_dict(), twin_opt.state_dict())

    resumed = nn.Linear(4, 3)
    resumed_opt = make(resumed.parameters())
    _train(resumed, resumed_opt, 1)  # a used optimizer: the load gives it the saved one's (none)
    with CheckpointEngine(config) as engine:
        result = engine.load(model=resumed, optimizer=resumed_opt)
    assert result.iteration == 0 and not resumed_opt.state
    assert not (result.report["optim"].missing or result.report["optim"].unexpected)
    torch.manual_seed(0)
    reference = nn.Linear(4, 3)
    reference_opt = make(reference.parameters())
    _train(resumed, resumed_opt, 3)
    _train(reference, reference_opt, 3)
    assert_state_dicts_equal(resumed.state_dict(), reference.state_dict())
    assert_state_dicts_equal(resumed_opt.state_dict(), reference_opt.state_dict())


class _LateBranch(nn.Module):
    """``late`` gets gradients only from step 4 on: until then the optimizer holds no state of it."""

    def __init__(self) -> None:
        super().__init__()
        self.early, self.late = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = self.early(x)
        return self.late(h) if step > 3 else h


def _train_late(model: _LateBranch, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        optimizer.zero_grad()
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        model(x, step).square().mean().backward()
        optimizer.step()


@pytest.mark.parametrize("make", _BEFORE_ITS_FIRST_STEP, ids=["adamw", "sgd_momentum", "rmsprop"])
def test_a_parameter_the_optimizer_held_no_state_of_resumes_without_state(tmp_path: Path, make: Any) -> None:
    """A branch that had no gradient before the save has no optimizer state in the checkpoint.
    The strict load refused the valid checkpoint (its state keys missing), and with
    ``strict: false``, as the error advised, the branch resumed with DCP's made-up first state
    (AdamW: step 1, zero moments) and trained on differently from the uninterrupted run."""
    torch.manual_seed(0)
    reference = _LateBranch()
    saved, resumed = copy.deepcopy(reference), _LateBranch()
    reference_opt, saved_opt, resumed_opt = (make(m.parameters()) for m in (reference, saved, resumed))
    _train_late(reference, reference_opt, range(1, 7))
    _train_late(saved, saved_opt, range(1, 3))
    assert len(saved_opt.state) == 2  # early's weight and bias only
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(2, model=saved, optimizer=saved_opt)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        result = engine.load(model=resumed, optimizer=resumed_opt)
    assert not (result.report["optim"].missing or result.report["optim"].unexpected)
    assert set(resumed_opt.state) == {resumed.early.weight, resumed.early.bias}
    assert_state_dicts_equal(resumed_opt.state_dict(), saved_opt.state_dict())
    _train_late(resumed, resumed_opt, range(3, 7))
    assert_state_dicts_equal(resumed.state_dict(), reference.state_dict())
    assert_state_dicts_equal(resumed_opt.state_dict(), reference_opt.state_dict())


def test_a_ddp_wrapped_model_with_a_parameter_without_state_resumes_too(tmp_path: Path, one_rank_mesh: Any) -> None:
    """DCP names a DDP model's parameters without its ``module.`` prefix: the names the fix checked
    against still had it, so a DDP model fell back to the strict refusal."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    saved, resumed = DistributedDataParallel(_LateBranch()), DistributedDataParallel(_LateBranch())
    saved_opt, resumed_opt = torch.optim.AdamW(saved.parameters()), torch.optim.AdamW(resumed.parameters())
    _train_late(saved.module, saved_opt, range(1, 3))
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(2, model=saved, optimizer=saved_opt)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=resumed, optimizer=resumed_opt)
    assert set(resumed_opt.state) == {resumed.module.early.weight, resumed.module.early.bias}
    assert_state_dicts_equal(resumed_opt.state_dict(), saved_opt.state_dict())


def test_each_optimizer_is_judged_alone_where_one_stepped_and_another_did_not(tmp_path: Path) -> None:
    """A GAN's discriminator steps before its generator: the checkpoint holds the one's state and
    the other's groups only. The load must give the discriminator its state and leave the
    generator without any (the whole component was judged at once: a strict load missed the
    generator's state keys, a lenient one gave it a step never taken)."""
    torch.manual_seed(0)
    gen, disc = nn.ModuleDict({"g": nn.Linear(4, 4)}), nn.ModuleDict({"d": nn.Linear(4, 1)})
    opt_g, opt_d = torch.optim.AdamW(gen.parameters(), lr=0.1), torch.optim.AdamW(disc.parameters(), lr=0.1)
    disc["d"](torch.randn(2, 4)).sum().backward()
    opt_d.step()
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=[gen, disc], optimizer=[opt_g, opt_d])
    assert not opt_g.state and len(opt_d.state) == 2
    gen2, disc2 = nn.ModuleDict({"g": nn.Linear(4, 4)}), nn.ModuleDict({"d": nn.Linear(4, 1)})
    opt_g2, opt_d2 = torch.optim.AdamW(gen2.parameters(), lr=0.5), torch.optim.AdamW(disc2.parameters(), lr=0.5)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=[gen2, disc2], optimizer=[opt_g2, opt_d2])
    assert not opt_g2.state and opt_g2.param_groups[0]["lr"] == 0.1
    assert_state_dicts_equal(opt_d2.state_dict(), opt_d.state_dict())


class _PerClassCounts:
    """An extra whose state holds dicts keyed by int (counts per class, a tensor per class)."""

    def __init__(self, counts: dict[int, int], weights: dict[int, torch.Tensor]) -> None:
        self.counts, self.weights = counts, weights
        self.received: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"counts": dict(self.counts), "weights": dict(self.weights), "text": {"007": 7, "²": 2}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.received = sd


def test_int_keys_of_an_extras_and_a_schedulers_state_load_under_their_int_keys(tmp_path: Path) -> None:
    """DCP's flattening names nested items by string paths, and its load set ``"1": 22`` beside
    the template's ``1: 0``: the object read the stale 0. MultiStepLR's milestones (a Counter of
    ints) got both too."""
    saved = _PerClassCounts({0: 11, 1: 22, -2: 33}, {3: torch.arange(4.0)})
    model = nn.Linear(2, 2)
    optim = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.MultiStepLR(optim, milestones=[2, 5], gamma=0.5)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=model, scheduler=sched, extra={"classes": saved})
    fresh = _PerClassCounts({0: 0, 1: 0, -2: 0}, {3: torch.zeros(4)})
    fresh_sched = torch.optim.lr_scheduler.MultiStepLR(torch.optim.SGD(model.parameters(), lr=1.0), milestones=[2, 5])
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=nn.Linear(2, 2), scheduler=fresh_sched, extra={"classes": fresh})
    assert fresh.received is not None
    assert fresh.received["counts"] == {0: 11, 1: 22, -2: 33}
    assert list(fresh.received["weights"]) == [3] and torch.equal(fresh.received["weights"][3], torch.arange(4.0))
    assert fresh.received["text"] == {"007": 7, "²": 2}  # string keys stay strings ("²".isdigit() is true)
    assert dict(fresh_sched.milestones) == {2: 1, 5: 1}


class _Offsets:
    """Per-shard offsets filled as training goes (``as_pairs``: kept under one key)."""

    def __init__(self, offsets: dict[str, int], *, as_pairs: bool) -> None:
        self.offsets, self.as_pairs = offsets, as_pairs

    def state_dict(self) -> dict[str, Any]:
        return {"offsets": sorted(self.offsets.items()) if self.as_pairs else dict(self.offsets)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.offsets = dict(sd["offsets"])


@pytest.mark.parametrize("as_pairs", [False, True])
def test_state_an_extra_does_not_ask_for_at_the_load_is_said_not_dropped_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, as_pairs: bool
) -> None:
    """A dict that grew during training: a fresh object's ``state_dict()`` lists none of the saved
    keys, so the load read none of them and said so only in the report. It is now a warning naming
    the keys and the fix; kept under one key (a list of pairs) the state loads whole."""
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(
            1, model=nn.Linear(2, 2), extra={"data": _Offsets({"shard-0": 12, "shard-1": 7}, as_pairs=as_pairs)}
        )
    fresh = _Offsets({}, as_pairs=as_pairs)
    with caplog.at_level("WARNING", logger="ckpt_engine"), CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=nn.Linear(2, 2), extra={"data": fresh})
    warned = [r.getMessage() for r in caplog.records if "did not list" in r.getMessage()]
    if as_pairs:
        assert fresh.offsets == {"shard-0": 12, "shard-1": 7} and not warned
    else:
        assert fresh.offsets == {}
        assert len(warned) == 1 and "extra 'data'" in warned[0] and "offsets.shard-0" in warned[0], warned
