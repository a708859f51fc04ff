"""The node-local tier on 4 gloo ranks as 2 simulated nodes (``ranks_per_node: 2``): each node
has its own ``local_dir`` folder (``<base>/node0``, ``<base>/node1``), ``save_dir`` is shared.

``train BASE KIND STEPS [key=value ...]``: a model (``replicated``: the same plain module on every
rank, as DDP keeps it; ``fsdp``: FSDP2 over all 4 ranks) trained ``STEPS`` steps with a save each,
durable every 3rd; each rank's state at each step is written to ``<base>/expected_<rank>_<step>.pt``.
Waits for the peer replicas and reports every save's tier, bytes and bytes reused. ``key=value``
items are further config fields (``plugins=pinned_staging``, ``incremental=1``,
``peer_bandwidth_mb_s=1``); with ``hold=1`` the job saves one more step after ``STEPS`` and then
waits to be killed while that step replicates (``<base>/holding`` says it is there; each rank's
pid is in ``<base>/pid_<rank>``).

``trains BASE:KIND:STEPS[:key=value ...] [...]``: several such trainings in one launch, one after
the other, each with its own base, engine and model (a torchrun launch costs more than a short
training); each reports its base with its saves.

``pair BASE`` (2 ranks): the 2-rank scenarios in one launch, each reporting under its name:
``shared`` (two ranks said to be on two nodes given one ``local_dir``: the first save is refused)
in ``BASE/shared``, then ``transfer`` (``tier_transfer.py``: files and messages between the two
ranks; last, as its last step leaves the pair out of step) in ``BASE/transfer``.

``resume KIND:BASE [KIND:BASE ...]``: for each base in turn, a fresh model of that kind resumed
through a new engine (with the config fields in ``<base>/resume.json``, if any); reports the
iteration, the bytes by source, the path and whether its state equals that step's
``expected_<rank>_<step>.pt`` bit for bit (``null`` where the kinds differ).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import tier_transfer
import torch
from _common import attempt, ckpt_test_exit, cpu_mesh, init, local, make_model, report, shard_fsdp2, step

from ckpt_engine import CheckpointEngine


def config(base: str, rank: int, **extra: Any) -> dict[str, Any]:
    plugins = extra.pop("plugins", None)
    return {
        "save_dir": os.path.join(base, "durable"),
        "local_dir": os.path.join(base, f"node{rank // 2}"),
        "ranks_per_node": 2,
        "persist_every": 3,
        "collective_timeout_s": 60,
        **({"plugins": [plugins]} if plugins else {}),
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
    hold = bool(extra.pop("hold", 0))
    if hold:  # torchrun starts each rank in a session of its own: the test kills the ranks by pid
        with open(os.path.join(base, f"pid_{rank}"), "w") as f:
            f.write(str(os.getpid()))
    if "chunk_bytes" in extra:  # small chunks, so that a throttled copy is seen in flight
        from ckpt_engine._tier import transfer

        transfer.CHUNK_BYTES = int(extra.pop("chunk_bytes"))
    model, optim = build(kind)
    saves = []
    with CheckpointEngine(config(base, rank, **extra)) as engine:
        for it in range(1, steps + 1 + hold):
            step(model, optim, seed=it)
            torch.save(state(model, optim), os.path.join(base, f"expected_{rank}_{it}.pt"))
            handle = engine.save(it, model=model, optimizer=optim)
            result = handle.result()
            saves.append({"tier": result.tier, "written": result.bytes_written, "reused": result.bytes_reused})
            if hold and it == steps:
                engine.wait_replicated()
        if hold:
            if rank == 0:
                open(os.path.join(base, "holding"), "w").close()
            time.sleep(600)  # the test kills the job while the last step replicates
        engine.wait_replicated()
    report({"base": base, "saves": saves})


def resume(targets: list[str], rank: int) -> None:
    for target in targets:
        kind, base = target.split(":", 1)
        with open(os.path.join(base, "kind")) as f:
            trained = f.read().strip()
        model, optim = build(kind)
        extra_path = os.path.join(base, "resume.json")  # config fields of this resume only
        extra: dict[str, Any] = {}
        if os.path.exists(extra_path):
            with open(extra_path) as f:
                extra = json.load(f)
        with CheckpointEngine(config(base, rank, **extra)) as engine:
            result = engine.load(model=model, optimizer=optim)
        same = None
        if kind == trained:
            expected = torch.load(os.path.join(base, f"expected_{rank}_{result.iteration}.pt"), weights_only=True)
            got = state(model, optim)
            same = sorted(expected) == sorted(got) and all(torch.equal(expected[k], got[k]) for k in expected)
        report(
            {
                "base": base,
                "iteration": result.iteration,
                "by_source": dict(result.bytes_by_source),
                "same": same,
                "path": result.checkpoint_path,
            }
        )


def shared(base: str, rank: int) -> None:
    """Two ranks said to be on two nodes (``ranks_per_node: 1``) given one ``local_dir``."""
    model, optim = build("replicated")
    cfg = {"save_dir": os.path.join(base, "durable"), "local_dir": os.path.join(base, "one"), "ranks_per_node": 1}
    with CheckpointEngine(cfg) as engine:
        report({"scenario": "shared", **attempt(lambda: engine.save(1, model=model, optimizer=optim))})


def fields(items: list[str]) -> dict[str, Any]:
    """``key=value`` items as config fields (numbers as numbers)."""
    extra: dict[str, Any] = {}
    for item in items:
        key, value = item.split("=", 1)
        extra[key] = int(value) if value.isdigit() else float(value) if value[:1].isdigit() else value
    return extra


def train_one(base: str, kind: str, steps: int, rank: int, items: list[str]) -> None:
    if rank == 0:
        with open(os.path.join(base, "kind"), "w") as f:
            f.write(kind)
    train(base, kind, steps, rank, fields(items))


def main() -> None:
    rank, _ = init()
    mode = sys.argv[1]
    if mode == "pair":
        shared(os.path.join(sys.argv[2], "shared"), rank)
        tier_transfer.exchanges(os.path.join(sys.argv[2], "transfer"), rank)
    elif mode == "train":
        train_one(sys.argv[2], sys.argv[3], int(sys.argv[4]), rank, sys.argv[5:])
    elif mode == "trains":
        for spec in sys.argv[2:]:
            base, kind, steps, *items = spec.split(":")
            train_one(base, kind, int(steps), rank, items)
    else:
        resume(sys.argv[2:], rank)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
