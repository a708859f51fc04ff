"""2 ranks: save from FSDP2 (Shard(0) per Linear), load into a differently sharded model.

A scenario of ``core.py`` (argument: save_dir). The target model keeps the module tree but places
parameters differently: ``0.weight`` Shard(1), ``0.bias`` Shard(0), ``2.*`` plain (replicated)
tensors, ``3.weight`` Shard(1) (3 + 2 columns), ``3.bias`` Replicate(). Returns the saved full
values, then per parameter of the target the placements, local shard and full value of the
parameter and exp_avg.
"""

from __future__ import annotations

from typing import Any

import torch
from _common import cpu_mesh, full, local, make_model, optim_full, params_full, shard_fsdp2, train_inputs
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from ckpt_engine import CheckpointEngine

TARGET_PLACEMENTS = {"0.weight": Shard(1), "0.bias": Shard(0), "3.weight": Shard(1), "3.bias": Replicate()}


def scenario(save_dir: str) -> list[Any]:
    mesh = cpu_mesh()
    src = shard_fsdp2(make_model(seed=0), mesh)
    src_optim = torch.optim.AdamW(src.parameters(), lr=0.1)
    x = train_inputs()
    for _ in range(2):
        src(x).pow(2).mean().backward()
        src_optim.step()
        src_optim.zero_grad()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(5, model=src, optimizer=src_optim)
    saved = {"saved_params": params_full(src), "saved_exp_avg": optim_full(src, src_optim, "exp_avg")}

    dst = make_model(seed=7)
    for name, placement in TARGET_PLACEMENTS.items():
        layer_name, attr = name.split(".")
        layer = dst.get_submodule(layer_name)
        value = getattr(layer, attr).detach()
        layer.register_parameter(attr, torch.nn.Parameter(distribute_tensor(value, mesh, [placement])))
    dst_optim = torch.optim.AdamW(dst.parameters(), lr=0.3, foreach=False)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        result = engine.load(model=dst, optimizer=dst_optim)

    loaded = {}
    for name, p in dst.named_parameters():
        state = dst_optim.state[p]["exp_avg"]
        loaded[name] = {
            "is_dtensor": isinstance(p, DTensor),
            "placements": [str(pl) for pl in p.placements] if isinstance(p, DTensor) else None,
            "state_placements": [str(pl) for pl in state.placements] if isinstance(state, DTensor) else None,
            "full": full(p.detach()).tolist(),
            "local": local(p.detach()).tolist(),
            "exp_avg_full": full(state).tolist(),
            "exp_avg_local": local(state).tolist(),
            "step": float(dst_optim.state[p]["step"]),
        }
    return [
        saved,
        {
            "iteration": result.iteration,
            "components": list(result.components),
            "loaded": sorted(result.report["model"].loaded),
            "optim_loaded": len(result.report["optim"].loaded),
            "params": loaded,
        },
    ]
