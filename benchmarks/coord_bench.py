"""Save and load phase times at 1, 2, 4 and 8 ranks with a fixed per-rank state: what grows with ranks.

Each world size is launched ``--repeats`` times under ``torch.distributed.run`` (gloo, CPU, this
machine), in alternating order (1, 2, 4, 8, then 8, 4, 2, 1, ...). Every rank holds the same
state whatever the world size (``--tensors`` DTensors sharded on dim 0, ``--kib`` per rank in
all); see ``_coord_worker.py`` for what each rank does and times. Reported per op (cold save:
plans; warm save: the cached plan; load), per phase and world size: rank 0's seconds and the
mean of the other ranks', the part of them spent in collectives (the bounded barrier that waits
for the slowest rank, and the object collective itself), and the exact pickled bytes gathered to
rank 0 and sent from it. Medians over every launch and round.

    nice python benchmarks/coord_bench.py --out coord.json --plot benchmarks/results/performance-coordination.png
    python benchmarks/coord_bench.py --smoke       # 1 and 2 ranks, tiny, one round: checks that it runs
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
from collections import defaultdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
OPS = ("save_cold", "save_warm", "load")
#: With ``--replicated-mib``: loads of a replicated state, ``dedup_reads`` off and on.
REPLICATED_OPS = ("load_replicated_off", "load_replicated_on")
SAVE_PHASES = ("enter", "prepare", "remap_keys", "stage", "plan", "write", "metadata", "commit")
LOAD_PHASES = ("enter", "validate", "read metadata", "plan", "read")


def launch(world: int, spec: dict[str, Any], workdir: str, timeout: float) -> dict[str, Any]:
    """One ``torchrun`` of ``world`` ranks; the worker's JSON document."""
    out = os.path.join(workdir, f"w{world}-{time.monotonic_ns()}.json")
    spec = {**spec, "out": out, "save_dir": os.path.join(workdir, f"ckpt-w{world}")}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd += ["--max-restarts=0", str(HERE / "_coord_worker.py"), json.dumps(spec)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{world} ranks failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
    with open(out, encoding="utf-8") as f:
        doc: dict[str, Any] = json.load(f)
    os.remove(out)
    return doc


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _samples(docs: list[dict[str, Any]], op: str) -> list[list[dict[str, Any]]]:
    """Per timed occurrence of ``op``: its row on every rank, rank-ordered."""
    out = []
    for doc in docs:
        by_rank = sorted(doc["ranks"], key=lambda r: r["rank"])
        ops = [[row for row in r["rows"] if row["op"] == op] for r in by_rank]
        out += [list(rows) for rows in zip(*ops, strict=True)]
    return out


def _split(rows: list[dict[str, Any]], get: Any) -> tuple[float, float]:
    """(rank 0's value, mean of the other ranks' values; rank 0's again with one rank)."""
    values = [get(row) for row in rows]
    return values[0], (statistics.fmean(values[1:]) if len(values) > 1 else values[0])


def summarize(docs: list[dict[str, Any]], op: str) -> dict[str, Any]:
    samples = _samples(docs, op)
    names = list(SAVE_PHASES if op.startswith("save") else LOAD_PHASES)
    for rows in samples:
        names += [n for row in rows for n in row["phases"] if n not in names]
    phases: dict[str, dict[str, float]] = {}
    for name in names:
        cols: dict[str, list[float]] = defaultdict(list)
        for rows in samples:
            for field, get in (
                ("s", lambda r, n=name: r["phases"].get(n, 0.0)),
                ("barrier_s", lambda r, n=name: r["coll"].get(n, {}).get("barrier_s", 0.0)),
                ("transfer_s", lambda r, n=name: r["coll"].get(n, {}).get("transfer_s", 0.0)),
            ):
                r0, others = _split(rows, get)
                cols["rank0_" + field].append(r0)
                cols["others_" + field].append(others)
        phases[name] = {k: _median(v) for k, v in cols.items()}
    totals = [_split(rows, lambda r: r["total_s"]) for rows in samples]
    out: dict[str, Any] = {
        "samples": len(samples),
        "rank0_total_s": _median([t[0] for t in totals]),
        "others_total_s": _median([t[1] for t in totals]),
        "phases": {n: v for n, v in phases.items() if v["rank0_s"] or v["others_s"]},
        "bytes": bytes_of(docs[0], op),
    }
    read = [[row.get("bytes_read") for row in rows] for rows in samples]
    if read and all(v is not None for v in read[0]):
        out["bytes_read_per_rank"] = read[0]  # the same in every sample (what each rank read)
        out["exact"] = all(row.get("exact", True) for rows in samples for row in rows)
    return out


def bytes_of(doc: dict[str, Any], op: str) -> dict[str, dict[str, int]]:
    """Exact pickled bytes per phase of ``op`` in the bytes round: gathered to rank 0 (its own
    part included; an all-gather's parts reach every rank) and sent from rank 0 (per receiver)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"to_rank0": 0, "to_all": 0, "from_rank0": 0})
    for r in doc["ranks"]:
        row = next(row for row in r["bytes_rows"] if row["op"] == op)
        for name, c in row["coll"].items():
            out[name]["to_rank0"] += int(c.get("to_rank0_bytes", 0))
            out[name]["to_all"] += int(c.get("to_all_bytes", 0))
            if r["rank"] == 0:
                out[name]["from_rank0"] += int(c.get("from_rank0_bytes", 0))
    return dict(out)


def run(args: argparse.Namespace) -> dict[str, Any]:
    ranks = [int(x) for x in args.ranks.split(",")]
    spec: dict[str, Any] = {"tensors": args.tensors, "rounds": args.rounds, "warm": args.warm, "loads": args.loads}
    spec["replicated_mib"] = args.replicated_mib
    server = None
    if args.s3:
        from _s3_server import KEY, SECRET, Server

        server = Server()
        server.fs().mkdir("coord-bench")
        spec["rep_url"] = "s3://coord-bench/rep"
        spec["rep_storage"] = {"endpoint_url": server.endpoint, "access_key_id": KEY, "secret_access_key": SECRET}
    root = tempfile.mkdtemp(prefix="coord-bench-", dir=args.workdir)
    docs: dict[int, list[dict[str, Any]]] = defaultdict(list)
    order: list[int] = []
    load_start = os.getloadavg()
    try:
        for rep in range(args.repeats):
            for world in ranks if rep % 2 == 0 else list(reversed(ranks)):
                t = time.perf_counter()
                docs[world].append(launch(world, spec, root, args.timeout))
                order.append(world)
                print(f"  {world} ranks: launch {len(docs[world])} in {time.perf_counter() - t:.1f} s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if server is not None:
            server.close()
    results: dict[str, Any] = {}
    ops = OPS + (REPLICATED_OPS if args.replicated_mib else ())
    for world in ranks:
        d = docs[world]
        exact = all(r["exact"] for doc in d for r in doc["ranks"])
        results[str(world)] = {op: summarize(d, op) for op in ops} | {"bit_exact": exact}
    first = docs[ranks[0]][0]
    return {
        "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": os.getloadavg()},
        "spec": spec | {"bytes_per_rank": first["bytes_per_rank"], "repeats": args.repeats, "order": order},
        "results": results,
    }


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f}" if s >= 0.0995 else f"{s * 1e3:.1f}"


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}" if n < 10240 else f"{n / 1024:.0f}"


def table(doc: dict[str, Any], op: str) -> str:
    """Markdown: per phase, per world size, rank 0 / other ranks' ms (in collectives), bytes."""
    res = doc["results"]
    worlds = list(res)
    names: list[str] = []
    for w in worlds:
        names += [n for n in res[w][op]["phases"] if n not in names]
    head = "| phase | " + " | ".join(f"{w} rank{'s' if w != '1' else ''}" for w in worlds) + " |"
    lines = [head, "|---" * (len(worlds) + 1) + "|"]
    for name in names:
        cells = []
        for w in worlds:
            p = res[w][op]["phases"].get(name)
            if p is None:
                cells.append("-")
                continue
            coll0 = p["rank0_barrier_s"] + p["rank0_transfer_s"]
            collo = p["others_barrier_s"] + p["others_transfer_s"]
            cell = f"{_ms(p['rank0_s'])} ({_ms(coll0)}) / {_ms(p['others_s'])} ({_ms(collo)})"
            b = res[w][op]["bytes"].get(name)
            if b and (b["to_rank0"] or b["to_all"]):
                cell += f"; {_kib(b['to_rank0'] + b['to_all'])} KiB in"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    totals = [f"**{_ms(res[w][op]['rank0_total_s'])}** / {_ms(res[w][op]['others_total_s'])}" for w in worlds]
    lines.append("| total | " + " | ".join(totals) + " |")
    return "\n".join(lines)


def replicated_table(doc: dict[str, Any], op: str) -> str:
    """Markdown: per world size, rank 0's and the others' total ms and the MiB each rank read."""
    lines = ["| ranks | rank 0 ms / others' ms | MiB read from storage, per rank | in total |", "|---|---|---|---|"]
    for w, res in doc["results"].items():
        r = res[op]
        per = r.get("bytes_read_per_rank") or []
        cells = " / ".join(f"{b / 2**20:.1f}" for b in per)
        total = f"{sum(per) / 2**20:.1f}"
        exact = "" if r.get("exact", True) else " (NOT bit-exact)"
        lines.append(f"| {w} | {_ms(r['rank0_total_s'])} / {_ms(r['others_total_s'])}{exact} | {cells} | {total} |")
    return "\n".join(lines)


def _log2_ranks(ax: Any, worlds: list[int]) -> None:
    ax.set_xscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(worlds)
    ax.set_xticklabels([str(w) for w in worlds])


def plot(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = doc["results"]
    worlds = [int(w) for w in res]
    fig, axes = plt.subplots(1, 4, figsize=(18, 4.2))
    for ax, op in zip(axes, OPS, strict=False):
        names: list[str] = []
        for w in res:
            names += [n for n in res[w][op]["phases"] if n not in names]
        for name in names:
            ys = [res[str(w)][op]["phases"].get(name, {}).get("rank0_s", 0.0) * 1e3 for w in worlds]
            if max(ys) >= 0.5:
                ax.plot(worlds, ys, marker="o", label=name)
        ax.plot(worlds, [res[str(w)][op]["rank0_total_s"] * 1e3 for w in worlds], "k--", marker="s", label="total")
        ax.set(title=f"{op}: rank 0, ms per phase", xlabel="ranks")
        _log2_ranks(ax, worlds)
        ax.legend(fontsize=7)
    ax = axes[3]
    several = [w for w in worlds if w > 1]
    for op in OPS:
        ys = [sum(b["to_rank0"] + b["to_all"] for b in res[str(w)][op]["bytes"].values()) / 1024 for w in several]
        ax.plot(several, ys, marker="o", label=op)
    ax.set(title="KiB gathered to rank 0 per op (exact)", xlabel="ranks", yscale="log")
    _log2_ranks(ax, several)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="1,2,4,8")
    ap.add_argument("--tensors", type=int, default=192, help="DTensors per rank (fixed per-rank state)")
    ap.add_argument("--repeats", type=int, default=3, help="launches per world size (alternating order)")
    ap.add_argument("--rounds", type=int, default=2, help="engines per launch (a cold save each)")
    ap.add_argument("--warm", type=int, default=2, help="saves of the unchanged structure per round")
    ap.add_argument("--loads", type=int, default=2, help="loads per round")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per launch")
    ap.add_argument("--workdir", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    ap.add_argument("--out", help="JSON results")
    ap.add_argument("--plot", help="PNG (needs matplotlib)")
    ap.add_argument(
        "--replicated-mib", type=int, default=0, help="also load a replicated state of this size, dedup_reads off/on"
    )
    ap.add_argument("--s3", action="store_true", help="the replicated state on a loopback S3 server (moto)")
    ap.add_argument("--smoke", action="store_true", help="1 and 2 ranks, 8 tensors, one of everything")
    ap.add_argument("--from-json", help="print the tables (and --plot) of an earlier --out file; run nothing")
    args = ap.parse_args()
    if args.smoke:
        args.ranks, args.tensors, args.repeats, args.rounds, args.warm, args.loads = "1,2", 8, 1, 1, 1, 1
    doc = json.loads(Path(args.from_json).read_text()) if args.from_json else run(args)
    s = doc["spec"]
    print(f"\n{s['tensors']} tensors, {s['bytes_per_rank'] / 2**20:.2f} MiB per rank; load {doc['machine']}")
    print("cells: rank 0 ms (of which in collectives) / other ranks' mean ms (in collectives); KiB in: to rank 0")
    for op in OPS:
        print(f"\n{op}\n{table(doc, op)}")
    for op in REPLICATED_OPS:
        if op in next(iter(doc["results"].values())):
            print(f"\n{op}\n{replicated_table(doc, op)}")
    if args.out and not args.from_json:
        Path(args.out).write_text(json.dumps(doc, indent=1))
    if args.plot:
        plot(doc, args.plot)


if __name__ == "__main__":
    main()
