"""peers_bench.py's output: medians over rounds, the best peer of every row, tables, JSON, plot."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import statistics
from typing import Any

MIB = 1 << 20
TIMES = ("blocking_s", "loop_added_s", "durable_s", "load_hot_s", "load_cold_s")
RATIOS = ("save_mem_x", "save_mem_total_x", "load_mem_x", "load_mem_total_x", "disk_x")
LABELS = {
    "blocking_s": "save() blocks",
    "loop_added_s": "loop time added",
    "durable_s": "until durable",
    "load_hot_s": "load, hot",
    "load_cold_s": "load, cold",
    "save_mem_x": "save: peak RSS / state",
    "save_mem_total_x": "save: + helpers' USS / state",
    "load_mem_x": "load: peak RSS / state",
    "load_mem_total_x": "load: + helpers' USS / state",
    "disk_x": "disk bytes / state",
}
#: the distribution each peer needs, beyond torch
NEEDS = {"torchtitan": "torchtitan", "torch_checkpointing": "torch_checkpointing", "safetensors": "safetensors"}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for dist in ("torch", "torchtitan", "torch_checkpointing", "safetensors", "ckpt-engine"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def availability() -> dict[str, str | None]:
    """Each method: None if its package is importable here, else why it cannot run."""
    from _peers_methods import PEERS

    out: dict[str, str | None] = {}
    for name, peer in PEERS.items():
        module = NEEDS.get(peer.family)
        missing = module is not None and importlib.util.find_spec(module) is None
        out[name] = f"{module} is not installed: pip install -e '.[peers]'" if missing else None
    return out


def _derived(row: dict[str, Any], state_bytes: int) -> dict[str, float]:
    out: dict[str, float] = {}
    if "save_rss_bytes" in row:
        out["save_mem_x"] = row["save_rss_bytes"] / state_bytes
        out["save_mem_total_x"] = (row["save_rss_bytes"] + row["save_helper_bytes"]) / state_bytes
        out["disk_x"] = row["disk_bytes"] / state_bytes
    if "load_hot_rss_bytes" in row:
        out["load_mem_x"] = row["load_hot_rss_bytes"] / state_bytes
        out["load_mem_total_x"] = (row["load_hot_rss_bytes"] + row["load_hot_helper_bytes"]) / state_bytes
    return out


def _per_round(state: dict[str, Any], name: str, metric: str) -> list[float | None]:
    """The metric of ``name`` in every round (a load shared with another row reads that row)."""
    load_as = state["peers"][name]["load_as"]
    source = load_as if load_as and metric.startswith(("load", "cold")) else name
    out: list[float | None] = []
    for rnd in state["rounds"]:
        row = rnd["rows"].get(source, {})
        value = row.get(metric, _derived(row, state["state_bytes"]).get(metric))
        out.append(value)
    return out


def summarize(state: dict[str, Any]) -> dict[str, Any]:
    """Medians per method, and per row: the best peer, the engine's best mode, their ratio."""
    names = list(state["peers"])
    methods: dict[str, Any] = {}
    for name in names:
        rows = [r["rows"].get(name, {}) for r in state["rounds"]]
        why = next((r.get("skipped") or r.get("error") for r in rows if "skipped" in r or "error" in r), None)
        med: dict[str, Any] = {"family": state["peers"][name]["family"], "load_as": state["peers"][name]["load_as"]}
        if why:
            med["not_run"] = why
        for metric in (*TIMES, *RATIOS, "disk_bytes", "first_blocking_s", "first_durable_s"):
            values = [v for v in _per_round(state, name, metric) if v is not None]
            if values and not why:
                med[metric] = statistics.median(values)
        methods[name] = med
    best: dict[str, Any] = {}
    for metric in (*TIMES, *RATIOS):
        ran = {n: m[metric] for n, m in methods.items() if metric in m}
        peers = {n: v for n, v in ran.items() if methods[n]["family"] != "ours"}
        ours = {n: v for n, v in ran.items() if methods[n]["family"] == "ours"}
        if not peers or not ours:
            continue
        peer, mine = min(peers, key=peers.__getitem__), min(ours, key=ours.__getitem__)
        pairs = zip(_per_round(state, mine, metric), _per_round(state, peer, metric), strict=True)
        ratios = [a / b for a, b in pairs if a is not None and b is not None and b > 0]
        best[metric] = {
            "best_peer": peer,
            "best_peer_value": peers[peer],
            "engine": mine,
            "engine_value": ours[mine],
            "ratio": statistics.median(ratios) if ratios and peers[peer] > 0 else None,
        }
    return {"methods": methods, "best": best}


def _fmt(metric: str, value: float | None) -> str:
    if value is None:
        return "-"
    if metric.endswith("_s"):
        return f"{value * 1e3:.0f} ms" if abs(value) < 1 else f"{value:.2f} s"
    return f"{value:.2f}x"


def method_table(state: dict[str, Any], summary: dict[str, Any]) -> str:
    cols = (
        "blocking_s",
        "loop_added_s",
        "durable_s",
        "load_hot_s",
        "load_cold_s",
        "save_mem_x",
        "save_mem_total_x",
        "load_mem_total_x",
        "disk_x",
    )
    head = "| method | " + " | ".join(LABELS[c] for c in cols) + " |"
    lines = [head, "|---" * (len(cols) + 1) + "|"]
    for name, m in summary["methods"].items():
        if "not_run" in m:
            lines.append(f"| {name} | not run: {m['not_run']} |" + " |" * (len(cols) - 1))
            continue
        cells = []
        for c in cols:
            cell = _fmt(c, m.get(c))
            if m["load_as"] and c.startswith("load"):
                cell += " (shared)"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def best_table(states: list[dict[str, Any]], summaries: list[dict[str, Any]]) -> str:
    head = "| row | " + " | ".join(s["label"] for s in states) + " |"
    lines = [head, "|---" * (len(states) + 1) + "|"]
    for metric in (*TIMES, *RATIOS):
        cells = []
        for s in summaries:
            b = s["best"].get(metric)
            if b is None:
                cells.append("-")
                continue
            ratio = "-" if b["ratio"] is None else f"**{b['ratio']:.2f}x**"
            cells.append(
                f"{b['best_peer']} {_fmt(metric, b['best_peer_value'])}; "
                f"{b['engine']} {_fmt(metric, b['engine_value'])}; {ratio}"
            )
        lines.append(f"| {LABELS[metric]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(states: list[dict[str, Any]], summaries: list[dict[str, Any]], path: str) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[demo]'): no plot"
    fig, axes = plt.subplots(len(states), 1, figsize=(13, 4.6 * len(states)), squeeze=False)
    colors = plt.get_cmap("tab20").colors
    for ax, state, summary in zip(axes[:, 0], states, summaries, strict=True):
        names = list(summary["methods"])
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            m = summary["methods"][name]
            if "not_run" in m:
                continue
            # a row not measured, or at or below zero (loop time within the noise), gets no bar
            bars = [(j + i * width, m[t]) for j, t in enumerate(TIMES) if (m.get(t) or 0.0) > 0]
            style = {"edgecolor": "black", "linewidth": 1.2} if m["family"] == "ours" else {}
            ax.bar([x for x, _ in bars], [y for _, y in bars], width, label=name, color=colors[i], **style)
        ax.set_yscale("log")
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(TIMES))], [LABELS[t] for t in TIMES])
        ax.set_ylabel("seconds (log)")
        ax.set_title(f"{state['label']} ({state['state_bytes'] / MIB:.0f} MiB, {state['tensors']:,} tensors)")
        ax.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.08))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return None


def paired_table(states: list[dict[str, Any]]) -> str:
    """One row per state of ``_peers_paired.paired_loads``' figures."""
    lines = [
        "| state | rounds | engine verified | engine unverified | safetensors | read floor | verified / safetensors "
        "| unverified / safetensors | verified / unverified | read floor / safetensors | verified / read floor |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    keys = (
        "verified_x_safetensors",
        "unverified_x_safetensors",
        "verified_x_unverified",
        "floor_x_safetensors",
        "verified_x_floor",
    )
    for state in states:
        p = state["paired_loads"]
        med = p["median_wall_s"]
        cells = [f"{med[n] * 1000:.0f} ms" for n in ("ours_verified", "ours_unverified", "safetensors", "read_floor")]
        for key in keys:
            w, c = p["ratios"][f"{key}_wall"], p["ratios"][f"{key}_cpu"]
            cells.append(f"**{w['median']:.2f}x** ({w['min']:.2f}-{w['max']:.2f}) / {c['median']:.2f}x")
        lines.append(f"| {state['label']} | {p['rounds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def report(
    states: list[dict[str, Any]],
    machine: dict[str, Any],
    avail: dict[str, str | None],
    out: str | None,
    png: str | None,
) -> dict[str, Any]:
    """Print the tables of a run (and plot them to ``png``); write its JSON to ``out`` (``None``:
    tables again from a recorded run, which keep the versions it recorded and write nothing)."""
    ok = [s for s in states if "rounds" in s]
    summaries = [summarize(s) for s in ok]
    for state, summary in zip(ok, summaries, strict=True):
        print(f"\n### {state['label']} ({state['state_bytes'] / MIB:.1f} MiB, {state['tensors']:,} tensors)\n")
        print(method_table(state, summary))
    if ok:
        print("\n### Best peer against the engine (peer value; engine mode value; engine / peer)\n")
        print(best_table(ok, summaries))
    paired = [s for s in ok if "paired_loads" in s]
    if paired:
        print("\n### Hot loads, paired round by round (median of per-round ratios, range; wall / CPU)\n")
        print(paired_table(paired))
    failed = [s["error"] for s in states if "error" in s]
    for why in failed:
        print(f"\nstate failed: {why}")
    machine.setdefault("versions", versions())
    note = plot(ok, summaries, png) if png and ok else None
    result = {
        "machine": machine,
        "availability": avail,
        "states": [{**s, "summary": m} for s, m in zip(ok, summaries, strict=True)],
        "failed_states": failed,
        "plot": note or png,
    }
    if out is not None:
        with open(out, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(f"\nload average {machine['load_average_start']} at the start, {machine['load_average_end']} at the end")
    return result
