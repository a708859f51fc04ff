"""The save folder's layout (``ckpt_engine/_format/layout.py``): the leftovers of crashed saves
removed when an engine starts, and the ``save_dir`` lock (``SaveDirLock``)."""

from __future__ import annotations

import errno
import logging
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _small_checkpoints import _ckpt, _latest, _listing, _load, _save, _state

from ckpt_engine import CheckpointEngine
from ckpt_engine._format.layout import SaveDirLock
from ckpt_engine.errors import SaveDirLockedError
from ckpt_engine.testing import assert_state_dicts_equal


def test_engine_start_removes_leftovers_and_nothing_else(save_dir: str, caplog: Any) -> None:
    saved = _save(save_dir, 1)
    partial = Path(save_dir, ".iter_000000002.partial", "model")
    partial.mkdir(parents=True)
    (partial / "__0_0.distcp").write_bytes(b"half written")
    Path(save_dir, ".iter_000000005.deleting").mkdir()
    keep = [
        Path(save_dir, ".cache"),
        Path(save_dir, ".iter_x.partial"),
        Path(save_dir, "iter_000000007"),  # an incomplete checkpoint is not ours to delete
        Path(save_dir, "notes.partial"),
    ]
    for p in keep:
        p.mkdir()
    Path(save_dir, "README.txt").write_text("mine")
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        engine = CheckpointEngine({"save_dir": save_dir})
    assert not Path(save_dir, ".iter_000000002.partial").exists()
    assert not Path(save_dir, ".iter_000000005.deleting").exists()
    assert all(p.exists() for p in keep) and Path(save_dir, "README.txt").exists()
    assert "removed" in caplog.text and ".iter_000000002.partial" in caplog.text
    result = engine.load(model=_state(9).model)
    assert result.iteration == 1
    del saved


def test_interrupted_resave_is_restored_at_start(save_dir: str) -> None:
    saved = _save(save_dir, 1)
    # A re-save of iteration 1 crashed between its two renames: the old one is parked aside.
    os.replace(_ckpt(save_dir, 1), Path(save_dir, ".iter_000000001.replaced.4242"))
    Path(save_dir, ".iter_000000001.partial").mkdir()
    result, fresh = _load(save_dir)
    assert result.iteration == 1
    assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[1])
    assert _listing(save_dir) == ["iter_000000001", "latest_checkpoint.txt"]


def test_leftovers_of_an_engine_that_is_saving_are_not_touched(save_dir: str) -> None:
    with CheckpointEngine({"save_dir": save_dir}) as saving:
        saving.save(1, **_state(1).objects())  # takes the lock
        in_flight = Path(save_dir, ".iter_000000002.partial")
        in_flight.mkdir()  # as if it were writing iteration 2 now
        CheckpointEngine({"save_dir": save_dir})  # e.g. an evaluation job starting up
        assert in_flight.exists()
    CheckpointEngine({"save_dir": save_dir})
    assert not in_flight.exists()


def test_engine_on_a_missing_folder_creates_nothing(tmp_path: Path) -> None:
    CheckpointEngine({"save_dir": str(tmp_path / "not" / "yet")}).load(model=_state(1).model)
    assert not (tmp_path / "not").exists()


def test_second_engine_saving_into_the_same_folder_gets_a_clear_error(save_dir: str) -> None:
    first = CheckpointEngine({"save_dir": save_dir})
    first.save(1, **_state(1).objects())
    second = CheckpointEngine({"save_dir": save_dir})
    with pytest.raises(SaveDirLockedError, match="is locked by another CheckpointEngine") as info:
        second.save(2, **_state(2).objects())
    assert save_dir in str(info.value) and f"pid {os.getpid()}" in str(info.value)
    assert _listing(save_dir) == ["iter_000000001", "latest_checkpoint.txt"]  # no file, no partial
    # Loading is not saving: a second engine may read while the first one saves.
    assert second.load(model=_state(9).model).iteration == 1
    first.save(3, **_state(3).objects())  # the holder keeps saving
    first.close()
    second.save(4, **_state(4).objects())  # released by close()
    assert _latest(save_dir) == "iter_000000004\n"
    second.close()


def test_lock_held_by_another_process_is_detected(save_dir: str) -> None:
    os.makedirs(save_dir)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); sys.stdin.read()",
            save_dir,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(SaveDirLockedError, match=rf"pid {holder.pid}"):
            CheckpointEngine({"save_dir": save_dir}).save(1, **_state(1).objects())
    finally:
        holder.communicate("")
    CheckpointEngine({"save_dir": save_dir}).save(1, **_state(1).objects())  # the holder exited


def test_lock_falls_back_to_a_lock_file_where_folders_cannot_be_locked(
    save_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    import ckpt_engine._format.layout as layout

    real_flock = layout._flock

    def nfs_like(fd: int) -> bool:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")  # what NFS says for a directory
        return real_flock(fd)

    monkeypatch.setattr(layout, "_flock", nfs_like)
    first = CheckpointEngine({"save_dir": save_dir})
    first.save(1, **_state(1).objects())
    assert Path(save_dir, ".ckpt_engine.lock").exists()
    with pytest.raises(SaveDirLockedError):
        CheckpointEngine({"save_dir": save_dir}).save(2, **_state(2).objects())
    first.close()

    def no_locks(fd: int) -> bool:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(layout, "_flock", no_locks)
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        CheckpointEngine({"save_dir": save_dir}).save(3, **_state(3).objects())
    assert "would not be detected" in caplog.text and _latest(save_dir) == "iter_000000003\n"


def test_lock_is_released_by_close_and_when_the_engine_is_dropped(save_dir: str) -> None:
    os.makedirs(save_dir)
    CheckpointEngine({"save_dir": save_dir}).save(1, **_state(1).objects())  # dropped at once
    probe = SaveDirLock(save_dir)
    assert probe.acquire()
    probe.release()
