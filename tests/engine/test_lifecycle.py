"""Plugins' part in the engine's life (ckpt_engine.lifecycle): declared protocols, called in order."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ckpt_engine import CheckpointEngine, CkptEngineError, HookContractError, hookimpl
from ckpt_engine.lifecycle import Closeable, ClosesInTwoSteps, StartsInBackground
from ckpt_engine.types import SaveContext, StagedState


class Recorder:
    """Closeable and ClosesInTwoSteps, with no hook at all."""

    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name, self.log, self.fail = name, log, fail

    def begin_close(self) -> None:
        self.log.append(f"begin {self.name}")

    def close(self) -> None:
        self.log.append(f"close {self.name}")
        if self.fail:
            raise RuntimeError(f"{self.name} cannot close")


def test_a_plugin_without_hooks_is_closed_in_reverse_order_after_begin_close(save_dir: str) -> None:
    log: list[str] = []
    engine = CheckpointEngine({"save_dir": save_dir}, plugins=[Recorder("a", log), Recorder("b", log)])
    engine.save(1, model=torch.nn.Linear(2, 2))
    engine.close()
    engine.close()  # idempotent: nothing is called twice
    assert log == ["begin a", "begin b", "close b", "close a"]


def test_every_plugin_is_closed_and_the_first_failure_raised(save_dir: str) -> None:
    log: list[str] = []
    engine = CheckpointEngine({"save_dir": save_dir}, plugins=[Recorder("a", log), Recorder("b", log, fail=True)])
    with pytest.raises(CkptEngineError, match="closing plugins failed: b cannot close"):
        engine.close()
    assert log[-2:] == ["close b", "close a"]


class Stager:
    def __init__(self, limit: Any) -> None:
        self.max_saves_in_flight = limit

    @hookimpl
    def stage(self, ctx: SaveContext, state: Any) -> StagedState:
        return StagedState(state={k: dict(v) for k, v in state.items()})


@pytest.mark.parametrize("limit", [0, True, "2", 1.5])
def test_an_invalid_max_saves_in_flight_names_the_plugin(save_dir: str, limit: Any) -> None:
    engine = CheckpointEngine({"save_dir": save_dir}, plugins=[Stager(limit)])
    with pytest.raises(HookContractError, match=r"max_saves_in_flight must be an int >= 1"):
        engine.save(1, model=torch.nn.Linear(2, 2))
    engine.close()


def test_wait_ready_reaches_plugins_that_start_in_the_background(save_dir: str) -> None:
    class Starts:
        def wait_ready(self, timeout: float | None = None) -> float:
            return 0.25

    with CheckpointEngine({"save_dir": save_dir}, plugins=[Starts()]) as engine:
        assert engine.wait_ready() == 0.25
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        assert engine.wait_ready() == 0.0


def test_pinned_staging_declares_its_lifecycle() -> None:
    from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin

    for protocol in (Closeable, ClosesInTwoSteps, StartsInBackground):
        assert issubclass(PinnedStagingPlugin, protocol), protocol.__name__
    # A protocol with a property supports isinstance only; the class declares it as a property.
    assert isinstance(PinnedStagingPlugin.__dict__["max_saves_in_flight"], property)
