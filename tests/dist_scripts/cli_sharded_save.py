"""2 ranks: an FSDP2 model (uneven and empty shards) and AdamW, saved twice with the engine.

argv: save_dir [local_dir]. With local_dir, every save is also committed to the node-local tier
there (each rank's part of the model, a rank-local checkpoint). Rank 0 reports the full
parameters after each save, so the CLI tests can check that ``convert`` and ``diff`` assemble
every tensor from both ranks' shards.
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
    if rank == 0:
        report(saved)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
