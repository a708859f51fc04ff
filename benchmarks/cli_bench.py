"""Command-line start-up: how long ``import ckpt_engine`` and ``ckpt-engine`` take in a fresh process.

Median of ``--reps`` (default 5) wall times, each a new interpreter, of::

    python -c "import torch"                  # the floor every torch-using command pays
    python -c "import torch.distributed.checkpoint"   # what reading a .metadata adds (no target)
    python -c "import ckpt_engine"
    ckpt-engine --help                        # run as python -c "...main(['--help'])"
    ckpt-engine ls SAVE_DIR                   # a small save folder made first (2 checkpoints)

and the ratios against the targets: ``--help`` at most 0.5 s, ``ls`` at most ``import torch`` +
0.5 s, ``import ckpt_engine`` at most 1.2x ``import torch``. ``--pythonpath DIR`` measures another
checkout (put first on ``PYTHONPATH``, e.g. a ``git worktree`` of an older commit)::

    python benchmarks/cli_bench.py
    python benchmarks/cli_bench.py --reps 9 --pythonpath /tmp/cli-before
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HELP_TARGET_S = 0.5
LS_OVER_TORCH_S = 0.5
IMPORT_RATIO = 1.2

_MAKE_SAVE_DIR = """
import sys, torch
from ckpt_engine import CheckpointEngine
model = torch.nn.Linear(16, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
with CheckpointEngine({"save_dir": sys.argv[1]}) as engine:
    for step in (1, 2):
        engine.save(step, model=model, optimizer=opt)
"""


def _env(pythonpath: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    return env


def _time_once(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def median_time(argv: list[str], env: dict[str, str], reps: int) -> tuple[float, float, float]:
    """Median, min and max wall seconds of ``reps`` fresh runs of ``argv`` (after one untimed run)."""
    _time_once(argv, env)  # warm the page cache and the .pyc files
    times = [_time_once(argv, env) for _ in range(reps)]
    return statistics.median(times), min(times), max(times)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=5, help="timed runs per command (default 5)")
    ap.add_argument("--pythonpath", default=None, help="a checkout to measure instead of the installed one")
    args = ap.parse_args(argv)
    env = _env(args.pythonpath)
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="cli-bench-") as tmp:
        save_dir = str(Path(tmp) / "checkpoints")
        subprocess.run([py, "-c", _MAKE_SAVE_DIR, save_dir], env=env, check=True, stdout=subprocess.DEVNULL)
        cli = "import sys; from ckpt_engine.cli import main; sys.exit(main(sys.argv[1:]))"
        rows = {
            "import torch": [py, "-c", "import torch"],
            # not a target: the floor of a command that reads .metadata (ls, inspect, verify)
            "import torch.d.checkpoint": [py, "-c", "import torch.distributed.checkpoint"],
            "import ckpt_engine": [py, "-c", "import ckpt_engine"],
            "ckpt-engine --help": [py, "-c", cli, "--help"],
            "ckpt-engine ls SAVE_DIR": [py, "-c", cli, "ls", save_dir],
        }
        results = {name: median_time(cmd, env, args.reps) for name, cmd in rows.items()}
    print(f"median of {args.reps} fresh processes (python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    print(f"{'command':<26}{'median s':>10}{'min s':>8}{'max s':>8}")
    for name, (med, lo, hi) in results.items():
        print(f"{name:<26}{med:>10.2f}{lo:>8.2f}{hi:>8.2f}")
    torch_s = results["import torch"][0]
    checks = [
        ("ckpt-engine --help", results["ckpt-engine --help"][0], HELP_TARGET_S, f"<= {HELP_TARGET_S} s"),
        (
            "ckpt-engine ls",
            results["ckpt-engine ls SAVE_DIR"][0],
            torch_s + LS_OVER_TORCH_S,
            f"<= import torch + {LS_OVER_TORCH_S} s",
        ),
        (
            "import ckpt_engine",
            results["import ckpt_engine"][0],
            IMPORT_RATIO * torch_s,
            f"<= {IMPORT_RATIO}x import torch",
        ),
    ]
    print(f"\n{'target':<26}{'measured':>10}{'limit':>8}  {'ratio':>6}")
    ok = True
    for name, got, limit, text in checks:
        met = got <= limit
        ok = ok and met
        print(f"{name:<26}{got:>9.2f}s{limit:>7.2f}s  {got / limit:>6.2f}  {text}: {'met' if met else 'MISSED'}")
    print(f"import ckpt_engine / import torch: {results['import ckpt_engine'][0] / torch_s:.2f}x")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
