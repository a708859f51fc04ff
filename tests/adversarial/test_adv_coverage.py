"""Stored chunks that do not cover their tensor, or claim bytes the files do not hold: refused on
load, verify, plan, convert and diff, before anything is allocated or read."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from adversarial._adv import ckpt, load, save, tamper_metadata
from ckpt_engine import CorruptCheckpointError
from ckpt_engine._format.verify import verify_checkpoint
from ckpt_engine.cli import main

KEY = "0.weight"  # Linear(8, 16): shape [16, 8], one chunk at [0, 0]


def _half(md: Metadata) -> None:
    md.state_dict_metadata[KEY].chunks[0] = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([8, 8]))


def _outside(md: Metadata) -> None:
    md.state_dict_metadata[KEY].chunks[0] = ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([32, 8]))


def _absent(md: Metadata) -> None:
    md.state_dict_metadata[KEY].chunks.clear()


def _overlap(md: Metadata) -> None:
    item = md.state_dict_metadata[KEY]
    item.chunks.append(ChunkStorageMetadata(torch.Size([8, 0]), torch.Size([8, 8])))
    assert md.storage_data is not None
    md.storage_data[MetadataIndex(KEY, [8, 0])] = md.storage_data[MetadataIndex(KEY, [0, 0])]


def _huge(md: Metadata) -> None:
    # A few-KB item claiming a [2**22, 8] float32 tensor (128 MiB).
    item = md.state_dict_metadata[KEY]
    md.state_dict_metadata[KEY] = dataclasses.replace(
        item, size=torch.Size([2**22, 8]), chunks=[ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2**22, 8]))]
    )


CASES: dict[str, tuple[Any, str]] = {
    "half": (_half, "do not cover it (64 of 128 elements stored)"),
    "outside": (_outside, "of size [32, 8] outside it"),
    "absent": (_absent, "do not cover it (0 of 128 elements stored)"),
    "overlap": (_overlap, "stored chunks overlap"),
    "huge": (_huge, "needs 134217728 bytes"),
}


@pytest.fixture(params=sorted(CASES))
def tampered(request: Any, save_dir: str) -> tuple[Path, str]:
    change, message = CASES[request.param]
    save(save_dir, 3)
    tamper_metadata(ckpt(save_dir, 3) / "model", change)
    return ckpt(save_dir, 3), message


def test_load_refuses_before_writing_into_the_model(tampered: tuple[Path, str], save_dir: str) -> None:
    checkpoint, message = tampered
    result_state = None
    with pytest.raises(CorruptCheckpointError, match=re.escape(message)) as info:
        result_state = load(save_dir, verify="checksums")
    assert result_state is None
    assert str(checkpoint / "model" / ".metadata") in str(info.value) and KEY in str(info.value)


def test_verify_reports_it(tampered: tuple[Path, str], capsys: Any) -> None:
    checkpoint, message = tampered
    report = verify_checkpoint(str(checkpoint), "checksums")
    assert not report.ok and any(message in p for p in report.problems), report.problems
    assert main(["verify", str(checkpoint)]) == 1


def test_convert_writes_nothing(tampered: tuple[Path, str], tmp_path: Path, capsys: Any) -> None:
    checkpoint, message = tampered
    out = tmp_path / "model.safetensors"
    assert main(["convert", str(checkpoint), str(out)]) != 0
    assert message in capsys.readouterr().err
    assert not out.exists() and os.listdir(tmp_path) == [os.path.basename(os.path.dirname(str(checkpoint)))]


def test_diff_refuses(tampered: tuple[Path, str], save_dir: str, capsys: Any) -> None:
    checkpoint, message = tampered
    save(os.path.join(save_dir, "other"), 3)
    assert main(["diff", str(checkpoint), str(ckpt(os.path.join(save_dir, "other"), 3))]) not in (0, 1)
    assert message in capsys.readouterr().err


def test_plan_refuses(tampered: tuple[Path, str], capsys: Any) -> None:
    checkpoint, message = tampered
    code = main(["plan", str(checkpoint), "--model", "adversarial._adv:objects"])
    assert code != 0
    captured = capsys.readouterr()  # plan reports the refused validation as its result (exit 1)
    assert message in captured.out + captured.err


def test_a_data_file_shorter_than_its_chunks_is_refused_before_reading(save_dir: str) -> None:
    save(save_dir, 3)
    data = ckpt(save_dir, 3) / "model" / "__0_0.distcp"
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) - 100)
    with pytest.raises(Exception, match="truncated"):
        load(save_dir, verify="off")
