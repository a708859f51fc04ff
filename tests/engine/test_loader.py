"""The reading side of a load (``ckpt_engine/_engine/loader.py``): damaged, missing or unreadable
files are typed errors naming the file, and a load opens nothing for writing, even on a read-only
filesystem."""

from __future__ import annotations

import builtins
import errno
import io
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _small_checkpoints import MODEL_FILE, _ckpt, _flip, _load, _save, _state

from ckpt_engine import CheckpointEngine, CheckpointSaveError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_engine._format.verify import verify_checkpoint
from ckpt_engine.errors import CheckpointPermissionError
from ckpt_engine.testing import assert_state_dicts_equal


def test_flipped_byte_with_verify_off_is_a_typed_error_naming_the_file(save_dir: str) -> None:
    _save(save_dir, 2)
    victim = _ckpt(save_dir, 2).joinpath(*MODEL_FILE)
    _flip(victim, offset=0)  # the first item's zip signature
    with pytest.raises(CorruptCheckpointError, match="is corrupt") as info:
        _load(save_dir, verify="off")
    assert str(victim) in str(info.value) and "'0." in str(info.value)


def test_permission_denied_is_a_typed_error_naming_the_file(save_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(save_dir, 1)
    victim = str(_ckpt(save_dir, 1).joinpath(*MODEL_FILE))
    real_open, real_os_open = builtins.open, os.open

    def deny_open(file: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(file) == victim:
            raise PermissionError(errno.EACCES, "Permission denied", victim)
        return real_open(file, *args, **kwargs)

    def deny_os_open(path: Any, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path) == victim:
            raise PermissionError(errno.EACCES, "Permission denied", victim)
        return real_os_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", deny_open)
    monkeypatch.setattr(io, "open", deny_open)
    monkeypatch.setattr(os, "open", deny_os_open)
    for level in ("off", "checksums"):
        with pytest.raises(CheckpointPermissionError, match="permission denied") as info:
            _load(save_dir, verify=level)
        assert victim in str(info.value)
        assert isinstance(info.value, PermissionError)
    victim = os.path.join(save_dir, "latest_checkpoint.txt")
    with pytest.raises(CheckpointPermissionError, match=r"latest_checkpoint\.txt"):
        _load(save_dir)


def test_missing_data_file_is_a_typed_error_naming_it(save_dir: str) -> None:
    _save(save_dir, 1)
    victim = _ckpt(save_dir, 1) / "optim" / "__0_0.distcp"
    victim.unlink()
    with pytest.raises(IncompleteCheckpointError, match="is missing") as info:
        _load(save_dir)
    assert str(victim) in str(info.value)


def _tree(root: str) -> dict[str, tuple[int, int, int]]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, name))
            out[os.path.join(dirpath, name)] = (st.st_size, st.st_mtime_ns, st.st_mode)
    st = os.lstat(root)
    out[root] = (st.st_size, st.st_mtime_ns, st.st_mode)
    return out


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def test_load_opens_nothing_for_writing_and_changes_nothing(save_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    saved = _save(save_dir, 1, 2)
    Path(save_dir, ".iter_000000003.partial").mkdir()  # a leftover in the load_dir stays: not ours
    before = _tree(save_dir)
    writes: list[str] = []
    real_open, real_os_open = builtins.open, os.open

    def audit_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if isinstance(file, (str, os.PathLike)) and os.fspath(file).startswith(save_dir) and set(mode) & set("wax+"):
            writes.append(f"open({file!r}, {mode!r})")
        return real_open(file, mode, *args, **kwargs)

    def audit_os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> Any:
        if os.fspath(path).startswith(save_dir) and flags & _WRITE_FLAGS:
            writes.append(f"os.open({path!r}, {flags:#o})")
        return real_os_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", audit_open)
    monkeypatch.setattr(io, "open", audit_open)
    monkeypatch.setattr(os, "open", audit_os_open)
    for level in ("off", "sizes", "checksums"):
        result, fresh = _load(str(Path(save_dir).parent / "elsewhere"), load_dir=save_dir, verify=level)
        assert result.iteration == 2
        assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[2])
    assert writes == []
    assert _tree(save_dir) == before


@pytest.fixture
def read_only_copy(tmp_path: Path) -> Iterator[Path]:
    """A checkpoint folder behind a read-only bind mount (root ignores permission bits)."""
    src = tmp_path / "ckpt"
    _save(str(src), 1)
    proc = subprocess.run(["mount", "--bind", str(src), str(src)], capture_output=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {proc.stderr.decode().strip()}")
    try:
        ro = subprocess.run(["mount", "-o", "remount,ro,bind", str(src)], capture_output=True)
        if ro.returncode != 0:
            pytest.skip(f"cannot remount read-only: {ro.stderr.decode().strip()}")
        yield src
    finally:
        subprocess.run(["umount", "-l", str(src)], check=False)


def test_load_from_a_read_only_filesystem(read_only_copy: Path) -> None:
    with pytest.raises(OSError, match="Read-only file system"):
        (read_only_copy / "probe").write_text("x")
    before = _tree(str(read_only_copy))
    for level in ("off", "sizes", "checksums"):
        # save_dir itself read-only: an evaluation job that never saves
        result, fresh = _load(str(read_only_copy), verify=level, fallback_to_last_complete=True)
        assert result.iteration == 1 and result.verified == (level != "off")
        assert_state_dicts_equal(dict(fresh.model.state_dict()), dict(_state(1).model.state_dict()))
    assert verify_checkpoint(str(read_only_copy / "iter_000000001")).verified
    assert _tree(str(read_only_copy)) == before
    with pytest.raises(CheckpointSaveError, match="Read-only file system"):
        CheckpointEngine({"save_dir": str(read_only_copy)}).save(2, **_state(2).objects())
