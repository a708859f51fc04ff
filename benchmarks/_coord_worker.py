"""One rank of ``coord_bench.py``, run by ``torch.distributed.run --standalone --nproc-per-node W``.

Every rank holds the same fixed state whatever the world size: ``tensors`` DTensors sharded on
dim 0 (as FSDP2 shards parameters), each rank's shard ``rows x cols`` fp32, built with
``DTensor.from_local`` so no rank ever holds the global tensors. Per round a fresh engine does a
cold save (plans), ``warm`` saves of the unchanged structure (the cached plan) and ``loads``
loads into zeroed DTensors of the same sharding, each op between two barriers of the default
group.

What is timed, on every rank:

* the phases the engine publishes (``ckpt_engine._dcpio.watch.PHASE_LOG``: prepare, stage,
  plan, write, metadata, commit; validate, read metadata, plan, read), from the op's start to
  its end; time before the first phase is ``enter``;
* inside each phase, the time spent in the engine's collectives, split into the bounded
  barrier that precedes each (``CollectiveWatch.barrier``: waiting for the slowest rank and, for
  a result, for rank 0's central step) and the object collective itself (``torch.distributed``
  ``all_gather_object`` / ``gather_object`` / ``scatter_object_list`` / ``broadcast_object_list``:
  pickling and moving the payload);
* in a last round whose times are discarded, the pickled bytes each rank contributes to each
  collective (exact; pickling them again to count would distort the times).

Rank 0 writes one JSON file with every rank's records (``spec["out"]``).
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
import shutil
import sys
import threading
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _bench_state import StateModule

from ckpt_engine import CheckpointEngine
from ckpt_engine._dcpio import watch as _watch

warnings.filterwarnings("ignore")

#: Per-rank shard shapes the state cycles through (fp32): 4 KiB to 64 KiB per tensor.
SHAPES = ((16, 1024), (64, 64), (4, 256), (32, 512))


class Recorder:
    """Collective time and bytes of the current op, by the phase they happened in."""

    def __init__(self) -> None:
        self.active = False
        self.count_bytes = False
        self.coll: dict[str, dict[str, float]] = {}

    def reset(self) -> None:
        self.coll = defaultdict(lambda: defaultdict(float))

    def current_phase(self) -> str:
        return _watch.PHASE_LOG[-1][0] if _watch.PHASE_LOG else "enter"

    def wrap(
        self, name: str, fn: Callable[..., Any], sizer: Callable[..., tuple[str, int]] | None
    ) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            where = self.coll[self.current_phase()]
            if self.count_bytes and sizer is not None:
                field, size = sizer(*args, **kwargs)
                where[field] += size
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                where[name + "_s"] += time.perf_counter() - t
                where["n_" + name] += 1

        return wrapper


def _size(obj: Any) -> int:
    try:
        return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        return 0


def install(rec: Recorder) -> None:
    """Wrap the public object collectives and the watch's barrier (they are looked up on the
    module and the class at call time, so the engine's calls go through the wrappers)."""

    def gather_size(obj: Any, *a: Any, **k: Any) -> tuple[str, int]:
        return "to_rank0_bytes", _size(obj)

    def all_gather_size(out: Any, obj: Any, *a: Any, **k: Any) -> tuple[str, int]:
        return "to_all_bytes", _size(obj)

    def scatter_size(box: Any, items: Any, *a: Any, **k: Any) -> tuple[str, int]:
        return "from_rank0_bytes", sum(_size(x) for x in items or ())

    def broadcast_size(box: Any, *a: Any, **k: Any) -> tuple[str, int]:
        return "from_rank0_bytes", _size(box) if dist.get_rank() == 0 else 0

    dist.gather_object = rec.wrap("transfer", dist.gather_object, gather_size)
    dist.all_gather_object = rec.wrap("transfer", dist.all_gather_object, all_gather_size)
    dist.scatter_object_list = rec.wrap("transfer", dist.scatter_object_list, scatter_size)
    dist.broadcast_object_list = rec.wrap("transfer", dist.broadcast_object_list, broadcast_size)
    cls = _watch.CollectiveWatch
    cls.barrier = rec.wrap("barrier", cls.barrier, None)  # type: ignore[method-assign]


def make_state(spec: dict[str, Any], mesh: Any, rank: int, fill: bool) -> StateModule:
    out: dict[str, torch.Tensor] = {}
    for i in range(spec["tensors"]):
        rows, cols = SHAPES[i % len(SHAPES)]
        local = torch.zeros(rows, cols)
        if fill:
            local.view(-1)[:: max(1, local.numel() // 16)] = float(i * 1000 + rank)
        out[f"layers.{i // 8}.p{i % 8}"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    return StateModule(out)


def segments(start: float, end: float) -> dict[str, float]:
    """Seconds per phase of this thread between ``start`` and ``end`` (names that repeat, one per
    component, are summed)."""
    me = threading.get_ident()
    marks = [(n, t) for n, t, tid in _watch.PHASE_LOG if tid == me and start <= t <= end]
    out: dict[str, float] = defaultdict(float)
    edges = [("enter", start), *marks, ("", end)]
    for (name, t0), (_, t1) in itertools.pairwise(edges):
        out[name] += t1 - t0
    return dict(out)


def timed(rec: Recorder, kind: str, fn: Callable[[], Any]) -> dict[str, Any]:
    dist.barrier()
    rec.reset()
    _watch.PHASE_LOG.clear()
    rec.active = True
    start = time.perf_counter()
    value = fn()
    end = time.perf_counter()
    rec.active = False
    dist.barrier()
    row: dict[str, Any] = {"op": kind, "total_s": end - start, "phases": segments(start, end)}
    row["coll"] = {p: dict(v) for p, v in rec.coll.items()}
    if hasattr(value, "bytes_read"):  # a LoadResult
        row["bytes_read"] = value.bytes_read
    if hasattr(value, "result"):  # a SaveHandle of a sync save: already done
        res = value.result()
        row["engine"] = {k: getattr(res, k) for k in ("staging_seconds", "write_seconds", "total_seconds")}
    return row


def one_round(
    spec: dict[str, Any], rec: Recorder, src: StateModule, dst: StateModule, it0: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    config = {"save_dir": spec["save_dir"], "keep_last": 2}
    with CheckpointEngine(config) as engine:
        for i in range(1 + spec["warm"]):
            kind = "save_cold" if i == 0 else "save_warm"
            rows.append(timed(rec, kind, lambda it=it0 + i: engine.save(it, model=src)))
        for _ in range(spec["loads"]):
            rows.append(timed(rec, "load", lambda: engine.load(model=dst)))
    if spec.get("replicated_mib"):
        rows += replicated_loads(spec, rec, it0)
    return rows


def replicated_state(spec: dict[str, Any], rank: int, fill: bool) -> StateModule:
    """``replicated_mib`` MiB of plain fp32 tensors of 4 MiB each, the same on every rank (DDP)."""
    n = max(1, spec["replicated_mib"] // 4)
    out = {}
    for i in range(n):
        t = torch.zeros(1 << 20)
        if fill:
            t[:: 1 << 12] = float(i + 1)
        out[f"rep.{i}"] = t
    return StateModule(out)


def replicated_loads(spec: dict[str, Any], rec: Recorder, it: int) -> list[dict[str, Any]]:
    """A save of the replicated state (rank 0 writes it: DCP saves a replicated value once),
    then its load with ``dedup_reads`` off and on, each ``loads`` times."""
    rank = dist.get_rank()
    src, dst = replicated_state(spec, rank, True), replicated_state(spec, rank, False)
    base = {"save_dir": spec.get("rep_url") or spec["save_dir"] + "-rep", "keep_last": 1}
    if spec.get("rep_storage"):
        base["storage"] = spec["rep_storage"]
    with CheckpointEngine(base) as engine:
        engine.save(it, model=src)
    rows = []
    for _ in range(spec["loads"]):
        for mode in ("off", "on"):
            for t in dst.state_dict().values():
                t.zero_()
            with CheckpointEngine({**base, "dedup_reads": mode}) as engine:
                rows.append(timed(rec, f"load_replicated_{mode}", lambda e=engine: e.load(model=dst)))
            rows[-1]["exact"] = all(
                torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True)
            )
    return rows


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    src, dst = make_state(spec, mesh, rank, True), make_state(spec, mesh, rank, False)
    rec = Recorder()
    install(rec)
    rows: list[dict[str, Any]] = []
    it = 1
    for r in range(spec["rounds"]):
        if rank == 0:
            shutil.rmtree(spec["save_dir"], ignore_errors=True)
        dist.barrier()
        for row in one_round(spec, rec, src, dst, it):
            rows.append({**row, "round": r})
        it += 1 + spec["warm"]
    rec.count_bytes = True  # the bytes round: counts exactly, its times are not used
    counted = [{**row, "round": "bytes"} for row in one_round(spec, rec, src, dst, it)]
    exact = all(
        torch.equal(a.to_local(), b.to_local())
        for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True)
    )
    per_rank = sum(p.to_local().numel() * 4 for p in src.state_dict().values())
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object({"rank": rank, "rows": rows, "bytes_rows": counted, "exact": exact}, gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        doc = {"world": world, "bytes_per_rank": per_rank, "tensors": spec["tensors"], "ranks": gathered}
        with open(spec["out"], "w", encoding="utf-8") as f:
            json.dump(doc, f)
        shutil.rmtree(spec["save_dir"], ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # gloo + a device mesh can abort at interpreter exit


if __name__ == "__main__":
    main()
