"""A training loop under ``engine.save_on_preemption()``: prints ``STEP <n> <loss repr>`` after
each step (flushed), saves every ``every`` steps, and on SIGTERM saves and exits 0.

argv: save_dir until every step_seconds
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from ckpt_engine import CheckpointEngine


def main() -> None:
    save_dir, until, every, pause = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with (
        CheckpointEngine({"save_dir": save_dir, "rng": True}) as engine,
        engine.save_on_preemption(every=every) as saver,
    ):
        start = engine.load(model=model, optimizer=opt).iteration
        print(f"START {start}", flush=True)
        for step in range(start + 1, until + 1):
            x = torch.randn(16, 8)
            loss = nn.functional.mse_loss(model(x), x.sum(dim=1, keepdim=True).sin())
            opt.zero_grad()
            loss.backward()
            opt.step()
            print(f"STEP {step} {loss.item()!r}", flush=True)
            time.sleep(pause)
            saver.step_done(step, model=model, optimizer=opt)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
