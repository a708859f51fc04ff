"""Where a load reads from (``ckpt_engine/_engine/resume.py``): a damaged or missing ``latest`` is
an error by default, and ``fallback_to_last_complete`` takes the newest checkpoint that passes
the checks."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from _small_checkpoints import MODEL_FILE, _ckpt, _flip, _load, _save, _state

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


def _flip_a_moment(save_dir: str, it: int) -> None:
    """Flip a byte in the data of an optimizer moment of checkpoint ``it``: found only as the load
    reads it (the sizes match), after the model component was read from the same checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    folder = _ckpt(save_dir, it) / "optim"
    stored = FileSystemReader(str(folder)).read_metadata().storage_data
    moment = next(i for k, i in stored.items() if k.fqn.endswith(".exp_avg"))
    _flip(folder / moment.relative_path, moment.offset + moment.length // 2)


def test_a_damaged_byte_found_while_reading_falls_back_with_the_option(save_dir: str, caplog: Any) -> None:
    """A flipped byte that only the read finds (``verify: read``, the default): an error by default,
    which says that values read before it may be in the model. With ``fallback_to_last_complete``
    the resume goes on to the newest checkpoint that loads, and its read replaces what the damaged
    one's had filled (the model was read from iteration 3 before its optimizer's damage was found),
    past a second damaged checkpoint too."""
    saved = _save(save_dir, 1, 2, 3)
    _flip_a_moment(save_dir, 3)
    with pytest.raises(CorruptCheckpointError, match=r"iter_000000003/optim/.*do not train on them"):
        _load(save_dir)
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        result, fresh = _load(save_dir, fallback_to_last_complete=True)
    assert (result.iteration, result.fell_back_from) == (2, str(_ckpt(save_dir, 3)))
    assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[2])
    want = _state(2).optimizer.state_dict()["state"]
    got = fresh.optimizer.state_dict()["state"]
    assert all(torch.equal(got[p][k], want[p][k]) for p in want for k in want[p]), "the optimizer is iteration 2's"
    assert "fell back to" in caplog.text and "iter_000000003" in caplog.text
    _flip_a_moment(save_dir, 2)
    result, fresh = _load(save_dir, fallback_to_last_complete=True)
    assert result.iteration == 1
    assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[1])
    _flip_a_moment(save_dir, 1)
    with pytest.raises(CorruptCheckpointError, match="found no other complete checkpoint"):
        _load(save_dir, fallback_to_last_complete=True)


def test_a_load_dir_naming_a_checkpoint_folder_resumes_it_whole_not_a_fresh_start(save_dir: str) -> None:
    """docs/reliability.md's branch from an older step: load_dir naming one checkpoint folder (it
    holds no latest_checkpoint.txt) started from scratch in silence. It resumes that checkpoint,
    every component, as latest would; a damaged one is refused as latest's is."""
    saved = _save(save_dir, 1, 2)
    result, fresh = _load(save_dir, load_dir=str(_ckpt(save_dir, 1)))
    assert (result.iteration, result.checkpoint_path, result.source) == (1, str(_ckpt(save_dir, 1)), "latest")
    assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[1])
    assert {"model", "optim", "scheduler", "trainer"} <= set(result.components)
    (_ckpt(save_dir, 1) / "model" / ".metadata").unlink()
    with pytest.raises(IncompleteCheckpointError, match="iter_000000001"):
        _load(save_dir, load_dir=str(_ckpt(save_dir, 1)))
