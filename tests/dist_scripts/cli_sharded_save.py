"""2 ranks: an FSDP2 model (uneven and empty shards) and AdamW, saved twice with the engine.

argv: save_dir [local_dir]. With local_dir, every save is also committed to the node-local tier
there (each rank's part of the model, a rank-local checkpoint). Rank 0 reports the full
parameters after each save, so the CLI tests can check that ``convert`` and ``diff`` assemble
every tensor from both ranks' shards. With local_dir, three more models are saved once each into
``<save_dir>_<case>`` and ``<local_dir>_<case>``: ``replicated`` (the same weights on both ranks:
each part is the whole model), ``pipeline`` (rank r holds stage r's layer only) and ``experts``
(a buffer held per rank, ``per_rank_keys``).
"""

from __future__ import annotations

import sys

import torch
from _common import ckpt_test_exit, cpu_mesh, init, make_model, params_full, report, shard_fsdp2, train_inputs

from ckpt_engine import CheckpointEngine


def main() -> None:
    save_dir = sys.argv[1]
    tier = {"local_dir": sys.argv[2], "peer_replicas": 0} if len(sys.argv) > 2 else {}
    rank, _ = init()
    model = shard_fsdp2(make_model(seed=0), cpu_mesh())
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = train_inputs()
    saved = {}
    with CheckpointEngine({"save_dir": save_dir, **tier}) as engine:
        for iteration in (1, 2):
            loss = model(x).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            engine.save(iteration, model=model, optimizer=optim).result(timeout=60)
            saved[iteration] = params_full(model)  # a collective: every rank calls it
    if tier:
        _save_parts(save_dir, sys.argv[2], rank)
    if rank == 0:
        report(saved)
    ckpt_test_exit()


def _save_parts(save_dir: str, local_dir: str, rank: int) -> None:
    """The three models whose rank-local parts ``convert`` must tell apart."""
    torch.manual_seed(0)
    replicated = torch.nn.Linear(3, 2)
    pipeline = torch.nn.Module()
    pipeline.add_module(f"stage{rank}", torch.nn.Linear(3, 2))
    experts = torch.nn.Linear(3, 2)
    experts.register_buffer("experts", torch.full((2,), float(rank)))
    for case, model, extra in (
        ("replicated", replicated, {}),
        ("pipeline", pipeline, {}),
        ("experts", experts, {"per_rank_keys": ["model.experts"]}),
    ):
        config = {"save_dir": f"{save_dir}_{case}", "local_dir": f"{local_dir}_{case}", "peer_replicas": 0, **extra}
        with CheckpointEngine(config) as engine:
            engine.save(1, model=model).result(timeout=60)


if __name__ == "__main__":
    main()
