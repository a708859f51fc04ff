"""Hostile or untrusted stored values (``ckpt_engine/_dcpio/unsafe.py``): a non-tensor value that
``weights_only`` refuses is an ``UnsafeCheckpointError`` unless ``trust_checkpoint`` is set."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from _small_checkpoints import _state

from ckpt_engine import CheckpointEngine, UnsafeCheckpointError


class LegacyValue:
    """A non-tensor value that weights_only=True refuses (a custom class), but harmless."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LegacyValue) and other.n == self.n


class _Legacy:
    def __init__(self, n: int) -> None:
        self.value = LegacyValue(n)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["value"]


def test_trust_checkpoint_loads_legacy_values_and_says_so(save_dir: str, caplog: Any) -> None:
    CheckpointEngine({"save_dir": save_dir}).save(1, model=_state(1).model, extra={"legacy": _Legacy(42)})
    with pytest.raises(UnsafeCheckpointError, match="trust_checkpoint=True"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_state(2).model, extra={"legacy": _Legacy(0)})
    target = _Legacy(0)
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        CheckpointEngine({"save_dir": save_dir, "trust_checkpoint": True}).load(
            model=_state(2).model, extra={"legacy": target}
        )
    assert target.value == LegacyValue(42)
    assert "trust_checkpoint=True" in caplog.text and "runs any code" in caplog.text
