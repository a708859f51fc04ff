"""The node-local tier's recovery planner at 1,024 and 8,192 ranks, simulated in one process.

No large job is started. As in ``coord_sim_bench.py``, every rank's messages are built as the
ranks of such a job would send them, pickled as ``torch.distributed``'s object collectives pickle
them, and handed to the functions one rank runs in a real resume (``_tier/recovery.py``,
``_tier/topology.py``, ``_tier/replication.py``). The job: ``--ranks`` ranks, 8 per node, racks
of 4 nodes (``failure_domain``), ``local_keep_last: 2``; ``save_dir``'s latest is step 3, the tier
holds steps 4 and 5 of the same run (each rank its own, and its ``peer_replicas`` replicas); node 1
is lost (its ranks hold nothing). Timed, on one rank (the planner is symmetric: every rank
gathers the same holdings and computes the same plan; rank 0 only logs):

* **topology**: the failure domains' gather (unpickling every rank's label) and the placement;
* **agreement**: unpickling the all-gather of every rank's holdings, the one-view check, the
  lineage filter and the plan (the newest step every rank's part is held for, and each part's
  source); its parts (unpickling, lineage filter, plan) are also timed once each;
* **transfers**: this rank's pairs of the plan (a rank of the lost node receives its part);
* **restore**: the replicas the placement asks for that their holders lack (those the lost node
  held and those of its ranks), and this rank's pairs of them.

``today`` runs the planner as it was before this change (each owner's order of candidate holders
built as a list of every rank: quadratic in the ranks) with no domains and no restore; ``now``
runs the current code. Reported: median seconds, the peak of Python memory under tracemalloc plus
the all-gather's receive buffer (ranks x the largest message, as ``all_gather_object`` allocates
it), the bytes every rank receives in the collectives, and the point-to-point pairs of rank 0,
of a rank of the lost node and of an ordinary rank. Network time is not in the figures (the
recovery-time model in docs/reliability.md adds it).

    python benchmarks/recovery_sim_bench.py --ranks 1024 8192 --out recovery_sim.json
    python benchmarks/recovery_sim_bench.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from ckpt_engine import EngineConfig
from ckpt_engine._format.manifest import Lineage
from ckpt_engine._tier import recovery
from ckpt_engine._tier.lineage import Announced, Durable, admissible
from ckpt_engine._tier.replication import missing_replicas
from ckpt_engine._tier.topology import Topology

PER_NODE, NODES_PER_RACK, LOST_NODE = 8, 4, 1
RUN = "5f3c0a9e1b2d4c6f"


def _lineage(iteration: int) -> Lineage:
    if iteration == 3:
        return Lineage(RUN, "a1b2c3d4e5f60718-3", None, None)
    return Lineage(RUN, f"a1b2c3d4e5f60718-{iteration}", "a1b2c3d4e5f60718-3", 3)


def payloads(topo: Topology) -> list[bytes]:
    """Every rank's message of the holdings all-gather: ``(durable, its copies)``, pickled."""
    durable = Durable(3, _lineage(3))
    out = []
    for rank in range(topo.world):
        copies = []
        if topo.node(rank) != LOST_NODE:
            for owner in (rank, *topo.sources(rank)):
                copies += [Announced(rank, owner, it, _lineage(it)) for it in (5, 4)]
        out.append(pickle.dumps((durable, copies)))
    return out


def today_plan(kept: list[Announced], topo: Topology) -> dict[int, int] | None:
    """The planner before this change: each owner's candidates as a list of every rank."""
    saves: dict[tuple[int, str], dict[int, set[int]]] = {}
    for c in kept:
        saves.setdefault((c.iteration, c.save_id or ""), {}).setdefault(c.owner, set()).add(c.holder)
    for _, holders in sorted(saves.items(), reverse=True):
        source = {}
        for owner in range(topo.world):
            order = [owner, *topo.holders(owner), *range(topo.world)]
            holder = next((h for h in order if h in holders.get(owner, ())), None)
            if holder is None:
                break
            source[owner] = holder
        else:
            return source
    return None


def pairs(plan: dict[int, int], rank: int) -> int:
    """This rank's pairs in the plan's transfers (in owner order, as ``_transfers`` walks them)."""
    return sum(1 for owner, holder in sorted(plan.items()) if holder != owner and rank in (owner, holder))


def measure(fn: Callable[[], int], reps: int) -> dict[str, float]:
    """Median seconds of ``fn`` over ``reps`` runs, then its peak under tracemalloc (MiB) plus the
    receive buffer ``fn`` reports."""
    times = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    gc.collect()
    tracemalloc.start()
    buffer = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds": statistics.median(times), "peak_mib": (peak + buffer) / 2**20}


def run(ranks: int, replicas: int, mode: str, reps: int) -> dict[str, Any]:
    config = EngineConfig(save_dir="/x", local_dir="/l", ranks_per_node=PER_NODE, peer_replicas=replicas)
    nodes = ranks // PER_NODE
    domained = mode == "now"
    racks = [f"rack{(r // PER_NODE) // NODES_PER_RACK}" if domained else None for r in range(ranks)]
    labels = [pickle.dumps(label) for label in racks]
    topo = Topology.of(config, ranks, [pickle.loads(b) for b in labels])
    blobs = payloads(topo)
    lost, ordinary = LOST_NODE * PER_NODE, (nodes // 2) * PER_NODE + 3
    watched = (("rank0", 0), ("lost", lost), ("ordinary", ordinary))
    found: dict[str, Any] = {}

    def topology() -> int:
        got = [pickle.loads(b) for b in labels]
        Topology.of(config, ranks, got)
        return len(labels) * max(map(len, labels))

    def agreement() -> int:
        gathered = [pickle.loads(b) for b in blobs]
        recovery._require_one_view([view for view, _ in gathered])
        kept, _ = admissible(gathered[0][0], [c for _, copies in gathered for c in copies])
        if mode == "today":
            found["plan"], found["kept"] = today_plan(kept, topo), kept
        else:
            plan = recovery._plan(kept, set(), topo)
            assert plan is not None
            found["plan"], found["kept"], found["save_id"] = plan.source, kept, plan.save_id
        return len(blobs) * max(map(len, blobs))

    def transfers() -> int:
        found["pairs"] = {who: pairs(found["plan"], r) for who, r in watched}
        return 0

    def restore() -> int:
        held = {(c.holder, c.owner) for c in found["kept"] if c.iteration == 5 and c.save_id == found["save_id"]}
        missing = missing_replicas(topo, held)
        found["restore"] = {who: sum(1 for o, h in missing if r in (o, h)) for who, r in watched}
        found["missing"] = len(missing)
        return 0

    def breakdown() -> dict[str, float]:
        """The agreement's parts, timed once each: unpickling, the lineage filter, the plan."""
        t0 = time.perf_counter()
        gathered = [pickle.loads(b) for b in blobs]
        t1 = time.perf_counter()
        kept, _ = admissible(gathered[0][0], [c for _, copies in gathered for c in copies])
        t2 = time.perf_counter()
        today_plan(kept, topo) if mode == "today" else recovery._plan(kept, set(), topo)
        t3 = time.perf_counter()
        return {"unpickle": t1 - t0, "lineage": t2 - t1, "plan": t3 - t2}

    out: dict[str, Any] = {"ranks": ranks, "nodes": nodes, "peer_replicas": replicas, "mode": mode}
    out["topology"] = measure(topology, reps)
    out["agreement"] = measure(agreement, reps)
    out["agreement_parts_seconds"] = breakdown()
    assert len(found["plan"]) == ranks and all(found["plan"][o] != o for o in range(lost, lost + PER_NODE))
    out["transfers"] = measure(transfers, reps)
    out["pairs"] = found["pairs"]
    if mode == "now":
        out["restore"] = measure(restore, reps)
        out["restore_pairs"], out["replicas_restored"] = found["restore"], found["missing"]
        out["exposed_domains"] = topo.exposed()
    out["received_bytes_per_rank"] = {
        "failure_domains": len(labels) * max(map(len, labels)),
        "holdings": len(blobs) * max(map(len, blobs)),
        "holdings_largest_message": max(map(len, blobs)),
    }
    # The resume's collectives on every rank: the domains' gather (now), the holdings, the checks'
    # and the transfers' refused copies (each object all-gather is two all-gathers), one barrier.
    out["collectives"] = {"all_gather_object": 4 if mode == "now" else 3, "barrier": 1}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1024, 8192])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="64 ranks, one repetition")
    args = ap.parse_args(argv)
    if args.smoke:
        args.ranks, args.reps = [64], 1
        # The objects alive now (the imports; in a test, the whole test process) are frozen
        # (``gc.freeze``), so each ``gc.collect`` before a timing scans only what the run made:
        # a full collection over a test process's heap costs about half a second, 28 times.
        gc.freeze()
    try:
        rows = _rows(args)
    finally:
        if args.smoke:
            gc.unfreeze()
    doc = {"rows": rows, "load_average": os.getloadavg(), "python": sys.version.split()[0]}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(json.dumps(doc, indent=2) + "\n")
    return 0


def _rows(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for ranks in args.ranks:
        for replicas in args.replicas:
            for mode in ("today", "now"):
                if mode == "today" and replicas > 1 and ranks > 1024:
                    continue  # quadratic: the 1-replica row shows it
                rows.append(run(ranks, replicas, mode, args.reps))
                print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    sys.exit(main())
