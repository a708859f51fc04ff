"""Lightning pointer files are checked, never just believed (``EngineCheckpointIO``).

A pointer names ``<save_dir>/iter_N`` and claims iteration ``N``; before this was checked, a
pointer planted in the checkpoint folder (or another run's ``last.ckpt``) resumed another run's
checkpoint, a pointer claiming step 8 loaded step 16, a FIFO ``*.ckpt`` hung every load and
``save_top_k`` removal in its folder, and removing one ``ModelCheckpoint`` folder's pointer
deleted the engine checkpoint a second folder's pointer still named.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from ckpt_engine import ArgumentTypeError, CorruptCheckpointError
from ckpt_engine.integrations.lightning import (
    MAX_STRUCTURE_DEPTH,
    POINTER_FOLDERS_FILE,
    EngineCheckpointIO,
    PointerMismatchError,
    parse_structure,
    read_pointer,
)


def _checkpoint(step: int) -> dict[str, Any]:
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((4,), float(step))}}


def _run(root: Path, steps: tuple[int, ...] = (4, 8)) -> EngineCheckpointIO:
    """Saves ``steps`` through a fresh IO, each under ``root/ckpts/step=N.ckpt``; torn down."""
    io = EngineCheckpointIO({"save_dir": str(root / "engine")})
    for step in steps:
        io.save_checkpoint(_checkpoint(step), str(root / "ckpts" / f"step={step}.ckpt"))
    io.teardown()
    return io


def _write_pointer(path: Path, **fields: Any) -> Path:
    path.write_text(json.dumps({"format": "ckpt-engine/lightning", **fields}))
    return path


def test_another_runs_pointer_is_refused_unless_allowed_and_then_named(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    _run(ours, (4,))
    _run(theirs, (4, 8))
    planted = ours / "ckpts" / "planted.ckpt"
    shutil.copy(theirs / "ckpts" / "step=8.ckpt", planted)
    io = EngineCheckpointIO({"save_dir": str(ours / "engine")})
    with pytest.raises(PointerMismatchError, match="allow_foreign_pointers") as info:
        io.load_checkpoint(planted)
    assert str(theirs / "engine") in str(info.value) and str(ours / "engine") in str(info.value)
    # a planted last.ckpt (the "latest" alias) is held to the same rule
    shutil.copy(theirs / "ckpts" / "last-engine.ckpt", ours / "ckpts" / "last.ckpt")
    with pytest.raises(PointerMismatchError):
        io.load_checkpoint(ours / "ckpts" / "last.ckpt")
    # the explicit opt-in loads it, with a warning that names both save folders
    trusting = EngineCheckpointIO({"save_dir": str(ours / "engine")}, allow_foreign_pointers=True)
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        loaded = trusting.load_checkpoint(planted)
    assert loaded["global_step"] == 8 and torch.equal(loaded["state_dict"]["w"], torch.full((4,), 8.0))
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert str(theirs / "engine") in warned and str(ours / "engine") in warned
    # our own pointers load as before
    assert io.load_checkpoint(ours / "ckpts" / "step=4.ckpt")["global_step"] == 4


def test_a_pointer_must_hold_the_iteration_it_claims(tmp_path: Path) -> None:
    _run(tmp_path, (4, 8))
    engine = tmp_path / "engine"
    io = EngineCheckpointIO({"save_dir": str(engine)})
    # the claim and the folder name disagree: refused before anything is read
    lying = _write_pointer(
        tmp_path / "ckpts" / "lying.ckpt", save_dir=str(engine), checkpoint="iter_000000008", iteration=4
    )
    with pytest.raises(CorruptCheckpointError, match=r"lying\.ckpt.*iter_000000008.*iteration 4"):
        io.load_checkpoint(lying)
    for bad in ({"iteration": "4"}, {"iteration": True}, {"save_dir": 3}):
        fields: dict[str, Any] = {"save_dir": str(engine), "checkpoint": "iter_000000004", "iteration": 4, **bad}
        with pytest.raises(CorruptCheckpointError, match=r"mangled\.ckpt"):
            io.load_checkpoint(_write_pointer(tmp_path / "ckpts" / "mangled.ckpt", **fields))
    # the folder the pointer names holds another step (swapped in): its manifest says so
    shutil.rmtree(engine / "iter_000000004")
    shutil.copytree(engine / "iter_000000008", engine / "iter_000000004")
    with pytest.raises(CorruptCheckpointError, match=r"named for iteration 4.*of iteration 8"):
        io.load_checkpoint(tmp_path / "ckpts" / "step=4.ckpt")


@pytest.mark.timeout(60, method="thread")  # a FIFO read would block: fail, do not hang the run
def test_a_fifo_pointer_is_refused_and_does_not_block_its_folder(tmp_path: Path) -> None:
    io = EngineCheckpointIO({"save_dir": str(tmp_path / "engine")})
    for step in (4, 8, 12):
        io.save_checkpoint(_checkpoint(step), str(tmp_path / "ckpts" / f"step={step}.ckpt"))
    fifo = tmp_path / "ckpts" / "evil.ckpt"
    os.mkfifo(fifo)
    with pytest.raises(CorruptCheckpointError, match=r"evil\.ckpt is a FIFO"):
        io.load_checkpoint(fifo)
    assert io.load_checkpoint(tmp_path / "ckpts" / "step=8.ckpt")["global_step"] == 8
    io.remove_checkpoint(tmp_path / "ckpts" / "step=4.ckpt")  # scans the folder's pointers, FIFO included
    assert not (tmp_path / "engine" / "iter_000000004").exists()
    io.remove_checkpoint(fifo)  # Lightning removing it: the file goes, nothing else
    assert not fifo.exists() and (tmp_path / "engine" / "iter_000000008").exists()
    io.teardown()


def test_a_checkpoint_another_folder_still_names_is_kept(tmp_path: Path) -> None:
    """Two ModelCheckpoint callbacks (``top_k/`` and ``every/``) name step 4; each removes only its own."""
    top_k, every = tmp_path / "top_k", tmp_path / "every"
    io = EngineCheckpointIO({"save_dir": str(tmp_path / "engine")})
    io.save_checkpoint(_checkpoint(4), str(top_k / "a.ckpt"))
    io.save_checkpoint(_checkpoint(4), str(every / "b.ckpt"))  # the same step, saved once
    io.save_checkpoint(_checkpoint(8), str(top_k / "c.ckpt"))
    io.remove_checkpoint(top_k / "a.ckpt")
    assert (tmp_path / "engine" / "iter_000000004").is_dir()  # every/b.ckpt still names it
    assert io.load_checkpoint(every / "b.ckpt")["global_step"] == 4
    io.teardown()
    # a later process (the run resumed) knows both folders from the save folder's record
    recorded = json.loads((tmp_path / "engine" / POINTER_FOLDERS_FILE).read_text())["folders"]
    assert sorted(recorded) == sorted([str(top_k), str(every)])
    resumed = EngineCheckpointIO({"save_dir": str(tmp_path / "engine")})
    resumed.save_checkpoint(_checkpoint(12), str(top_k / "d.ckpt"))
    resumed.remove_checkpoint(top_k / "c.ckpt")
    assert not (tmp_path / "engine" / "iter_000000008").exists()  # no pointer names it any more
    assert (tmp_path / "engine" / "iter_000000004").is_dir()
    resumed.remove_checkpoint(every / "b.ckpt")  # the last pointer naming step 4
    assert not (tmp_path / "engine" / "iter_000000004").exists()
    pointer = read_pointer(top_k / "d.ckpt")
    assert pointer is not None and pointer.iteration == 12
    resumed.teardown()


def test_the_structure_json_is_bounded_when_written_and_when_read(tmp_path: Path) -> None:
    where = str(tmp_path / "engine" / "iter_000000001" / "lightning")
    for raw, reason in (("[" * 100_000, "nests 100000 deep"), ('{"n": ' + "7" * 5000 + "}", "5000 digits")):
        with pytest.raises(CorruptCheckpointError, match=reason) as info:
            parse_structure(raw, where)
        assert where in str(info.value)
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(MAX_STRUCTURE_DEPTH):  # each level of dicts is about three levels of JSON
        node["x"] = {}
        node = node["x"]
    io = EngineCheckpointIO({"save_dir": str(tmp_path / "engine")})
    with pytest.raises(ArgumentTypeError, match="nests deeper"):
        io.save_checkpoint({**_checkpoint(1), "deep": deep}, str(tmp_path / "ckpts" / "deep.ckpt"))
    io.teardown()
    assert not list((tmp_path / "engine").glob("iter_*")) and not (tmp_path / "ckpts" / "deep.ckpt").exists()
