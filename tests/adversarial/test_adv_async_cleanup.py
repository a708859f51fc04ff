"""A background save that fails on one component while another is still being written: the engine
lets that write end before removing the uncommitted folder, and the next save proceeds."""

from __future__ import annotations

import copy
import errno
import os
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from adversarial._adv import load
from ckpt_engine import (
    CheckpointEngine,
    CheckpointSaveError,
    SaveContext,
    StagedState,
    WriteContext,
    WriteResult,
    hookimpl,
)
from ckpt_engine.defaults import DefaultIO
from ckpt_engine.testing import TinyTrainingState


class _SlowAsyncIO:
    """Background writes (one thread per component); while ``fail`` is set, ``model`` fails at
    once with ENOSPC while ``optim`` is still writing (as a writer process does)."""

    name = "slow_async_io"

    def __init__(self) -> None:
        self.fail = True
        self.running = 0
        self.lock = threading.Lock()

    @hookimpl
    def stage(self, ctx: SaveContext, state: Any) -> StagedState:
        return StagedState(components=copy.deepcopy(dict(state)), is_copy=True)

    @hookimpl
    def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> Future[WriteResult]:
        future: Future[WriteResult] = Future()

        def run() -> None:
            with self.lock:
                self.running += 1
            try:
                if self.fail and ctx.component == "model":
                    raise OSError(errno.ENOSPC, "No space left on device")
                if self.fail:
                    time.sleep(0.5)  # still writing when model has failed
                future.set_result(DefaultIO().write(ctx, state_dict))
            except Exception as err:
                future.set_exception(err)
            finally:
                with self.lock:
                    self.running -= 1

        threading.Thread(target=run, daemon=True).start()
        return future


def test_failed_background_save_is_cleaned_up_and_the_next_save_proceeds(save_dir: str) -> None:
    plugin = _SlowAsyncIO()
    state = TinyTrainingState.create(seed=4, steps=1)
    with CheckpointEngine({"save_dir": save_dir}, plugins=[plugin]) as engine:
        failed = engine.save(1, **state.objects())
        while not failed.done():
            time.sleep(0.01)
        assert plugin.running == 0  # no write of the failed save was still running at cleanup
        assert sorted(os.listdir(save_dir)) == [], os.listdir(save_dir)  # no .iter_000000001.partial left
        plugin.fail = False
        engine.save(2, **state.objects()).result()  # not the old error: this save happens
        with pytest.raises(CheckpointSaveError, match="iteration 1"):
            engine.wait()  # the earlier failure, whose handle nobody asked: reported once, here
        engine.wait()
    result, _ = load(save_dir)
    assert result.iteration == 2
