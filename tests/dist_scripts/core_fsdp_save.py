"""2 ranks: FSDP2 model, 2 AdamW steps with a GradScaler, save every component with the engine.

A scenario of ``core.py`` (argument: save_dir). Returns the full parameters, the optimizer's
exp_avg/exp_avg_sq (gathered), step, lr, the scheduler and scaler state, and this rank's per-rank
extra state.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
import torch.distributed as dist
from _common import cpu_mesh, make_model, optim_full, params_full, shard_fsdp2, train_inputs

from ckpt_engine import CheckpointEngine


class RankState:
    """Per-rank state with rank-specific keys (DCP keeps one copy of a same-key plain value)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        torch.manual_seed(100 + rank)
        self.rng = torch.get_rng_state()
        self.pos = 1000 + 7 * rank

    def state_dict(self) -> dict[str, Any]:
        r = self.rank
        return {f"rng_rank{r}": self.rng, f"pos_rank{r}": self.pos, f"name_rank{r}": f"worker-{r}"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise AssertionError("not loaded in this script")


def scenario(save_dir: str) -> list[Any]:
    rank = dist.get_rank()
    mesh = cpu_mesh()
    model = shard_fsdp2(make_model(seed=0), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.05)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    x = train_inputs()
    for _ in range(2):
        loss = model(x).pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(optim)
        scaler.update()
        sched.step()
        optim.zero_grad()
    extra = RankState(rank)

    engine = CheckpointEngine({"save_dir": save_dir})
    handle = engine.save(2, model=model, optimizer=optim, scheduler=sched, grad_scaler=scaler, extra={"ranks": extra})
    result = handle.result(timeout=60)
    engine.close()

    first = next(iter(model.parameters()))
    return [
        {
            "params": params_full(model),
            "exp_avg": optim_full(model, optim, "exp_avg"),
            "exp_avg_sq": optim_full(model, optim, "exp_avg_sq"),
            "step": [float(optim.state[p]["step"]) for p in model.parameters()],
            "lr": optim.param_groups[0]["lr"],
            "scheduler": {k: v for k, v in sched.state_dict().items() if k in ("last_epoch", "_last_lr")},
            "scaler": scaler.state_dict(),
            "local_shape": list(first.to_local().shape),
            "extra": {
                "rng_sha": hashlib.sha256(extra.rng.numpy().tobytes()).hexdigest(),
                "rng_numel": extra.rng.numel(),
                "pos": extra.pos,
            },
            "saved": {"succeeded": result.succeeded, "path": result.path, "bytes": result.bytes_written},
        }
    ]
