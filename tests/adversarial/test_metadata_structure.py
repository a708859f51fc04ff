"""Metadata that parses but lies: chunks that don't tile the tensor, entries without storage, bad paths.

Before the structural checks, a ``.metadata`` whose chunk covered half a tensor loaded with
``verified=True`` and left the rest of the destination as it was; ``convert`` turned a 108 KB
checkpoint claiming a ``[2**25, 8]`` tensor into 1 GiB of uninitialised memory.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex

from ckpt_engine import CheckpointEngine, CorruptCheckpointError
from ckpt_engine._format.metadata import read_metadata


def chunk(offsets: list[int], sizes: list[int]) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))


def rewrite(cdir: Path, edit: Callable[[Metadata], None]) -> None:
    path = cdir / ".metadata"
    md = pickle.loads(path.read_bytes())  # the test's own, trusted file
    edit(md)
    path.write_bytes(pickle.dumps(md))


def set_chunks(*chunks: ChunkStorageMetadata) -> Callable[[Metadata], None]:
    def edit(md: Metadata) -> None:
        md.state_dict_metadata["w"].chunks = list(chunks)  # type: ignore[union-attr]
        info = next(iter(md.storage_data.values()))
        md.storage_data = {MetadataIndex("w", c.offsets): info for c in chunks} | {
            k: v for k, v in md.storage_data.items() if k.fqn != "w"
        }

    return edit


CASES: dict[str, tuple[Callable[[Metadata], None], str]] = {
    "half": (set_chunks(chunk([0, 0], [4, 8])), r"do not cover it \(32 of 64 elements"),
    "absent": (set_chunks(), r"do not cover it \(0 of 64"),
    "outside": (
        set_chunks(chunk([0, 0], [4, 8]), chunk([6, 0], [4, 8])),
        r"chunk at \[6, 0\] of size \[4, 8\] outside",
    ),
    "overlap_same_volume": (set_chunks(chunk([0, 0], [4, 8]), chunk([2, 0], [4, 8])), r"overlap"),
    "overlap_more_volume": (set_chunks(chunk([0, 0], [8, 8]), chunk([0, 0], [8, 8])), r"overlap"),
    "wrong_rank": (set_chunks(chunk([0], [64])), r"1-d offsets"),
    "negative": (set_chunks(chunk([-1, 0], [8, 8])), r"outside"),
}


def saved(tmp_path: Path) -> Path:
    cdir = tmp_path / "ckpt"
    dcp.save({"w": torch.arange(64.0).reshape(8, 8), "step": 3}, checkpoint_id=cdir)
    return cdir


@pytest.mark.parametrize("case", sorted(CASES))
def test_chunks_must_tile_the_tensor_exactly(tmp_path: Path, case: str) -> None:
    edit, message = CASES[case]
    cdir = saved(tmp_path)
    read_metadata(str(cdir))  # the unedited file is fine
    rewrite(cdir, edit)
    with pytest.raises(CorruptCheckpointError, match=message) as info:
        read_metadata(str(cdir))
    assert "tensor 'w' of shape [8, 8]" in str(info.value) and str(cdir / ".metadata") in str(info.value)


def test_tiling_by_several_chunks_is_accepted(tmp_path: Path) -> None:
    cdir = saved(tmp_path)
    rewrite(
        cdir, set_chunks(chunk([0, 0], [3, 8]), chunk([3, 0], [5, 4]), chunk([3, 4], [5, 4]), chunk([8, 0], [0, 8]))
    )
    md = read_metadata(str(cdir))
    assert len(md.state_dict_metadata["w"].chunks) == 4  # type: ignore[union-attr]


def test_a_chunk_without_storage_entry_is_refused(tmp_path: Path) -> None:
    cdir = saved(tmp_path)
    rewrite(cdir, lambda md: md.storage_data.pop(MetadataIndex("w", torch.Size([0, 0]))))
    with pytest.raises(CorruptCheckpointError, match=r"chunk of 'w' at offset \[0, 0\] has no storage entry"):
        read_metadata(str(cdir))


def test_a_value_without_storage_entry_is_refused(tmp_path: Path) -> None:
    cdir = saved(tmp_path)
    rewrite(cdir, lambda md: md.storage_data.pop(MetadataIndex("step")))
    with pytest.raises(CorruptCheckpointError, match=r"value of 'step' has no storage entry"):
        read_metadata(str(cdir))


@pytest.mark.parametrize("rel", ["../x.distcp", "/etc/passwd", "a/b.distcp", "", ".hidden", "a\0b"])
def test_storage_entries_name_plain_files_in_the_folder(tmp_path: Path, rel: str) -> None:
    cdir = saved(tmp_path)

    def edit(md: Metadata) -> None:
        next(iter(md.storage_data.values())).relative_path = rel

    rewrite(cdir, edit)
    with pytest.raises(CorruptCheckpointError, match=r"outside its folder"):
        read_metadata(str(cdir))


def test_negative_offsets_and_lengths_are_refused(tmp_path: Path) -> None:
    cdir = saved(tmp_path)

    def edit(md: Metadata) -> None:
        next(iter(md.storage_data.values())).length = -5

    rewrite(cdir, edit)
    with pytest.raises(CorruptCheckpointError, match=r"length -5"):
        read_metadata(str(cdir))


def test_wrong_field_types_are_corrupt_not_attribute_errors(tmp_path: Path) -> None:
    cdir = saved(tmp_path)

    def edit(md: Metadata) -> None:
        md.storage_data = ["not", "a", "dict"]  # type: ignore[assignment]

    rewrite(cdir, edit)
    with pytest.raises(CorruptCheckpointError, match=r"storage_data is not a dict"):
        read_metadata(str(cdir))


def test_half_covered_tensor_is_refused_by_load(save_dir: str) -> None:
    """End to end: the load refuses before writing anything into the model."""
    model = torch.nn.Linear(8, 8, bias=False)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=model)
    cdir = Path(save_dir) / "iter_000000001" / "model"
    (Path(save_dir) / "iter_000000001" / "ckpt_engine_manifest.json").unlink()  # as if re-hashed by the attacker

    def edit(md: Metadata) -> None:
        md.state_dict_metadata["weight"].chunks = [chunk([0, 0], [4, 8])]  # type: ignore[union-attr]

    rewrite(cdir, edit)
    target = torch.nn.Linear(8, 8, bias=False)
    before = target.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'weight' of shape \[8, 8\].*do not cover it"):
        CheckpointEngine({"save_dir": save_dir}).load(model=target)
    assert torch.equal(target.weight, before)
