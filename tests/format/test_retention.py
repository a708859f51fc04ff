"""Retention (``ckpt_engine/_format/retention.py``): ``keep_last`` / ``keep_every`` after a commit,
never ``latest`` nor newer checkpoints, deletions through a hidden name, retried when they fail."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from typing import Any

import pytest
from _small_checkpoints import _ckpt, _iters, _latest, _listing, _load, _save, _state

import ckpt_engine._format.retention as retention_module
from ckpt_engine import CheckpointEngine
from ckpt_engine.testing import assert_state_dicts_equal


def test_keep_last_and_keep_every(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with caplog.at_level(logging.INFO, logger="ckpt_engine"):
        saved = _save(a, *range(1, 7), keep_last=2)
    # each deletion names its folder (a two-tier save keeps a local copy's and the store's apart)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("retention deleted")]
    assert said and all(m.endswith(f" in {a}") for m in said), said
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
