"""SIGKILL while an ``overlap`` snapshot is still being copied (run by ``tests/plugins/test_overlap.py``).

argv: save_dir. Trains a deterministic model (``state_at``), saves iteration 1 and waits for
its commit, steps, saves iteration 2 with ``pinned_staging`` ``overlap: true`` and, right after
``save()`` returned, prints ``STAGING 2`` and steps on (the step pre-hook waits
for the copy, then the writer writes). The test kills the whole process group on that line.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn

from ckpt_engine import CheckpointEngine

WIDTH = 1024  # 4 layers of 1024x1024 floats: 16 MB of weights, 48 MB with AdamW's state


def make() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(4)])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def train_step(model: nn.Module, optim: torch.optim.Optimizer, i: int) -> None:
    gen = torch.Generator().manual_seed(100 + i)
    model(torch.randn(8, WIDTH, generator=gen)).square().mean().backward()
    optim.step()
    optim.zero_grad()


def state_at(iteration: int) -> dict[str, Any]:
    """The model and optimizer state after ``iteration`` steps (what save(iteration) holds)."""
    model, optim = make()
    for i in range(iteration):
        train_step(model, optim, i)
    return {"model": model.state_dict(), "optim": optim.state_dict()}


def main() -> None:
    os.setpgid(0, 0)  # the test kills the whole group: the writer process dies with us
    torch.set_num_threads(1)
    model, optim = make()
    plugins = [{"name": "pinned_staging", "options": {"overlap": True}}]
    engine = CheckpointEngine({"save_dir": sys.argv[1], "plugins": plugins})
    train_step(model, optim, 0)
    engine.save(1, model=model, optimizer=optim).result()
    print("COMMITTED 1", flush=True)
    train_step(model, optim, 1)
    handle = engine.save(2, model=model, optimizer=optim)
    print("STAGING 2", flush=True)
    del handle
    for i in range(2, 1000):
        train_step(model, optim, i)


if __name__ == "__main__":
    main()
