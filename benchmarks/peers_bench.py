"""ckpt-engine against the checkpointers a team would pick instead, side by side in one run.

    python benchmarks/peers_bench.py --out benchmarks/results/performance-peers-results.json \
        --plot benchmarks/results/performance-peers.png
    python benchmarks/peers_bench.py --states 256 --rounds 2 --methods ours_sync,dcp,safetensors
    python benchmarks/peers_bench.py --list            # every method, and whether it can run here
    python benchmarks/peers_bench.py --smoke           # tiny, one round: checks that it runs (CI)
    python benchmarks/peers_bench.py --ranks 2 --states 256,small10000   # FSDP2 over 2 gloo ranks
    python benchmarks/peers_bench.py --states 256,lm256 --methods ours_sync,safetensors --paired 11
        # the engine's hot load verified and unverified against safetensors, paired round by
        # round (benchmarks/_peers_paired.py); lm256: a small LM (201 parameters) with AdamW;
        # emb1024: 1 GiB whose three largest tensors (an embedding table and its moments) are each a third
    python benchmarks/peers_bench.py --full --out benchmarks/results/performance-peers-results.json \
        --plot benchmarks/results/performance-peers.png
        # the whole table: one rank (256 MiB, 1 GiB, 50,000 tensors), then two ranks (256 MiB,
        # 10,000 tensors) into benchmarks/results/performance-peers-2rank-results.json and -2rank.png

Methods (benchmarks/_peers_methods.py): the engine (sync; ``pinned_staging``; ``pinned_staging``
with ``overlap``), ``dcp.save``/``dcp.load``, ``dcp.async_save`` (thread executor; PROCESS
executor with a reused ``DefaultStager``), torchtitan's ``CheckpointManager`` in its three
``async_mode``s, torch_checkpointing's ``CheckpointManager``, safetensors ``save_file``/``load_file``.
Peers are optional (``pip install -e '.[peers]'``); one that is missing or fails is a row with
its reason.

Each state runs in a fresh child process (one world_size=1 gloo process group, as under
``torchrun``; one intra-op thread). With ``--ranks N`` the child is N ``torchrun`` ranks over
gloo, every layer sharded with FSDP2 (``fully_shard``); the ranks run the same steps (they agree
on each one) and each figure is the slowest rank's. The methods that save one process's files
(safetensors, torch_checkpointing) are rows with that reason; DCP's asynchronous paths get a
gloo group of their own, as DCP's documentation asks. A round runs every method in turn (the order reversed every
other round) between two loops without saves (their memory peak is the loop's own). Per method:
an untimed first save where the method keeps buffers or helper processes between saves, a loop
without saves (the step time), then one save inside the training loop (blocking time, loop time
added, time until durable, peak memory, disk bytes), then a hot and a cold load into the live
model and optimizer (each load is checked against a copy taken when the save started).
_peers_measure.py says how each figure is taken.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import time
import traceback
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

MIB = 1 << 20
METRICS = ("blocking_s", "loop_added_s", "durable_s", "load_hot_s", "load_cold_s")
MEMORY = ("save_mem_x", "save_mem_total_x", "load_mem_x", "load_mem_total_x", "disk_x")


# -- the child ---------------------------------------------------------------------------------


def _init_process_group() -> None:
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)


def _warm(peer: Any, w: Any, loss: Any, step: int) -> dict[str, float]:
    """The untimed first save (its figures are kept: allocation and helper start-up live here)."""
    from _peers_measure import Waiter, train_step

    train_step(w, loss, peer)
    t0 = time.perf_counter()
    pending = peer.save(step)
    blocking = time.perf_counter() - t0
    waiter = Waiter(pending, peer.paths(step), t0)
    waiter.run()
    if waiter.error is not None:
        raise waiter.error
    with peer.guard():
        pass
    return {"first_blocking_s": blocking, "first_durable_s": waiter.durable_s}


def _load_rows(peer: Any, w: Any, step: int, saved: list[Any], cold: bool, meter: Any, helpers: Any) -> dict[str, Any]:
    from _peers_measure import drop_page_cache, matches, trim

    out: dict[str, Any] = {}
    for kind in ("hot", "cold") if cold else ("hot",):
        if kind == "cold":
            out["cold_resident_after_drop"] = drop_page_cache(peer.paths(step))
        trim()
        meter.start(helpers)
        t0 = time.perf_counter()
        peer.load(step)
        out[f"load_{kind}_s"] = time.perf_counter() - t0
        grown, helper = meter.stop()
        out[f"load_{kind}_rss_bytes"], out[f"load_{kind}_helper_bytes"] = grown, helper
        if not matches(w, saved):
            raise RuntimeError(f"{peer.name}: the {kind} load did not bring back the saved values")
    return out


#: the smoke run's checkpointers kept open from one state to the next (``Peer.reusable``: those
#: not bound to one state's folder), so a helper process starts once per run, not once per state
_KEPT: dict[str, Any] = {}


def measure(name: str, w: Any, loss: Any, spec: dict[str, Any], step: int, base: dict[str, Any]) -> dict[str, Any]:
    """One method, one round: set up, (warm), the save in the loop, the loads, close."""
    from _bench_methods import Skip
    from _peers_measure import Meter, descendants, disk_bytes, loop, rss_now, trim, world_size
    from _peers_methods import PEERS

    peer = _KEPT.pop(name, None) or PEERS[name]()
    if world_size() > 1 and peer.one_process_only:
        raise Skip(f"{world_size()} ranks: {peer.one_process_only}")
    trim()
    rss0, before = rss_now(), descendants()
    row: dict[str, Any] = {}
    meter = Meter()

    def helpers() -> set[int]:
        return {p for p in descendants() if p not in before or peer.uses_dcp_daemon}

    peer.setup(w)
    try:
        if peer.warm:
            row.update(_warm(peer, w, loss, step - 1))
        # the loop without a save right before this one's: the step time it is compared with
        row["step_s"] = loop(w, loss, spec["steps"])["loop_s"] / spec["steps"]
        rss1 = rss_now()
        meter.start(helpers)
        res = loop(w, loss, spec["steps"], peer, step, max_s=spec["max_loop_s"])
        grown, helper = meter.stop()
        row["blocking_s"], row["durable_s"], row["done_s"] = res["blocking_s"], res["durable_s"], res["done_s"]
        row["loop_steps"] = res["steps"]
        row["loop_added_s"] = res["loop_s"] - res["steps"] * row["step_s"]
        row["save_rss_bytes"] = rss1 - rss0 + grown - base["loop_rss_bytes"]
        row["save_helper_bytes"] = helper
        row["disk_bytes"], row["files"] = disk_bytes(peer.paths(step))
        if not peer.load_as:
            row.update(_load_rows(peer, w, step, res["saved"], spec["cold"], meter, helpers))
    finally:
        if spec.get("smoke") and peer.reusable:
            _KEPT[name] = peer  # closed by the next state's run of it, or at the end of the child
        else:
            peer.close()
        _barrier()  # no rank removes files another still reads
        if _rank() == 0:
            shutil.rmtree(os.path.join(w.root, name), ignore_errors=True)
        _barrier()
    return row


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _slowest_rank(outs: list[dict[str, Any]]) -> dict[str, Any]:
    """One state's result from every rank's: each figure the largest over the ranks (a job
    waits for its slowest rank; memory and disk bytes per rank), the rest rank 0's."""
    merged = outs[0]
    for r, rnd in enumerate(merged["rounds"]):
        for name, row in rnd["rows"].items():
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "files":
                    row[key] = max(o["rounds"][r]["rows"][name].get(key, value) for o in outs)
    merged["ranks"] = len(outs)
    merged["state_bytes_per_rank"] = [o["state_bytes"] for o in outs]
    return merged


def _baseline(w: Any, loss: Any, steps: int) -> dict[str, Any]:
    from _peers_measure import Meter, loop, trim

    trim()
    meter = Meter()
    meter.start(set)
    res = loop(w, loss, steps)
    grown, _ = meter.stop()
    return {"step_s": res["loop_s"] / steps, "loop_rss_bytes": grown}


def run_state(spec: dict[str, Any]) -> dict[str, Any]:
    from _peers_measure import build, state_tensors
    from _peers_methods import PEERS

    w, loss, label = build(spec["kind"], spec["size"], spec["batch"])
    w.root = os.path.join(spec["workdir"], f"{spec['kind']}-{spec['size']}")
    os.makedirs(w.root, exist_ok=True)
    for _ in range(2):  # optimizer state exists before anything saves; first-call costs paid
        loss().backward()
        w.optim.step()
        w.optim.zero_grad()
    tensors = state_tensors(w)
    import ckpt_engine

    out: dict[str, Any] = {
        "engine_source": os.path.dirname(os.path.abspath(ckpt_engine.__file__)),
        "label": label,
        "kind": spec["kind"],
        "size": spec["size"],
        "state_bytes": sum(t.nbytes for t in tensors),
        "tensors": len(tensors),
        "rounds": [],
        "errors": {},
    }
    step = 10
    for r in range(spec["rounds"]):
        order = spec["methods"] if r % 2 == 0 else spec["methods"][::-1]
        first = _baseline(w, loss, spec["steps"])
        rows: dict[str, Any] = {}
        for name in order:
            step += 10
            try:
                rows[name] = measure(name, w, loss, spec, step, first)
            except Exception as err:
                from _bench_methods import Skip

                if isinstance(err, Skip):
                    rows[name] = {"skipped": str(err)}
                else:
                    rows[name] = {"error": f"{type(err).__name__}: {err}"}
                    out["errors"][name] = traceback.format_exc(limit=6)
            log(f"  {label}, round {r + 1}, {name}: {_brief(rows[name])}")
        last = _baseline(w, loss, spec["steps"])
        base = {k: (first[k] + last[k]) / 2 for k in first}
        out["rounds"].append({"order": order, "baseline": base, "baselines": [first, last], "rows": rows})
    out["peers"] = {n: {"family": PEERS[n].family, "load_as": PEERS[n].load_as} for n in spec["methods"]}
    if spec.get("paired") and _rank() == 0 and int(os.environ.get("WORLD_SIZE", "1")) == 1:
        from _peers_paired import paired_loads

        out["paired_loads"] = paired_loads(w, spec["paired"])
        log(f"  {label}, paired hot loads: {_paired_brief(out['paired_loads'])}")
    import torch.distributed as dist

    if dist.get_world_size() > 1:
        outs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(outs, out)
        out = _slowest_rank(outs)
        out["state_bytes"] = sum(out["state_bytes_per_rank"])
    return out


def _brief(row: dict[str, Any]) -> str:
    if "skipped" in row or "error" in row:
        return str(row.get("skipped") or row.get("error"))
    keys = [k for k in METRICS if k in row]
    return ", ".join(f"{k[:-2]} {row[k]:.3f} s" for k in keys)


def _paired_brief(paired: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v['median']:.2f}" for k, v in paired["ratios"].items() if k.endswith("_wall"))


def log(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 speaks for all
        print(msg, file=sys.stderr, flush=True)


def child_main(specs: list[dict[str, Any]]) -> None:
    import warnings

    import torch

    warnings.filterwarnings("ignore")
    torch.set_num_threads(specs[0]["threads"])
    if specs[0].get("smoke"):
        import _peers_measure

        _peers_measure.FREEZE_AFTER_TRIM = True
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # started by torchrun
        import torch.distributed as dist

        dist.init_process_group("gloo")
    else:
        _init_process_group()
    results = [run_state(spec) for spec in specs]
    for peer in _KEPT.values():
        peer.close()
    if _rank() == 0:
        print("RESULT " + json.dumps(results), flush=True)
    sys.stderr.flush()
    os._exit(0)  # DCP's PROCESS daemon and gloo: no clean interpreter exit (dcp-notes section 4)


# -- the parent --------------------------------------------------------------------------------


def _specs(args: argparse.Namespace) -> list[dict[str, Any]]:
    from _peers_measure import parse_state
    from _peers_methods import PEERS

    methods = list(PEERS) if args.methods == "all" else [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in PEERS]
    if unknown:
        raise SystemExit(f"unknown method(s) {unknown}; --list shows them")
    states = [s.strip() for s in args.states.split(",") if s.strip()]
    rounds = [int(r) for r in str(args.rounds).split(",")]
    rounds += [rounds[-1]] * (len(states) - len(rounds))
    specs = []
    for state, n in zip(states, rounds, strict=False):
        kind, size = parse_state(state, args.small_count)
        specs.append(
            {
                "kind": kind,
                "size": size,
                "paired": args.paired,
                "rounds": n,
                "methods": methods,
                "steps": args.steps,
                "batch": args.batch,
                "threads": args.threads,
                "cold": kind != "small" or args.small_cold,
                "max_loop_s": args.max_loop_s,
                "ranks": args.ranks,
                "workdir": os.path.abspath(args.workdir),
                "smoke": args.smoke,
            }
        )
    return specs


def _run_child(specs: list[dict[str, Any]], timeout: float) -> list[dict[str, Any]]:
    """One child process; its stderr (the progress lines) passes through."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
    # A fixed mmap threshold: freed tensors go back to the system, so one method's leftovers
    # neither pad nor hide the next one's memory.
    env.update(MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=str(specs[0]["threads"]))
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(specs)]
    ranks = specs[0]["ranks"]
    if ranks > 1:
        cmd[1:1] = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    try:
        # cwd: the work folder, so that no process (the engine's writer runs ``python -m``) imports
        # the engine from the current folder rather than from PYTHONPATH or the installed copy
        os.makedirs(specs[0]["workdir"], exist_ok=True)
        cwd = specs[0]["workdir"]
        proc = subprocess.run(cmd, env=env, cwd=cwd, timeout=timeout, stdout=subprocess.PIPE, text=True)
    except subprocess.TimeoutExpired:
        return [{"error": f"timed out after {timeout:.0f} s"}]
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            out: list[dict[str, Any]] = json.loads(line[len("RESULT ") :])
            return out
    return [{"error": f"child exited {proc.returncode} without a result: {proc.stdout[-2000:]}"}]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--states",
        help="MiB of model+AdamW state, 'lmN' (a small LM of N MiB), 'embN' (N MiB, mostly one embedding "
        "table), or 'small[N]' (default 256,1024,small)",
    )
    parser.add_argument("--rounds", default="3,2,1", help="rounds per state (one number: all states)")
    parser.add_argument(
        "--paired",
        type=int,
        default=0,
        help="after the rounds, this many rounds of paired hot loads per state (one rank): the engine "
        "verified, unverified and safetensors back to back; medians of the per-round ratios",
    )
    parser.add_argument("--small-count", type=int, default=50_000, help="tensors of the 'small' state")
    parser.add_argument("--small-cold", action="store_true", help="also cold loads of the small state")
    parser.add_argument("--methods", default="all", help="comma-separated (see --list)")
    parser.add_argument("--steps", type=int, default=4, help="training steps at least, per loop")
    parser.add_argument("--batch", type=int, default=32, help="rows per step of the MLP")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of the training process")
    parser.add_argument("--ranks", type=int, default=1, help="ranks under torchrun (FSDP2 over gloo when > 1)")
    parser.add_argument("--max-loop-s", type=float, default=300.0, help="a save not durable by then fails")
    parser.add_argument("--workdir", default=os.path.join(HERE, ".work", "peers"), help="where checkpoints go")
    parser.add_argument("--out", default=os.path.join(HERE, "results-peers.json"), help="JSON results")
    parser.add_argument("--plot", help="PNG of the time rows (needs matplotlib)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="per state")
    parser.add_argument("--smoke", action="store_true", help="tiny states, one round, one process: seconds")
    parser.add_argument("--list", action="store_true", help="list the methods and whether each can run")
    parser.add_argument("--from-json", help="print the tables (and --plot) of an earlier run's JSON; no run")
    parser.add_argument(
        "--full",
        action="store_true",
        help="the whole table in one command: the one-rank run, then --ranks 2 --states 256,small10000 "
        "--rounds 2,1 into the --out/--plot names with -2rank",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child_main(json.loads(args.child))
    from _peers_report import availability, report

    if args.from_json:
        with open(args.from_json) as f:
            earlier = json.load(f)
        return report(earlier["states"], earlier["machine"], earlier["availability"], None, args.plot)
    if args.list:
        for name, why in availability().items():
            print(f"{name:<24} {why or 'available'}")
        return {}
    if args.full:
        if args.ranks != 1 or args.smoke:
            parser.error("--full runs one rank and then two: leave out --ranks and --smoke")
        args.paired = args.paired or 11
        args.states = args.states or "256,1024,lm256,lm1024,small"
        one = _run_states(args)
        two_rank = argparse.Namespace(**{**vars(args), "ranks": 2, "states": "256,small10000", "rounds": "2,1"})
        two_rank.out, two_rank.plot = _two_rank_name(args.out), args.plot and _two_rank_name(args.plot)
        log(f"two ranks: {two_rank.out}")
        return {"one_rank": one, "two_ranks": _run_states(two_rank)}
    return _run_states(args)


def _two_rank_name(path: str) -> str:
    """``results/performance-peers-results.json`` -> ``results/performance-peers-2rank-results.json``
    (``x.png`` -> ``x-2rank.png``): where ``--full`` writes the two-rank run."""
    head, tail = os.path.split(path)
    stem, ext = os.path.splitext(tail)
    if stem.endswith("-results"):
        return os.path.join(head, f"{stem[: -len('-results')]}-2rank-results{ext}")
    return os.path.join(head, f"{stem}-2rank{ext}")


def _run_states(args: argparse.Namespace) -> dict[str, Any]:
    """Run every state of ``args`` (each in a child), then the report: tables, JSON, plot."""
    from _peers_report import availability, report

    if args.smoke:
        args.states = args.states or "8,small300"
        args.rounds, args.steps, args.batch, args.max_loop_s = "1", 2, 8, 120.0
        args.small_cold = True
        args.paired = args.paired or 2
    args.states = args.states or "256,1024,small"
    specs = _specs(args)
    load_start, t0 = os.getloadavg(), time.perf_counter()
    states: list[dict[str, Any]] = []
    batches = [specs] if args.smoke else [[s] for s in specs]
    for batch in batches:
        log(f"state(s) {[s['kind'] + ':' + str(s['size']) for s in batch]}")
        states += _run_child(batch, args.timeout)
    shutil.rmtree(args.workdir, ignore_errors=True)
    machine = {
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "wall_s": time.perf_counter() - t0,
        "args": {k: v for k, v in vars(args).items() if k != "child"},
    }
    return report(states, machine, availability(), args.out, args.plot)


if __name__ == "__main__":
    main()
