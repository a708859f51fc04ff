"""``pinned_staging``'s writer heartbeat: a stopped writer fails its save once it has been silent
for ``heartbeat_timeout_s`` (not ``write_timeout_s``, 300 s by default), and a slow writer that keeps
beating is never failed by it. Real writer processes, stopped and continued with real signals.

The watchdog judges the writer on a :class:`ManualClock` the test advances itself, so no verdict
depends on how fast a loaded machine schedules the writer: each test waits for progress (a request
pending, a heartbeat heard, a save done), never for a guessed number of seconds.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin
from ckpt_engine_plugins.pinned_staging.process import WriterProcess
from torch import nn

from ckpt_engine import CheckpointEngine, CheckpointSaveError, SaveHandle

pytestmark = pytest.mark.full  # real writer processes, stopped and continued


class ManualClock:
    """A monotonic clock that moves only when the test says so."""

    def __init__(self) -> None:
        self._now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._now += seconds


def _until(condition: Callable[[], bool]) -> None:
    """Poll until ``condition`` holds; a hang is pytest-timeout's to report, not a guessed bound's."""
    while not condition():
        time.sleep(0.005)


def _writer(plugin: PinnedStagingPlugin) -> WriterProcess:
    writer = plugin._writer
    assert writer is not None
    return writer


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def plugin(clock: ManualClock) -> Iterator[PinnedStagingPlugin]:
    p = PinnedStagingPlugin(PinnedStagingPlugin.Options(heartbeat_timeout_s=3.0, write_timeout_s=300.0), clock=clock)
    yield p
    pid = p.writer_pid
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def test_a_stopped_writer_fails_the_save_after_the_heartbeat_timeout(
    plugin: PinnedStagingPlugin, clock: ManualClock, tmp_path: Path
) -> None:
    model = nn.Linear(64, 64)
    with CheckpointEngine({"save_dir": str(tmp_path)}, plugins=[plugin]) as engine:
        plugin.wait_ready()
        assert engine.save(1, model=model).result().succeeded
        pid = plugin.writer_pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        handle = engine.save(2, model=model)
        _until(lambda: _writer(plugin).oldest_pending_age() is not None)
        # Silent for 4 s of the watchdog's clock: past heartbeat_timeout_s (3 s), far below
        # write_timeout_s (300 s), so only the heartbeat rule can fail this save.
        clock.advance(4.0)
        with pytest.raises(CheckpointSaveError, match=r"sent no heartbeat .* heartbeat_timeout_s=3s.*stopped") as info:
            handle.result()
        assert f"pid {pid}" in str(info.value)
        assert (tmp_path / "latest_checkpoint.txt").read_text() == "iter_000000001\n"
        with pytest.raises(CheckpointSaveError):
            engine.wait()
        # a new writer takes over: the next save works
        assert engine.save(3, model=model).result().succeeded


def _throttle_until_done(plugin: PinnedStagingPlugin, clock: ManualClock, pid: int, handle: SaveHandle) -> float:
    """Cycle the stopped writer (1.5 s of the clock stopped, continued until its next beat is heard)
    until ``handle`` is done or it has been judged pending past twice the timeout; returns the
    longest pending age a watchdog round judged. The writer is left running."""
    heartbeat_s = 0.2  # the writer's beat interval: heartbeat_timeout_s / 10
    longest = 0.0
    _until(lambda: handle.done() or _writer(plugin).oldest_pending_age() is not None)
    while not handle.done() and longest <= 2 * 2.0:
        time.sleep(heartbeat_s)  # pacing only: the writer's next beat is due when it resumes
        clock.advance(1.5)
        age = _writer(plugin).oldest_pending_age()
        plugin._writers.watch(None)  # the watchdog's round at this instant
        assert plugin.writer_pid == pid, "a writer that beats every 1.5 s was killed"
        longest = max(longest, age or 0.0)
        heard_by = clock()
        os.kill(pid, signal.SIGCONT)
        _until(lambda: handle.done() or _writer(plugin).last_heard >= heard_by)  # noqa: B023 (called at once)
        if not handle.done() and longest <= 2 * 2.0:
            os.kill(pid, signal.SIGSTOP)
    os.kill(pid, signal.SIGCONT)
    return longest


def test_a_slow_writer_that_keeps_beating_is_never_failed(clock: ManualClock, tmp_path: Path) -> None:
    """The writer is stopped, 1.5 s pass on the watchdog's clock, it is continued until its next
    heartbeat arrives, and stopped again: its write stays pending for longer than
    ``heartbeat_timeout_s`` (2 s) while it is never silent for that long, so its save succeeds.

    A watchdog round runs at each instant the clock is moved, so the verdict is taken there, whatever
    the machine's load. A save that finished before it was pending past the timeout proves nothing
    and is followed by another (the writer runs a few milliseconds per cycle, so the first one
    almost always suffices)."""
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    plugin = PinnedStagingPlugin(
        PinnedStagingPlugin.Options(heartbeat_timeout_s=2.0, write_timeout_s=300.0), clock=clock
    )
    with CheckpointEngine({"save_dir": str(tmp_path), "keep_last": 2}, plugins=[plugin]) as engine:
        plugin.wait_ready()
        pid = plugin.writer_pid
        assert pid is not None
        longest_pending_judged = 0.0
        try:
            for iteration in range(1, 21):
                os.kill(pid, signal.SIGSTOP)
                handle = engine.save(iteration, model=model)
                longest_pending_judged = _throttle_until_done(plugin, clock, pid, handle)
                assert handle.result().succeeded
                if longest_pending_judged > 2.0:
                    break
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        assert longest_pending_judged > 2.0, "no save stayed pending past heartbeat_timeout_s in 20 tries"
        assert plugin.writer_pid == pid  # never replaced
    want = {k: v.clone() for k, v in model.state_dict().items()}
    fresh = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=fresh)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, want[k])
