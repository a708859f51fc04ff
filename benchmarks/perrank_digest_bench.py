"""What the per-rank state check (``check_replicated``) costs a save: 2 gloo ranks, a DDP model.

    python benchmarks/perrank_digest_bench.py                  # 256 MiB and 1 GiB, 3 reps each
    python benchmarks/perrank_digest_bench.py --sizes 256 --reps 5
    python benchmarks/perrank_digest_bench.py --smoke          # tiny, untimed in spirit: it runs

Launches itself under ``torch.distributed.run --standalone --nproc-per-node 2``. Every rank holds
the same plain tensors (a transformer-like state of about 200 tensors, replicated as under DDP),
so DCP writes each once, from rank 0, and the check digests all of them. Per size, alternating
the check off and on to spread the machine's noise over both:

* ``sync``: the engine's synchronous ``save()``, timed on every rank between barriers (rank 0's
  time reported), and its preparation until the write's plan starts (``sync_prep_ms``: where the
  check runs, without the write's disk noise);
* ``async``: ``pinned_staging``'s ``save()`` until it returns (the training loop's blocking time),
  and that time less the staging copy (``async_prep_ms``: where the check's share of ``save()``
  runs); the save's completion is outside the timing;
* ``digest_ms``: the digests alone (``consensus.digests`` of every item, rank 0), the check's CPU
  work, without the machine noise a whole save carries.

Output: a table on stdout and ``--out`` JSON (default ``benchmarks/results/perrank-digest.json``;
none in ``--smoke`` unless ``--out`` is given).
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
    for size in spec["sizes"]:
        torch.manual_seed(0)
        module = StateModule(make_tensors(transformer_shapes(size * MIB)))  # the same on both ranks
        state = {"model": module.state_dict()}
        t0 = time.perf_counter()
        digests(state, {"model": {}}, 1, (), "all")
        digest_ms = (time.perf_counter() - t0) * 1e3
        row: dict[str, Any] = {"size_mib": size, "tensors": len(state["model"]), "digest_ms": digest_ms}
        for mode in ("sync", "async"):
            runs: dict[str, list[tuple[float, float]]] = {"off": [], "on": []}
            for rep in range(spec["reps"]):
                for check in ("off", "on") if rep % 2 == 0 else ("on", "off"):
                    runs[check].append(_timed_save(spec, module, mode, check == "on", rank))
            row[mode] = {k: statistics.median(t for t, _ in v) for k, v in runs.items()}
            row[mode + "_prep_ms"] = {k: statistics.median(p for _, p in v) for k, v in runs.items()}
            row[mode + "_all"] = runs
        if rank == 0:  # each size as soon as it is measured
            print("RESULT " + json.dumps(row), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def _timed_save(spec: dict[str, Any], module: Any, mode: str, check: bool, rank: int) -> tuple[float, float]:
    """``(seconds, prep_ms)`` of one save after a warm one: ``save()`` until it returns (sync:
    and every rank is done), and the milliseconds of it that are neither the copy nor the write
    (sync: until the write's plan starts; async: all but the staging copy), where the check runs."""
    import torch.distributed as dist

    from ckpt_engine import CheckpointEngine
    from ckpt_engine._dcpio.watch import PHASE_LOG

    save_dir = os.path.join(spec["workdir"], f"{mode}-{int(check)}")
    if rank == 0 and os.path.exists(save_dir):
        shutil.rmtree(save_dir)
    dist.barrier()
    config: dict[str, Any] = {"save_dir": save_dir, "check_replicated": check}
    if mode == "async":
        config["plugins"] = [{"name": "pinned_staging", "options": {"close_timeout_s": 120}}]
    with CheckpointEngine(config) as engine:
        engine.save(1, model=module)  # warm: buffers, plan caches, the check's group
        engine.wait()
        dist.barrier()
        PHASE_LOG.clear()
        t0 = time.perf_counter()
        handle = engine.save(2, model=module)
        if mode == "sync":
            dist.barrier()
        seconds = time.perf_counter() - t0
        result = handle.result()
        dist.barrier()
    if mode == "sync":
        prep_ms = (next(t for name, t, _ in PHASE_LOG if name == "plan") - t0) * 1e3
    else:
        prep_ms = (result.blocked_seconds - result.staging_seconds) * 1e3
    return seconds, prep_ms


def launch(sizes: list[int], reps: int, workdir: str) -> list[dict[str, Any]]:
    spec = {"sizes": sizes, "reps": reps, "workdir": workdir}
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([REPO, os.path.join(REPO, "plugins")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryFile("w+") as errors:  # a file: a full pipe would stall the ranks
        worker_cmd = [*cmd, __file__, "--worker", json.dumps(spec)]
        proc = subprocess.Popen(worker_cmd, stdout=subprocess.PIPE, stderr=errors, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:  # echoed as it comes: a long run that is stopped keeps what it measured
            if line.startswith("RESULT "):
                print(line, end="", flush=True)
                rows.append(json.loads(line[len("RESULT ") :]))
        if proc.wait() != 0 or len(rows) != len(sizes):
            errors.seek(0)
            raise SystemExit(f"worker failed (rc={proc.returncode}):\n{errors.read()[-6000:]}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="256,1024", help="MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary folder here)")
    parser.add_argument(
        "--out", default=None, help="JSON (default: benchmarks/results/perrank-digest.json; none with --smoke)"
    )
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
        f"{'MiB':>5} {'digest ms':>9} {'sync s':>7} {'prep off':>8} {'prep on':>7} {'+ms':>6} {'+%':>5} "
        f"{'async s':>7} {'prep off':>8} {'prep on':>7} {'+ms':>6}"
    )
    for r in rows:
        sp, ap = r["sync_prep_ms"], r["async_prep_ms"]
        added = sp["on"] - sp["off"]
        print(
            f"{r['size_mib']:>5} {r['digest_ms']:>9.2f} {r['sync']['off']:>7.3f} {sp['off']:>8.1f} {sp['on']:>7.1f} "
            f"{added:>6.1f} {added / (10 * r['sync']['off']):>5.1f} {r['async']['off']:>7.3f} {ap['off']:>8.1f} "
            f"{ap['on']:>7.1f} {ap['on'] - ap['off']:>6.1f}"
        )
    out = args.out or (None if args.smoke else os.path.join(HERE, "results", "perrank-digest.json"))
    if out is not None:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            json.dump({"reps": reps, "rows": rows}, f, indent=1)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
