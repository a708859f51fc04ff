"""The save side (``ckpt_engine/_engine/saver.py``): a write that fails, or a disk that fills,
fails the save and leaves nothing behind, and the next save succeeds."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _small_checkpoints import _latest, _listing, _load, _save, _state

from ckpt_engine import CheckpointEngine, CheckpointSaveError, hookimpl
from ckpt_engine.testing import assert_state_dicts_equal
from ckpt_engine.types import WriteResult


class _FailingWrite:
    """A ``write`` provider that writes with DCP but fails one component, like a full disk."""

    name = "failing_write"

    def __init__(self, component: str = "optim", error: OSError | None = None) -> None:
        self.component = component
        self.error = error or OSError(errno.ENOSPC, "No space left on device")
        self.armed = True

    @hookimpl
    def write(self, ctx: Any, state_dict: dict[str, Any]) -> WriteResult:
        writer = dcp.FileSystemWriter(ctx.path, sync_files=False)
        dcp.save(state_dict, storage_writer=writer, planner=ctx.planner)
        if self.armed and ctx.component == self.component:
            raise self.error
        return WriteResult(component=ctx.component, bytes_written=1, seconds=0.0)


def test_write_error_fails_the_save_and_leaves_nothing(save_dir: str) -> None:
    saved = _save(save_dir, 1)
    before = _listing(save_dir)
    plugin = _FailingWrite()
    with CheckpointEngine({"save_dir": save_dir}, plugins=[plugin]) as engine:
        with pytest.raises(CheckpointSaveError, match="No space left on device") as info:
            engine.save(2, **_state(2).objects())
        assert "iteration 2" in str(info.value)
        assert _listing(save_dir) == before and _latest(save_dir) == "iter_000000001\n"
        assert _load(save_dir)[0].iteration == 1
        plugin.armed = False  # space was freed: training continues, the next save succeeds
        engine.save(3, **_state(3).objects())
    result, _ = _load(save_dir, verify="checksums")
    assert result.iteration == 3 and result.verified
    del saved


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB tmpfs, where the machine allows mounting (root in a privileged container)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_real_disk_full(small_fs: Path) -> None:
    save_dir = str(small_fs / "ckpt")
    small = _state(1)
    big = torch.nn.Sequential(torch.nn.Linear(512, 600))  # ~1.2 MB of weights: does not fit
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, **small.objects())
        # DCP reports a full disk as ENOSPC or, from torch's zip writer, as "unexpected pos";
        # the engine adds the free space it saw before removing the uncommitted folder.
        with pytest.raises(CheckpointSaveError, match=r"No space left on device|disk full"):
            engine.save(2, model=big)
        assert _listing(save_dir) == ["iter_000000001", "latest_checkpoint.txt"]
        assert _latest(save_dir) == "iter_000000001\n"
        engine.save(3, **_state(3).objects())  # the space was given back: the next save works
    result, fresh = _load(save_dir, verify="checksums")
    assert result.iteration == 3 and result.verified
    assert_state_dicts_equal(dict(fresh.model.state_dict()), dict(_state(3).model.state_dict()))
