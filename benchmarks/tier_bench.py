"""The node-local tier (``local_dir``): what a save blocks, what replication costs a training step,
and how fast a restart and a node loss recover, against the durable tier on disk and on S3.

Two ranks under torchrun, each a node of its own (``ranks_per_node: 1``, ``local_dir`` on tmpfs,
``peer_replicas: 1``: each rank's checkpoints are replicated to the other). For each state size
(``--sizes``, MiB per rank of parameters plus AdamW state), in one run, side by side
(``benchmarks/_tier_worker.py`` has the details):

(a) ``save()``'s blocked seconds, ``pinned_staging`` to the local tier / ``pinned_staging`` to
    ``save_dir`` (the async durable save), and each / the copy floor        target <= 1.1
    (and, for reference, a local-tier save with the default synchronous write)
(b) a training step with CPU to spare (``--compute-ms`` of compute, ``--idle-ms`` waiting, as on an
    accelerator), a local-tier save every ``--save-every`` steps: with peer replicas / without
                                                                            target <= 1.05
(c) ``load()`` after a restart and after a node loss (from the local tier and a peer's replica),
    against ``load()`` from ``save_dir`` on disk and on the S3 server      target S3 / local >= 3
(d) ``--phases reshard`` (``benchmarks/_reshard_worker.py``; FSDP2 saved by 4 ranks as 2 nodes):
    ``load()`` on 2 ranks resharded from the tier (node 1 lost; node 0 lost, from peers), against
    the same-shape restart on 4 ranks and ``save_dir`` on disk and S3 on 2 ranks
                                              targets S3 / reshard >= 3, reshard / same shape <= 2

The S3 server is moto on loopback (pure Python: slower than a real endpoint; the ratio to it says
what the tier saves where the durable store is remote). Usage::

    python benchmarks/tier_bench.py [--sizes 256,1024] [--rounds 3] [--out results.json]
    python benchmarks/tier_bench.py --smoke          # tiny, seconds: keeps the script from rotting
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _s3_server import KEY, SECRET, Server

HERE = Path(__file__).resolve().parent


def run_size(mib: float, args: argparse.Namespace, s3: dict[str, Any] | None) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="tier-bench-", dir=args.work))
    shm = Path(tempfile.mkdtemp(prefix="tier-bench-", dir=args.shm))
    spec = {
        "mib": mib,
        "rounds": args.rounds,
        "work": str(work),
        "shm": str(shm),
        "s3": s3,
        "phases": args.phases.split(","),
        "block": args.block,
        "save_every": args.save_every,
        "compute_ms": args.compute_ms,
        "idle_ms": args.idle_ms,
        "smoke": args.smoke,
    }
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    try:
        proc = subprocess.run(
            [*cmd, str(HERE / "_tier_worker.py"), json.dumps(spec)], capture_output=True, text=True, env=env
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def _torchrun(nproc: int, worker: str, spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    proc = subprocess.run([*cmd, str(HERE / worker), json.dumps(spec)], capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the worker failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def run_reshard(mib: float, args: argparse.Namespace, s3: dict[str, Any] | None) -> dict[str, Any]:
    """(d): the 4-rank save and same-shape restart, then the 2-rank loads."""
    work = Path(tempfile.mkdtemp(prefix="tier-bench-", dir=args.work))
    shm = Path(tempfile.mkdtemp(prefix="tier-bench-", dir=args.shm))
    spec = {"mib": mib, "rounds": args.rounds, "work": str(work), "shm": str(shm / "tier"), "s3": s3}
    try:
        saved = _torchrun(4, "_reshard_worker.py", {**spec, "mode": "save"})
        loaded = _torchrun(2, "_reshard_worker.py", {**spec, "mode": "load"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    print(f"reshard, {mib:g} MiB per old rank: {json.dumps(saved)} {json.dumps(loaded)}", flush=True)
    runs = {**saved["runs"], **loaded["runs"]}
    sources = {"same_shape": saved["bytes_by_source"], **loaded["bytes_by_source"]}
    times = {k: v for k, v in {**saved, **loaded}.items() if k.endswith("_s")}
    return {"mib": mib, "reshard": {**times, "runs": runs, "bytes_by_source": sources}}


def report_reshard(results: list[dict[str, Any]]) -> None:
    if not any("reshard" in r for r in results):
        return
    head = ("MiB/old rank", "same 4->4", "reshard 4->2", "from peers", "disk", "S3", "S3/reshard", "reshard/same")
    print("\n" + " ".join(f"{h:>{len(h) + 1}}" for h in head))
    for r in results:
        c = r.get("reshard")
        if c:
            s3 = c.get("durable_s3_s")
            cells = [r["mib"], c["same_shape_s"], c["reshard_s"], c["reshard_peer_s"], c["durable_disk_s"]]
            cells += [s3, s3 / c["reshard_s"] if s3 else None, c["reshard_s"] / c["same_shape_s"]]
            print(
                " ".join(f"{'-' if v is None else f'{v:.3f}':>{len(h) + 1}}" for h, v in zip(head, cells, strict=True))
            )


def report(results: list[dict[str, Any]]) -> None:
    print(
        f"{'MiB/rank':>9} {'floor':>8} {'async':>8} {'local':>8} {'local/async':>11} {'local/floor':>11} "
        f"{'local, sync write':>17}"
    )
    for r in results:
        b = r.get("blocked")
        if b:
            print(
                f"{r['mib']:>9g} {b['floor_s']:>8.4f} {b['durable_async_s']:>8.4f} {b['local_s']:>8.4f} "
                f"{b['local_s'] / b['durable_async_s']:>11.2f} {b['local_s'] / b['floor_s']:>11.2f} "
                f"{b['local_sync_s']:>17.4f}"
            )
    print(f"\n{'MiB/rank':>9} {'step, no replicas':>18} {'with replicas':>14} {'slowdown':>9}")
    for r in results:
        s = r.get("step")
        if s:
            print(
                f"{r['mib']:>9g} {s['no_replicas_step_s']:>18.4f} {s['replicas_step_s']:>14.4f} {s['slowdown']:>9.1%}"
            )
    head = ("MiB/rank", "restart", "node loss", "disk", "S3", "S3/restart", "S3/node loss")
    print("\n" + " ".join(f"{h:>{w}}" for h, w in zip(head, (9, 8, 9, 8, 8, 10, 12), strict=True)))
    for r in results:
        c = r.get("recover")
        if c:
            s3 = c.get("durable_s3_s")
            print(
                f"{r['mib']:>9g} {c['restart_s']:>8.3f} {c['node_loss_s']:>9.3f} {c['durable_disk_s']:>8.3f} "
                + (f"{s3:>8.3f} {s3 / c['restart_s']:>10.1f} {s3 / c['node_loss_s']:>12.1f}" if s3 else "")
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="256,1024", help="MiB of state per rank")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--phases", default="blocked,step,recover")
    parser.add_argument("--block", type=int, default=20, help="steps per block of the step phase")
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--compute-ms", type=float, default=100.0)
    parser.add_argument("--idle-ms", type=float, default=150.0)
    parser.add_argument("--work", default=tempfile.gettempdir(), help="a folder on disk (save_dir)")
    parser.add_argument("--shm", default="/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    parser.add_argument("--no-s3", action="store_true", help="skip the S3 server")
    parser.add_argument("--out", help="write the results as JSON")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: seconds")
    args = parser.parse_args()
    if args.smoke:
        args.sizes, args.rounds, args.block, args.save_every = "2", 1, 4, 2
        args.compute_ms, args.idle_ms = 5.0, 5.0
    server = None if args.no_s3 else Server()
    try:
        s3 = None
        if server is not None:
            bucket = f"tier-bench-{int(time.time() * 1000) % 10**9}"
            server.fs().call_s3("create_bucket", Bucket=bucket)
            s3 = {"endpoint": server.endpoint, "key": KEY, "secret": SECRET, "bucket": bucket}
        phases = args.phases.split(",")
        args.phases = ",".join(p for p in phases if p != "reshard")
        results = [run_size(float(mib), args, s3) for mib in args.sizes.split(",")] if args.phases else []
        if "reshard" in phases:
            results += [run_reshard(float(mib), args, s3) for mib in args.sizes.split(",")]
    finally:
        if server is not None:
            server.close()
    if any("reshard" not in r for r in results):
        report([r for r in results if "reshard" not in r])
    report_reshard(results)
    if args.out:
        machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()}
        Path(args.out).write_text(json.dumps({"machine": machine, "args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
