"""Failures one after another, and failure domains, in the node-local tier on 4 gloo ranks.

``BASE``: for each scenario of :data:`SCENARIOS` in turn, a model (the same plain module on every
rank, as DDP keeps it) trained 5 steps with a save each (durable every 3rd) through its own
engine, each node's ``local_dir`` at ``<base>/<scenario>/node<n>``; then, for each loss in its
list, every engine closed, the lost nodes' folders wiped by rank 0 (between two barriers: no
rank runs meanwhile), and a fresh model resumed through a new engine. Each resume reports the
scenario, the loss, the iteration, the bytes by source and whether the state equals the one
saved at that step bit for bit.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
from _common import ckpt_test_exit, init, report, step
from tiers import build, state

from ckpt_engine import CheckpointEngine
from ckpt_engine._tier.topology import DOMAIN_ENV

#: name -> (ranks_per_node, peer_replicas, each rank's domain and where it is given, the losses).
SCENARIOS: dict[str, tuple[int, int | None, tuple[str, ...], str, list[list[int]]]] = {
    # 2 nodes, one replica each: node 1 lost and rebuilt, then node 0 lost before any save.
    "rebuild": (2, None, (), "", [[1], [0]]),
    # 4 nodes on 2 racks (a: nodes 0, 1; b: nodes 2, 3), 2 replicas: rack b lost, then rack a.
    "racks2": (1, 2, ("a", "a", "b", "b"), "env", [[2, 3], [0, 1]]),
    # The same racks, 1 replica: rack a lost (the next node would be on the same rack).
    "racks1": (1, 1, ("a", "a", "b", "b"), "config", [[0, 1]]),
}


def config(base: str, rank: int, per_node: int, replicas: int | None, domains: tuple[str, ...], how: str) -> Any:
    cfg: dict[str, Any] = {
        "save_dir": os.path.join(base, "durable"),
        "local_dir": os.path.join(base, f"node{rank // per_node}"),
        "ranks_per_node": per_node,
        "persist_every": 3,
    }
    if replicas is not None:
        cfg["peer_replicas"] = replicas
    if how == "config":
        cfg["failure_domain"] = domains[rank]
    if how == "env":
        os.environ[DOMAIN_ENV] = domains[rank]
    else:
        os.environ.pop(DOMAIN_ENV, None)
    return cfg


def scenario(root: str, name: str, rank: int) -> None:
    per_node, replicas, domains, how, losses = SCENARIOS[name]
    base = os.path.join(root, name)
    if rank == 0:
        os.makedirs(base)
    dist.barrier()
    cfg = config(base, rank, per_node, replicas, domains, how)
    model, optim = build("replicated")
    with CheckpointEngine(cfg) as engine:
        for it in range(1, 6):
            step(model, optim, seed=it)
            torch.save(state(model, optim), os.path.join(base, f"expected_{rank}_{it}.pt"))
            engine.save(it, model=model, optimizer=optim).result()
        engine.wait_replicated()
    for lost in losses:
        dist.barrier()
        if rank == 0:
            for node in lost:
                shutil.rmtree(os.path.join(base, f"node{node}"))
        dist.barrier()
        model, optim = build("replicated")
        with CheckpointEngine(cfg) as engine:
            result = engine.load(model=model, optimizer=optim)
        expected = torch.load(os.path.join(base, f"expected_{rank}_{result.iteration}.pt"), weights_only=True)
        got = state(model, optim)
        same = sorted(expected) == sorted(got) and all(torch.equal(expected[k], got[k]) for k in expected)
        by_source = dict(result.bytes_by_source)
        report({"scenario": name, "lost": lost, "iteration": result.iteration, "by_source": by_source, "same": same})


def main() -> None:
    rank, _ = init()
    for name in SCENARIOS:
        scenario(sys.argv[1], name, rank)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
