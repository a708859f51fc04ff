"""What checking every byte a load reads costs: ``verify: read`` against ``verify: sizes``, paired.

One checkpoint of ``--model-mib`` MiB of fp32 parameters (16 square bias-free ``Linear`` layers)
with AdamW's state (twice that again) is saved to ``--dir`` (tmpfs by default: a hot load, the
case where hashing is the largest share), then loaded into the same objects ``--rounds`` times
at each level, the two levels alternating which goes first in every round. Reported: each
load's seconds, the medians, and the median of the per-round ratios read / sizes.

Usage::

    python benchmarks/verified_read_bench.py [--model-mib 256] [--rounds 7] [--out results.json]
    python benchmarks/verified_read_bench.py --smoke     # tiny, seconds: keeps the script from rotting
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
from torch import nn

from ckpt_engine import CheckpointEngine

LEVELS = ("sizes", "read")


def _state(model_mib: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    side = int((model_mib * (1 << 20) / 4 / 16) ** 0.5)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(side, side, bias=False) for _ in range(16)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()  # AdamW's moments exist: the checkpoint holds 3x the parameters
    return model, opt


def _load(folder: str, level: str, model: nn.Module, opt: torch.optim.Optimizer) -> float:
    with CheckpointEngine({"save_dir": folder, "verify": level}) as engine:
        start = time.perf_counter()
        engine.load(model=model, optimizer=opt)
        return time.perf_counter() - start


def run(model_mib: int, rounds: int, root: str) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="verified-read-bench-", dir=root)
    try:
        model, opt = _state(model_mib)
        with CheckpointEngine({"save_dir": folder}) as engine:
            engine.save(1, model=model, optimizer=opt).result()
        _load(folder, "read", model, opt)  # warm: the page cache, the allocator, the imports
        times: dict[str, list[float]] = {level: [] for level in LEVELS}
        for r in range(rounds):
            for level in LEVELS if r % 2 == 0 else LEVELS[::-1]:
                times[level].append(_load(folder, level, model, opt))
        ratios = [b / a for a, b in zip(times["sizes"], times["read"], strict=True)]
        nbytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(folder) for f in fs)
        return {
            "model_mib": model_mib,
            "checkpoint_bytes": nbytes,
            "rounds": rounds,
            "dir": root,
            "seconds": times,
            "median_s": {level: statistics.median(ts) for level, ts in times.items()},
            "median_ratio_read_over_sizes": statistics.median(ratios),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__},
        }
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-mib", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--out")
    parser.add_argument("--smoke", action="store_true", help="tiny and untimed")
    args = parser.parse_args()
    if args.smoke:
        args.model_mib, args.rounds = 1, 2
    result = run(args.model_mib, args.rounds, args.dir)
    text = json.dumps(result, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
