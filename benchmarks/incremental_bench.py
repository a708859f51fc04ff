"""Incremental saves (``incremental: true``) against full saves, side by side in one run.

Two shapes, each saved by two engines into two folders, alternating which goes first in every
round, with the same state:

* ``finetune``: ``--frozen-mib`` MiB of frozen fp32 weights (16 bias-free square ``Linear``
  layers, each with a ``LayerNorm``) and a trainable head of ``--head-pct`` percent of that,
  with AdamW over the head. Each round is an AdamW step of the head (synthetic gradients: the
  forward pass is not what is measured), then one save per engine. Reported per save after the
  first: bytes written and carried over, seconds until committed, and the disk use of
  ``--keep`` retained checkpoints against one full checkpoint (each inode counted once). A third
  engine keeps 2 checkpoints: retention then removes a link to the shared frozen files after
  every commit, so their recorded version no longer matches and every save reads them again
  (checksum) before linking them: what vouching for carried bytes costs when it must read.
* ``pretrain``: ``--pretrain-mib`` MiB of parameters, all trainable (AdamW): every byte changes
  at every save, so incremental saves can only cost. Sync and ``pinned_staging`` (async) saves;
  reported: seconds until committed (and ``save()``'s blocking time for async), the ratio
  incremental / full.

* ``s3``: the fine-tune shape at ``--s3-frozen-mib`` saved to an S3-protocol server (moto, on
  loopback, in its own process) by both engines: bytes this client uploaded per save (the
  engine's ``bytes_written``), bytes copied inside the store (``bytes_reused``), seconds.

Targets (issue: incremental checkpoints): fine-tune saves after the first write at most 1.1x the
changed bytes (under 3 % of a full save), take at most 10 % of a full save's time, and ten
retained checkpoints use at most 1.2x one full checkpoint; pre-training saves at most 3 % slower.

Usage::

    python benchmarks/incremental_bench.py [--rounds 5] [--out results.json]
    python benchmarks/incremental_bench.py --smoke     # tiny, seconds: keeps the script from rotting
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
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ckpt_engine import CheckpointEngine
from ckpt_engine._inspect.files import shared_once_usage  # what `ckpt-engine ls` reports as disk use

MIB = 2**20
LAYERS = 16


class FineTuneModel(nn.Module):
    """Frozen square layers with norms, and a trainable head."""

    def __init__(self, frozen_mib: float, head_pct: float) -> None:
        super().__init__()
        width = int((frozen_mib * MIB / 4 / LAYERS) ** 0.5)
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(LAYERS))
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(LAYERS))
        for p in [*self.layers.parameters(), *self.norms.parameters()]:
            p.requires_grad_(False)
        head_out = max(1, int(frozen_mib * MIB / 4 * head_pct / 100 / width))
        self.head = nn.Linear(width, head_out)


def _state_bytes(*objs: Any) -> int:
    total = 0
    for obj in objs:
        sd = obj.state_dict() if hasattr(obj, "state_dict") else obj
        for v in _tensors(sd):
            total += v.numel() * v.element_size()
    return total


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _step(optimizer: torch.optim.Optimizer, gen: torch.Generator) -> None:
    """One AdamW step with synthetic gradients on every trainable parameter."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _paired_saves(
    engines: dict[str, CheckpointEngine], rounds: int, model: Any, optimizer: torch.optim.Optimizer, gen: Any
) -> dict[str, list[Any]]:
    """``rounds`` + 1 saves by every engine of the same state, an AdamW step before each round
    after the first, the engines' order reversed every other round; the results of the saves
    after the first (which writes everything in every mode), per engine."""
    results: dict[str, list[Any]] = {m: [] for m in engines}
    order = list(engines)
    for it in range(1, rounds + 2):
        if it > 1:
            _step(optimizer, gen)
        for m in order if it % 2 else order[::-1]:
            r = engines[m].save(it, model=model, optimizer=optimizer).result()
            if it > 1:
                results[m].append(r)
    return results


def _checkpoint_bytes(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(folder) for f in fs)


def finetune(work: str, args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    model = FineTuneModel(args.frozen_mib, args.head_pct)
    optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    _step(optimizer, gen)  # AdamW state exists from the first save on
    dirs = {m: os.path.join(work, f"finetune-{m}") for m in ("full", "incremental", "reread")}
    # "reread": keep_last 2, so retention removes a link to the shared frozen files after every
    # commit; their version (ctime) moves, and each save reads them again before linking them.
    keep = {"full": args.keep, "incremental": args.keep, "reread": 2}
    engines = {
        m: CheckpointEngine({"save_dir": d, "incremental": m != "full", "keep_last": keep[m]}) for m, d in dirs.items()
    }
    try:
        saved = _paired_saves(engines, args.rounds, model, optimizer, gen)
        rows = {
            m: [{"s": r.total_seconds, "written": r.bytes_written, "reused": r.bytes_reused} for r in rs]
            for m, rs in saved.items()
        }
        for it in range(args.rounds + 2, args.keep + 2):  # fill retention up to --keep checkpoints
            _step(optimizer, gen)
            engines["incremental"].save(it, model=model, optimizer=optimizer).result()
    finally:
        for e in engines.values():
            e.close()
    head = _state_bytes(model.head) + _state_bytes(optimizer)  # what changes at every save
    full_ckpt = _checkpoint_bytes(os.path.join(dirs["full"], sorted(os.listdir(dirs["full"]))[0]))
    inc, full, reread = rows["incremental"], rows["full"], rows["reread"]
    written = statistics.median(r["written"] for r in inc)
    return {
        "frozen_bytes": _state_bytes(*model.layers, *model.norms),
        "changed_bytes": head,
        "full_checkpoint_bytes": full_ckpt,
        "full_s": statistics.median(r["s"] for r in full),
        "incremental_s": statistics.median(r["s"] for r in inc),
        "written_bytes": written,
        "reused_bytes": statistics.median(r["reused"] for r in inc),
        "written_over_changed": written / head,
        "written_over_full": written / full_ckpt,
        "time_over_full": statistics.median(i["s"] / f["s"] for i, f in zip(inc, full, strict=True)),
        "reread_s": statistics.median(r["s"] for r in reread),
        "reread_reused_bytes": statistics.median(r["reused"] for r in reread),
        "reread_over_incremental": statistics.median(r["s"] / i["s"] for r, i in zip(reread, inc, strict=True)),
        "reread_over_full": statistics.median(r["s"] / f["s"] for r, f in zip(reread, full, strict=True)),
        "retained": len([n for n in os.listdir(dirs["incremental"]) if n.startswith("iter_")]),
        "disk_use_bytes": shared_once_usage(dirs["incremental"]),
        "disk_over_one_full": shared_once_usage(dirs["incremental"]) / full_ckpt,
        "rounds": {m: rows[m] for m in rows},
    }


def pretrain(work: str, args: argparse.Namespace, plugins: list[Any]) -> dict[str, Any]:
    torch.manual_seed(0)
    numel = int(args.pretrain_mib * MIB / 4 / LAYERS)
    model = nn.ParameterList(nn.Parameter(torch.randn(numel)) for _ in range(LAYERS))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(2)
    _step(optimizer, gen)
    name = "async" if plugins else "sync"
    engines = {
        m: CheckpointEngine(
            {
                "save_dir": os.path.join(work, f"pretrain-{name}-{m}"),
                "incremental": m == "incremental",
                "keep_last": 2,
                "plugins": plugins,
            }
        )
        for m in ("full", "incremental")
    }
    try:
        for e in engines.values():
            e.wait_ready()
        saved = _paired_saves(engines, args.rounds, model, optimizer, gen)
        rows = {
            m: [{"s": r.total_seconds, "blocked_s": r.blocked_seconds, "written": r.bytes_written} for r in rs]
            for m, rs in saved.items()
        }
    finally:
        for e in engines.values():
            e.close()
    full_s = statistics.median(r["s"] for r in rows["full"])
    inc_s = statistics.median(r["s"] for r in rows["incremental"])
    paired = [i["s"] / f["s"] for i, f in zip(rows["incremental"], rows["full"], strict=True)]
    return {
        "state_bytes": _state_bytes(model) * 3,
        "full_s": full_s,
        "incremental_s": inc_s,
        # The median of the rounds' ratios: each round's two saves ran back to back on the same
        # state, so a machine that slows down between rounds moves both.
        "incremental_over_full": statistics.median(paired),
        # The fastest of each: what the machine's noise (other processes, the disk) adds least to.
        "best_ratio": min(r["s"] for r in rows["incremental"]) / min(r["s"] for r in rows["full"]),
        "full_blocked_s": statistics.median(r["blocked_s"] for r in rows["full"]),
        "incremental_blocked_s": statistics.median(r["blocked_s"] for r in rows["incremental"]),
        "rounds": rows,
    }


def s3(work: str, args: argparse.Namespace) -> dict[str, Any]:
    from _s3_server import KEY, SECRET, Server  # the loopback S3 server (moto)

    server = Server()
    try:
        fs = server.fs()
        bucket = f"incremental-{int(time.time() * 1000) % 10**9}"
        fs.call_s3("create_bucket", Bucket=bucket)
        storage = {"endpoint_url": server.endpoint, "access_key_id": KEY, "secret_access_key": SECRET}
        torch.manual_seed(0)
        model = FineTuneModel(args.s3_frozen_mib, args.head_pct)
        optimizer = torch.optim.AdamW(model.head.parameters(), lr=1e-3)
        gen = torch.Generator().manual_seed(3)
        _step(optimizer, gen)
        engines = {
            m: CheckpointEngine(
                {
                    "save_dir": f"s3://{bucket}/{m}",
                    "storage": {**storage, "spool_dir": os.path.join(work, f"spool-{m}")},
                    "incremental": m == "incremental",
                    "keep_last": 2,
                }
            )
            for m in ("full", "incremental")
        }
        try:
            saved = _paired_saves(engines, args.s3_rounds, model, optimizer, gen)
            rows = {
                m: [
                    {"s": r.total_seconds, "uploaded": r.bytes_written, "copied": r.bytes_reused, "how": r.carried_by}
                    for r in rs
                ]
                for m, rs in saved.items()
            }
        finally:
            for e in engines.values():
                e.close()
    finally:
        server.close()
    full, inc = rows["full"], rows["incremental"]
    changed = _state_bytes(model.head) + _state_bytes(optimizer)
    return {
        "frozen_bytes": _state_bytes(*model.layers, *model.norms),
        "changed_bytes": changed,
        "full_uploaded_bytes": statistics.median(r["uploaded"] for r in full),
        "incremental_uploaded_bytes": statistics.median(r["uploaded"] for r in inc),
        "incremental_copied_bytes": statistics.median(r["copied"] for r in inc),
        "uploaded_over_changed": statistics.median(r["uploaded"] for r in inc) / changed,
        "full_s": statistics.median(r["s"] for r in full),
        "incremental_s": statistics.median(r["s"] for r in inc),
        "carried_by": sorted({r["how"] for r in inc}),
        "rounds": rows,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frozen-mib", type=float, default=1024)
    parser.add_argument("--head-pct", type=float, default=1.0)
    parser.add_argument("--pretrain-mib", type=float, default=256)
    parser.add_argument("--s3-frozen-mib", type=float, default=256, help="the object-store run's frozen part")
    parser.add_argument("--s3-rounds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep", type=int, default=10, help="retained fine-tune checkpoints (keep_last)")
    parser.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round")
    parser.add_argument(
        "--only", choices=["finetune", "pretrain_sync", "pretrain_async", "s3"], action="append", help="run only these"
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.frozen_mib, args.pretrain_mib, args.rounds, args.keep = 16, 4, 1, 3
        args.s3_frozen_mib, args.s3_rounds = 8, 1
    torch.set_num_threads(1)
    work = args.workdir or tempfile.mkdtemp(prefix="ckpt-incremental-bench-")
    os.makedirs(work, exist_ok=True)
    t0 = time.perf_counter()
    try:
        result: dict[str, Any] = {
            "machine": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "cpus": os.cpu_count(),
                "loadavg": os.getloadavg(),
            },
            "args": vars(args),
        }
        runs = {
            "finetune": lambda: finetune(work, args),
            "pretrain_sync": lambda: pretrain(work, args, []),
            "pretrain_async": lambda: pretrain(work, args, ["pinned_staging"]),
            "s3": lambda: s3(work, args),
        }
        for name, run in runs.items():
            if not args.only or name in args.only:
                result[name] = run()
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    result["seconds"] = time.perf_counter() - t0
    result["machine"]["loadavg_end"] = os.getloadavg()
    _print(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _print(result: dict[str, Any]) -> None:
    if "finetune" not in result:
        return _print_pretrain(result)
    ft = result["finetune"]
    print(f"fine-tune ({ft['frozen_bytes'] / MIB:.0f} MiB frozen, {ft['changed_bytes'] / MIB:.1f} MiB changing):")
    print(
        f"  written per save {ft['written_bytes'] / MIB:.2f} MiB = {ft['written_over_changed']:.3f}x the changed "
        f"bytes, {100 * ft['written_over_full']:.2f} % of a full checkpoint"
    )
    print(f"  save {ft['incremental_s']:.3f} s against {ft['full_s']:.3f} s full ({100 * ft['time_over_full']:.1f} %)")
    print(
        f"  with the frozen files read again before each link (keep_last 2): {ft['reread_s']:.3f} s, "
        f"{ft['reread_over_incremental']:.2f}x the incremental save, {100 * ft['reread_over_full']:.1f} % of full"
    )
    print(f"  {ft['retained']} retained checkpoints use {ft['disk_over_one_full']:.3f}x one full checkpoint")
    return _print_pretrain(result)


def _print_s3(result: dict[str, Any]) -> None:
    s = result.get("s3")
    if s is None:
        return
    print(
        f"object store ({s['frozen_bytes'] / MIB:.0f} MiB frozen): uploaded "
        f"{s['incremental_uploaded_bytes'] / MIB:.2f} MiB per save "
        f"({s['uploaded_over_changed']:.3f}x the changed bytes) against "
        f"{s['full_uploaded_bytes'] / MIB:.1f} MiB; {s['incremental_copied_bytes'] / MIB:.1f} MiB copied in the store; "
        f"{s['incremental_s']:.2f} s against {s['full_s']:.2f} s"
    )


def _print_pretrain(result: dict[str, Any]) -> None:
    _print_s3(result)
    for name in ("sync", "async"):
        p = result.get(f"pretrain_{name}")
        if p is None:
            continue
        print(
            f"pre-training {name} ({p['state_bytes'] / MIB:.0f} MiB): incremental {p['incremental_s']:.3f} s, "
            f"full {p['full_s']:.3f} s (medians); paired ratio {p['incremental_over_full']:.3f}x, "
            f"fastest over fastest {p['best_ratio']:.3f}x"
        )


if __name__ == "__main__":
    sys.exit(main())
