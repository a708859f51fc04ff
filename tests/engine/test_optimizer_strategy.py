"""``optimizer_state_dicts``: optimizer-shaped keys for plugin property tests, drawn as the engine
saves an ``optim`` component, and the strategies re-exported from ``ckpt_engine.testing``."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpt_engine import testing
from ckpt_engine.testing import optimizer_state_dicts, plan_load, state_dicts

NO_TE = {"name": "te_extra_state", "enabled": False}


def described(sd: dict[str, Any]) -> dict[str, Any]:
    return {k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for k, v in sd.items()}


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_optimizer_shaped_keys_load_into_themselves(data: st.DataObject) -> None:
    params = data.draw(state_dicts(meta=True))
    optim = data.draw(optimizer_state_dicts(params))
    for key, value in optim.items():
        kind, fqn_and_name = key.split(".", 1)
        fqn, name = fqn_and_name.rsplit(".", 1)
        assert kind in ("state", "param_groups") and fqn in params
        if kind == "state" and name != "step":
            assert isinstance(value, torch.Tensor) and value.shape == params[fqn].shape
    report = plan_load(optim, described(optim), plugins=[NO_TE], component="optim", strict=True)
    assert set(report.loaded) == set(optim) and not report.missing and not report.unexpected


def test_the_strategies_are_importable_from_testing() -> None:
    from ckpt_engine import strategies

    for name in ("dotted_keys", "shapes", "state_dicts", "stored_like", "renamed_keys", "KeyRenames"):
        assert getattr(testing, name) is getattr(strategies, name)
