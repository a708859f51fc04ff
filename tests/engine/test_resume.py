"""Where a load reads from (``ckpt_engine/_engine/resume.py``): a damaged or missing ``latest`` is
an error by default, and ``fallback_to_last_complete`` takes the newest checkpoint that passes
the checks."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from _small_checkpoints import MODEL_FILE, _ckpt, _flip, _load, _save

from ckpt_engine import CheckpointNotFoundError, CorruptCheckpointError, IncompleteCheckpointError
from ckpt_engine.errors import IntegrityError
from ckpt_engine.testing import assert_state_dicts_equal


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
