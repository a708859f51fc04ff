"""Crash-safe commits, the manifest, verification, fallback, retention, the save_dir lock, and
the faults a checkpoint must survive. Single process, except the last test (2 torchrun ranks,
``tests/dist_scripts/reliability_dist.py``); SIGKILL trials are in test_crash.py."""

from __future__ import annotations

import builtins
import errno
import io
import json
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

import ckpt_engine._engine.engine as engine_module
import ckpt_engine._format.retention as retention_module
from ckpt_engine import (
    CheckpointEngine,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    hookimpl,
)
from ckpt_engine._format.layout import SaveDirLock
from ckpt_engine._format.manifest import MANIFEST_FILE
from ckpt_engine._format.verify import verify_checkpoint
from ckpt_engine.errors import CheckpointPermissionError, IntegrityError, SaveDirLockedError
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal
from ckpt_engine.types import StagedState, WriteResult

MODEL_FILE = ("model", "__0_0.distcp")


def _state(seed: int) -> TinyTrainingState:
    return TinyTrainingState.create(seed=seed, steps=1)


def _save(save_dir: str, *iterations: int, **config: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Save each iteration with its own state (seed = iteration); returns model state by iteration."""
    out = {}
    with CheckpointEngine({"save_dir": save_dir, **config}) as engine:
        for it in iterations:
            state = _state(it)
            engine.save(it, **state.objects())
            out[it] = {k: v.clone() for k, v in state.model.state_dict().items()}
    return out


def _ckpt(save_dir: str, it: int) -> Path:
    return Path(save_dir, f"iter_{it:09}")


def _flip(path: Path, offset: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    i = len(raw) // 2 if offset is None else offset
    raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def _listing(save_dir: str) -> list[str]:
    return sorted(os.listdir(save_dir))


def _latest(save_dir: str) -> str:
    return Path(save_dir, "latest_checkpoint.txt").read_text()


def _load(save_dir: str, **config: Any) -> tuple[Any, TinyTrainingState]:
    fresh = _state(999)
    with CheckpointEngine({"save_dir": save_dir, **config}) as engine:
        result = engine.load(**fresh.objects())
    return result, fresh


# -- the manifest --------------------------------------------------------------------------------


def test_manifest_lists_every_file_with_size_and_checksum(save_dir: str) -> None:
    state = _state(3)
    CheckpointEngine({"save_dir": save_dir, "rng": False}).save(3, **state.objects(), extra={"rng": _Rng()})
    ckpt = _ckpt(save_dir, 3)
    doc = json.loads((ckpt / MANIFEST_FILE).read_text())
    on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    assert sorted(doc["files"]) == on_disk
    assert "model/.metadata" in doc["files"] and "rng/__0_0.distcp" in doc["files"]
    for rel, entry in doc["files"].items():
        data = (ckpt / rel).read_bytes()
        assert entry["size"] == len(data), rel
        assert entry["checksum"] == xxhash.xxh3_64(data).hexdigest(), rel  # an independent recomputation
    assert doc["checksum_algorithm"] == "xxh3_64"
    assert doc["iteration"] == 3 and doc["world_size"] == 1
    assert doc["components"] == ["model", "optim", "scheduler", "trainer", "rng"]
    assert doc["torch_version"] == torch.__version__ and doc["engine_version"]
    assert doc["total_bytes"] == sum(e["size"] for e in doc["files"].values())


class _Rng:
    def state_dict(self) -> dict[str, Any]:
        return {"state": torch.arange(5)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_manifest_never_breaks_plain_dcp_and_old_checkpoints_still_load(save_dir: str, caplog: Any) -> None:
    saved = _save(save_dir, 4)
    ckpt = _ckpt(save_dir, 4)
    # Each component folder is still exactly a DCP checkpoint: plain dcp.load reads it.
    sd = {k: torch.zeros_like(v) for k, v in saved[4].items()}
    dcp.load(sd, checkpoint_id=str(ckpt / "model"))
    assert_state_dicts_equal(sd, saved[4])
    # The same checkpoint without a manifest (as plain DCP or the original checkpointer write it)
    # loads, reported and logged as unverified, at verify='sizes'; verify='checksums' fails closed
    # unless allow_unverified says that is fine (tests/adversarial/test_adv_checksums.py).
    result, _ = _load(save_dir)
    assert result.verified
    (ckpt / MANIFEST_FILE).unlink()
    for config in ({"verify": "sizes"}, {"verify": "checksums", "allow_unverified": True}):
        with caplog.at_level(logging.INFO, logger="ckpt_engine"):
            result, fresh = _load(save_dir, **config)
        assert result.iteration == 4 and not result.verified
        assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[4])
    assert "unverified: no ckpt_engine_manifest.json" in caplog.text


def test_verify_checksums_catches_a_flipped_byte_before_any_tensor_is_loaded(
    save_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(save_dir, 2)
    victim = _ckpt(save_dir, 2).joinpath(*MODEL_FILE)
    _flip(victim)
    calls: list[Any] = []
    import ckpt_engine._engine.loader as loader_module

    real_load = loader_module.load_state_dict

    def counting_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader_module, "load_state_dict", counting_load)
    fresh = _state(999)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(IntegrityError, match="checksum") as info:
        CheckpointEngine({"save_dir": save_dir, "verify": "checksums"}).load(**fresh.objects())
    assert str(victim) in str(info.value) and "nothing was loaded" in str(info.value)
    assert calls == []  # DCP never started reading
    assert_state_dicts_equal(dict(fresh.model.state_dict()), before)
    # The default (sizes) does not read the data, so this flip goes unnoticed there.
    result, _ = _load(save_dir, verify="sizes")
    assert result.verified and len(calls) > 0


def test_verify_sizes_catches_a_grown_file_and_off_skips_the_manifest(save_dir: str) -> None:
    saved = _save(save_dir, 2)
    victim = _ckpt(save_dir, 2).joinpath(*MODEL_FILE)
    size = victim.stat().st_size
    with open(victim, "ab") as f:
        f.write(b"\0" * 10)  # complete by DCP's metadata, but not the file that was committed
    with pytest.raises(IntegrityError, match=rf"{size + 10} bytes, ckpt_engine_manifest.json says {size}") as info:
        _load(save_dir)  # default verify="sizes"
    assert str(victim) in str(info.value)
    result, fresh = _load(save_dir, verify="off")
    assert not result.verified
    assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[2])


def test_flipped_byte_with_verify_off_is_a_typed_error_naming_the_file(save_dir: str) -> None:
    _save(save_dir, 2)
    victim = _ckpt(save_dir, 2).joinpath(*MODEL_FILE)
    _flip(victim, offset=0)  # the first item's zip signature
    with pytest.raises(CorruptCheckpointError, match="is corrupt") as info:
        _load(save_dir, verify="off")
    assert str(victim) in str(info.value) and "'0." in str(info.value)


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (lambda m: m.write_text("{not json"), CorruptCheckpointError, "not valid JSON"),
        (lambda m: m.write_text('{"format": "x"}'), CorruptCheckpointError, "not a ckpt-engine manifest"),
        (
            lambda m: _edit_manifest(m, add={"../../etc/passwd": {"size": 1, "checksum": "00"}}),
            CorruptCheckpointError,
            "not a plain relative path",
        ),
        (
            lambda m: _edit_manifest(m, drop="model/__0_0.distcp"),
            IntegrityError,
            "needed by DCP metadata but not listed",
        ),
        (
            lambda m: _edit_manifest(m, add={"model/extra.bin": {"size": 3, "checksum": "00"}}),
            IntegrityError,
            "extra.bin is missing",
        ),
    ],
    ids=["garbage", "foreign", "path-escape", "omits-a-file", "lists-a-missing-file"],
)
def test_damaged_manifest_is_a_typed_error_naming_the_file(
    save_dir: str, damage: Any, error: type, message: str
) -> None:
    _save(save_dir, 2)
    manifest = _ckpt(save_dir, 2) / MANIFEST_FILE
    damage(manifest)
    with pytest.raises(error, match=message) as info:
        _load(save_dir)
    assert str(_ckpt(save_dir, 2)) in str(info.value)


def _edit_manifest(path: Path, *, add: dict[str, Any] | None = None, drop: str | None = None) -> None:
    doc = json.loads(path.read_text())
    doc["files"].update(add or {})
    if drop:
        del doc["files"][drop]
    path.write_text(json.dumps(doc))


def test_newer_manifest_version_loads_unverified(save_dir: str) -> None:
    _save(save_dir, 2)
    manifest = _ckpt(save_dir, 2) / MANIFEST_FILE
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "version": 99, "files": "a new layout"}))
    result, _ = _load(save_dir)
    assert result.iteration == 2 and not result.verified


def test_save_checksums_off_records_sizes_only(save_dir: str) -> None:
    _save(save_dir, 2, save_checksums=False)
    doc = json.loads((_ckpt(save_dir, 2) / MANIFEST_FILE).read_text())
    assert doc["checksum_algorithm"] is None
    assert all(e["checksum"] is None and e["size"] > 0 for e in doc["files"].values())
    assert _load(save_dir, verify="sizes")[0].verified
    assert not _load(save_dir, verify="checksums", allow_unverified=True)[0].verified  # cannot claim checksums
    report = verify_checkpoint(str(_ckpt(save_dir, 2)), "checksums")
    assert report.ok and not report.verified and "sizes only" in (report.unverified_reason or "")


def test_crc32_manifests_verify_too(save_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "DEFAULT_ALGORITHM", "crc32")  # e.g. written without xxhash
    _save(save_dir, 2)
    ckpt = _ckpt(save_dir, 2)
    assert json.loads((ckpt / MANIFEST_FILE).read_text())["checksum_algorithm"] == "crc32"
    assert _load(save_dir, verify="checksums")[0].verified
    _flip(ckpt.joinpath(*MODEL_FILE))
    with pytest.raises(IntegrityError, match="crc32 checksum"):
        _load(save_dir, verify="checksums")


def test_verify_checkpoint_reports_every_problem_and_never_raises(save_dir: str) -> None:
    _save(save_dir, 2)
    ckpt = _ckpt(save_dir, 2)
    seen: list[tuple[int, int]] = []
    report = verify_checkpoint(str(ckpt), "checksums", progress=lambda done, total: seen.append((done, total)))
    assert report.ok and report.verified and report.complete and report.problems == []
    assert report.files == len(json.loads((ckpt / MANIFEST_FILE).read_text())["files"])
    assert report.bytes == sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    assert seen[-1] == (report.bytes, report.bytes)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # monotonic

    _flip(ckpt.joinpath(*MODEL_FILE))
    _flip(ckpt / "optim" / "__0_0.distcp")
    assert verify_checkpoint(str(ckpt), "sizes").verified  # sizes cannot see flips
    report = verify_checkpoint(str(ckpt), "checksums")
    assert not report.verified and report.complete and len(report.problems) == 2
    assert "model/__0_0.distcp" in report.problems[0] and "optim/__0_0.distcp" in report.problems[1]

    (ckpt / "trainer" / ".metadata").unlink()
    report = verify_checkpoint(str(ckpt), "checksums")
    assert not report.complete and any("trainer/.metadata" in p for p in report.problems)
    report = verify_checkpoint(str(Path(save_dir, "iter_000000077")), "sizes")
    assert not report.complete and not report.ok and "does not exist" in report.problems[0]


# -- fallback to the newest complete checkpoint --------------------------------------------------


def _break_missing(save_dir: str) -> None:
    Path(save_dir, "latest_checkpoint.txt").write_text("iter_000000009\n")


def _break_incomplete(save_dir: str) -> None:
    (_ckpt(save_dir, 3) / "optim" / ".metadata").unlink()


def _break_garbage_latest(save_dir: str) -> None:
    Path(save_dir, "latest_checkpoint.txt").write_text("../../etc/passwd\n")


def _break_empty_latest(save_dir: str) -> None:
    Path(save_dir, "latest_checkpoint.txt").write_text("")


def _break_flipped(save_dir: str) -> None:
    _flip(_ckpt(save_dir, 3).joinpath(*MODEL_FILE))


@pytest.mark.parametrize(
    "breaker, error",
    [
        (_break_missing, CheckpointNotFoundError),
        (_break_incomplete, IncompleteCheckpointError),
        (_break_garbage_latest, CorruptCheckpointError),
        (_break_empty_latest, CorruptCheckpointError),
        (_break_flipped, IntegrityError),
    ],
    ids=["missing", "incomplete", "garbage-latest", "empty-latest", "flipped-byte"],
)
def test_bad_latest_is_an_error_by_default_and_falls_back_with_the_option(
    save_dir: str, breaker: Any, error: type, caplog: Any
) -> None:
    saved = _save(save_dir, 1, 2, 3)
    breaker(save_dir)
    with pytest.raises(error):
        _load(save_dir, verify="checksums")
    # iteration 3 is the newest, unless it is the damaged one
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        result, fresh = _load(save_dir, verify="checksums", fallback_to_last_complete=True)
    want = 2 if breaker in (_break_incomplete, _break_flipped) else 3
    assert result.iteration == want and result.checkpoint_path == str(_ckpt(save_dir, want))
    assert result.fell_back_from is not None and result.verified
    assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[want])
    assert "fell back to" in caplog.text and result.fell_back_from in caplog.text


def test_fallback_without_any_complete_checkpoint_is_a_clear_error(save_dir: str) -> None:
    _save(save_dir, 1)
    (_ckpt(save_dir, 1) / "model" / ".metadata").unlink()
    os.makedirs(_ckpt(save_dir, 0) / "model")  # an empty, older folder
    with pytest.raises(IncompleteCheckpointError, match="found no other complete checkpoint") as info:
        _load(save_dir, fallback_to_last_complete=True)
    assert "iter_000000000: IncompleteCheckpointError" in str(info.value)


def test_good_latest_never_falls_back(save_dir: str) -> None:
    _save(save_dir, 1, 2)
    result, _ = _load(save_dir, fallback_to_last_complete=True)
    assert result.iteration == 2 and result.fell_back_from is None


# -- retention -------------------------------------------------------------------------------------


def _iters(save_dir: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(save_dir) if n.startswith("iter_"))


def test_keep_last_and_keep_every(tmp_path: Path) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    saved = _save(a, *range(1, 7), keep_last=2)
    assert _iters(a) == [5, 6] and _latest(a) == "iter_000000006\n"
    _save(b, *range(1, 8), keep_last=1, keep_every=3)
    assert _iters(b) == [3, 6, 7]
    result, fresh = _load(a)
    assert result.iteration == 6
    assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[6])
    assert not [n for n in os.listdir(a) if n.startswith(".")]  # nothing half-deleted left


def test_keep_every_needs_keep_last() -> None:
    with pytest.raises(ValueError, match="keep_every is set without keep_last"):
        CheckpointEngine({"save_dir": "x", "keep_every": 5})


def test_retention_never_deletes_latest_nor_newer_checkpoints(save_dir: str) -> None:
    _save(save_dir, 1, 2, 3, 4, 5)
    # A rollback: the user pointed latest at 2 and resumed; 3..5 belong to the abandoned run.
    Path(save_dir, "latest_checkpoint.txt").write_text("iter_000000002\n")
    _save(save_dir, 3, keep_last=1, allow_overwrite=True)  # the resumed run saves 3 (replacing the old 3)
    assert _iters(save_dir) == [3, 4, 5]  # 1 and 2 deleted; 4, 5 (newer than latest) kept
    assert _latest(save_dir) == "iter_000000003\n"


def test_incomplete_checkpoints_do_not_count_towards_keep_last(save_dir: str) -> None:
    _save(save_dir, 1, 2)
    (_ckpt(save_dir, 2) / "model" / ".metadata").unlink()  # e.g. the original checkpointer crashed
    _save(save_dir, 3, keep_last=2)
    assert _iters(save_dir) == [1, 2, 3]  # keeps 3 and 1 (complete); 2 is inside the window
    _save(save_dir, 4, keep_last=2)
    assert _iters(save_dir) == [3, 4]


def test_failed_deletion_is_logged_and_retried_at_the_next_commit(
    save_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    real = retention_module.remove_checkpoint
    failures = iter([True])

    def flaky(path: str, store: Any = None) -> None:
        if next(failures, False):
            raise OSError(errno.EBUSY, "Device or resource busy", path)
        real(path, store)

    monkeypatch.setattr(retention_module, "remove_checkpoint", flaky)
    with (
        caplog.at_level(logging.WARNING, logger="ckpt_engine"),
        CheckpointEngine({"save_dir": save_dir, "keep_last": 1}) as engine,
    ):
        engine.save(1, **_state(1).objects())
        result = engine.save(2, **_state(2).objects()).result()
        assert result.succeeded  # never fatal
        assert _iters(save_dir) == [1, 2] and "retention could not delete" in caplog.text
        engine.save(3, **_state(3).objects())
        assert _iters(save_dir) == [3]


def test_retention_deletes_through_a_hidden_name_and_finishes_interrupted_deletions(
    save_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(save_dir, 1, 2)
    # A deletion that crashed after the rename: a hidden .deleting folder, never a half iter_1.
    os.replace(_ckpt(save_dir, 1), Path(save_dir, ".iter_000000001.deleting"))
    renames: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(
        retention_module.os, "replace", lambda a, b: (renames.append((str(a), str(b))), real_replace(a, b))[1]
    )
    _save(save_dir, 3, keep_last=1)
    assert _listing(save_dir) == ["iter_000000003", "latest_checkpoint.txt"]
    assert (str(_ckpt(save_dir, 2)), os.path.join(save_dir, ".iter_000000002.deleting")) in renames


# -- leftovers of crashed saves --------------------------------------------------------------------


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


# -- the save_dir lock -----------------------------------------------------------------------------


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


# -- faults during a save --------------------------------------------------------------------------


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


# -- read faults -----------------------------------------------------------------------------------


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


# -- loading writes nothing ------------------------------------------------------------------------


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


# -- 2 ranks -----------------------------------------------------------------------------------------


@pytest.mark.dist
def test_two_ranks_commit_verify_fallback_lock_and_one_rank_failures(tmp_path: Path) -> None:
    from _torchrun import run_torchrun

    # The ranks keep the default collective_timeout_s (600 s): a rank left waiting for one that
    # failed would outlast the launch's hang guard, so finishing shows that every rank raised.
    run = run_torchrun("reliability_dist.py", str(tmp_path / "ckpt"), timeout=120.0)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == [0, 1], run.describe()
    # rng is on by default: each rank's generators are a component of their own
    components = ("model", "optim", "rng", "trainer")
    names = [f"{c}/{f}" for c in components for f in (".metadata", "__0_0.distcp", "__1_0.distcp")]
    for rank in (0, 1):
        got = results[rank][0]
        what = f"rank {rank}"
        commit = got["commit"]
        assert commit["listing"] == ["iter_000000002", "iter_000000003", "latest_checkpoint.txt"], what
        assert commit["world_size"] == 2 and commit["files"] == names and commit["all_checksummed"], what
        assert got["verified"]["value"] == {"iteration": 3, "verified": True, "fell_back_from": None, "equal_to": [3]}
        flip = got["flip"]
        assert flip["raised"] == "IntegrityError" and "model/__1_0.distcp" in flip["message"], what
        assert "checksum" in flip["message"] and flip["untouched"], what
        fallback = got["fallback"]["value"]
        assert fallback["iteration"] == 2 and fallback["equal_to"] == [2] and fallback["verified"], what
        assert fallback["fell_back_from"].endswith("iter_000000003"), what
        # one rank fails: every rank raises a typed error naming the file
        read = got["read_error"]
        assert read["raised"] == "CheckpointLoadError" and "Input/output error" in read["message"], what
        assert "iter_000000002/model/__" in read["message"], what
        check = got["check_error"]
        assert check["raised"] == "CheckpointPermissionError", what
        assert "permission denied" in check["message"], what
        lock = got["lock"]
        assert lock["raised"] in ("SaveDirLockedError", "CheckpointSaveError"), what
        assert "SaveDirLockedError" in lock["message"] or "is locked by another" in lock["message"], what
        assert got["lock_after_close"]["value"] is True and got["lock_latest"] == "iter_000000002\n", what
        assert got["leftover_removed"], what
    # rank 0 runs the pre-load checks for every rank: the other ranks raise its error, saying so
    assert "(found by rank 0)" in results[1][0]["check_error"]["message"]


# -- trust_checkpoint --------------------------------------------------------------------------------


class LegacyValue:
    """A non-tensor value that weights_only=True refuses (a custom class), but harmless."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LegacyValue) and other.n == self.n


class _Legacy:
    def __init__(self, n: int) -> None:
        self.value = LegacyValue(n)

    def state_dict(self) -> dict[str, Any]:
        return {"value": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.value = sd["value"]


def test_trust_checkpoint_loads_legacy_values_and_says_so(save_dir: str, caplog: Any) -> None:
    CheckpointEngine({"save_dir": save_dir}).save(1, model=_state(1).model, extra={"legacy": _Legacy(42)})
    with pytest.raises(UnsafeCheckpointError, match="trust_checkpoint=True"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_state(2).model, extra={"legacy": _Legacy(0)})
    target = _Legacy(0)
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        CheckpointEngine({"save_dir": save_dir, "trust_checkpoint": True}).load(
            model=_state(2).model, extra={"legacy": target}
        )
    assert target.value == LegacyValue(42)
    assert "trust_checkpoint=True" in caplog.text and "runs any code" in caplog.text
