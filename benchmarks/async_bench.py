"""Async saves with ``pinned_staging`` against the floor and against the engine's sync save.

For each state size (``--sizes``, MiB; ~200 fp32/bf16 tensors), in one run, side by side:

(a) blocking time of the 2nd and later async saves / time to copy the same bytes into
    preallocated host buffers (the floor)                                  target <= 1.25
(b) total time until committed: async / the engine's synchronous save      target <= 1.2
(c) RSS of the training process (and of the writer) after ``--rss-saves`` async saves vs after
    the 2nd                                                               target growth < 5 %
(d) steps/s of a small CPU training loop with a save every ``--save-every`` steps vs no saves
    (async and sync)
(e) the overlap comparison (``--overlap-sizes``, MiB of parameters + AdamW state): a training loop
    in alternating rounds of no saves / sync saves / async ``overlap: false`` / async
    ``overlap: true``; per save the time blocked in ``save()``, the time waited in the step hook
    and the loop's slowdown, each over the copy floor of the same state

Usage::

    python benchmarks/async_bench.py [--sizes 256,1024] [--reps 3] [--out results.json] [--dir DIR]
    python benchmarks/async_bench.py --smoke          # tiny, seconds: keeps the script from rotting

Checkpoints go to ``--dir`` (default: a temporary folder on the same disk as /tmp); every save
but the newest is deleted as soon as it is committed (untimed), so disk use stays at ~2 states.
``--device cuda`` puts the state on the GPU: staging then goes through page-locked buffers and a
side stream, and the floor is a non-blocking copy into page-locked host tensors. No GPU was
available where the numbers in benchmarks/RESULTS.md were taken: that path is untested there.
"""

from __future__ import annotations

import argparse
import gc
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
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin
from torch import nn

from ckpt_engine import CheckpointEngine, SaveResult

MIB = 2**20


class SyntheticState(nn.Module):
    """``n`` parameters (alternately fp32 and bf16) adding up to ``size_mib``."""

    def __init__(self, size_mib: float, n: int = 200, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        per = int(size_mib * MIB) // n
        self.params = nn.ParameterList()
        for i in range(n):
            dtype = torch.float32 if i % 2 == 0 else torch.bfloat16
            numel = max(256, per // dtype.itemsize // 256 * 256)
            t = torch.randn(numel // 256, 256, generator=gen).to(dtype)
            self.params.append(nn.Parameter(t, requires_grad=False))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params)


def rss_bytes(pid: int | str = "self") -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_targets(model: SyntheticState) -> list[torch.Tensor]:
    """Preallocated host buffers for the floor copy (page-locked when the state is on a GPU)."""
    pin = any(p.is_cuda for p in model.params)
    return [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in model.params]


def floor_copy_seconds(model: SyntheticState, targets: list[torch.Tensor]) -> float:
    """Time to copy every tensor into preallocated, already-touched host buffers."""
    with torch.no_grad():
        t0 = time.perf_counter()
        for dst, src in zip(targets, model.params, strict=True):
            dst.copy_(src, non_blocking=src.is_cuda)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return time.perf_counter() - t0


def _prune(save_dir: Path, keep: int) -> None:
    """Delete committed checkpoints but the newest ``keep`` (outside any timed region)."""
    done = sorted(p for p in save_dir.glob("iter_*") if p.is_dir())
    for p in done[:-keep]:
        shutil.rmtree(p, ignore_errors=True)


def save_once(engine: CheckpointEngine, model: SyntheticState, save_dir: Path, iteration: int) -> SaveResult:
    """One save, waited for (so blocked and total times are its own), after a 'training step'."""
    with torch.no_grad():  # the content changes between saves
        model.params[iteration % len(model.params)].add_(1)
    result = engine.save(iteration, model=model).result(timeout=3600)
    _prune(save_dir, keep=1)
    return result


def bench_size(
    size_mib: float,
    reps: int,
    rss_saves: int,
    root: Path,
    plugin: PinnedStagingPlugin,
    device: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Phase 1: ``rss_saves`` async saves alone (RSS after the 2nd and the last). Phase 2: ``reps``
    rounds of (floor copy, async save, sync save; the two saves in alternating order), so each
    ratio compares runs made under the same machine load."""
    model = SyntheticState(size_mib).to(device)
    out: dict[str, Any] = {"size_mib": size_mib, "tensors": len(model.params), "state_bytes": model.nbytes}
    async_dir, sync_dir = root / f"async_{size_mib:g}", root / f"sync_{size_mib:g}"
    with CheckpointEngine({"save_dir": str(async_dir)}, plugins=[plugin]) as async_engine:
        out["writer_start_s"] = plugin.wait_ready()
        writer_pid = plugin.writer_pid or 0
        phase1: list[SaveResult] = []
        for i in range(1, rss_saves + 1):
            phase1.append(save_once(async_engine, model, async_dir, i))
            if i == 2:
                gc.collect()
                out["rss_after_2"], out["writer_rss_after_2"] = rss_bytes(), rss_bytes(writer_pid)
        gc.collect()
        out["rss_saves"] = len(phase1)
        out["rss_after_n"], out["writer_rss_after_n"] = rss_bytes(), rss_bytes(writer_pid)
        out["first_async_blocked_s"] = phase1[0].blocked_seconds
        out["phase1_async_blocked_s"] = [r.blocked_seconds for r in phase1[1:]]
        log(f"  {len(phase1)} async saves: RSS {out['rss_after_2'] / MIB:.0f} -> {out['rss_after_n'] / MIB:.0f} MiB")

        targets = host_targets(model)
        floor_copy_seconds(model, targets)  # touch the targets
        floors, blocked, staging, totals, syncs = [], [], [], [], []
        parts: dict[str, list[float]] = {
            k: [] for k in ("async_write_s", "async_commit_s", "sync_write_s", "sync_commit_s")
        }
        with CheckpointEngine({"save_dir": str(sync_dir)}) as sync_engine:
            save_once(sync_engine, model, sync_dir, 0)  # warm DCP up in this process
            for i in range(reps):
                floors.append(floor_copy_seconds(model, targets))
                # Alternate which mode goes first, so neither always follows the other's I/O.
                for mode in ("async", "sync") if i % 2 == 0 else ("sync", "async"):
                    if mode == "async":
                        r = save_once(async_engine, model, async_dir, 1000 + i)
                        blocked.append(r.blocked_seconds)
                        staging.append(r.staging_seconds)
                        totals.append(r.total_seconds)
                        parts["async_write_s"].append(r.write_seconds)
                        parts["async_commit_s"].append(r.total_seconds - r.blocked_seconds - r.write_seconds)
                        out["bytes_written"] = r.bytes_written
                    else:
                        rs = save_once(sync_engine, model, sync_dir, 1000 + i)
                        syncs.append(rs.total_seconds)
                        parts["sync_write_s"].append(rs.write_seconds)
                log(
                    f"  round {i + 1}: floor {floors[-1] * 1e3:.1f} ms, async blocked {blocked[-1] * 1e3:.1f} ms, "
                    f"async total {totals[-1]:.3f} s, sync total {syncs[-1]:.3f} s"
                )
        out["buffer_sets"] = len(plugin.buffer_sets())
        del targets
    for d in (async_dir, sync_dir):
        shutil.rmtree(d, ignore_errors=True)
    out.update(parts)
    out.update(
        floor_copy_s=floors,
        async_blocked_s=blocked,
        async_staging_s=staging,
        async_total_s=totals,
        sync_total_s=syncs,
    )
    med = statistics.median
    out["ratio_blocked_over_floor"] = med(b / f for b, f in zip(blocked, floors, strict=True))
    out["ratio_async_total_over_sync"] = med(a / s for a, s in zip(totals, syncs, strict=True))
    out["rss_growth"] = out["rss_after_n"] / out["rss_after_2"] - 1
    w2 = out["writer_rss_after_2"]
    out["writer_rss_growth"] = out["writer_rss_after_n"] / w2 - 1 if w2 else None
    return out


class MLP(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out


def bench_training(
    steps: int,
    save_every: int,
    width: int,
    depth: int,
    rounds: int,
    root: Path,
    plugin: PinnedStagingPlugin,
    device: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Steps/s of a small CPU training loop: no saves, async saves, sync saves, in alternating rounds."""
    out: dict[str, Any] = {"steps": steps, "save_every": save_every, "width": width, "depth": depth}
    torch.manual_seed(0)
    model = MLP(width, depth).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x, y = torch.randn(64, width, device=device), torch.randn(64, width, device=device)

    def step() -> None:
        nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        optim.step()
        optim.zero_grad()

    def loop(engine: CheckpointEngine | None, first: int) -> float:
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            step()
            if engine is not None and i % save_every == 0:
                engine.save(first + i, model=model, optimizer=optim)
        if engine is not None:
            engine.wait()  # the last save counts too
        return steps / (time.perf_counter() - t0)

    for _ in range(3):  # warm-up; AdamW state exists before the first save
        step()
    out["state_mib"] = (sum(p.nbytes for p in model.parameters()) * 3) / MIB  # params + 2 moments
    async_dir, sync_dir = root / "train_async", root / "train_sync"
    runs: dict[str, list[float]] = {"none": [], "async": [], "sync": []}
    with (
        CheckpointEngine({"save_dir": str(async_dir)}, plugins=[plugin]) as async_engine,
        CheckpointEngine({"save_dir": str(sync_dir)}) as sync_engine,
    ):
        plugin.wait_ready()
        async_engine.save(0, model=model, optimizer=optim).result(timeout=600)  # allocate the buffers
        sync_engine.save(0, model=model, optimizer=optim)
        for r in range(rounds):
            runs["none"].append(loop(None, 0))
            runs["async"].append(loop(async_engine, (2 * r + 1) * steps))
            _prune(async_dir, keep=1)
            runs["sync"].append(loop(sync_engine, (2 * r + 1) * steps))
            _prune(sync_dir, keep=1)
            log(
                f"  round {r + 1}: no saves {runs['none'][-1]:.1f}, async {runs['async'][-1]:.1f}, "
                f"sync {runs['sync'][-1]:.1f} steps/s"
            )
    for d in (async_dir, sync_dir):
        shutil.rmtree(d, ignore_errors=True)
    med = statistics.median
    out.update({f"{k}_steps_per_s_runs": v for k, v in runs.items()})
    out["no_save_steps_per_s"], out["async_steps_per_s"], out["sync_steps_per_s"] = (
        med(runs["none"]),
        med(runs["async"]),
        med(runs["sync"]),
    )
    out["async_relative"] = out["async_steps_per_s"] / out["no_save_steps_per_s"]
    out["sync_relative"] = out["sync_steps_per_s"] / out["no_save_steps_per_s"]
    return out


def _overlap_model(state_mib: float, width: int = 1024, copies: int = 3) -> nn.Module:
    """An MLP whose parameters plus AdamW's two moments (``copies`` 3; plain SGD: 1, the
    parameters alone) add up to about ``state_mib``."""
    layers = max(1, round(state_mib * MIB / copies / (width * width * 4)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


class OverlapEngines:
    """(e)'s three engines (sync, async, async with ``overlap``) saving under ``root``, and the next
    iteration they save. Each (size, optimizer) run opens its own; the smoke run shares one set
    between the optimizers of a size (each run's untimed first save allocates its buffers), so it
    starts two writers, not two per optimizer."""

    def __init__(self, root: Path) -> None:
        self.root, self.next_iteration = root, 0
        self.engines: dict[str, CheckpointEngine] = {
            "sync": CheckpointEngine({"save_dir": str(root / "ov_sync")}),
            "async": CheckpointEngine(
                {"save_dir": str(root / "ov_async")}, plugins=[PinnedStagingPlugin(PinnedStagingPlugin.Options())]
            ),
            "overlap": CheckpointEngine(
                {"save_dir": str(root / "ov_overlap")},
                plugins=[PinnedStagingPlugin(PinnedStagingPlugin.Options(overlap=True))],
            ),
        }

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def bench_overlap(
    state_mib: float,
    steps: int,
    save_every: int,
    rounds: int,
    root: Path,
    log: Callable[[str], None],
    optimizer: str = "adamw",
    shared: OverlapEngines | None = None,
) -> dict[str, Any]:
    """(e): no saves / sync / async overlap false / async overlap true, rounds alternating.
    ``optimizer``: ``adamw`` (the state is parameters and two moments) or ``sgd`` (plain SGD,
    no momentum: the parameters alone make the state). ``shared``: engines to use (and leave
    open) instead of a set of this run's own."""
    root = root / f"overlap_{state_mib:g}_{optimizer}"  # each size its own save folders and iterations
    torch.manual_seed(0)
    model = _overlap_model(state_mib, copies=3 if optimizer == "adamw" else 1)
    optim: torch.optim.Optimizer = (
        torch.optim.AdamW(model.parameters(), lr=1e-4)
        if optimizer == "adamw"
        else torch.optim.SGD(model.parameters(), lr=1e-4)
    )
    x = torch.randn(256, 1024)

    def step() -> None:
        model(x).square().mean().backward()
        optim.step()
        optim.zero_grad()

    step()
    tensors = [p.detach() for p in model.parameters()] + [
        t for st in optim.state.values() for t in st.values() if t.dim() > 0
    ]
    targets = [torch.empty_like(t) for t in tensors]

    def copy_floor() -> float:
        """One copy of the state into the preallocated host tensors (the best of three)."""
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            for d, t in zip(targets, tensors, strict=True):
                d.copy_(t)
            times.append(time.perf_counter() - t0)
        return min(times)

    copy_floor()  # touch the targets
    own = shared is None
    group = OverlapEngines(root) if shared is None else shared
    engines, modes = group.engines, group.engines
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in ("none", *modes)}
    floors: list[float] = []
    it = group.next_iteration
    try:
        for plugin in [p for e in engines.values() for p in (e._plugins.pm.get_plugin("pinned_staging"),) if p]:
            plugin.wait_ready()
        for engine in engines.values():  # allocate buffers: not timed
            engine.save(it, model=model, optimizer=optim).result(timeout=600)
        it += 1
        for r in range(rounds):
            floors.append(copy_floor())  # each round's ratios use the floor measured in that round
            for name in runs:
                engine = engines.get(name)
                handles = []
                t0 = time.perf_counter()
                for i in range(1, steps + 1):
                    step()
                    if engine is not None and i % save_every == 0:
                        handles.append(engine.save(it, model=model, optimizer=optim))
                        it += 1
                loop_s = time.perf_counter() - t0
                results = [h.result(timeout=600) for h in handles]
                if engine is not None:
                    _prune(group.root / f"ov_{name}", keep=1)
                runs[name].append(
                    {
                        "loop_s": loop_s,
                        "saves": len(results),
                        "blocked_s": statistics.median([x.blocked_seconds for x in results]) if results else 0.0,
                        "step_wait_s": statistics.median([x.step_wait_seconds for x in results]) if results else 0.0,
                        "copy_s": statistics.median([x.background_copy_seconds for x in results]) if results else 0.0,
                    }
                )
            log("  round " + str(r + 1) + ": " + ", ".join(f"{n} {v[-1]['loop_s']:.2f}s" for n, v in runs.items()))
    finally:
        group.next_iteration = it
        if own:
            group.close()
    med = statistics.median
    base = med([x["loop_s"] for x in runs["none"]])
    out: dict[str, Any] = {
        "optimizer": optimizer,
        "tensors": len(tensors),
        "state_mib": sum(t.nbytes for t in tensors) / MIB,
        "floor_copy_s": med(floors),
        "floor_copy_s_runs": floors,
        "step_s": base / steps,
        "steps": steps,
        "save_every": save_every,
        "runs": runs,
    }
    for name in modes:
        rs = runs[name]
        saves = rs[0]["saves"]
        # Ratios per round (over that round's floor and that round's loop without saves), then
        # the median: a machine whose load drifts between rounds skews one round, not all.
        per_round = [
            {
                "blocked": x["blocked_s"] / f,
                "wait": x["step_wait_s"] / f,
                "loop_wait": (x["blocked_s"] + x["step_wait_s"]) / f,
                "slowdown": (x["loop_s"] - none["loop_s"]) / saves / f,
                "copy": x["copy_s"] / f,
            }
            for x, none, f in zip(rs, runs["none"], floors, strict=True)
        ]
        out[name] = {
            "blocked_over_floor": med([p["blocked"] for p in per_round]),
            "step_wait_over_floor": med([p["wait"] for p in per_round]),
            "loop_wait_over_floor": med([p["loop_wait"] for p in per_round]),
            "slowdown_per_save_over_floor": med([p["slowdown"] for p in per_round]),
            "background_copy_over_floor": med([p["copy"] for p in per_round]),
        }
    return out


def overlap_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "(e) per save, over the copy floor: blocked in save() | waited in step hook | loop wait | slowdown",
    ]
    for o in rows:
        lines.append(
            f"  {o['state_mib']:.0f} MiB, {o.get('optimizer', 'adamw')}, {o.get('tensors', '?')} tensors "
            f"(floor {o['floor_copy_s'] * 1e3:.1f} ms, step {o['step_s'] * 1e3:.0f} ms):"
        )
        for name in ("sync", "async", "overlap"):
            m = o[name]
            lines.append(
                f"    {name:<8} {m['blocked_over_floor']:6.2f} | {m['step_wait_over_floor']:6.2f} | "
                f"{m['loop_wait_over_floor']:6.2f} | {m['slowdown_per_save_over_floor']:6.2f}"
            )
    return "\n".join(lines)


def table(sizes: list[dict[str, Any]], training: dict[str, Any]) -> str:
    med = statistics.median
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("state (MiB, tensors)", lambda s: f"{s['state_bytes'] / MIB:.0f}, {s['tensors']}"),
        ("floor copy (ms)", lambda s: f"{med(s['floor_copy_s']) * 1e3:.1f}"),
        ("async blocked, 2nd+ (ms)", lambda s: f"{med(s['async_blocked_s']) * 1e3:.1f}"),
        ("(a) blocked / floor  [<= 1.25]", lambda s: f"{s['ratio_blocked_over_floor']:.2f}"),
        ("async first save blocked (ms)", lambda s: f"{s['first_async_blocked_s'] * 1e3:.1f}"),
        ("sync save total (s)", lambda s: f"{med(s['sync_total_s']):.3f}"),
        ("async total until committed (s)", lambda s: f"{med(s['async_total_s']):.3f}"),
        ("(b) async / sync total  [<= 1.2]", lambda s: f"{s['ratio_async_total_over_sync']:.2f}"),
        ("RSS after 2nd save (MiB)", lambda s: f"{s['rss_after_2'] / MIB:.0f}"),
        ("RSS after n-th save (MiB, n)", lambda s: f"{s['rss_after_n'] / MIB:.0f}, {s['rss_saves']}"),
        ("(c) RSS growth  [< 5 %]", lambda s: f"{s['rss_growth'] * 100:+.2f} %"),
        (
            "writer RSS 2nd -> n-th (MiB)",
            lambda s: f"{s['writer_rss_after_2'] / MIB:.0f} -> {s['writer_rss_after_n'] / MIB:.0f}",
        ),
        ("writer start-up (s)", lambda s: f"{s['writer_start_s']:.2f}"),
    ]
    width = max(len(r[0]) for r in rows) + 2
    lines = ["".ljust(width) + "".join(f"{s['size_mib']:>12g} MiB" for s in sizes)]
    for label, fmt in rows:
        lines.append(label.ljust(width) + "".join(f"{fmt(s):>16}" for s in sizes))
    t = training
    lines.append("")
    lines.append(
        f"(d) training loop ({t['state_mib']:.0f} MiB state, save every {t['save_every']} of {t['steps']} steps): "
        f"no saves {t['no_save_steps_per_s']:.1f} steps/s, async {t['async_steps_per_s']:.1f} "
        f"({t['async_relative'] * 100:.0f} %), sync {t['sync_steps_per_s']:.1f} ({t['sync_relative'] * 100:.0f} %)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="256,1024", help="state sizes in MiB, comma-separated")
    parser.add_argument("--reps", type=int, default=3, help="timed sync saves (and floor copies) per size")
    parser.add_argument("--rss-saves", type=int, default=20, help="async saves per size (RSS after 2nd vs last)")
    parser.add_argument("--train-steps", type=int, default=200, help="steps per training-loop run")
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--train-rounds", type=int, default=3, help="alternating runs of each training mode")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads of the training process")
    parser.add_argument("--device", default="cpu", help="where the state lives: cpu, or cuda (pinned staging path)")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--dir", help="folder for the checkpoints (default: a temporary folder)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes and counts: seconds, for tests")
    parser.add_argument("--overlap-sizes", default="256,1024", help="(e) states in MiB (params + AdamW); '' skips")
    parser.add_argument("--overlap-steps", type=int, default=12, help="(e) steps per round")
    parser.add_argument("--only-overlap", action="store_true", help="run (e) alone")
    parser.add_argument(
        "--overlap-optimizers", default="adamw", help="(e) adamw and/or sgd (plain SGD: parameters only)"
    )
    args = parser.parse_args(argv)
    overlap_sizes = [float(s) for s in args.overlap_sizes.split(",") if s.strip()]
    unknown = {o.strip() for o in args.overlap_optimizers.split(",") if o.strip()} - {"adamw", "sgd"}
    if unknown:
        parser.error(f"--overlap-optimizers: unknown {sorted(unknown)} (adamw, sgd)")
    overlap_rounds = 3
    if args.smoke:
        sizes, args.reps, args.rss_saves, args.train_steps, args.save_every = [2.0], 1, 3, 8, 4
        args.train_rounds, width, depth = 1, 64, 2
        overlap_sizes, args.overlap_steps, overlap_rounds = [13.0], 4, 1
    else:
        sizes = [float(s) for s in args.sizes.split(",") if s.strip()]
        width, depth = 1024, 4
    torch.set_num_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    root = Path(tempfile.mkdtemp(prefix="ckpt_async_bench_", dir=args.dir))
    train_plugin = PinnedStagingPlugin()  # its writer starts now, while the sizes are measured
    try:
        overlap = []
        for size in overlap_sizes:
            shared = OverlapEngines(root / f"overlap_{size:g}") if args.smoke else None
            try:
                for optimizer in [o.strip() for o in args.overlap_optimizers.split(",") if o.strip()]:
                    log(f"overlap comparison, {size:g} MiB, {optimizer}")
                    every = max(1, args.overlap_steps // 4)
                    overlap.append(
                        bench_overlap(size, args.overlap_steps, every, overlap_rounds, root, log, optimizer, shared)
                    )
            finally:
                if shared is not None:
                    shared.close()
        if args.only_overlap:
            sizes = []
        per_size = []
        for size in sizes:
            log(f"state of {size:g} MiB")
            # As at engine start: the writer starts while the state is being built, and is
            # waited for before the first save (its start-up is reported, never timed in a save).
            plugin = PinnedStagingPlugin()
            per_size.append(bench_size(size, args.reps, args.rss_saves, root, plugin, args.device, log))
        training: dict[str, Any] = {}
        if not args.only_overlap:
            log("training loop")
            training = bench_training(
                args.train_steps, args.save_every, width, depth, args.train_rounds, root, train_plugin, args.device, log
            )
    finally:
        train_plugin.close()  # idempotent: the training engine closed it already
        shutil.rmtree(root, ignore_errors=True)
    results = {
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "load_average_at_end": os.getloadavg(),
            "args": vars(args),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cuda": torch.cuda.is_available(),
            "checkpoint_dir": str(root.parent),
        },
        "sizes": per_size,
        "training": training,
        "overlap": overlap,
    }
    if per_size:
        print(table(per_size, training))
    print(overlap_table(overlap))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
