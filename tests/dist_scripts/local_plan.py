"""A first save planned by each rank alone gives DCP's central plan, layout by layout.

argv: OUT_DIR. For each layout, the same state dict is saved twice through the engine's save
(``fast_save.save_state_dict``, the engine's planner and writer): once as it runs (each rank
finishes its plan alone where the layout allows) and once with that turned off (DCP's gather,
``create_global_plan`` and scatter). Rank 0 reports whether the two ``Metadata`` are equal
(tensor descriptions and chunk order, ``planner_data``, which file and bytes hold each item, the
chunk numbers), which path each save took, and whether ``dcp.load`` of the first gives back the
state. Every rank reports the bytes it wrote.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _common import ckpt_test_exit, init, report_ordered
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckpt_engine._dcpio import fast_save, local_plan
from ckpt_engine._dcpio.fast_write import FastFileSystemWriter
from ckpt_engine._dcpio.planner import EngineSavePlanner


def layouts(rank: int, world: int) -> dict[str, dict[str, Any]]:
    torch.manual_seed(0)  # the same global values on every rank
    flat = init_device_mesh("cpu", (world,))
    replicas = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
    sharded_2d = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    w, b, big = torch.randn(8, 4), torch.randn(6), torch.randn(4, 6)
    return {
        "fsdp": {  # Shard(0) over every rank, plain tensors and values every rank holds
            "w": distribute_tensor(w, flat, [Shard(0)]),
            "b": distribute_tensor(b, flat, [Shard(0)]),
            "step": torch.tensor(3.0),
            "lr": 0.1,
            "note": "kept",
        },
        "hsdp_replicas": {  # replicated on the first mesh dimension: only the lowest rank writes
            "w": distribute_tensor(w, replicas, [Replicate(), Shard(0)]),
            "big": distribute_tensor(big, replicas, [Replicate(), Shard(1)]),
        },
        "hsdp_shards": {
            "w": distribute_tensor(w, sharded_2d, [Replicate(), Shard(0)]),
            "big": distribute_tensor(big, sharded_2d, [Replicate(), Shard(1)]),
        },
        "replicated_dtensor": {"w": distribute_tensor(w, flat, [Replicate()]), "b": b},
        "own_keys": {  # each rank its copy of per-rank keys and its own random state: planned alone
            f"loader.position@rank{rank}": 10 + rank,
            f"buffer@rank{rank}": torch.full((2,), float(rank)),
            f"rank{rank}.torch_cpu": torch.full((4,), float(rank), dtype=torch.float64),
            f"rank{rank}.python.version": 3,
            "w": distribute_tensor(w, flat, [Shard(0)]),
            "step": torch.tensor(3.0),
        },
        "another_ranks_key": {  # every rank saves rank 0's key: not its own, planned centrally
            "rank0.torch_cpu": torch.ones(4),
            "w": distribute_tensor(w, flat, [Shard(0)]),
        },
        "ranks_differ": {  # each rank its own plain key: planned centrally
            f"only_{rank}": torch.full((3,), float(rank)),
            "w": distribute_tensor(w, flat, [Shard(0)]),
        },
    }


def save(state: dict[str, Any], path: str) -> tuple[Any, int, bool]:
    went_alone: list[bool] = []
    real = local_plan.finish_alone

    def counted(*args: Any) -> Any:
        went_alone.append(True)
        return real(*args)

    fast_save.finish_alone = counted  # type: ignore[assignment]
    try:
        writer = FastFileSystemWriter(path, sync_files=False)
        out = fast_save.save_state_dict(state, storage_writer=writer, planner=EngineSavePlanner())
    finally:
        fast_save.finish_alone = real
    return out.metadata, writer_bytes(path, dist.get_rank()), bool(went_alone)


def writer_bytes(path: str, rank: int) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.startswith(f"__{rank}_"))


def described(md: Any) -> dict[str, Any]:
    """Everything of a ``Metadata`` but ``storage_meta``, with each storage key's chunk number."""
    storage = {
        (k.fqn, None if k.offset is None else tuple(k.offset)): (k.index, v.relative_path, v.offset, v.length)
        for k, v in md.storage_data.items()
    }
    return {"sdm": md.state_dict_metadata, "planner_data": md.planner_data, "storage": storage}


def equal_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Every value equal; every rank makes the same collectives (no early return)."""
    same = []
    for k, v in a.items():
        got = b[k]
        if isinstance(v, DTensor):
            same.append(torch.equal(v.full_tensor(), got.full_tensor()))
        elif isinstance(v, torch.Tensor):
            same.append(torch.equal(v, got))
        else:
            same.append(v == got)
    return all(same)


def main() -> None:
    out_dir = sys.argv[1]
    rank, world = init()
    out: dict[str, Any] = {}
    for name, state in layouts(rank, world).items():
        alone_md, alone_bytes, alone = save(state, os.path.join(out_dir, name, "alone"))
        real_digest = fast_save.replicated_digest
        fast_save.replicated_digest = lambda *a: None  # type: ignore[assignment]
        try:
            central_md, central_bytes, went = save(state, os.path.join(out_dir, name, "central"))
        finally:
            fast_save.replicated_digest = real_digest
        fresh = {
            k: (
                DTensor.from_local(torch.zeros_like(v.to_local()), v.device_mesh, v.placements)
                if isinstance(v, DTensor)
                else torch.zeros_like(v)
                if isinstance(v, torch.Tensor)
                else None
            )
            for k, v in state.items()
        }
        dcp.load(fresh, checkpoint_id=os.path.join(out_dir, name, "alone"))
        row: dict[str, Any] = {
            "alone": alone,
            "central_went_alone": went,
            "bytes": [alone_bytes, central_bytes],
            "loaded": equal_state(state, fresh),
        }
        if rank == 0:
            a, c = described(alone_md), described(central_md)
            row["same_metadata"] = {part: a[part] == c[part] for part in a}
            row["files"] = sorted({v[1] for v in a["storage"].values()})
        out[name] = row
    report_ordered(out)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
