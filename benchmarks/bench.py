"""ckpt-engine benchmark suite: ours against the baselines and the machine's limits, in one run.

    python benchmarks/bench.py                      # 256 MiB and 1 GiB, repo disk and /dev/shm
    python benchmarks/bench.py --big                # adds 4 GiB
    python benchmarks/bench.py --sizes 256 --dirs shm --methods dcp_load,ours_load --reps 5
    python benchmarks/bench.py --smoke              # tiny and untimed-in-spirit: checks it runs

Every measurement runs in a fresh child process (``--child``) that builds the state, prepares
(untimed: writes the checkpoint a load reads, allocates destinations), then times ``--reps``
repetitions. Peak extra memory is the child's peak RSS during a repetition minus its RSS just
before it: the peak is reset per repetition through ``/proc/self/clear_refs`` (value 5), and
read from ``VmHWM`` (where that is refused, a thread samples RSS every millisecond instead; the
JSON says which). Page cache is not RSS, so a save's peak is its own buffers.

Output: a table on stdout, ``--out`` JSON (default ``benchmarks/results.json``), and ``--plot``
PNG (throughput vs size per method) where matplotlib is installed. See docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

MIB = 1 << 20
SMOKE_EXCLUDED = ("dcp_async_process", "ours_async")  # each starts a process: slow for a smoke run


# -- memory ------------------------------------------------------------------------------------


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value, _unit = line.split()
                out[key.rstrip(":")] = int(value) * 1024
    return out


class PeakRss:
    """Peak RSS growth over one repetition: ``clear_refs`` + ``VmHWM``, else a sampling thread."""

    def __init__(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.mode = "clear_refs+VmHWM"
        except OSError:
            self.mode = "sampling thread (1 ms)"
        self._stop = threading.Event()
        self._peak = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.base = _status()["VmRSS"]
        if self.mode.startswith("clear_refs"):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        else:
            self._peak = self.base
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def _sample(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self._stop.wait(0.001):
            with open("/proc/self/statm") as f:
                self._peak = max(self._peak, int(f.read().split()[1]) * page)

    def stop(self) -> int:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            peak = self._peak
        else:
            peak = _status()["VmHWM"]
        return max(0, peak - self.base)


# -- the child ---------------------------------------------------------------------------------


def run_child(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from _bench_methods import METHODS, Ctx, Skip
    from _bench_state import make_tensors, nbytes, small_shapes, transformer_shapes

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    shapes = small_shapes(spec["count"]) if spec["kind"] == "small" else transformer_shapes(spec["bytes"])
    state = make_tensors(shapes)
    workdir = spec["workdir"]
    os.makedirs(workdir, exist_ok=True)
    ctx = Ctx(
        shapes=shapes,
        state=state,
        nbytes=nbytes(state),
        workdir=workdir,
        dir_kind=spec["dir"],
        threads=spec["threads"],
    )
    rss = PeakRss()
    results: dict[str, Any] = {"nbytes": ctx.nbytes, "tensors": len(state), "rss_mode": rss.mode, "methods": {}}
    for name in spec["methods"]:
        method = METHODS[name]()
        row: dict[str, Any] = {"group": method.group, "op": method.op, "reference": method.reference}
        ctx.scratch = {}
        try:
            method.prepare(ctx)
            for rep in range(-spec.get("warmup", 0), 0):  # untimed: imports, first-call costs
                method.before_rep(ctx, rep)
                method.run(ctx, rep)
                method.after_rep(ctx, rep)
            reps: list[dict[str, float]] = []
            peaks: list[int] = []
            for rep in range(spec["reps"]):
                method.before_rep(ctx, rep)
                rss.start()
                reps.append(method.run(ctx, rep))
                peaks.append(rss.stop())
                method.after_rep(ctx, rep)
            row["reps"] = reps
            row["peak_extra_bytes"] = max(peaks)
            row["extra"] = {k: v for k, v in ctx.scratch.items() if isinstance(v, (int, float, str, list))}
        except Skip as why:
            row["skipped"] = str(why)
        except Exception as err:
            row["error"] = f"{type(err).__name__}: {err}"
            row["traceback"] = traceback.format_exc(limit=8)
        finally:
            try:
                method.close(ctx)
            except Exception as err:
                row.setdefault("error", f"close: {type(err).__name__}: {err}")
            ctx.scratch = {}
        results["methods"][name] = row
    shutil.rmtree(workdir, ignore_errors=True)
    return results


# -- the parent --------------------------------------------------------------------------------


def _child(spec: dict[str, Any], timeout: float, inproc: bool = False) -> dict[str, Any]:
    if inproc:  # --smoke: no fresh interpreter per group (faster; memory figures less clean)
        try:
            return run_child(spec)
        except Exception as err:
            return {"error": f"{type(err).__name__}: {err}"}
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    return _run_for_result(cmd, env, timeout, "child")


def _run_for_result(cmd: list[str], env: dict[str, str], timeout: float, what: str) -> dict[str, Any]:
    """Run a measurement process; its last ``RESULT <json>`` line, or an ``error`` record."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            result: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return result
    return {"error": f"{what} exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-2000:]}"}


def _dist(spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        os.path.join(HERE, "_bench_dist.py"),
        json.dumps(spec),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return _run_for_result(cmd, env, timeout, "torchrun")


def _dir_root(kind: str, args: argparse.Namespace) -> str:
    if kind == "shm":
        return "/dev/shm"
    return args.workdir or os.path.join(HERE, ".work")


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def build_rows(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (method, metric, dir, size) with medians, ratios to limits and to plain DCP."""
    rows: list[dict[str, Any]] = []
    for run in runs:
        result = run["result"]
        for name, m in (result.get("methods") or {}).items():
            base = {
                "kind": run["kind"],
                "dir": run["dir"],
                "size_mib": run.get("size_mib"),
                "count": run.get("count"),
                "nbytes": result.get("nbytes"),
                "method": name,
                "group": m.get("group"),
                "op": m.get("op"),
                "reference": m.get("reference"),
            }
            if "reps" not in m:
                rows.append({**base, "metric": "time", "note": m.get("skipped") or m.get("error")})
                continue
            metrics = ["blocking", "total"] if m["op"] == "async" else ["time"]
            for metric in metrics:
                values = [r[metric] for r in m["reps"]]
                row = {**base, "metric": metric, **_summary(values), "reps": values}
                row["gbps"] = result["nbytes"] / row["median"] / 1e9 if row["median"] > 0 else None
                row["peak_extra_bytes"] = m.get("peak_extra_bytes")
                row["peak_extra_x_state"] = m.get("peak_extra_bytes", 0) / max(1, result["nbytes"])
                if run["kind"] == "small":
                    row["us_per_tensor"] = row["median"] / max(1, result.get("tensors", 1)) * 1e6
                if m.get("extra"):
                    row["extra"] = m["extra"]
                rows.append(row)
        if run["kind"] == "error":
            rows.append({"kind": "error", "dir": run["dir"], "method": "?", "note": result.get("error")})
    # ratios within one (kind, dir, size/count)
    index = {(r["kind"], r["dir"], r.get("size_mib"), r.get("count"), r["method"], r["metric"]): r for r in rows}
    for r in rows:
        if "median" not in r:
            continue
        key = (r["kind"], r["dir"], r.get("size_mib"), r.get("count"))
        ref = index.get((*key, r.get("reference") or "", "time"))
        if ref is not None and ref.get("median") and r["reference"] != r["method"]:
            r["x_limit"] = r["median"] / ref["median"]
        dcp_name = {"save": "dcp_save", "load": "dcp_load_cold" if r["method"].endswith("_cold") else "dcp_load"}.get(
            r["op"] or ""
        )
        if r["kind"] == "small":
            dcp_name = "small_dcp_save" if r["op"] == "save" else "small_dcp_load"
        dcp_row = index.get((*key, dcp_name or "", "time"))
        if dcp_row is not None and dcp_row.get("median") and r["method"] != dcp_name and r["group"] != "limit":
            r["speedup_vs_dcp"] = dcp_row["median"] / r["median"]
    return rows


def _fmt_size(r: dict[str, Any]) -> str:
    if r["kind"] == "small":
        return f"{r['count']} t"
    return f"{r['size_mib']} MiB"


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'dir':<5} {'size':>9} {'method':<26} {'metric':<8} {'median s':>9} {'min-max s':>15} "
        f"{'GB/s':>6} {'x limit':>8} {'vs dcp':>7} {'peak extra':>10}  note"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.get("kind") == "error":
            lines.append(f"{r['dir']:<5} error: {r.get('note')}")
            continue
        if "median" not in r:
            blank = f"{'-':<8} {'':>9} {'':>15} {'':>6}"
            lines.append(f"{r['dir']:<5} {_fmt_size(r):>9} {r['method']:<26} {blank}  {r['note']}")
            continue
        extra = ""
        if r["kind"] == "small":
            extra = f"{r['us_per_tensor']:.0f} us/tensor, peak +{r['peak_extra_bytes'] / 2**20:.0f} MiB"
            plans = (r.get("extra") or {}).get("plans")
            if plans:
                extra += f"; DCP global plans per save: {[p['global'] for p in plans]}"
        ms = f"{r['min']:.3f}-{r['max']:.3f}"
        x_limit = f"{r['x_limit']:.2f}x" if "x_limit" in r else ""
        vs = f"{r['speedup_vs_dcp']:.2f}x" if "speedup_vs_dcp" in r else ""
        gbps = f"{r['gbps']:.2f}" if r.get("gbps") and r["kind"] != "small" else ""
        peak = f"{r['peak_extra_x_state']:.3f}x" if r.get("peak_extra_bytes") is not None else ""
        lines.append(
            f"{r['dir']:<5} {_fmt_size(r):>9} {r['method']:<26} {r['metric']:<8} {r['median']:>9.3f} {ms:>15} "
            f"{gbps:>6} {x_limit:>8} {vs:>7} {peak:>10}  {extra}"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    # safetensors_load only maps the file (its row is not a read): left out of the plot
    big = [r for r in rows if r.get("kind") == "big" and r.get("gbps") and r["method"] != "safetensors_load"]
    dirs = sorted({r["dir"] for r in big})
    if not big:
        return "nothing to plot"
    fig, axes = plt.subplots(len(dirs), 2, figsize=(13, 4.2 * len(dirs)), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for i, d in enumerate(dirs):
        for j, op in enumerate(("save", "load")):
            ax = axes[i][j]
            ops = {"save": ("save", "copy", "async"), "load": ("load",)}[op]
            series: dict[str, list[tuple[int, float]]] = {}
            for r in big:
                if r["dir"] == d and r["op"] in ops:
                    label = r["method"] + ("" if r["metric"] == "time" else f" ({r['metric']})")
                    series.setdefault(label, []).append((r["size_mib"], r["gbps"]))
            for n, (label, pts) in enumerate(sorted(series.items())):
                pts.sort()
                limit = label.startswith(("raw", "memcpy"))
                style = "--" if limit else ("-" if label.startswith("ours") else ":")
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    style,
                    marker="o",
                    color="black" if limit and "cold" not in label else colors[n % len(colors)],
                    linewidth=2.2 if label.startswith("ours") else 1.2,
                    label=label,
                )
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("state size (MiB)")
            ax.set_ylabel("GB/s (median)")
            ax.set_title(f"{op} on {d} (solid: ours, dashed: limits, dotted: baselines)", fontsize=9)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
    return None


def machine_info() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "loadavg": os.getloadavg(),
    }
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kib"] = int(f.readline().split()[1])
    except OSError:
        pass
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="256,1024", help="state sizes in MiB (comma separated)")
    p.add_argument("--big", action="store_true", help="add a 4 GiB state")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement (>= 3 for the docs)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions before the timed ones")
    p.add_argument("--dirs", default="repo,shm", help="repo (the repository's disk) and/or shm (/dev/shm tmpfs)")
    p.add_argument("--workdir", default=None, help="folder for the 'repo' dir (default benchmarks/.work)")
    p.add_argument("--methods", default=None, help="only these methods (comma separated); see --list")
    p.add_argument("--small", default="10000,50000", help="tensor counts for the planning-cost rows ('' to skip)")
    p.add_argument("--no-dist", action="store_true", help="skip the 2-rank torchrun rows")
    p.add_argument(
        "--dist",
        action="store_true",
        help="with --smoke of every method: the 2-rank rows too (one run covers every row kind)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the 'tuned' DCP thread count")
    p.add_argument("--out", default=os.path.join(HERE, "results.json"), help="JSON results")
    p.add_argument("--plot", default=None, help="PNG plot of throughput vs size (needs matplotlib)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per child")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 rep, one child per size: checks it runs")
    p.add_argument("--list", action="store_true", help="list the methods and exit")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.child is not None:
        print("RESULT " + json.dumps(run_child(json.loads(args.child))), flush=True)
        return 0

    from _bench_methods import BIG_METHODS, METHODS, SMALL_METHODS

    if args.list:
        for name, cls in METHODS.items():
            print(f"{name:<24} {cls.group:<9} {cls.op:<6} {(cls.__doc__ or '').strip().splitlines()[0:1]}")
        return 0

    sizes = [int(s) for s in args.sizes.split(",") if s] + ([4096] if args.big else [])
    small = [int(s) for s in args.small.split(",") if s]
    small_given = any(a.startswith("--small") for a in (argv if argv is not None else sys.argv[1:]))
    reps = args.reps
    wanted = set(args.methods.split(",")) if args.methods else None
    group_children = False
    if args.smoke:
        sizes, reps, group_children = [2], 1, True
        small = small if small_given else [100, 300]
        args.warmup = 0
        args.no_dist = args.no_dist or (wanted is None and not args.dist)
    dirs = [d for d in args.dirs.split(",") if d]
    for d in dirs:
        if d not in ("repo", "shm"):
            p.error(f"--dirs: unknown dir {d!r} (repo or shm)")

    def chosen(names: list[str], dir_kind: str) -> list[str]:
        out = [n for n in names if wanted is None or n in wanted]
        if args.smoke and wanted is None:
            out = [n for n in out if n not in SMOKE_EXCLUDED]
        if dir_kind == "shm":
            out = [n for n in out if not METHODS[n].cold]  # tmpfs pages are the files: no cold read
        return out

    runs: list[dict[str, Any]] = []
    started = time.time()
    info = machine_info()
    print(f"# machine: {info['cpus']} CPUs, torch {info['torch']}, load average {info['loadavg']}", flush=True)

    def record(kind: str, dir_kind: str, spec: dict[str, Any], result: dict[str, Any], **extra: Any) -> None:
        if "error" in result and "methods" not in result:
            print(f"  ! {result['error'][:500]}", flush=True)
            runs.append({"kind": "error", "dir": dir_kind, "result": result, **extra})
        else:
            runs.append({"kind": kind, "dir": dir_kind, "result": result, **extra})

    for dir_kind in dirs:
        root = _dir_root(dir_kind, args)
        os.makedirs(root, exist_ok=True)
        for size in sizes:
            names = chosen(BIG_METHODS, dir_kind)
            batches = [names] if group_children else [[n] for n in names]
            for batch in batches:
                if not batch:
                    continue
                workdir = tempfile.mkdtemp(prefix="ckpt-bench-", dir=root)
                spec = {
                    "kind": "big",
                    "bytes": size * MIB,
                    "dir": dir_kind,
                    "workdir": workdir,
                    "methods": batch,
                    "reps": reps,
                    "warmup": args.warmup,
                    "threads": args.threads,
                }
                print(f"# {dir_kind} {size} MiB: {', '.join(batch)} (load {os.getloadavg()[0]:.2f})", flush=True)
                result = _child(spec, args.timeout, inproc=args.smoke)
                shutil.rmtree(workdir, ignore_errors=True)
                record("big", dir_kind, spec, result, size_mib=size)
    small_dir = "shm" if "shm" in dirs else dirs[0]
    for count in small:
        names = chosen(SMALL_METHODS, small_dir)
        batches = [names] if group_children else [[n] for n in names]
        for batch in batches:
            if not batch:
                continue
            workdir = tempfile.mkdtemp(prefix="ckpt-bench-", dir=_dir_root(small_dir, args))
            spec = {
                "kind": "small",
                "count": count,
                "dir": small_dir,
                "workdir": workdir,
                "methods": batch,
                "reps": reps,
                "warmup": args.warmup,
                "threads": args.threads,
            }
            print(f"# {small_dir} {count} tensors: {', '.join(batch)} (load {os.getloadavg()[0]:.2f})", flush=True)
            result = _child(spec, args.timeout, inproc=args.smoke)
            shutil.rmtree(workdir, ignore_errors=True)
            record("small", small_dir, spec, result, count=count)

    dist_rows: list[dict[str, Any]] = []
    if not args.no_dist:
        dist_dir = dirs[0]
        for size in sizes:
            workdir = tempfile.mkdtemp(prefix="ckpt-bench-dist-", dir=_dir_root(dist_dir, args))
            spec = {"bytes": size * MIB, "workdir": os.path.join(workdir, "ckpt"), "reps": reps}
            print(f"# {dist_dir} {size} MiB: 2-rank torchrun save + resharded load", flush=True)
            result = _dist(spec, args.timeout)
            shutil.rmtree(workdir, ignore_errors=True)
            if "error" in result:
                print(f"  ! {result['error'][:500]}", flush=True)
                dist_rows.append({"dir": dist_dir, "size_mib": size, "error": result["error"]})
                continue
            for metric in ("save", "load"):
                values = result[metric]
                s = _summary(values)
                dist_rows.append(
                    {
                        "kind": "big",
                        "dir": dist_dir,
                        "size_mib": size,
                        "count": None,
                        "nbytes": result["nbytes"],
                        "method": f"ours_2rank_{'save' if metric == 'save' else 'load_resharded'}",
                        "group": "ours",
                        "op": metric,
                        "reference": "",
                        "metric": "time",
                        **s,
                        "reps": values,
                        "gbps": result["nbytes"] / s["median"] / 1e9,
                        "bit_exact": result.get("bit_exact"),
                    }
                )

    rows = build_rows(runs) + [r for r in dist_rows if "median" in r]
    print()
    print(table(rows))
    for r in dist_rows:
        if "error" in r:
            print(f"2-rank torchrun at {r['size_mib']} MiB failed: {r['error'][:300]}")
    info["loadavg_end"] = os.getloadavg()
    info["seconds"] = time.time() - started
    out = {
        "machine": info,
        "args": {k: v for k, v in vars(args).items() if k != "child"},
        "rss_mode": next((r["result"].get("rss_mode") for r in runs if "rss_mode" in r["result"]), None),
        "cold_reads": "drop_caches" if any(r.get("method", "").endswith("_cold") for r in rows) else "not measured",
        "rows": rows,
        "dist_errors": [r for r in dist_rows if "error" in r],
    }
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"\n# wrote {args.out}")
    if args.plot:
        why = plot(rows, args.plot)
        print(f"# plot: {why or args.plot}")
    print(f"# load average at the end: {info['loadavg_end']}; {info['seconds']:.0f}s")
    failed = [r for r in rows if r.get("note") and "Error" in str(r.get("note"))]
    return 1 if failed and args.smoke else 0


if __name__ == "__main__":
    sys.exit(main())
