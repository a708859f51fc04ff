"""Resumes from the node-local tier on another number of ranks or nodes (gloo, simulated nodes).

Each "node" has its own ``local_dir`` (``<base>/node<rank // ranks_per_node>``); ``save_dir`` is
shared. The model is FSDP2 over every rank of the launch (``_common.shard_fsdp2``), with AdamW.

``train BASE RPN STEPS``: ``STEPS`` saves, one per step, durable every 5th; rank 0 writes every
step's full state (parameters and AdamW moments as whole tensors) to ``<base>/full_<step>.pt``.
Waits for the peer replicas.

``resume BASE:RPN [...]``: for each base, a fresh model resumed through a new engine with
``ranks_per_node: RPN``; reports the iteration, the bytes by source and whether the full state
equals ``full_<iteration>.pt`` bit for bit.

``stall BASE:RPN``: a resume whose rank 0 stops for good once it has received the first chunk of
the resharding exchange (``<base>/stalled`` says so; each rank's pid is in ``<base>/pid_<rank>``):
the test kills the job there.

``continue BASE:RPN [...]``: ``resume``, then one more step saved (to the local tier only).

``then``: modes chain in one launch (``train ... then stall ...``).
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any

import torch
from _common import ckpt_test_exit, cpu_mesh, full, init, make_model, report, shard_fsdp2, step

from ckpt_engine import CheckpointEngine


def config(base: str, rank: int, rpn: int) -> dict[str, Any]:
    return {
        "save_dir": os.path.join(base, "durable"),
        "local_dir": os.path.join(base, f"node{rank // rpn}"),
        "ranks_per_node": rpn,
        "persist_every": 5,
        "collective_timeout_s": 60,
    }


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard_fsdp2(make_model(seed=7), cpu_mesh())
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def full_state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Whole parameters and AdamW moments (collective: every rank calls it)."""
    out = {f"p.{n}": full(p.detach()).clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for field in ("exp_avg", "exp_avg_sq", "step"):
            out[f"{field}.{n}"] = full(optim.state[p][field]).clone()
    return out


def save_steps(engine: Any, model: Any, optim: Any, base: str, rank: int, iterations: range) -> None:
    """One training step and one save per iteration; rank 0 keeps each step's full state."""
    for it in iterations:
        step(model, optim, seed=it)
        state = full_state(model, optim)
        if rank == 0:
            torch.save(state, os.path.join(base, f"full_{it}.pt"))
        engine.save(it, model=model, optimizer=optim).result()
    engine.wait_replicated()


class Damaged(logging.Handler):
    """The engine's warnings of a tier's copy that failed its check."""

    def __init__(self) -> None:
        super().__init__()
        self.said: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if "is damaged" in record.getMessage():
            self.said.append(record.getMessage())


def train(base: str, rpn: int, steps: int, rank: int) -> None:
    model, optim = build()
    with CheckpointEngine(config(base, rank, rpn)) as engine:
        save_steps(engine, model, optim, base, rank, range(1, steps + 1))
    report({"base": base, "trained": steps})


def resume(base: str, rpn: int, rank: int, more: int = 0) -> None:
    """Resume ``base``; then, with ``more``, save that many more steps (local only here)."""
    model, optim = build()
    handler = Damaged()
    logging.getLogger("ckpt_engine").addHandler(handler)
    with CheckpointEngine(config(base, rank, rpn)) as engine:
        result = engine.load(model=model, optimizer=optim)
        got = full_state(model, optim)
        save_steps(engine, model, optim, base, rank, range(result.iteration + 1, result.iteration + 1 + more))
    expected = torch.load(os.path.join(base, f"full_{result.iteration}.pt"), weights_only=True)
    same = sorted(expected) == sorted(got) and all(torch.equal(expected[k], got[k]) for k in expected)
    logging.getLogger("ckpt_engine").removeHandler(handler)
    report(
        {
            "base": base,
            "iteration": result.iteration,
            "by_source": dict(result.bytes_by_source),
            "same": same,
            "damaged": handler.said,
        }
    )


def stall(base: str, rpn: int, rank: int) -> None:
    """A resume whose rank 0 stops for good inside the resharding exchange, after its first chunk."""
    from ckpt_engine._tier import reshard_read

    with open(os.path.join(base, f"pid_{rank}"), "w") as f:  # torchrun gives each rank a session of its own
        f.write(str(os.getpid()))
    real = reshard_read.exchange_bytes

    def stopping(*args: Any, **kwargs: Any) -> Any:
        got = real(*args, **kwargs)
        if rank == 0 and got:
            open(os.path.join(base, "stalled"), "w").close()
            time.sleep(600)
        return got

    reshard_read.exchange_bytes = stopping
    resume(base, rpn, rank)


def main() -> None:
    rank, _ = init()
    args = sys.argv[1:]
    while args:
        mode, *rest = args
        cut = rest.index("then") if "then" in rest else len(rest)
        here, args = rest[:cut], rest[cut + 1 :]
        if mode == "train":
            train(here[0], int(here[1]), int(here[2]), rank)
        else:
            for target in here:
                base, rpn = target.rsplit(":", 1)
                if mode == "continue":
                    resume(base, int(rpn), rank, more=1)
                else:
                    (stall if mode == "stall" else resume)(base, int(rpn), rank)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
