"""``pinned_staging``'s writer heartbeat: a stopped writer fails its save within
``heartbeat_timeout_s`` (not ``write_timeout_s``, 300 s by default), and a slow writer that keeps
running is never failed by it. Real writer processes, stopped and continued with real signals.

Each test bounds its wait by ``result(timeout=...)`` far below ``write_timeout_s``: without the
heartbeat the stopped save would still be pending there, and ``result`` would raise
``TimeoutError`` instead of the writer's error.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin
from torch import nn

from ckpt_engine import CheckpointEngine, CheckpointSaveError

pytestmark = pytest.mark.full  # waits out heartbeat timeouts of stopped writers


@pytest.fixture
def plugin() -> Iterator[PinnedStagingPlugin]:
    p = PinnedStagingPlugin(PinnedStagingPlugin.Options(heartbeat_timeout_s=3.0, write_timeout_s=300.0))
    yield p
    pid = p.writer_pid
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_stopped_writer_fails_the_save_after_the_heartbeat_timeout(
    plugin: PinnedStagingPlugin, tmp_path: Path
) -> None:
    model = nn.Linear(64, 64)
    with CheckpointEngine({"save_dir": str(tmp_path)}, plugins=[plugin]) as engine:
        plugin.wait_ready()
        assert engine.save(1, model=model).result(timeout=120).succeeded
        pid = plugin.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        handle = engine.save(2, model=model)
        with pytest.raises(CheckpointSaveError, match=r"sent no heartbeat .* heartbeat_timeout_s=3s.*stopped") as info:
            handle.result(timeout=120)
        assert f"pid {pid}" in str(info.value)
        assert (tmp_path / "latest_checkpoint.txt").read_text() == "iter_000000001\n"
        with pytest.raises(CheckpointSaveError):
            engine.wait()
        # a new writer takes over: the next save works
        assert engine.save(3, model=model).result(timeout=120).succeeded


def test_a_slow_writer_that_keeps_running_is_never_failed(tmp_path: Path) -> None:
    """The writer is stopped for 1.2 s and continued for 30 ms, over and over, while it writes: it
    runs at a few percent of its speed but beats in every window, so its save succeeds."""
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(heartbeat_timeout_s=2.0, write_timeout_s=300.0))
    with CheckpointEngine({"save_dir": str(tmp_path)}, plugins=[plugin]) as engine:
        plugin.wait_ready()
        pid = plugin.writer_pid
        assert pid is not None
        done = threading.Event()
        stops = [0]

        def throttle() -> None:
            while not done.is_set():
                os.kill(pid, signal.SIGSTOP)
                stops[0] += 1
                done.wait(1.2)
                os.kill(pid, signal.SIGCONT)
                done.wait(0.03)

        thread = threading.Thread(target=throttle, daemon=True)
        thread.start()  # the writer is stopped before the save is submitted
        while stops[0] == 0:
            done.wait(0.01)
        handle = engine.save(1, model=model)
        try:
            result = handle.result(timeout=240)
            stopped_while_pending = stops[0]
        finally:
            done.set()
            thread.join()
            os.kill(pid, signal.SIGCONT)
        # pending across two stops (2.4 s): longer than heartbeat_timeout_s without the write finishing
        assert stopped_while_pending >= 2
        assert result.succeeded
        assert plugin.writer_pid == pid  # never replaced
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=fresh)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k])
