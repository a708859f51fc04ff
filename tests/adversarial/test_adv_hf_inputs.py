"""Hugging Face weights (``load_path`` = a safetensors file or folder) that would hang or exhaust
the reader, or that the reference ``safetensors`` reader refuses: each is a typed error naming the file.

* a FIFO where ``model.safetensors``, a shard or the index belongs blocked ``open`` forever;
* an index symlinked to ``/dev/zero`` (or just huge) was read until memory ran out;
* JSON nested 100,000 deep or holding a 5,000-digit integer escaped as ``RecursionError`` /
  ``ValueError`` without the file's name (and, under a raised ``sys.setrecursionlimit``, crashed
  the process);
* overlapping ``data_offsets`` and tensors named twice were taken silently.

The FIFO tests use pytest-timeout's thread method, so a regression fails instead of hanging.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from ckpt_engine import CheckpointEngine, CorruptCheckpointError, IncompleteCheckpointError, LoadResult
from ckpt_engine._dcpio.hf_read import read_index
from ckpt_engine._format.safetensors import INDEX_FILE, MAX_INDEX_BYTES, SINGLE_FILE

SHARD = "model-00001-of-00001.safetensors"


def load(load_path: Path, tmp_path: Path) -> LoadResult:
    with CheckpointEngine({"save_dir": str(tmp_path / "run"), "load_path": str(load_path)}) as engine:
        return engine.load(model=nn.Linear(2, 2))


def refused(load_path: Path, tmp_path: Path, victim: Path, match: str) -> str:
    """The load of ``load_path`` fails with :class:`CorruptCheckpointError` naming ``victim``."""
    with pytest.raises(CorruptCheckpointError, match=match) as info:
        load(load_path, tmp_path)
    message = str(info.value)
    assert str(victim) in message
    return message


def write_raw(path: Path, header: str, data: bytes = b"") -> Path:
    """A safetensors file with exactly this header text (no checks: an attacker's file)."""
    blob = header.encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    return path


def u8(begin: int, end: int) -> dict[str, Any]:
    return {"dtype": "U8", "shape": [end - begin], "data_offsets": [begin, end]}


def hf_folder(folder: Path) -> Path:
    """A valid sharded HF folder holding nn.Linear(2, 2)'s weights."""
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in nn.Linear(2, 2).state_dict().items()}, str(folder / SHARD))
    index = {"metadata": {"total_size": 24}, "weight_map": {"weight": SHARD, "bias": SHARD}}
    (folder / INDEX_FILE).write_text(json.dumps(index))
    return folder


def fifo(path: Path) -> Path:
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


# -- files that are not regular files --------------------------------------------------------------


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("where", [SINGLE_FILE, INDEX_FILE, SHARD, "direct"])
def test_fifo_is_refused_not_waited_on(tmp_path: Path, where: str) -> None:
    if where == SINGLE_FILE:  # a folder without an index
        folder = tmp_path / "hf"
        folder.mkdir()
        load_path = folder
        victim = fifo(folder / SINGLE_FILE)
    elif where == "direct":  # load_path names the file itself
        load_path = victim = fifo(tmp_path / "weights.safetensors")
    else:
        load_path = hf_folder(tmp_path / "hf")
        victim = fifo(load_path / where)
    refused(load_path, tmp_path, victim, "FIFO")


@pytest.mark.timeout(60, method="thread")
def test_index_linked_to_dev_zero_is_refused_unread(tmp_path: Path) -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    folder = hf_folder(tmp_path / "hf")
    (folder / INDEX_FILE).unlink()
    (folder / INDEX_FILE).symlink_to("/dev/zero")
    refused(folder, tmp_path, folder / INDEX_FILE, "device file")


def test_oversized_index_is_refused_by_its_size(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "hf")
    with open(folder / INDEX_FILE, "r+b") as f:
        f.truncate(MAX_INDEX_BYTES + 1)  # sparse: nothing is written
    refused(folder, tmp_path, folder / INDEX_FILE, "larger than")


# -- JSON that exhausts or overflows the parser ----------------------------------------------------


def _header_with(value: str) -> str:
    """A valid one-tensor header with ``value`` in an extra field of its record."""
    return '{"t":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":' + value + "}}"


def _index_with(value: str) -> str:
    return '{"metadata":{"total_size":' + value + '},"weight_map":' + json.dumps({"weight": SHARD, "bias": SHARD}) + "}"


HOSTILE_VALUES = {
    "nested 100,000 deep": "[" * 100_000 + "]" * 100_000,
    "nested 40 deep": "[" * 40 + "]" * 40,
    "a 5,000-digit integer": "1" * 5_000,
    "a 21-digit integer": "1" * 21,
    "NaN": "NaN",
}


@pytest.mark.parametrize("what", list(HOSTILE_VALUES))
def test_hostile_json_in_a_header_is_corrupt_and_named(tmp_path: Path, what: str) -> None:
    path = write_raw(tmp_path / "w.safetensors", _header_with(HOSTILE_VALUES[what]), bytes(4))
    message = refused(path, tmp_path, path, "nests|integer|NaN")
    assert len(message) < 1_000


@pytest.mark.parametrize("what", list(HOSTILE_VALUES))
def test_hostile_json_in_an_index_is_corrupt_and_named(tmp_path: Path, what: str) -> None:
    folder = hf_folder(tmp_path / "hf")
    (folder / INDEX_FILE).write_text(_index_with(HOSTILE_VALUES[what]))
    message = refused(folder, tmp_path, folder / INDEX_FILE, "nests|integer|NaN")
    assert len(message) < 1_000


@pytest.mark.full  # over 2 s on 2 cores: a new process
def test_deep_header_is_refused_even_under_a_raised_recursion_limit(tmp_path: Path) -> None:
    """json's C parser recurses once per level: with the limit raised (as some training scripts
    do) 500,000 levels overflowed the C stack and killed the process."""
    path = write_raw(tmp_path / "w.safetensors", _header_with("[" * 500_000 + "]" * 500_000), bytes(4))
    script = (
        "import sys; sys.setrecursionlimit(10**7)\n"
        "from ckpt_engine import CorruptCheckpointError\n"
        "from ckpt_engine._format.safetensors import read_header\n"
        "try:\n    read_header(sys.argv[1])\nexcept CorruptCheckpointError as err:\n    print('refused:', err)\n"
    )
    done = subprocess.run([sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2_000:]
    assert done.stdout.startswith("refused:") and str(path) in done.stdout


def test_messages_show_a_bounded_part_of_hostile_names(tmp_path: Path) -> None:
    name = "n" * 100_000
    path = write_raw(tmp_path / "w.safetensors", json.dumps({name: {"dtype": "X" * 100_000}}))
    assert len(refused(path, tmp_path, path, "dtype")) < 1_000
    folder = hf_folder(tmp_path / "hf")
    weight_map = {f"{i}{name}": f"{i}{name[:200]}.safetensors" for i in range(100)}
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(IncompleteCheckpointError, match="names 100 shard file") as info:
        load(folder, tmp_path)
    assert str(folder / INDEX_FILE) in str(info.value) and len(str(info.value)) < 2_000


def test_a_shard_that_is_a_dangling_link_is_a_missing_shard_for_the_loader_and_the_cli(tmp_path: Path) -> None:
    """The loader and ``ckpt-engine verify`` read a folder through one reader: a shard whose link
    points nowhere is reported as missing, with how many tensors it held and the fix."""
    from ckpt_engine._format.safetensors_header import read_weights_folder

    folder = hf_folder(tmp_path / "hf")
    (folder / SHARD).unlink()
    (folder / SHARD).symlink_to(tmp_path / "gone.safetensors")
    with pytest.raises(IncompleteCheckpointError, match=r"names 1 shard file\(s\) .* \(2 tensors, e\.g\. ") as info:
        load(folder, tmp_path)
    assert "Download the missing shard(s) again" in str(info.value)
    with pytest.raises(IncompleteCheckpointError, match=r"names 1 shard file\(s\) .* \(2 tensors, e\.g\. "):
        read_weights_folder(str(folder))


# -- layouts the reference reader refuses ----------------------------------------------------------


LAYOUTS: dict[str, tuple[str, int]] = {
    "overlap": (json.dumps({"a": u8(0, 4), "b": u8(2, 6)}), 6),
    "same range twice": (json.dumps({"a": u8(0, 4), "b": u8(0, 4)}), 4),
    "gap": (json.dumps({"a": u8(0, 4), "b": u8(5, 8)}), 8),
    "not from the start": (json.dumps({"a": u8(2, 8)}), 8),
    "trailing bytes": (json.dumps({"a": u8(0, 4)}), 8),
    "empty tensor inside another": (json.dumps({"a": u8(0, 4), "z": u8(2, 2)}), 4),
    "name twice": ('{"a":' + json.dumps(u8(0, 4)) + ',"a":' + json.dumps(u8(4, 8)) + "}", 8),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_the_reference_refuses_is_refused_naming_the_tensor(tmp_path: Path, layout: str) -> None:
    header, data_size = LAYOUTS[layout]
    path = write_raw(tmp_path / "w.safetensors", header, bytes(data_size))
    with pytest.raises(SafetensorError):
        load_file(str(path))
    message = refused(path, tmp_path, path, "data byte|twice")
    if layout != "trailing bytes":
        assert "'a'" in message or "'b'" in message or "'z'" in message


def test_duplicate_tensor_in_the_index_is_refused(tmp_path: Path) -> None:
    folder = hf_folder(tmp_path / "hf")
    (folder / INDEX_FILE).write_text(f'{{"weight_map":{{"weight":"{SHARD}","bias":"{SHARD}","weight":"{SHARD}"}}}}')
    assert "'weight'" in refused(folder, tmp_path, folder / INDEX_FILE, "twice")


def test_layouts_the_reference_accepts_still_load(tmp_path: Path) -> None:
    """Empty tensors at the edges, a padded header, an unknown field: read as the reference reads them."""
    header = json.dumps({"z0": u8(0, 0), "a": u8(0, 4), "z4": u8(4, 4), "__metadata__": {"format": "pt"}})
    path = write_raw(tmp_path / "w.safetensors", header + "  ", bytes(range(4)))
    assert set(load_file(str(path))) == {"z0", "a", "z4"}
    assert set(read_index(str(path)).tensors) == {"z0", "a", "z4"}
    save_file({"weight": torch.ones(2, 2), "bias": torch.zeros(2)}, str(tmp_path / "ok.safetensors"))
    assert set(load(tmp_path / "ok.safetensors", tmp_path).report["model"].loaded) == {"weight", "bias"}
