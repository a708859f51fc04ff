"""What the per-rank state check (``check_replicated``) costs a save: 2 gloo ranks, a DDP model.

    python benchmarks/perrank_digest_bench.py                  # 256 MiB and 1 GiB, 3 reps each
    python benchmarks/perrank_digest_bench.py --sizes 256 --reps 5
    python benchmarks/perrank_digest_bench.py --smoke          # tiny, untimed in spirit: it runs

Launches itself under ``torch.distributed.run --standalone --nproc-per-node 2``. Every rank holds
the same plain tensors (a transformer-like state of about 200 tensors, replicated as under DDP),
so DCP writes each once, from rank 0, and the check digests all of them. Per size, alternating
the check off and on to spread the machine's noise over both:

* ``sync``: the engine's synchronous ``save()``, timed on every rank between barriers (rank 0's
  time reported);
* ``async``: ``pinned_staging``'s ``save()`` until it returns (the training loop's blocking time),
  then the save's completion outside the timing;
* ``digest_ms``: the digests alone (``consensus.digests`` of every item, rank 0), the check's CPU
  work, without the machine noise a whole save carries.

Output: a table on stdout and ``--out`` JSON (default ``benchmarks/results/perrank-digest.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
MIB = 1 << 20


def worker(spec: dict[str, Any]) -> None:
    """One rank: the timed saves of each size, rank 0 prints ``RESULT {json}``."""
    sys.path.insert(0, HERE)
    import torch
    import torch.distributed as dist
    from _bench_state import StateModule, make_tensors, transformer_shapes

    from ckpt_engine._engine.consensus import digests

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    out: list[dict[str, Any]] = []
    for size in spec["sizes"]:
        torch.manual_seed(0)
        module = StateModule(make_tensors(transformer_shapes(size * MIB)))  # the same on both ranks
        state = {"model": module.state_dict()}
        t0 = time.perf_counter()
        digests(state, {"model": {}}, 1, (), "all")
        digest_ms = (time.perf_counter() - t0) * 1e3
        row: dict[str, Any] = {"size_mib": size, "tensors": len(state["model"]), "digest_ms": digest_ms}
        for mode in ("sync", "async"):
            times: dict[str, list[float]] = {"off": [], "on": []}
            for rep in range(spec["reps"]):
                for check in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                    times[check].append(_timed_save(spec, module, mode, check == "on", rank, rep))
            row[mode] = {k: statistics.median(v) for k, v in times.items()}
            row[mode + "_all"] = times
        out.append(row)
    if rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _timed_save(spec: dict[str, Any], module: Any, mode: str, check: bool, rank: int, rep: int) -> float:
    import torch.distributed as dist

    from ckpt_engine import CheckpointEngine

    save_dir = os.path.join(spec["workdir"], f"{mode}-{int(check)}")
    if rank == 0 and os.path.exists(save_dir):
        shutil.rmtree(save_dir)
    dist.barrier()
    config: dict[str, Any] = {"save_dir": save_dir, "check_replicated": check, "allow_overwrite": True}
    if mode == "async":
        config["plugins"] = [{"name": "pinned_staging", "options": {"close_timeout_s": 120}}]
    with CheckpointEngine(config) as engine:
        engine.save(1, model=module)  # warm: buffers, plan caches, the check's group
        engine.wait()
        dist.barrier()
        t0 = time.perf_counter()
        handle = engine.save(2, model=module)
        if mode == "sync":
            dist.barrier()
        seconds = time.perf_counter() - t0
        handle.result()
        dist.barrier()
    return seconds


def launch(sizes: list[int], reps: int, workdir: str) -> list[dict[str, Any]]:
    spec = {"sizes": sizes, "reps": reps, "workdir": workdir}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "plugins")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    proc = subprocess.run([*cmd, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    rows: list[dict[str, Any]] = json.loads(lines[-1][len("RESULT ") :])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="256,1024", help="MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary folder here)")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "perrank-digest.json"))
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    sizes = [4] if args.smoke else [int(s) for s in args.sizes.split(",")]
    reps = 1 if args.smoke else args.reps
    workdir = tempfile.mkdtemp(prefix="perrank-bench-", dir=args.workdir or REPO)
    try:
        rows = launch(sizes, reps, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(
        f"{'MiB':>6} {'tensors':>7} {'digest ms':>9} {'sync off s':>10} {'sync on s':>9} {'+%':>6} "
        f"{'async off ms':>12} {'async on ms':>11} {'+ms':>6}"
    )
    for r in rows:
        s, a = r["sync"], r["async"]
        print(
            f"{r['size_mib']:>6} {r['tensors']:>7} {r['digest_ms']:>9.2f} {s['off']:>10.3f} {s['on']:>9.3f} "
            f"{100 * (s['on'] / s['off'] - 1):>6.1f} {a['off'] * 1e3:>12.2f} {a['on'] * 1e3:>11.2f} "
            f"{(a['on'] - a['off']) * 1e3:>6.2f}"
        )
    if not args.smoke:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"reps": reps, "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
