"""A load racing retention: retention skips a checkpoint being read, and a load whose checkpoint
vanishes fails before it writes anything into the destination."""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

import ckpt_engine._engine.loader as engine_module
from adversarial._adv import ckpt, save
from ckpt_engine import CheckpointEngine, CheckpointNotFoundError
from ckpt_engine._format.layout import remove_checkpoint
from ckpt_engine._format.retention import apply_retention
from ckpt_engine.testing import TinyTrainingState


def test_retention_skips_a_checkpoint_that_is_being_read(save_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    save(save_dir, 1)
    reading, release = threading.Event(), threading.Event()
    real = engine_module.Loader._load_component

    def slow(self: Any, *args: Any, **kwargs: Any) -> Any:
        reading.set()
        assert release.wait(30)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(engine_module.Loader, "_load_component", slow)
    state = TinyTrainingState.create(seed=9, steps=0)
    outcome: dict[str, Any] = {}

    def loader() -> None:
        with CheckpointEngine({"save_dir": save_dir}) as engine:
            outcome["result"] = engine.load(**state.objects())

    thread = threading.Thread(target=loader)
    thread.start()
    assert reading.wait(30)
    save(save_dir, 2)  # latest moves on; keep_last=1 would delete iteration 1 ...
    result = apply_retention(save_dir, keep_last=1)
    assert result.deleted == [] and ckpt(save_dir, 1).is_dir()  # ... but it is being read
    release.set()
    thread.join(30)
    assert outcome["result"].iteration == 1
    assert apply_retention(save_dir, keep_last=1).deleted == [str(ckpt(save_dir, 1))]  # retried later


def test_a_checkpoint_deleted_as_the_load_begins_leaves_the_destination_untouched(
    save_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    save(save_dir, 1)
    state = TinyTrainingState.create(seed=9, steps=0)
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    real = engine_module.ReadLock.acquire

    def deleted_meanwhile(path: str, local: bool) -> Any:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)  # opened, then retention renamed it away
        remove_checkpoint(path)
        os.close(fd)
        return real(path, local)

    monkeypatch.setattr(engine_module.ReadLock, "acquire", staticmethod(deleted_meanwhile))
    with CheckpointEngine({"save_dir": save_dir}) as engine, pytest.raises(CheckpointNotFoundError):
        engine.load(**state.objects())
    assert all(state.model.state_dict()[k].equal(v) for k, v in before.items())
