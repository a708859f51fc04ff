"""Paired hot loads for peers_bench.py: the engine verified, the engine unverified, safetensors and
the read floor, interleaved.

The table's rows load once per round, each method in its own turn, so a ratio between two of
them mixes in whatever else the machine did in between. Here the three loads run back to back
in every round (the order rotated from round to round: A B C, B C A, C A B, ...), into the same
live model and optimizer, and each round gives its own ratios; the figures are the medians of
those per-round ratios (and their range). Every engine load is a new ``CheckpointEngine``, as a
resumed job has. ``verify: read`` (the default) checks each block it reads against its digest;
``verify: off`` checks nothing: their ratio is the cost of verification alone. Each load is
checked against the values saved.

The **read floor** is not a loader: it reads every data file of the engine's checkpoint into
memory allocated once (as the live tensors are), on as many threads as the engine's reader
uses, each file cut into one contiguous part per thread, and hashes each 256 KiB with xxh3
right after reading it. No metadata, no plan, no placing. It is the least any load that checks
every byte it reads does on this machine; ``floor_x_safetensors`` says how far from
safetensors' whole (unchecked) load that least is, and ``verified_x_floor`` what the engine
spends beyond it.
"""

from __future__ import annotations

import glob
import os
import shutil
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from _peers_measure import fingerprint, matches, trim
from _peers_methods import Safetensors, Work

__all__ = ["paired_loads"]

#: The ratios reported, each ``(name, numerator, denominator)``.
RATIOS = (
    ("verified_x_safetensors", "ours_verified", "safetensors"),
    ("unverified_x_safetensors", "ours_unverified", "safetensors"),
    ("verified_x_unverified", "ours_verified", "ours_unverified"),
    ("floor_x_safetensors", "read_floor", "safetensors"),
    ("verified_x_floor", "ours_verified", "read_floor"),
)
#: The read floor hashes what it read in pieces of this size (as the engine's reader does).
PIECE = 256 << 10


def _read_floor(folder: str) -> Callable[[], None]:
    """The read floor of the module docstring for the checkpoint under ``folder``."""
    import xxhash

    files = sorted(glob.glob(os.path.join(folder, "iter_*", "*", "*.distcp")))
    buffers = [torch.empty(os.path.getsize(f), dtype=torch.uint8) for f in files]
    threads = min(4, os.cpu_count() or 1)  # the engine's reader's default
    jobs = [
        (path, memoryview(buf.numpy()), len(buf) * k // threads, len(buf) * (k + 1) // threads)
        for path, buf in zip(files, buffers, strict=True)
        for k in range(threads)
    ]

    def one(job: tuple[str, memoryview, int, int]) -> None:
        path, view, at, end = job
        hasher = xxhash.xxh3_64()
        fd = os.open(path, os.O_RDONLY)
        try:
            while at < end:
                piece = view[at : min(end, at + PIECE)]
                got = os.preadv(fd, [piece], at)
                if got <= 0:
                    raise RuntimeError(f"read floor: {path} ends at byte {at}")
                hasher.update(piece[:got])
                at += got
        finally:
            os.close(fd)

    def load() -> None:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, jobs))

    return load


def _engine_load(w: Work, folder: str, verify: str) -> Callable[[], None]:
    from ckpt_engine import CheckpointEngine

    def load() -> None:
        engine = CheckpointEngine({"save_dir": folder, "verify": verify})
        try:
            engine.load(model=w.model, optimizer=w.optim if w.with_optim else None)
        finally:
            engine.close()

    return load


def paired_loads(w: Work, rounds: int) -> dict[str, Any]:
    """``rounds`` rounds of the three hot loads and the read floor; per method its times (wall and CPU), per ratio
    its per-round values, their median and range."""
    from ckpt_engine import CheckpointEngine

    folder = w.folder("paired_ours")
    engine = CheckpointEngine({"save_dir": folder})
    try:
        engine.save(1, model=w.model, optimizer=w.optim if w.with_optim else None)
    finally:
        engine.close()
    safetensors = Safetensors()
    safetensors.setup(w)
    safetensors.save(1)
    saved = fingerprint(w)
    methods: dict[str, Callable[[], None]] = {
        "ours_verified": _engine_load(w, folder, "read"),
        "ours_unverified": _engine_load(w, folder, "off"),
        "safetensors": lambda: safetensors.load(1),
        "read_floor": _read_floor(folder),
    }
    for load in methods.values():  # first calls (imports, allocator) outside the figures
        load()
    wall: dict[str, list[float]] = {n: [] for n in methods}
    cpu: dict[str, list[float]] = {n: [] for n in methods}
    names = list(methods)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            trim()
            t0, c0 = time.perf_counter(), time.process_time()
            methods[name]()
            wall[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if not matches(w, saved):
                raise RuntimeError(f"paired loads: {name} did not bring back the saved values")
    out: dict[str, Any] = {"rounds": rounds, "wall_s": wall, "cpu_s": cpu, "ratios": {}}
    for key, a, b in RATIOS:
        for clock, times in (("wall", wall), ("cpu", cpu)):
            per_round = [x / y for x, y in zip(times[a], times[b], strict=True)]
            out["ratios"][f"{key}_{clock}"] = {
                "median": statistics.median(per_round),
                "min": min(per_round),
                "max": max(per_round),
                "per_round": per_round,
            }
    out["median_wall_s"] = {n: statistics.median(v) for n, v in wall.items()}
    for sub in ("paired_ours", "safetensors"):
        shutil.rmtree(os.path.join(w.root, sub), ignore_errors=True)
    return out
