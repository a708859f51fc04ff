"""The global view a resharding recovery builds from rank-local parts (``_tier/reshard_meta``), on
real DCP checkpoints in one process, and the spread of parts over the ranks that hold them."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from ckpt_engine._dcpio.fast_read import FastFileSystemReader
from ckpt_engine._dcpio.torch_private import pickle_metadata
from ckpt_engine._format.metadata_read import read_metadata, validate_metadata
from ckpt_engine._tier.reshard import assign_servers
from ckpt_engine._tier.reshard_meta import item_digests, merge_metadata


def _part(folder: Path, state: dict[str, object]) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)), no_dist=True)


def test_parts_combine_into_one_checkpoint_with_differing_values_kept_per_rank(tmp_path: Path) -> None:
    weight = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _part(tmp_path / "p0", {"w": weight, "lr": 0.5, "pos": 3})
    _part(tmp_path / "p1", {"w": weight.clone(), "lr": 0.5, "pos": 7})
    parts = {r: read_metadata(str(tmp_path / f"p{r}")) for r in (0, 1)}
    digests = {r: item_digests(str(tmp_path / f"p{r}"), parts[r], "crc32") for r in (0, 1)}

    merged, names = merge_metadata(parts, digests)

    # the replicated tensor and the equal value once, from rank 0; the differing value per rank
    assert sorted(merged.state_dict_metadata) == ["lr", "pos@rank0", "pos@rank1", "w"]
    assert {
        merged.storage_data[i].relative_path.split("_", 1)[0] for i in merged.storage_data if i.fqn != "pos@rank1"
    } == {"p00000"}
    assert len(merged.state_dict_metadata["w"].chunks) == 1
    validate_metadata(merged, str(tmp_path / "merged"))

    # a folder of the parts' files under their new names reads back as one checkpoint
    out = tmp_path / "merged"
    out.mkdir()
    (out / ".metadata").write_bytes(pickle_metadata(merged))
    for new, (owner, rel) in names.items():
        os.link(tmp_path / f"p{owner}" / rel, out / new)
    state: dict[str, object] = {"w": torch.zeros(3, 4), "lr": 0.0}
    dcp.load(state, storage_reader=FastFileSystemReader(str(out)), no_dist=True)
    assert torch.equal(state["w"], weight)  # type: ignore[arg-type]
    assert state["lr"] == 0.5


def test_parts_are_served_by_the_holders_serving_fewest() -> None:
    # four old ranks, all held on one node by two ranks: two parts each
    assert assign_servers({0: [0, 1], 1: [0, 1], 2: [0, 1], 3: [0, 1]}) == {0: 0, 1: 1, 2: 0, 3: 1}
    # a part held by one rank only is served by it
    assert assign_servers({0: [1], 1: [0, 1]}) == {0: 1, 1: 0}
