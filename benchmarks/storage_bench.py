"""Object storage: ckpt-engine's save to / load from ``s3://`` against plain s3fs on the same bytes.

An S3 server (moto, from PyPI) runs on loopback in a separate process, so that it does not share
the benchmark's interpreter lock. For each state size (``--sizes``, MiB), in one run, side by
side, median of ``--reps`` timed repetitions after one untimed warm-up:

* ``s3fs_put``: ``S3FileSystem.put(local_folder, url, recursive=True)`` of the files a local
  save of the same state writes (what a user would do: save locally, then upload);
* ``ours_save``: ``CheckpointEngine.save`` to the ``s3://`` URL: write the spool, checksum,
  upload, manifest, ``latest`` (everything a committed checkpoint needs);
* ``s3fs_cat``: ``S3FileSystem.cat`` of every object of that checkpoint into memory;
* ``ours_load``: ``CheckpointEngine.load`` from the URL into a model (range reads straight into
  the tensors, ``verify="sizes"``).

Throughput is state bytes / seconds; ``x_s3fs`` is ours / s3fs (1.0: as fast as the plain
client). The loopback server is the bottleneck here (moto is pure Python): the ratios say how
much the engine adds on top of the same client and server, not what a real S3 endpoint gives.

Usage::

    python benchmarks/storage_bench.py [--sizes 64,256] [--reps 3] [--out results.json]
    python benchmarks/storage_bench.py --smoke      # tiny, seconds: keeps the script from rotting
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _s3_server import KEY, SECRET, Server
from torch import nn

from ckpt_engine import CheckpointEngine

MIB = 2**20


class State(nn.Module):
    """``size_mib`` MiB of fp32 parameters in 16 tensors."""

    def __init__(self, size_mib: int) -> None:
        super().__init__()
        numel = size_mib * MIB // 4 // 16
        self.params = nn.ParameterList([nn.Parameter(torch.randn(numel), requires_grad=False) for _ in range(16)])


def _timed(fn: Callable[[], Any], reps: int) -> list[float]:
    fn()  # warm-up (and the first request's connection setup)
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def run_size(server: Server, size_mib: int, reps: int, work: Path) -> list[dict[str, Any]]:
    fs = server.fs()
    bucket = f"bench-{size_mib}-{int(time.time() * 1000) % 10**9}"
    fs.call_s3("create_bucket", Bucket=bucket)
    storage = {"endpoint_url": server.endpoint, "access_key_id": KEY, "secret_access_key": SECRET}
    model = State(size_mib)
    nbytes = sum(p.numel() * 4 for p in model.parameters())

    local = work / f"local-{size_mib}"
    with CheckpointEngine({"save_dir": str(local)}) as engine:
        engine.save(1, model=model)
    local_ckpt = local / "iter_000000001"

    counter = iter(range(10**6))

    def plain_put() -> None:
        fs.put(str(local_ckpt), f"{bucket}/plain/{next(counter)}", recursive=True)

    url = f"s3://{bucket}/ours"
    engine = CheckpointEngine({"save_dir": url, "storage": storage, "keep_last": 1})
    iteration = iter(range(1, 10**6))

    def ours_save() -> None:
        engine.save(next(iteration), model=model).result()

    rows = []
    put = _timed(plain_put, reps)
    save = _timed(ours_save, reps)
    latest = fs.cat_file(f"{bucket}/ours/latest_checkpoint.txt").decode().strip()
    objects = [k for k in fs.find(f"{bucket}/ours/{latest}")]

    def plain_cat() -> None:
        fs.cat(objects)

    target = State(size_mib)

    def ours_load() -> None:
        with CheckpointEngine({"save_dir": url, "storage": storage}) as loader:
            loader.load(model=target)

    cat = _timed(plain_cat, reps)
    load = _timed(ours_load, reps)
    engine.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), target.parameters(), strict=True))
    shutil.rmtree(local)
    for method, times, base in (
        ("s3fs_put", put, None),
        ("ours_save", save, put),
        ("s3fs_cat", cat, None),
        ("ours_load", load, cat),
    ):
        med = statistics.median(times)
        row: dict[str, Any] = {
            "size_mib": size_mib,
            "method": method,
            "median_s": med,
            "times": times,
            "mb_per_s": nbytes / med / 1e6,
        }
        if base is not None:
            row["x_s3fs"] = statistics.median(base) / med  # > 1: faster than the plain client
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256", help="state sizes in MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="4 MiB, 1 rep")
    args = parser.parse_args(argv)
    sizes = [4] if args.smoke else [int(s) for s in args.sizes.split(",") if s]
    reps = 1 if args.smoke else args.reps
    server = Server()
    work = Path(tempfile.mkdtemp(prefix="ckpt-storage-bench-"))
    try:
        rows = [row for size in sizes for row in run_size(server, size, reps, work)]
    finally:
        server.close()
        shutil.rmtree(work, ignore_errors=True)
    print(f"{'size':>6}  {'method':<10} {'median s':>9} {'MB/s':>8} {'x s3fs':>7}")
    for r in rows:
        ratio = f"{r['x_s3fs']:.2f}" if "x_s3fs" in r else ""
        print(f"{r['size_mib']:>4}Mi  {r['method']:<10} {r['median_s']:>9.3f} {r['mb_per_s']:>8.1f} {ratio:>7}")
    if args.out:
        machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()}
        Path(args.out).write_text(json.dumps({"rows": rows, "machine": machine}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
