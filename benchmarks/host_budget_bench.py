"""``pinned_staging`` with ``max_host_bytes`` at a quarter of the state vs no budget, in one run.

For each state size (``--sizes``, MiB; ~200 transformer-like tensors), in rounds alternating
between the two configurations (each its own engine and writer, both warm), per save:

* time blocked in ``save()``, and as a ratio to the copy floor of the same round (one copy of
  the state into preallocated host buffers);
* time until the checkpoint is committed;
* the staging bytes the plugin allocated (sum of its buffer sets, i.e. its shared-memory
  mapping: not RSS) against the budget: target <= budget x 1.05.

Usage::

    python benchmarks/host_budget_bench.py [--sizes 256,1024] [--rounds 3] [--out results.json]
    python benchmarks/host_budget_bench.py --smoke      # tiny, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_state import MIB, StateModule, make_tensors, nbytes, transformer_shapes
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin

from ckpt_engine import CheckpointEngine


def _floor(tensors: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> float:
    t = time.perf_counter()
    for k, v in tensors.items():
        buffers[k].copy_(v)
    return time.perf_counter() - t


def _engine(save_dir: str, budget: int | None) -> tuple[CheckpointEngine, PinnedStagingPlugin]:
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(max_host_bytes=budget))
    engine = CheckpointEngine({"save_dir": save_dir, "keep_last": 1}, plugins=[plugin])
    plugin.wait_ready()
    return engine, plugin


def run_size(size_mib: int, rounds: int, workdir: str) -> dict[str, Any]:
    tensors = make_tensors(transformer_shapes(size_mib * MIB))
    state = StateModule(tensors)
    total = nbytes(tensors)
    budget = total // 4
    buffers = {k: torch.empty_like(v) for k, v in tensors.items()}
    configs: dict[str, int | None] = {"unlimited": None, "quarter": budget}
    engines = {name: _engine(os.path.join(workdir, name), b) for name, b in configs.items()}
    rows: dict[str, dict[str, list[float]]] = {n: {"blocked": [], "committed": [], "ratio": []} for n in configs}
    peak: dict[str, int] = dict.fromkeys(configs, 0)
    windows: dict[str, int] = dict.fromkeys(configs, 1)
    iteration = 0
    try:
        for engine, _ in engines.values():  # warm-up: allocate the buffers, plan once
            iteration += 1
            engine.save(iteration, model=state).result(600)
        for _ in range(rounds):
            for name, (engine, plugin) in engines.items():
                floor = _floor(tensors, buffers)
                iteration += 1
                t0 = time.perf_counter()
                handle = engine.save(iteration, model=state)
                blocked = time.perf_counter() - t0
                handle.result(600)
                committed = time.perf_counter() - t0
                rows[name]["blocked"].append(blocked)
                rows[name]["committed"].append(committed)
                rows[name]["ratio"].append(blocked / floor)
                sets = plugin.buffer_sets()
                peak[name] = max(peak[name], sum(s.nbytes for s in sets))
                windows[name] = max(s.windows for s in sets)
    finally:
        for engine, _ in engines.values():
            engine.close()
    out: dict[str, Any] = {"size_mib": size_mib, "state_bytes": total, "tensors": len(tensors), "budget": budget}
    for name in configs:
        out[name] = {
            "blocked_s": statistics.median(rows[name]["blocked"]),
            "committed_s": statistics.median(rows[name]["committed"]),
            "blocked_over_floor": statistics.median(rows[name]["ratio"]),
            "staging_bytes": peak[name],
            "windows": windows[name],
        }
    out["quarter"]["staging_over_budget"] = peak["quarter"] / budget
    return out


def _table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| state | budget | staging bytes | windows | save() blocked | / copy floor | committed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name in ("unlimited", "quarter"):
            row = r[name]
            budget = "none" if name == "unlimited" else f"{r['budget'] / MIB:.1f} MiB"
            lines.append(
                f"| {r['size_mib']} MiB | {budget} | {row['staging_bytes'] / MIB:.1f} MiB | {row['windows']} | "
                f"{row['blocked_s'] * 1e3:.0f} ms | {row['blocked_over_floor']:.2f}x | "
                f"{row['committed_s'] * 1e3:.0f} ms |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256,1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds (one save per configuration)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training process")
    parser.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    sizes = [4] if args.smoke else [int(s) for s in args.sizes.split(",")]
    rounds = 1 if args.smoke else args.rounds
    workdir = tempfile.mkdtemp(prefix="host_budget_bench.", dir=args.dir)
    try:
        results = [run_size(size, rounds, workdir) for size in sizes]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    report = {"sizes": results, "threads": args.threads, "cpus": os.cpu_count()}
    print(_table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
