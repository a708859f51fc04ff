"""Many small tensors, cold: a new engine's first save, and a load in a new process.

A job's first save plans its structure from nothing, and every resume runs in a new process:
neither has the plan cache, the remembered ``.metadata`` or the state-dict checks an earlier save
in the same process leaves behind. This benchmark measures exactly those two calls, each in a new
interpreter, with nothing cached on disk from an earlier run (every round saves into a new
folder), against safetensors doing the same in new interpreters:

* ``ours_save``: ``CheckpointEngine({"save_dir": <new folder>})``, then ``save(1, model=model)``
  (timed: the ``save()`` call; the engine's construction, and the imports of
  ``torch.distributed.checkpoint`` and ``torch._dynamo`` that any first use of DCP's state-dict
  functions pays once per process, are reported apart);
* ``ours_load``: ``CheckpointEngine`` on that folder, ``load(model=model)`` into a zeroed model
  (timed: the ``load()`` call), checked against the saved values;
* ``safetensors_save``: ``save_file(model.state_dict(), ...)``, then the file and its folder
  fsynced (what the engine's save guarantees);
* ``safetensors_load``: ``load_file``, then ``model.load_state_dict``.

The state is the peers benchmark's small one: ``count`` parameters of 16 fp32 elements (an
``nn.ParameterList``). Each child also reports its peak RSS growth during the call (``VmHWM``
reset through ``/proc/self/clear_refs`` just before it) and its CPU time (all threads, user and
system: less swayed than wall time by other processes on a shared machine). Rounds are paired: every method once
per round, the order reversed every other round; ratios are medians of the per-round ratios.

    python benchmarks/cold_bench.py                                  # 20,000 and 50,000, 3 rounds
    python benchmarks/cold_bench.py --counts 50000 --rounds 5 --out cold.json
    python benchmarks/cold_bench.py --dir /tmp/cold                  # on disk instead of tmpfs
    python benchmarks/cold_bench.py --smoke                          # 500 tensors, one round

``--smoke`` checks that the benchmark runs and its figures are well formed: 500 tensors, one
round, and the four methods in this one process (one interpreter start instead of four; its
figures are not cold).
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
METHODS = ("ours_save", "ours_load", "safetensors_save", "safetensors_load")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak() -> int:
    """Reset the peak RSS to the current RSS (where the kernel allows it); the RSS now."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    return _status("VmRSS")


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def child(method: str, count: int, folder: str) -> dict[str, Any]:
    """One measurement, in this (new) interpreter."""
    import torch

    sys.path.insert(0, HERE)
    from _peers_measure import SmallModel

    torch.set_num_threads(1)
    model = SmallModel(count)
    if method.endswith("_load"):
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    out: dict[str, Any] = {}
    if method.startswith("ours"):
        t0 = time.perf_counter()
        # Once per process, whatever the state: DCP's state-dict functions import torch._dynamo
        # (about half a second here); reported apart, not in the per-tensor figure.
        import torch._dynamo
        import torch.distributed.checkpoint

        out["imports_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        from ckpt_engine import CheckpointEngine

        engine = CheckpointEngine({"save_dir": folder})
        out["engine_s"] = time.perf_counter() - t0
        base = _reset_peak()
        t0, cpu0 = time.perf_counter(), time.process_time()
        if method == "ours_save":
            engine.save(1, model=model)
        else:
            engine.load(model=model)
        out["seconds"], out["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
        out["peak_bytes"] = _status("VmHWM") - base
        engine.close()
    else:
        from safetensors.torch import load_file, save_file

        path = os.path.join(folder, "model.safetensors")
        base = _reset_peak()
        t0, cpu0 = time.perf_counter(), time.process_time()
        if method == "safetensors_save":
            os.makedirs(folder, exist_ok=True)
            save_file(model.state_dict(), path)
            _fsync(path)
            _fsync(folder)
        else:
            model.load_state_dict(load_file(path))
        out["seconds"], out["cpu_s"] = time.perf_counter() - t0, time.process_time() - cpu0
        out["peak_bytes"] = _status("VmHWM") - base
    if method.endswith("_load"):  # the values came back
        expect = SmallModel(count)
        for i in (0, count // 2, count - 1):
            if not torch.equal(model.p[i].detach(), expect.p[i].detach()):
                raise AssertionError(f"{method}: parameter {i} was not restored")
    return out


def _run_child(method: str, count: int, folder: str, timeout: float) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--child", method, "--counts", str(count), "--dir", folder],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{method} ({count}): exit {proc.returncode}: {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    return result


def _in_process(method: str, count: int, folder: str) -> dict[str, Any]:
    """:func:`child` in this process, after the heap's free pages went back to the system (so
    the call's peak RSS growth is its own, not hidden in pages an earlier call left)."""
    sys.path.insert(0, HERE)
    from _peers_measure import trim

    trim()
    return child(method, count, folder)


def measure(count: int, rounds: int, root: str, timeout: float, in_process: bool = False) -> dict[str, Any]:
    """``rounds`` paired rounds at ``count`` tensors; every save goes to a new folder (each
    method in a new interpreter, or with ``in_process`` in this one: the smoke run)."""
    samples: dict[str, list[dict[str, Any]]] = {m: [] for m in METHODS}
    for r in range(rounds):
        folders = {"ours": tempfile.mkdtemp(prefix="ours-", dir=root), "safetensors": tempfile.mkdtemp(dir=root)}
        os.rmdir(folders["ours"])  # the engine creates its save_dir: nothing is there before
        order = [("ours_save", "safetensors_save"), ("ours_load", "safetensors_load")]
        for saves_or_loads in order:  # a load needs its save first
            pair = saves_or_loads if r % 2 == 0 else saves_or_loads[::-1]
            for method in pair:
                folder = folders[method.split("_")[0]]
                samples[method].append(
                    _in_process(method, count, folder) if in_process else _run_child(method, count, folder, timeout)
                )
        for folder in folders.values():
            shutil.rmtree(folder, ignore_errors=True)

    def med(method: str, key: str) -> float:
        return float(statistics.median(s[key] for s in samples[method]))

    def ratio(a: str, b: str, key: str) -> float:
        return float(statistics.median(x[key] / y[key] for x, y in zip(samples[a], samples[b], strict=True)))

    return {
        "count": count,
        "state_bytes": count * 16 * 4,
        "samples": samples,
        "median_s": {m: med(m, "seconds") for m in METHODS},
        "us_per_tensor": {m: med(m, "seconds") / count * 1e6 for m in METHODS},
        "cpu_us_per_tensor": {m: med(m, "cpu_s") / count * 1e6 for m in METHODS},
        "median_peak_bytes": {m: med(m, "peak_bytes") for m in METHODS},
        "ours_engine_s": {m: med(m, "engine_s") for m in ("ours_save", "ours_load")},
        "ours_imports_s": {m: med(m, "imports_s") for m in ("ours_save", "ours_load")},
        "ratios": {
            "save time / safetensors": ratio("ours_save", "safetensors_save", "seconds"),
            "load time / safetensors": ratio("ours_load", "safetensors_load", "seconds"),
            "save CPU / safetensors": ratio("ours_save", "safetensors_save", "cpu_s"),
            "load CPU / safetensors": ratio("ours_load", "safetensors_load", "cpu_s"),
            "save peak RSS / safetensors": ratio("ours_save", "safetensors_save", "peak_bytes"),
            "load peak RSS / safetensors": ratio("ours_load", "safetensors_load", "peak_bytes"),
        },
    }


def table(results: list[dict[str, Any]]) -> str:
    mib = 1 << 20
    lines = [
        "| tensors | method | median (range) | us / tensor | CPU us / tensor | peak RSS growth |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        for m in METHODS:
            s = [x["seconds"] for x in r["samples"][m]]
            lines.append(
                f"| {r['count']:,} | {m} | {statistics.median(s):.3f} s ({min(s):.3f}-{max(s):.3f}) | "
                f"{r['us_per_tensor'][m]:.0f} | {r['cpu_us_per_tensor'][m]:.0f} | "
                f"{r['median_peak_bytes'][m] / mib:.1f} MiB |"
            )
        ratios = ", ".join(f"{k} {v:.2f}x" for k, v in r["ratios"].items())
        lines.append(f"| {r['count']:,} | ratios | {ratios} | | | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--counts", default="20000,50000", help="tensor counts, comma separated")
    p.add_argument("--rounds", type=int, default=3, help="paired rounds per count")
    p.add_argument("--dir", default="/dev/shm" if os.path.isdir("/dev/shm") else None, help="where the folders go")
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--timeout", type=float, default=900, help="seconds per child")
    p.add_argument("--smoke", action="store_true", help="500 tensors, one round, one process: checks that it runs")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        print("RESULT " + json.dumps(child(args.child, int(args.counts), args.dir)), flush=True)
        return 0
    counts = [500] if args.smoke else [int(c) for c in args.counts.split(",") if c]
    rounds = 1 if args.smoke else args.rounds
    start_load, t0 = os.getloadavg(), time.perf_counter()
    root = tempfile.mkdtemp(prefix="ckpt-cold-", dir=args.dir)
    try:
        results = [measure(c, rounds, root, args.timeout, in_process=args.smoke) for c in counts]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(table(results))
    out = {
        "command": " ".join(["cold_bench.py", *(argv if argv is not None else sys.argv[1:])]),
        "load_average_start": start_load,
        "load_average_end": os.getloadavg(),
        "wall_s": time.perf_counter() - t0,
        "dir": args.dir,
        "results": results,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
