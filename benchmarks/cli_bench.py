"""Command-line start-up: how long ``import ckpt_engine`` and ``ckpt-engine`` commands take, each a
fresh process, in paired rounds.

Every round runs each command once as a new interpreter (the order reversed every other round,
so the machine's load of the moment falls on all of them alike)::

    python -c "import torch"                    # the floor a command that imports torch pays
    python -c "import ckpt_engine"
    ckpt-engine --help                          # run as python -c "...main(['--help'])"
    ckpt-engine ls SAVE_DIR                     # 10 checkpoints (model, optim, scheduler, trainer)
    ckpt-engine inspect CHECKPOINT              # the newest of them, every key and value
    ckpt-engine verify SAVE_DIR --level sizes   # all 10 against their manifests
    ckpt-engine inspect model.safetensors       # its model, exported with `convert`

and reports each command's median, and the median over rounds of its difference from
``--help`` in the same round. Targets: ``--help`` at most 0.5 s; ``ls``, ``inspect`` and
``verify --level sizes`` at most 0.5 s over ``--help`` (none imports torch); ``import
ckpt_engine`` at most 1.2x ``import torch``. ``--before DIR`` also runs every command from another
checkout (put first on ``PYTHONPATH``, e.g. a ``git worktree`` of an older commit) in the same
rounds; ``--pythonpath DIR`` measures another checkout instead of this one::

    python benchmarks/cli_bench.py
    python benchmarks/cli_bench.py --rounds 9 --before /tmp/cli-before
    python benchmarks/cli_bench.py --smoke      # one round, for the test suite: times mean nothing
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
OVER_HELP_S = 0.5
IMPORT_RATIO = 1.2
CHECKPOINTS = 10
#: Marks the rows of the ``--before`` checkout.
BEFORE = " (before)"

#: A save folder of CHECKPOINTS checkpoints of about 2.8 MiB each (model, AdamW, scheduler, trainer),
#: and the newest model as a safetensors file.
_MAKE = """
import sys, torch
from ckpt_engine import CheckpointEngine
from ckpt_engine.cli import main
save_dir, n = sys.argv[1], int(sys.argv[2])
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10)
with CheckpointEngine({"save_dir": save_dir, "keep_last": None}) as engine:
    for step in range(1, n + 1):
        model(torch.randn(4, 256)).sum().backward()
        opt.step()
        sched.step()
        engine.save(step, model=model, optimizer=opt, scheduler=sched)
assert main(["convert", save_dir, sys.argv[3]]) == 0
"""
_CLI = "import sys; from ckpt_engine.cli import main; sys.exit(main(sys.argv[1:]))"


def _env(pythonpath: str | None, cwd: str) -> dict[str, str]:
    env = dict(os.environ, CLI_BENCH_CWD=cwd)
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH", "")) if p)
    return env


def _time_once(argv: list[str], env: dict[str, str], failed: set[str] | None = None, name: str = "") -> float:
    """Wall seconds of one fresh run; a command that fails (an older checkout without it) is noted in ``failed``."""
    start = time.perf_counter()
    # In the benchmark's own empty folder: `python -c` puts the working folder first on sys.path,
    # where a checkout's ckpt_engine/ would shadow the one measured.
    proc = subprocess.run(argv, env=env, cwd=env["CLI_BENCH_CWD"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if proc.returncode != 0 and failed is not None:
        failed.add(name)
    return time.perf_counter() - start


Command = tuple[list[str], dict[str, str]]


def paired_rounds(
    commands: dict[str, Command], rounds: int, warm: bool = True
) -> tuple[dict[str, list[float]], set[str]]:
    """Wall seconds of every command in each of ``rounds`` rounds (after one untimed round, which
    warms the page cache and writes the ``.pyc`` files, unless ``warm`` is false: the smoke run,
    whose times mean nothing); odd rounds run the commands in reverse.
    Also the commands that failed (exit code not 0)."""
    names = list(commands)
    failed: set[str] = set()
    for name in names if warm else ():
        _time_once(*commands[name], failed, name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else reversed(names):
            times[name].append(_time_once(*commands[name], failed, name))
    return times, failed


def _make(tmp: Path, env: dict[str, str]) -> dict[str, str]:
    save_dir, weights = tmp / "checkpoints", tmp / "model.safetensors"
    subprocess.run(
        [sys.executable, "-c", _MAKE, str(save_dir), str(CHECKPOINTS), str(weights)],
        env=env,
        cwd=tmp,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return {"save_dir": str(save_dir), "checkpoint": str(save_dir / f"iter_{CHECKPOINTS:09}"), "weights": str(weights)}


def _report(times: dict[str, list[float]], failed: set[str], rounds: int) -> bool:
    print(f"{rounds} paired rounds of fresh processes (python {sys.version.split()[0]}, {os.cpu_count()} CPUs)")
    print(f"{'command':<50}{'median s':>9}{'min s':>8}{'max s':>8}{'- --help s':>12}")
    for name, ts in times.items():
        help_times = times["ckpt-engine --help" + (BEFORE if name.endswith(BEFORE) else "")]
        over = statistics.median(t - h for t, h in zip(ts, help_times, strict=True))
        note = "  (failed: exit code not 0)" if name in failed else ""
        print(f"{name:<50}{statistics.median(ts):>9.2f}{min(ts):>8.2f}{max(ts):>8.2f}{over:>12.2f}{note}")
    torch_s = statistics.median(times["import torch"])
    help_times = times["ckpt-engine --help"]
    checks = [("ckpt-engine --help", statistics.median(help_times), HELP_TARGET_S, f"<= {HELP_TARGET_S} s")]
    for name in times:
        if name.startswith("ckpt-engine") and "--help" not in name and name not in failed and BEFORE not in name:
            over = statistics.median(t - h for t, h in zip(times[name], help_times, strict=True))
            checks.append((name, over, OVER_HELP_S, f"<= --help + {OVER_HELP_S} s (paired)"))
    imported = statistics.median(times["import ckpt_engine"])
    checks.append(("import ckpt_engine", imported, IMPORT_RATIO * torch_s, f"<= {IMPORT_RATIO}x import torch"))
    print(f"\n{'target':<50}{'measured':>9}{'limit':>8}  {'ratio':>6}")
    ok = True
    for name, got, limit, text in checks:
        met = got <= limit
        ok = ok and met
        print(f"{name:<50}{got:>8.2f}s{limit:>7.2f}s  {got / limit:>6.2f}  {text}: {'met' if met else 'MISSED'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (default 7)")
    ap.add_argument("--pythonpath", default=None, help="a checkout to measure instead of the installed one")
    ap.add_argument(
        "--before",
        default=None,
        metavar="DIR",
        help="also run every ckpt-engine command from the checkout DIR, in the same rounds (rows marked 'before')",
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="one round, no warm-up round: checks the benchmark runs, times mean nothing",
    )
    args = ap.parse_args(argv)
    rounds = 1 if args.smoke else args.rounds
    py = sys.executable
    with tempfile.TemporaryDirectory(prefix="cli-bench-") as tmp:
        env = _env(args.pythonpath, tmp)
        paths = _make(Path(tmp), env)
        cli = {
            "--help": ["--help"],
            f"ls SAVE_DIR ({CHECKPOINTS} checkpoints)": ["ls", paths["save_dir"]],
            "inspect CHECKPOINT": ["inspect", paths["checkpoint"]],
            "verify SAVE_DIR --level sizes": ["verify", paths["save_dir"], "--level", "sizes"],
            "inspect model.safetensors": ["inspect", paths["weights"]],
        }
        commands: dict[str, Command] = {
            "import torch": ([py, "-c", "import torch"], env),
            "import ckpt_engine": ([py, "-c", "import ckpt_engine"], env),
        }
        commands.update({f"ckpt-engine {name}": ([py, "-c", _CLI, *a], env) for name, a in cli.items()})
        if args.before:
            before = _env(args.before, tmp)
            commands.update({f"ckpt-engine {name}{BEFORE}": ([py, "-c", _CLI, *a], before) for name, a in cli.items()})
        times, failed = paired_rounds(commands, rounds, warm=not args.smoke)
    ok = _report(times, failed, rounds)
    if any(BEFORE not in name for name in failed):
        return 1  # this checkout's commands must run, in the smoke run too
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
