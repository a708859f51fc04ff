"""A checkpoint that holds part of its tensors (a rank-local checkpoint: one rank's shards) is said
to be a part by ``inspect``, ``verify``, ``diff`` and ``convert``, and never read as the whole:
a read of what it lacks is a typed error naming the key and the elements, never zeros.

The two-rank checkpoints of the node-local tier are checked in tests/cli/test_cli.py (they share
its torchrun launch); here a plain DCP folder is given the rank-local mark by hand."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cli import Run

from ckpt_engine._format.names import RANK_LOCAL_MARK
from ckpt_engine._inspect.parts import missing_region
from ckpt_engine._inspect.reader import ComponentReader
from ckpt_engine.errors import CorruptCheckpointError, PartialCheckpointError


def _half_held(checkpoint: Path, *, mark: bool) -> Path:
    """A checkpoint folder (no manifest) whose ``model`` component's ``w`` says shape [8, 3] but holds
    rows 0:4 (one rank's part), with the rank-local mark in its ``.metadata`` when ``mark``; ``b``
    is held whole."""
    folder = checkpoint / "model"
    dcp.save({"w": torch.arange(1.0, 13.0).reshape(4, 3), "b": torch.ones(2)}, checkpoint_id=str(folder), no_dist=True)
    path = folder / ".metadata"
    md = pickle.loads(path.read_bytes())  # the test's own file
    md.state_dict_metadata["w"] = dataclasses.replace(md.state_dict_metadata["w"], size=torch.Size([8, 3]))
    if mark:
        md.storage_meta.modules = [RANK_LOCAL_MARK]
    path.write_bytes(pickle.dumps(md))
    return checkpoint


@pytest.fixture
def marked(tmp_path: Path) -> Path:
    return _half_held(tmp_path / "marked" / "iter_000000001", mark=True)


def test_without_the_mark_a_folder_that_does_not_cover_its_tensor_is_refused(cli: Run, tmp_path: Path) -> None:
    checkpoint = _half_held(tmp_path / "plain" / "iter_000000001", mark=False)
    with pytest.raises(CorruptCheckpointError, match="do not cover it"):
        ComponentReader(str(checkpoint / "model"))
    assert cli("inspect", str(checkpoint))[0] == 2


def test_a_read_of_what_a_part_lacks_is_a_typed_error_never_zeros(marked: Path) -> None:
    reader = ComponentReader(str(marked / "model"))
    assert reader.part is not None and reader.part.partial == ("w",)
    assert (reader.part.held, reader.part.total) == (12 + 2, 24 + 2)
    assert torch.equal(reader.read(["b"])["b"], torch.ones(2))  # what it holds whole still reads
    with pytest.raises(PartialCheckpointError, match=r"'w' of shape \[8, 3\].* holds 12 of its 24 elements") as err:
        reader.read(["b", "w"])
    assert "[4:8, 0:3]" in str(err.value)


def test_convert_refuses_a_part_and_writes_nothing(cli: Run, marked: Path, tmp_path: Path) -> None:
    out = tmp_path / "m.pt"
    code, _, err = cli("convert", str(marked), str(out))
    assert code == 2 and "PartialCheckpointError" in err and "'w'" in err and "[4:8, 0:3]" in err
    assert not out.exists()
    code, _, _ = cli("convert", str(marked), str(out), "--keys", "b")  # held whole: converts
    assert code == 0 and torch.equal(torch.load(out, weights_only=True)["b"], torch.ones(2))


def test_inspect_verify_and_diff_say_it_is_one_ranks_part(cli: Run, marked: Path, tmp_path: Path) -> None:
    code, out, _ = cli("inspect", str(marked))
    assert code == 0 and "one rank's part of a rank-local checkpoint" in out and "not the whole" in out
    assert "12 of 24" in out
    code, out, _ = cli("inspect", str(marked), "--json")
    comp = json.loads(out)["components"]["model"]
    assert comp["part"] == {"rank": None, "world_size": None, "held": 14, "total": 26, "partial_keys": ["w"]}
    assert {k["key"]: k.get("held") for k in comp["keys"]} == {"w": 12, "b": None}

    code, out, _ = cli("verify", str(marked), "--level", "sizes")
    assert code == 0 and "one rank's part" in out and "not the whole" in out and "complete" not in out

    whole = tmp_path / "whole" / "iter_000000001"
    dcp.save({"w": torch.zeros(8, 3), "b": torch.ones(2)}, checkpoint_id=str(whole / "model"), no_dist=True)
    code, out, _ = cli("diff", str(marked), str(whole))
    assert code == 1 and "not compared: w: a side holds only part of it" in out
    assert "the checkpoints are not identical" in out
    code, out, _ = cli("diff", str(marked), str(whole), "--json")
    model = json.loads(out)["components"]["model"]
    assert model["not_compared_partial"] == ["w"] and model["equal"] == 1 and model["parts"]["a"]["held"] == 14


@pytest.mark.parametrize(
    ("shape", "boxes", "missing"),
    [
        ((8, 3), [((0, 0), (4, 3))], ((4, 0), (4, 3))),
        ((16, 8), [((8, 0), (8, 8))], ((0, 0), (8, 8))),
        ((4, 4), [((0, 0), (2, 2)), ((2, 2), (2, 2)), ((0, 2), (2, 2))], ((2, 0), (2, 2))),
        ((5,), [], ((0,), (5,))),
        ((), [], ((), ())),
        ((4, 4), [((0, 0), (4, 4))], None),
        ((0, 4), [], None),
    ],
)
def test_missing_region_names_a_box_no_chunk_covers(
    shape: tuple[int, ...], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], missing: object
) -> None:
    assert missing_region(shape, boxes) == missing
