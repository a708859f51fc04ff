"""Train a tiny model on CPU, checkpoint every few steps, get killed, resume, and check.

    python examples/train_resume.py [--steps 12] [--save-every 3] [--kill-after 8] [--out runs/example]

1. A reference run trains ``--steps`` steps without interruption and records its losses.
2. A worker process trains the same model, saving with ckpt-engine every ``--save-every`` steps.
   It is killed with SIGKILL after step ``--kill-after``.
3. A fresh process resumes from ``latest_checkpoint.txt`` and trains to the end.
4. The resumed losses must equal the reference losses, step for step.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import time

import torch
from torch import nn

from ckpt_engine import CheckpointEngine


def build(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
    return model, optimizer, scheduler


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step: a function of the step, so a resumed run sees the same batches."""
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: object, step: int) -> float:
    x, y = batch(step)
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    scheduler.step()  # type: ignore[attr-defined]
    return loss.item()


def reference(steps: int) -> list[float]:
    model, optimizer, scheduler = build()
    return [train_step(model, optimizer, scheduler, s) for s in range(1, steps + 1)]


def worker(args: argparse.Namespace) -> None:
    """Train, saving every --save-every steps; print each step so the parent can kill us."""
    model, optimizer, scheduler = build()
    engine = CheckpointEngine({"save_dir": args.out})
    result = engine.load(model=model, optimizer=optimizer, scheduler=scheduler)
    for step in range(result.iteration + 1, args.steps + 1):
        loss = train_step(model, optimizer, scheduler, step)
        print(f"step {step} loss {loss:.6f}", flush=True)
        if step % args.save_every == 0:
            engine.save(step, model=model, optimizer=optimizer, scheduler=scheduler)
            print(f"saved {step}", flush=True)
        if args.slow:
            time.sleep(args.slow)
    engine.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--save-every", type=int, default=3)
    parser.add_argument("--kill-after", type=int, default=8)
    parser.add_argument("--out", default=os.path.join("runs", "example", "checkpoints"))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--slow", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0

    shutil.rmtree(args.out, ignore_errors=True)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    expected = reference(args.steps)
    print(f"reference run: {args.steps} steps, final loss {expected[-1]:.6f}")

    # The worker is killed hard after --kill-after steps, wherever it is.
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--steps",
        str(args.steps),
        "--save-every",
        str(args.save_every),
        "--out",
        args.out,
        "--slow",
        "0.05",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        print(f"  worker: {line.rstrip()}")
        if line.startswith(f"step {args.kill_after} "):
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait()
    print(f"worker killed with SIGKILL (exit code {proc.returncode})")

    # A fresh "process" (new objects) resumes from latest_checkpoint.txt.
    model, optimizer, scheduler = build(seed=12345)  # different init: everything must come from disk
    with CheckpointEngine({"save_dir": args.out}) as engine:
        result = engine.load(model=model, optimizer=optimizer, scheduler=scheduler)
    print(f"resumed from {result.checkpoint_path} at iteration {result.iteration}")
    print("\n".join("  " + line for line in result.report.summary().splitlines()))
    resumed = [train_step(model, optimizer, scheduler, s) for s in range(result.iteration + 1, args.steps + 1)]
    tail = expected[result.iteration :]
    for step, (a, b) in enumerate(zip(tail, resumed, strict=True), start=result.iteration + 1):
        print(f"  step {step:3d}: uninterrupted {a:.6f}  resumed {b:.6f}  {'ok' if a == b else 'DIFFERENT'}")
    if resumed != tail:
        print("FAILED: the resumed run diverged from the uninterrupted one")
        return 1
    print(f"OK: the resumed run matches the uninterrupted run for all {len(tail)} steps after the resume")
    return 0


if __name__ == "__main__":
    sys.exit(main())
