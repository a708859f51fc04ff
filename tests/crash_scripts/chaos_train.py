"""A small training job for the outside crash-consistency tool ``ckpt-chaos`` (tests/reliability/test_chaos.py).

``python chaos_train.py --out DIR [--mode sync|pinned_staging|incremental]``: resumes from
``DIR/ckpt`` (printing ``resumed from step N``), trains to step 12 with a save every 4 steps,
and writes the final weights to ``DIR/final.bin``, so that the tool can kill it at every file
event of a save, resume it, and compare the result and the step resumed from with a run that was
never killed. Deterministic: step ``s`` draws its batch from seed ``s``.
"""

from __future__ import annotations

import argparse
import os

import torch
from torch import nn

from ckpt_engine import CheckpointEngine

STEPS, EVERY = 12, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--mode", default="sync", choices=["sync", "pinned_staging", "incremental"])
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 4))
    if args.mode == "incremental":
        model[0].requires_grad_(False)  # a frozen part, carried over between checkpoints
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    config = {
        "save_dir": os.path.join(args.out, "ckpt"),
        "plugins": ["pinned_staging"] if args.mode == "pinned_staging" else [],
        "incremental": args.mode == "incremental",
    }
    with CheckpointEngine(config) as engine:
        start = engine.load(model=model, optimizer=opt).iteration
        print(f"resumed from step {start}", flush=True)
        for step in range(start + 1, STEPS + 1):
            gen = torch.Generator().manual_seed(step)
            loss = model(torch.randn(8, 32, generator=gen)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step % EVERY == 0:
                engine.save(step, model=model, optimizer=opt).result()
    with open(os.path.join(args.out, "final.bin"), "wb") as f:
        for t in model.state_dict().values():
            f.write(t.contiguous().view(-1).numpy().tobytes())


if __name__ == "__main__":
    main()
