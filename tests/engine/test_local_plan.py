"""A first save that no rank plans centrally (``_dcpio/local_plan.py``): DCP's plan, made by
each rank alone, and a ``.metadata`` that the coordinator builds and validates as DCP does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _torchrun import run_torchrun
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import (
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ckpt_engine._dcpio import fast_save
from ckpt_engine._dcpio.fast_save import plan_cache, save_state_dict
from ckpt_engine._dcpio.fast_write import FastFileSystemWriter
from ckpt_engine._dcpio.local_plan import PlanColumns, build_metadata, own_key
from ckpt_engine._dcpio.planner import EngineSavePlanner


def _state() -> dict[str, Any]:
    torch.manual_seed(0)
    return {
        "a": torch.randn(4, 3),
        "b": torch.arange(5),
        "empty": torch.zeros(0, 2),
        "scalar": torch.tensor(1.5),
        "value": {"nested": [1, 2]},
        "text": "kept",
    }


def _template() -> dict[str, Any]:
    """What ``dcp.load`` fills: the same structure, other values."""
    out = {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v for k, v in _state().items()}
    out.update(value={"nested": [0, 0]}, text="other")
    return out


def _described(md: Any) -> dict[str, Any]:
    storage = {
        (k.fqn, None if k.offset is None else tuple(k.offset)): (k.index, v.relative_path, v.offset, v.length)
        for k, v in md.storage_data.items()
    }
    return {"sdm": md.state_dict_metadata, "planner_data": md.planner_data, "storage": storage}


def _save(path: Path, *, central: bool, monkeypatch: pytest.MonkeyPatch, cache_key: str | None = None) -> Any:
    with monkeypatch.context() as m:
        if central:
            m.setattr(fast_save, "replicated_digest", lambda *a: None)
        cache = plan_cache(cache_key) if cache_key else None
        out = save_state_dict(
            _state(), storage_writer=FastFileSystemWriter(str(path)), planner=EngineSavePlanner(), cache=cache
        )
    return out.metadata


def test_one_process_plans_alone_and_writes_what_the_central_plan_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    real = fast_save.finish_alone
    monkeypatch.setattr(fast_save, "finish_alone", lambda *a: calls.append(1) or real(*a))
    alone = _save(tmp_path / "alone", central=False, monkeypatch=monkeypatch)
    central = _save(tmp_path / "central", central=True, monkeypatch=monkeypatch)
    assert calls == [1]  # the first save went alone, the second through DCP's global plan
    assert _described(alone) == _described(central)
    # The same items in the same places (each torch.save archive has its own serialization id).
    sizes = {name: os.path.getsize(tmp_path / name / "__0_0.distcp") for name in ("alone", "central")}
    assert sizes["alone"] == sizes["central"] > 0
    fresh = _template()
    dcp.load(fresh, checkpoint_id=str(tmp_path / "alone"))
    for k, v in _state().items():
        assert torch.equal(v, fresh[k]) if isinstance(v, torch.Tensor) else v == fresh[k], k


def test_a_plan_made_alone_is_cached_and_reused_like_a_central_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = f"local-plan-test-{os.getpid()}"
    first = _save(tmp_path / "1", central=False, monkeypatch=monkeypatch, cache_key=key)
    cache = plan_cache(key)
    assert (cache.misses, cache.hits) == (1, 0) and cache.final_plan is not None and cache.metadata is first
    second = _save(tmp_path / "2", central=False, monkeypatch=monkeypatch, cache_key=key)
    assert (cache.misses, cache.hits, cache.metadata_reused) == (1, 1, 1)  # the last .metadata again
    assert _described(second) == _described(first)
    fresh = _template()
    dcp.load(fresh, checkpoint_id=str(tmp_path / "2"))
    assert torch.equal(fresh["a"], _state()["a"]) and fresh["text"] == "kept"


def _shard(fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], size: tuple[int, ...]) -> WriteItem:
    chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets)),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size(size)
        ),
    )


def _columns(*plans: list[WriteItem]) -> list[PlanColumns]:
    return [
        PlanColumns.of(SavePlan(items, planner_data={i.index.fqn: (i.index.fqn,) for i in items})) for items in plans
    ]


def test_a_key_of_a_ranks_own_is_named_with_its_rank_blanked() -> None:
    assert own_key("loader.position@rank1", 1) == "loader.position@rank*"
    assert own_key("rank1.python.state", 1) == "rank*.python.state"
    for key in ("loader.position@rank1", "rank1.python.state", "rank10.torch_cpu", "w", "ranked.x"):
        assert own_key(key, 0 if "1" in key else 1) is None, key


def test_the_built_metadata_orders_chunks_by_rank_and_shares_descriptions() -> None:
    cols = _columns(
        [_shard("w", (0, 0), (2, 4), (4, 4)), _shard("v", (0,), (3,), (6,))],
        [_shard("w", (2, 0), (2, 4), (4, 4)), _shard("v", (3,), (3,), (6,))],
    )
    md = build_metadata(cols)
    w = md.state_dict_metadata["w"]
    assert [tuple(c.offsets) for c in w.chunks] == [(0, 0), (2, 0)]  # type: ignore[union-attr]
    assert tuple(w.size) == (4, 4) and md.planner_data == {"w": ("w",), "v": ("v",)}  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (_shard("w", (1, 0), (2, 4), (4, 4)), "overlapping chunks"),
        (_shard("w", (3, 0), (2, 4), (4, 4)), "out of bounds chunk"),
        (_shard("w", (2, 0), (1, 4), (4, 4)), "invalid fill"),
    ],
)
def test_the_built_metadata_is_validated_as_dcp_validates_a_global_plan(second: WriteItem, message: str) -> None:
    with pytest.raises(ValueError, match=f"Failed to validate global plan: key:w has {message}|key:w {message}"):
        build_metadata(_columns([_shard("w", (0, 0), (2, 4), (4, 4))], [second]))


def test_a_value_two_ranks_write_is_refused() -> None:
    item = WriteItem(index=MetadataIndex("x"), type=WriteItemType.BYTE_IO)
    with pytest.raises(ValueError, match="x is saved by more than one rank"):
        build_metadata(_columns([item], [item]))


@pytest.mark.dist
def test_two_ranks_plan_alone_exactly_as_dcp_plans_centrally(tmp_path: Path) -> None:
    run = run_torchrun("local_plan.py", str(tmp_path), nproc=2, timeout=180)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == [0, 1], run.describe()
    went_alone = {
        "fsdp": True,
        "hsdp_replicas": True,
        "hsdp_shards": True,
        "replicated_dtensor": True,
        "own_keys": True,
    }
    for rank in (0, 1):
        (out,) = results[rank]
        for layout, row in out.items():
            assert row["alone"] == went_alone.get(layout, False), (rank, layout)
            assert not row["central_went_alone"], (rank, layout)
            assert row["loaded"], (rank, layout)
            assert row["bytes"][0] == row["bytes"][1], (rank, layout)  # each rank wrote what DCP had it write
            if rank == 0:
                assert row["same_metadata"] == {"sdm": True, "planner_data": True, "storage": True}, layout
    rank0 = results[0][0]
    assert rank0["hsdp_replicas"]["files"] == ["__0_0.distcp"]  # the replica on rank 1 was not written
    assert rank0["hsdp_shards"]["files"] == ["__0_0.distcp", "__1_0.distcp"]
    assert results[1][0]["hsdp_replicas"]["bytes"] == [0, 0]


@pytest.mark.parametrize(
    ("last", "message"),
    [
        (None, None),
        (((61, 0), (2, 4)), "overlapping chunks"),  # overlaps the chunk before it
        (((63, 0), (2, 4)), "out of bounds chunk"),
        (((62, 0), (1, 4)), "invalid fill"),
    ],
)
def test_many_chunks_are_checked_as_arrays_with_the_walks_verdict(
    last: tuple[tuple[int, int], tuple[int, int]] | None, message: str | None
) -> None:
    """32 ranks' chunks of one tensor (the array check's range): valid ones pass, and each
    fault is found and named as the chunk-by-chunk walk names it."""
    plans = [[_shard("w", (2 * r, 0), (2, 4), (64, 4))] for r in range(31)]
    offsets, sizes = last if last is not None else ((62, 0), (2, 4))
    plans.append([_shard("w", offsets, sizes, (64, 4))])
    if message is None:
        md = build_metadata(_columns(*plans))
        assert len(md.state_dict_metadata["w"].chunks) == 32  # type: ignore[union-attr]
        return
    with pytest.raises(ValueError, match=message):
        build_metadata(_columns(*plans))
