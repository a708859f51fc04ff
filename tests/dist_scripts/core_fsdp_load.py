"""2 ranks: resume a checkpoint written by one process into an FSDP2 model + AdamW.

A scenario of ``core.py`` (argument: save_dir, holding latest_checkpoint.txt). Returns the load
result and, per parameter, this rank's local shard and the gathered full value of the parameter
and its exp_avg.
"""

from __future__ import annotations

from typing import Any

import torch
from _common import cpu_mesh, full, local, make_model, shard_fsdp2

from ckpt_engine import CheckpointEngine


def scenario(save_dir: str) -> list[Any]:
    model = shard_fsdp2(make_model(seed=42), cpu_mesh())
    optim = torch.optim.AdamW(model.parameters(), lr=0.5)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu")
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        result = engine.load(model=model, optimizer=optim, scheduler=sched, grad_scaler=scaler)

    params, exp_avg = {}, {}
    for name, p in model.named_parameters():
        state = optim.state[p]["exp_avg"]
        params[name] = {
            "full": full(p.detach()).tolist(),
            "local": local(p.detach()).tolist(),
            "local_shape": list(local(p).shape),
            "placements": [str(pl) for pl in p.placements],
        }
        exp_avg[name] = {"full": full(state).tolist(), "local": local(state).tolist()}
    return [
        {
            "iteration": result.iteration,
            "path": result.checkpoint_path,
            "loaded": sorted(result.report["model"].loaded),
            "components": list(result.components),
            "params": params,
            "exp_avg": exp_avg,
            "step": [float(optim.state[p]["step"]) for p in model.parameters()],
            "lr": optim.param_groups[0]["lr"],
            "last_epoch": sched.last_epoch,
            "scale": scaler.get_scale(),
        }
    ]
