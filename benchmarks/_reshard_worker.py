"""The resharding recovery's worker of ``benchmarks/tier_bench.py`` (``--phases reshard``), run
twice under ``torch.distributed.run --standalone``: ``save`` on 4 ranks as 2 nodes
(``ranks_per_node: 2``, each node's ``local_dir`` on tmpfs), then ``load`` on 2 ranks.
Rank 0 prints one ``RESULT {json}`` line.

The state is an FSDP2 model (8 square ``Linear`` layers, each its own group) with AdamW's
moments: ``mib`` MiB per rank of the 4-rank job. ``save`` saves step 1 into the local tier and
``save_dir`` (``persist_every: 1``) and, with ``s3``, to the S3 server, then times a restart of
the same shape (4 ranks from their own nodes). ``load`` times, on 2 ranks (the slowest rank's
``load()`` seconds, median of ``rounds``): the resharding recovery with both ranks on node 0
(node 1 lost: node 0 holds every part), the same after node 0 is lost (a new, empty node 0: rank
0 receives its bytes from rank 1 on node 1), and ``save_dir`` alone on disk and on S3.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from ckpt_engine import CheckpointEngine

warnings.filterwarnings("ignore")
MIB = 2**20
LAYERS = 8


def _state(mib: float, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``mib`` MiB of state per rank of a 4-rank job: parameters and two moments."""
    side = max(4, int((mib * MIB * 4 / 3 / 4 / LAYERS) ** 0.5))
    torch.manual_seed(seed)
    model = nn.Sequential(*[nn.Linear(side, side, bias=False) for _ in range(LAYERS)])
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, side)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _slowest(seconds: float) -> float:
    box = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def _tier(spec: dict[str, Any], shm: str, per_node: int) -> dict[str, Any]:
    node = dist.get_rank() // per_node
    return {
        "save_dir": os.path.join(spec["work"], "durable"),
        "local_dir": os.path.join(shm, f"node{node}"),
        "ranks_per_node": per_node,
        "persist_every": 1,
        "collective_timeout_s": 600,
    }


def _s3(spec: dict[str, Any]) -> dict[str, Any]:
    s3 = spec["s3"]
    storage = {"endpoint_url": s3["endpoint"], "access_key_id": s3["key"], "secret_access_key": s3["secret"]}
    name = f"reshard-{spec['mib']:g}".replace(".", "_")  # a folder per size
    return {"save_dir": f"s3://{s3['bucket']}/{name}", "storage": storage, "collective_timeout_s": 600}


def _timed(cfg: dict[str, Any], spec: dict[str, Any]) -> tuple[list[float], list[dict[str, int]]]:
    times, sources = [], []
    for _ in range(spec["rounds"]):
        model, opt = _state(spec["mib"], seed=99)
        dist.barrier()
        t0 = time.perf_counter()
        with CheckpointEngine(cfg) as engine:
            result = engine.load(model=model, optimizer=opt)
        times.append(_slowest(time.perf_counter() - t0))
        assert result.iteration == 1, result.iteration
        every: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(every, dict(result.bytes_by_source))
        sources.append(every)
    return times, sources[-1]


def save(spec: dict[str, Any]) -> dict[str, Any]:
    model, opt = _state(spec["mib"], seed=1)
    cfg = _tier(spec, spec["shm"], 2)
    with CheckpointEngine(cfg) as engine:
        engine.save(1, model=model, optimizer=opt)
        engine.wait_replicated()
    if spec["s3"] is not None:
        with CheckpointEngine(_s3(spec)) as engine:
            engine.save(1, model=model, optimizer=opt)
    times, sources = _timed(cfg, spec)
    return {"same_shape_s": statistics.median(times), "runs": {"same_shape": times}, "bytes_by_source": sources}


def load(spec: dict[str, Any]) -> dict[str, Any]:
    lost0 = spec["shm"] + "-lost0"
    if dist.get_rank() == 0:
        shutil.copytree(spec["shm"], lost0)
        shutil.rmtree(os.path.join(lost0, "node0"))
    dist.barrier()
    durable = {"save_dir": os.path.join(spec["work"], "durable"), "collective_timeout_s": 600}
    configs = {
        "reshard": _tier(spec, spec["shm"], 2),
        "reshard_peer": _tier(spec, lost0, 1),
        "durable_disk": durable,
    }
    if spec["s3"] is not None:
        configs["durable_s3"] = _s3(spec)
    out: dict[str, Any] = {"runs": {}, "bytes_by_source": {}}
    for name, cfg in configs.items():
        times, sources = _timed(cfg, spec)
        out[f"{name}_s"] = statistics.median(times)
        out["runs"][name] = times
        out["bytes_by_source"][name] = sources
    return out


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result = {"save": save, "load": load}[spec["mode"]](spec)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
