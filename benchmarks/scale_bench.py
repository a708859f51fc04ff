"""Per-tensor cost of saves and loads with many small tensors, side by side in one run.

For each tensor count (16 fp32 values per tensor, one module of buffers): the engine's save of
an unchanged structure (the cached plan; checksums on and off, alternating), the engine's load,
plain ``dcp.save`` / ``dcp.load`` of the same state dict, and the ``.metadata`` file: its size,
the engine's safe read (``ckpt_engine._format.metadata.read_metadata``) and a plain ``pickle.load``,
in this process (also with cyclic garbage collection off, as the safe read runs) and each in a
new process.

    python benchmarks/scale_bench.py --counts 10000,50000 --reps 3 --out scale.json
    python benchmarks/scale_bench.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from ckpt_engine import CheckpointEngine
from ckpt_engine._format.metadata import read_metadata


class Buffers(nn.Module):
    def __init__(self, count: int, fill: bool) -> None:
        super().__init__()
        for i in range(count):
            self.register_buffer(f"p{i}", torch.full((16,), float(i) if fill else 0.0))


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(count: int, reps: int, root: str, fresh_processes: bool = True) -> dict[str, Any]:
    src, dst = Buffers(count, True), Buffers(count, False)
    out: dict[str, list[float]] = {k: [] for k in ("save", "save_nochecksums", "load", "dcp_save", "dcp_load")}
    on = CheckpointEngine({"save_dir": os.path.join(root, "on"), "keep_last": 2})
    off = CheckpointEngine({"save_dir": os.path.join(root, "off"), "save_checksums": False, "keep_last": 2})
    on.save(1, model=src)  # plans; later saves of the same structure use the cached plan
    off.save(1, model=src)
    for rep in range(reps):
        it = rep + 2
        pair = [("save", on), ("save_nochecksums", off)]
        for name, engine in pair if rep % 2 == 0 else reversed(pair):
            out[name].append(_time(lambda e=engine, i=it: e.save(i, model=src)))
        out["load"].append(_time(lambda: on.load(model=dst)))
        assert torch.equal(dst.p1, src.p1)
    sd = src.state_dict()
    template = {k: torch.zeros_like(v) for k, v in sd.items()}
    for rep in range(reps):
        path = os.path.join(root, f"dcp{rep}")
        out["dcp_save"].append(_time(lambda p=path: dcp.save(sd, checkpoint_id=p)))
        out["dcp_load"].append(_time(lambda p=path: dcp.load(template, checkpoint_id=p)))
        shutil.rmtree(path)
    on.close()
    off.close()
    folder = os.path.join(root, "on", f"iter_{reps + 1:09d}", "model")
    md_file = os.path.join(folder, ".metadata")
    safe = [_time(lambda: read_metadata(folder)) for _ in range(reps)]

    def plain() -> None:
        with open(md_file, "rb") as f:
            pickle.load(f)

    raw = [_time(plain) for _ in range(reps)]
    was = gc.isenabled()
    gc.disable()
    try:
        raw_nogc = [_time(plain) for _ in range(reps)]
    finally:
        if was:
            gc.enable()
    fresh = _fresh_metadata_reads(folder, reps, fresh_processes)
    med = {k: statistics.median(v) for k, v in out.items()}
    return {
        "count": count,
        "samples": out,
        "median_s": med,
        "us_per_tensor": {k: v / count * 1e6 for k, v in med.items()},
        "vs_dcp": {"save": med["dcp_save"] / med["save"], "load": med["dcp_load"] / med["load"]},
        "checksum_cost": med["save"] / med["save_nochecksums"] - 1,
        "metadata_bytes": os.path.getsize(md_file),
        "metadata_read_safe_s": statistics.median(safe),
        "metadata_read_pickle_s": statistics.median(raw),
        "metadata_read_pickle_nogc_s": statistics.median(raw_nogc),
        "metadata_read_fresh_safe_s": statistics.median(fresh["safe"]),
        "metadata_read_fresh_pickle_s": statistics.median(fresh["pickle"]),
    }


#: One read of a ``.metadata`` in a new interpreter (``sys.argv``: folder, which), timed alone.
_FRESH = """
import pickle, sys, time
folder, which = sys.argv[1], sys.argv[2]
from ckpt_engine._format.metadata import read_metadata
path = folder + "/.metadata"
t = time.perf_counter()
if which == "safe":
    read_metadata(folder)
else:
    with open(path, "rb") as f:
        pickle.load(f)
print(time.perf_counter() - t)
"""


def _read_once(folder: str, which: str) -> float:
    """What ``_FRESH`` times, in this process."""
    t = time.perf_counter()
    if which == "safe":
        read_metadata(folder)
    else:
        with open(os.path.join(folder, ".metadata"), "rb") as f:
            pickle.load(f)
    return time.perf_counter() - t


def _fresh_metadata_reads(folder: str, reps: int, fresh_processes: bool = True) -> dict[str, list[float]]:
    """The safe read and ``pickle.load`` of one ``.metadata``, each in a new process (a small
    heap, as at the start of a job), alternating: the benchmark's own process holds the model and
    every earlier object, which changes what ``pickle.load``'s cyclic collections cost. Without
    ``fresh_processes`` (the smoke run, untimed) the same code runs in this process instead."""
    out: dict[str, list[float]] = {"safe": [], "pickle": []}
    for rep in range(reps):
        for which in ("safe", "pickle") if rep % 2 == 0 else ("pickle", "safe"):
            if not fresh_processes:
                out[which].append(_read_once(folder, which))
                continue
            done = subprocess.run(
                [sys.executable, "-c", _FRESH, folder, which], check=True, capture_output=True, text=True
            )
            out[which].append(float(done.stdout.strip().splitlines()[-1]))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="10000,50000")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    p.add_argument("--out")
    p.add_argument("--smoke", action="store_true", help="tiny, untimed, in one process: checks that the benchmark runs")
    args = p.parse_args(argv)
    counts = [200] if args.smoke else [int(c) for c in args.counts.split(",") if c]
    reps = 1 if args.smoke else args.reps
    torch.set_num_threads(1)
    results = []
    for count in counts:
        root = tempfile.mkdtemp(prefix="ckpt-scale-", dir=args.dir)
        try:
            r = run(count, reps, root, fresh_processes=not args.smoke)
        finally:
            shutil.rmtree(root, ignore_errors=True)
        results.append(r)
        us, vs = r["us_per_tensor"], r["vs_dcp"]
        print(
            f"{count:>7} tensors  save {r['median_s']['save']:.3f}s ({us['save']:.0f} us/t, {vs['save']:.1f}x dcp)  "
            f"load {r['median_s']['load']:.3f}s ({us['load']:.0f} us/t, {vs['load']:.1f}x dcp)  "
            f"dcp save {r['median_s']['dcp_save']:.3f}s load {r['median_s']['dcp_load']:.3f}s  "
            f"checksums {r['checksum_cost'] * 100:+.1f}%  .metadata {r['metadata_bytes'] / 1e6:.2f} MB "
            f"safe read {r['metadata_read_safe_s']:.3f}s pickle {r['metadata_read_pickle_s']:.3f}s "
            f"(without gc {r['metadata_read_pickle_nogc_s']:.3f}s; in a new process: safe "
            f"{r['metadata_read_fresh_safe_s']:.3f}s pickle {r['metadata_read_fresh_pickle_s']:.3f}s)",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"load_average": os.getloadavg(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
