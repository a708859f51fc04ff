"""2-rank benchmark worker, run by ``torch.distributed.run --standalone --nproc_per_node 2``.

Every tensor of the transformer-like state is a DTensor sharded on dim 0 over a 1-D CPU mesh.
``save``: the engine's sync save, timed on every rank between barriers. ``load``: a resharded
load: the destination is sharded on dim 1 (vectors stay on dim 0), so every rank reads a strided
part of every chunk both ranks wrote. Rank 0 prints one ``RESULT {json}`` line.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
import torch.distributed as dist
from _bench_state import StateModule, make_tensors, transformer_shapes
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

warnings.filterwarnings("ignore")


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shapes = transformer_shapes(spec["bytes"])
    full = make_tensors(shapes)
    nbytes = sum(t.numel() * t.element_size() for t in full.values())
    src = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()}
    dst = {
        k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(1) if v.dim() > 1 else Shard(0)])
        for k, v in full.items()
    }
    del full
    from ckpt_engine import CheckpointEngine, EngineConfig

    save_dir = spec["workdir"]
    saves, loads = [], []
    module, dest = StateModule(src), StateModule(dst)
    for rep in range(spec["reps"]):
        if rank == 0 and os.path.exists(save_dir):
            shutil.rmtree(save_dir)
        dist.barrier()
        with CheckpointEngine(EngineConfig(save_dir=save_dir)) as engine:
            dist.barrier()
            t0 = time.perf_counter()
            engine.save(rep + 1, model=module)
            dist.barrier()
            saves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.load(model=dest)
            dist.barrier()
            loads.append(time.perf_counter() - t0)
    ok = all(
        torch.equal(dest.get_parameter(k).full_tensor(), module.get_parameter(k).full_tensor())
        for k in ("embed.weight", "layers.0.attn.q.weight", "layers.0.mlp.up.bias")
    )
    if rank == 0:
        print("RESULT " + json.dumps({"save": saves, "load": loads, "nbytes": nbytes, "bit_exact": ok}), flush=True)
        shutil.rmtree(save_dir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo + a device mesh can abort at interpreter exit (dcp-notes section 11)


if __name__ == "__main__":
    main()
