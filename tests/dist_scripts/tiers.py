"""The node-local tier on 4 gloo ranks as 2 simulated nodes (``ranks_per_node: 2``): each node
has its own ``local_dir`` folder (``<base>/node0``, ``<base>/node1``), ``save_dir`` is shared.

``train BASE KIND STEPS``: a model (``replicated``: the same plain module on every rank, as DDP
keeps it; ``fsdp``: FSDP2 over all 4 ranks) trained ``STEPS`` steps with a save each, durable
every 3rd, each rank's state at each step written to ``<base>/expected_<rank>_<step>.pt``; waits
for the peer replicas and reports every save's tier.

``resume BASE KIND``: a fresh model resumed through ``engine.load``; reports the iteration, the
bytes by source and whether its state equals that step's ``expected_<rank>_<step>.pt`` bit for bit.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from _common import ckpt_test_exit, cpu_mesh, init, local, make_model, report, shard_fsdp2, step

from ckpt_engine import CheckpointEngine


def config(base: str, rank: int, **extra: Any) -> dict[str, Any]:
    return {
        "save_dir": os.path.join(base, "durable"),
        "local_dir": os.path.join(base, f"node{rank // 2}"),
        "ranks_per_node": 2,
        "persist_every": 3,
        "collective_timeout_s": 60,
        **extra,
    }


def build(kind: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed=7)
    if kind == "fsdp":
        model = shard_fsdp2(model, cpu_mesh())
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's own share: parameters and AdamW moments (local shards under FSDP2)."""
    out = {f"p.{n}": local(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for field in ("exp_avg", "exp_avg_sq"):
            out[f"{field}.{n}"] = local(optim.state[p][field]).clone()
    return out


def train(base: str, kind: str, steps: int, rank: int, extra: dict[str, Any]) -> None:
    model, optim = build(kind)
    tiers = []
    with CheckpointEngine(config(base, rank, **extra)) as engine:
        for it in range(1, steps + 1):
            step(model, optim, seed=it)
            result = engine.save(it, model=model, optimizer=optim).result()
            tiers.append(result.tier)
            torch.save(state(model, optim), os.path.join(base, f"expected_{rank}_{it}.pt"))
        engine.wait_replicated()
    report({"tiers": tiers})


def resume(base: str, kind: str, rank: int, extra: dict[str, Any]) -> None:
    model, optim = build(kind)
    with CheckpointEngine(config(base, rank, **extra)) as engine:
        result = engine.load(model=model, optimizer=optim)
    expected = torch.load(os.path.join(base, f"expected_{rank}_{result.iteration}.pt"), weights_only=True)
    got = state(model, optim)
    same = sorted(expected) == sorted(got) and all(torch.equal(expected[k], got[k]) for k in expected)
    report(
        {
            "iteration": result.iteration,
            "by_source": dict(result.bytes_by_source),
            "same": same,
            "path": result.checkpoint_path,
        }
    )


def main() -> None:
    rank, _ = init()
    mode, base, kind = sys.argv[1:4]
    extra: dict[str, Any] = {}
    for item in sys.argv[5 if mode == "train" else 4 :]:
        key, value = item.split("=", 1)
        extra[key] = int(value) if value.isdigit() else value
    if mode == "train":
        train(base, kind, int(sys.argv[4]), rank, extra)
    else:
        resume(base, kind, rank, extra)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
