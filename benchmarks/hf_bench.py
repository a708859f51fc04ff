"""Loading Hugging Face safetensors weights: ckpt-engine's ``load_path`` against the alternatives.

Side by side, on the same files (a sharded HF folder written once, read from the page cache),
each measurement in a fresh child process so peak memory is its own:

* ``st_load_file``: ``safetensors.torch.load_file`` on every shard (tensors in new memory; no model);
* ``st_load_file+copy``: the same, then ``model.load_state_dict`` (what filling a model takes);
* ``dcp_hf_reader``: ``dcp.load`` into the model's state dict with torch's ``HuggingFaceStorageReader``;
* ``ours``: ``CheckpointEngine.load(model=...)`` with ``load_path`` = the folder.

``load_file`` maps the files and returns tensors whose pages are read on first touch, so its own
time is ~0; ``st_load_file+copy`` is what filling a model with it costs.

Two cases: fp32 files into an fp32 model, and bf16 files into an fp32 model (a cast on load).
"peak" is the child's peak RSS above what it held once the model existed (``ru_maxrss``).

    python benchmarks/hf_bench.py                  # 512 MiB of fp32 weights, 3 reps
    python benchmarks/hf_bench.py --mib 2048 --reps 5
    python benchmarks/hf_bench.py --smoke          # tiny, 1 rep: checks that it runs
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

METHODS = ("st_load_file", "st_load_file+copy", "dcp_hf_reader", "ours")


def _model(mib: int, layers: int) -> Any:
    import torch
    from torch import nn

    side = max(8, int((mib * 2**20 / 4 / layers) ** 0.5))
    with torch.device("cpu"):
        model = nn.Sequential(*(nn.Linear(side, side) for _ in range(layers)))
    for p in model.parameters():
        p.data.zero_()  # touched: its pages count in the baseline
    return model


def _write(folder: str, mib: int, layers: int, dtype: str) -> None:
    import torch
    from safetensors.torch import save_file

    model = _model(mib, layers)
    gen = torch.Generator().manual_seed(0)
    sd = {k: torch.randn(v.shape, generator=gen).to(getattr(torch, dtype)) for k, v in model.state_dict().items()}
    keys = list(sd)
    shards = max(1, min(4, layers))
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: sd[k] for k in keys[i::shards]}, os.path.join(folder, name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(keys[i::shards], name)
    total = sum(v.numel() * v.element_size() for v in sd.values())
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)


def _child(method: str, folder: str, mib: int, layers: int) -> dict[str, float]:
    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch import nn
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ckpt_engine import CheckpointEngine

    torch.set_num_threads(1)
    # torch's get_model_state_dict (every engine load builds the model's state dict with it)
    # imports torch._dynamo on its first call with submodules (~0.4 s, once per process): paid
    # here by every method alike, outside the timed part (benchmarks/RESULTS.md quotes it)
    get_model_state_dict(nn.Sequential(nn.Linear(2, 2)))
    model = _model(mib, layers)
    files = sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith(".safetensors"))
    run = tempfile.mkdtemp()
    engine = CheckpointEngine({"save_dir": run, "load_path": folder})  # built outside the timed part
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    if method == "st_load_file":
        sd: dict[str, Any] = {}
        for f in files:
            sd |= load_file(f)
    elif method == "st_load_file+copy":
        sd = {}
        for f in files:
            sd |= load_file(f)
        model.load_state_dict(sd)
    elif method == "dcp_hf_reader":
        from torch.distributed.checkpoint import HuggingFaceStorageReader

        target = model.state_dict()
        dcp.load(target, storage_reader=HuggingFaceStorageReader(folder), no_dist=True)
    elif method == "ours":
        engine.load(model=model)
    else:
        raise SystemExit(f"unknown method {method}")
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
    engine.close()
    os.rmdir(run)
    return {"seconds": seconds, "peak_mib": peak / 1024}


def _run_child(method: str, folder: str, mib: int, layers: int) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", method, "--folder", folder, "--mib", str(mib), "--layers", str(layers)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{method} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=512, help="size of the fp32 weights")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--folder", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(_child(args.child, args.folder, args.mib, args.layers)))
        return
    if args.smoke:
        args.mib, args.layers, args.reps = 4, 4, 1
    rows = []
    with tempfile.TemporaryDirectory(prefix="hf-bench-") as root:
        for dtype in ("float32", "bfloat16"):
            folder = os.path.join(root, dtype)
            os.makedirs(folder)
            _write(folder, args.mib, args.layers, dtype)
            _run_child("st_load_file", folder, args.mib, args.layers)  # warm the page cache
            runs: dict[str, list[dict[str, float]]] = {m: [] for m in METHODS}
            for _ in range(args.reps):
                for method in METHODS:  # interleaved, so drift hits every method alike
                    runs[method].append(_run_child(method, folder, args.mib, args.layers))
            for method in METHODS:
                secs = [r["seconds"] for r in runs[method]]
                rows.append(
                    {
                        "files": dtype,
                        "method": method,
                        "median_s": statistics.median(secs),
                        "min_s": min(secs),
                        "peak_mib": max(r["peak_mib"] for r in runs[method]),
                    }
                )
    size = f"{args.mib} MiB fp32 model, {args.layers} Linear layers, 4 shards"
    print(f"HF safetensors load ({size}; files from the page cache; {args.reps} reps)")
    print(f"{'files':<9} {'method':<18} {'median s':>9} {'min s':>7} {'GB/s':>6} {'peak MiB':>9}  vs st_load_file")
    for row in rows:
        ref = next(r for r in rows if r["files"] == row["files"] and r["method"] == "st_load_file")
        nbytes = args.mib * 2**20 / (2 if row["files"] == "bfloat16" else 1)
        print(
            f"{row['files']:<9} {row['method']:<18} {row['median_s']:>9.3f} {row['min_s']:>7.3f} "
            f"{nbytes / row['median_s'] / 1e9:>6.2f} {row['peak_mib']:>9.0f}  {row['median_s'] / ref['median_s']:.2f}x"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"mib": args.mib, "layers": args.layers, "reps": args.reps, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
