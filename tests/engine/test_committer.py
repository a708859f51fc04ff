"""The end of a save (``ckpt_engine/_engine/committer.py``): a commit on the commit thread writes
the manifest, applies retention and reports a background write's error."""

from __future__ import annotations

import errno
import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _small_checkpoints import _ckpt, _iters, _latest, _listing, _load, _state

from ckpt_engine import CheckpointEngine, CheckpointSaveError, hookimpl
from ckpt_engine._format.verify import verify_checkpoint
from ckpt_engine.types import StagedState, WriteResult


class _BackgroundWrite:
    """Stages copies and writes in a thread (like an async writer); fails while ``fail`` is set."""

    name = "background_write"

    def __init__(self) -> None:
        self.fail = False

    @hookimpl
    def stage(self, ctx: Any, state: Any) -> StagedState:
        return StagedState(components={k: _copy(v) for k, v in state.items()}, is_copy=True)

    @hookimpl
    def write(self, ctx: Any, state_dict: dict[str, Any]) -> Future[WriteResult]:
        fut: Future[WriteResult] = Future()

        def run() -> None:
            try:
                time.sleep(0.02)
                dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(ctx.path), planner=ctx.planner)
                if self.fail and ctx.component == "optim":
                    raise OSError(errno.EIO, "Input/output error")
                fut.set_result(WriteResult(component=ctx.component, bytes_written=1, seconds=0.0))
            except BaseException as err:
                fut.set_exception(err)

        threading.Thread(target=run).start()
        return fut


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


def test_background_commit_writes_the_manifest_applies_retention_and_reports_errors(save_dir: str) -> None:
    plugin = _BackgroundWrite()
    with CheckpointEngine({"save_dir": save_dir, "keep_last": 1}, plugins=[plugin]) as engine:
        for it in (1, 2):
            engine.save(it, **_state(it).objects())
        engine.wait()
        assert _iters(save_dir) == [2]
        assert verify_checkpoint(str(_ckpt(save_dir, 2))).verified
        plugin.fail = True
        handle = engine.save(3, **_state(3).objects())
        with pytest.raises(CheckpointSaveError, match=r"iteration 3 .* failed: .*Input/output error"):
            engine.wait()
        with pytest.raises(CheckpointSaveError, match="Input/output error"):
            handle.result()
        assert _listing(save_dir) == ["iter_000000002", "latest_checkpoint.txt"]
        plugin.fail = False
        engine.save(4, **_state(4).objects()).result()
    assert _latest(save_dir) == "iter_000000004\n" and _load(save_dir, verify="checksums")[0].verified
