"""A process that can open the latest checkpoint folder read-only can take ``flock(LOCK_EX)`` on it
and hold it. Loads waited on the shared lock with no timeout, so every load hung; now they retry
for ``LOCK_WAIT_S`` and fail with a typed error naming the holder, and ``ls``/``verify`` (which take
no lock) are unaffected. The holder is a real second process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ckpt_engine import CheckpointEngine, CheckpointLockedError
from ckpt_engine._format import read_lock
from ckpt_engine.cli import main
from ckpt_engine.testing import TinyTrainingState

from ._adv import ckpt, save

HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECTORY)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the test closes our stdin
"""


@contextmanager
def held_exclusively(folder: Path) -> Iterator[int]:
    """A second process holding ``LOCK_EX`` on ``folder``; yields its pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
        yield proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)


@pytest.mark.timeout(120, method="thread")
def test_a_held_exclusive_lock_fails_the_load_naming_the_holder(
    save_dir: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    save(save_dir, 1)
    monkeypatch.setattr(read_lock, "LOCK_WAIT_S", 0.5)
    with held_exclusively(ckpt(save_dir, 1)) as pid:
        held = rf"iter_000000001 is held under an exclusive lock by pid {pid}"
        with pytest.raises(CheckpointLockedError, match=held):
            CheckpointEngine({"save_dir": save_dir}).load(**TinyTrainingState.create().objects())
        assert main(["ls", save_dir]) == 0
        assert main(["verify", str(ckpt(save_dir, 1))]) == 0
        capsys.readouterr()
    # Once the holder is gone, the same load works.
    result = CheckpointEngine({"save_dir": save_dir}).load(**TinyTrainingState.create().objects())
    assert result.iteration == 1


def test_the_wait_ends_as_soon_as_the_lock_is_released(save_dir: str) -> None:
    """A brief exclusive hold (what retention does) delays a load without failing it."""
    save(save_dir, 1)
    folder = ckpt(save_dir, 1)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    assert proc.stdin is not None
    proc.stdin.close()  # released while (or before) the load retries
    result = CheckpointEngine({"save_dir": save_dir}).load(**TinyTrainingState.create().objects())
    proc.wait(timeout=30)
    assert result.iteration == 1


def test_lock_holder_reads_the_pid_from_proc_locks(tmp_path: Path) -> None:
    import os

    with held_exclusively(tmp_path) as pid:
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            holder = read_lock.lock_holder(fd)
        finally:
            os.close(fd)
    assert holder is not None and holder.startswith(f"pid {pid} (python")
