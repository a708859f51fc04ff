"""Component state dicts: the model's own ``state_dict()`` stands in for DCP's
``get_model_state_dict`` only where the two were shown equal, and never after a change."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from ckpt_engine._engine import state as state_mod
from ckpt_engine._engine.state import TrainingObjects, apply_component, model_state_dict


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
    assert module in state_mod._PLAIN and dcp_calls == [1]
    model_state_dict([module])
    assert dcp_calls == [1]  # unchanged: DCP's walk skipped
    module[0].weight = nn.Parameter(torch.zeros(2, 3))  # new memory
    assert _same(model_state_dict([module]), get_model_state_dict(module)) and dcp_calls == [1, 1]
    module.add_module("extra", nn.Linear(2, 2))  # new keys
    assert _same(model_state_dict([module]), get_model_state_dict(module)) and dcp_calls == [1, 1, 1]
    compiled = torch.compile(module)
    assert list(model_state_dict([compiled])) == list(get_model_state_dict(module))


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
