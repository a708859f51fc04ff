"""Rank 0's share of a save's and a load's coordination at 1,024 ranks, simulated in one process.

No 1,024-rank job is started. Every rank's messages are built synthetically, as the ranks of an
FSDP job would send them (``--tensors`` parameters per rank, each sharded on dim 0 over all
ranks; one data file per rank), pickled as ``torch.distributed``'s object collectives pickle
them, and handed to the same functions rank 0 runs in a real save or load. What is timed (and,
in a second pass under ``tracemalloc``, the peak of Python memory allocated) is rank 0's work
on them: unpickling what it gathers, planning, pickling what it scatters or broadcasts,
``finish`` writing ``.metadata`` (to a temporary folder). The receive buffer of each gather
(ranks x the largest message, as ``gather_object`` allocates it) is added to the peak. Network
time is not in the figures.

* **cold save** (a new structure), as the engine saves a layout every rank can plan alone
  (``_dcpio/local_plan.py``; FSDP2's is one): the all-gather of the 1,024 ``(hit, digest,
  replicated digest)`` triples, then the gather of every rank's write results with its final
  items by columns (``PlanColumns``), ``build_metadata`` (the ``Metadata`` DCP's global plan
  builds, validated as DCP validates it), ``compact_metadata`` and the writer's ``finish``.
* **cold save, central** (a layout that is not planned alone): gather the 1,024 local
  ``SavePlan`` s, the engine planner's ``create_global_plan`` (DCP's, with
  ``dedup_save_to_lowest_rank``), the engine writer's ``prepare_global_plan``, the scatter of
  the final plans, ``compact_metadata``; then the gather of every rank's write results and the
  writer's ``finish``.
* **warm save** (the cached plan): the all-gather of the 1,024 ``(hit, digest)`` pairs, then the
  gather of the write results and ``write_metadata``, the coordinator's finish of a real save:
  with the plan cache of a cold save that wrote the same results before, it writes the last
  ``.metadata`` again with a new ``storage_meta`` instead of pickling the ``Metadata``.
* **engine load**: the fixed-size agreements of :meth:`Comm.settle` (plan, with each rank's plan
  digest, and read), the
  validation's agreements, and the broadcast of ``.metadata``'s bytes (pickled once).
* **DCP save**, on the same input: the same gathers and scatter with DCP's own objects (write
  results pickled one by one), ``DefaultSavePlanner`` and ``FileSystemWriter`` (``finish``).
* **DCP load**: the gather of the 1,024 local ``LoadPlan`` s (``create_default_local_load_plan``
  of each rank's shards), ``create_global_plan`` and the scatter of the plans.

The engine's operations run without cyclic garbage collection, as its collectives run rank 0's
part (``Comm.gather_scatter`` / ``gather_finish``); DCP's with it, as ``dcp.save``/``dcp.load``
do. Also reported: the bytes through rank 0 (gathered plus sent) per operation.

    python benchmarks/coord_sim_bench.py --ranks 1024 --tensors 200 --out coord_sim.json
    python benchmarks/coord_sim_bench.py --smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ckpt_engine._dcpio.fast_read import gc_paused
from ckpt_engine._dcpio.fast_save import (
    CompactResults,
    SavePlanCache,
    compact_metadata,
    gathered_results,
    write_metadata,
)
from ckpt_engine._dcpio.fast_write import FastFileSystemWriter
from ckpt_engine._dcpio.local_plan import PlanColumns, build_metadata
from ckpt_engine._dcpio.planner import EngineSavePlanner

ROWS, COLS = 4, 64  # each rank's shard of each parameter: 4 x 64 fp32 (1 KiB)


def _props() -> TensorProperties:
    return TensorProperties(dtype=torch.float32)


def local_save_plan(rank: int, ranks: int, tensors: int, hint: int | None = None) -> SavePlan:
    """Rank ``rank``'s local plan: one shard write item per parameter, as DCP makes it for a
    DTensor (``hint``: each item's chunk number, as a final plan carries it)."""
    items = []
    size = torch.Size([ranks * ROWS, COLS])
    for t in range(tensors):
        offsets = torch.Size([rank * ROWS, 0])
        chunk = ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([ROWS, COLS]))
        items.append(
            WriteItem(
                index=MetadataIndex(f"layers.{t}.weight", offsets, hint),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=_props(), size=size),
            )
        )
    return SavePlan(items, planner_data={f"layers.{t}.weight": (f"layers.{t}.weight",) for t in range(tensors)})


def write_results(plan: SavePlan, rank: int) -> list[WriteResult]:
    """What rank ``rank``'s writer returns for ``plan``: one archive per item in ``__{rank}_0.distcp``."""
    out, pos = [], 0
    for item in plan.items:
        length = ROWS * COLS * 4 + 1100  # the tensor's bytes and its torch.save archive around them
        out.append(
            WriteResult(
                index=item.index, size_in_bytes=length, storage_data=_StorageInfo(f"__{rank}_0.distcp", pos, length)
            )
        )
        pos += length
    return out


def global_metadata(ranks: int, tensors: int) -> Metadata:
    """The ``.metadata`` of such a checkpoint (every rank's chunk of every parameter)."""
    sdm = {}
    size = torch.Size([ranks * ROWS, COLS])
    for t in range(tensors):
        chunks = [
            ChunkStorageMetadata(offsets=torch.Size([r * ROWS, 0]), sizes=torch.Size([ROWS, COLS]))
            for r in range(ranks)
        ]
        sdm[f"layers.{t}.weight"] = TensorStorageMetadata(properties=_props(), size=size, chunks=chunks)
    return Metadata(state_dict_metadata=sdm)


def local_load_plan(rank: int, md: Metadata, tensors: int) -> LoadPlan:
    """Rank ``rank``'s local load plan for its shard of every parameter, by DCP's planner."""
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    items = []
    for t in range(tensors):
        fqn = f"layers.{t}.weight"
        tmd = md.state_dict_metadata[fqn]
        assert isinstance(tmd, TensorStorageMetadata)
        local = [ChunkStorageMetadata(offsets=torch.Size([rank * ROWS, 0]), sizes=torch.Size([ROWS, COLS]))]
        items += create_read_items_for_chunk_list(fqn, tmd, local)
    return LoadPlan(items)


def _gather(blobs: list[bytes]) -> tuple[list[Any], int]:
    """Rank 0's side of ``gather_object``: unpickle every rank's message; the receive buffer's size."""
    return [pickle.loads(b) for b in blobs], len(blobs) * max(len(b) for b in blobs)


def _scatter(values: list[Any]) -> int:
    """Rank 0's side of ``scatter_object_list``: pickle every rank's value; the bytes sent."""
    return sum(len(pickle.dumps(v)) for v in values)


def paused(fn: Callable[[], int]) -> Callable[[], int]:
    """``fn`` without cyclic garbage collection, as the engine's collectives run rank 0's part."""

    def run() -> int:
        with gc_paused():
            return fn()

    return run


def measure(fn: Callable[[], int], reps: int) -> dict[str, float]:
    """Median seconds of ``fn`` over ``reps`` runs, then its peak memory under tracemalloc (MiB),
    plus the receive buffers ``fn`` reports."""
    times = []
    for _ in range(reps):
        gc.collect()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    gc.collect()
    tracemalloc.start()
    buffers = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return {"seconds": statistics.median(times), "peak_mib": (peak + buffers) / 2**20}


def run(ranks: int, tensors: int, reps: int) -> dict[str, Any]:
    folder = tempfile.mkdtemp(prefix="coord-sim-")
    plans = [local_save_plan(r, ranks, tensors) for r in range(ranks)]
    # What finish_alone leaves each rank (Shard(0) over every rank: its chunk is number `rank`).
    alone_plans = [local_save_plan(r, ranks, tensors, hint=r) for r in range(ranks)]
    plan_blobs = [pickle.dumps(p) for p in plans]
    results = [write_results(p, r) for r, p in enumerate(plans)]
    result_blobs = [pickle.dumps(CompactResults(r)) for r in results]  # what the engine's write step sends
    dcp_result_blobs = [pickle.dumps(r) for r in results]  # what dcp.save's sends
    digest_blobs = [pickle.dumps((True, os.urandom(16), None)) for _ in range(ranks)]
    replicated = os.urandom(16)  # every rank's digest of its plain items: equal
    alone_blobs = [pickle.dumps((False, os.urandom(16), replicated)) for _ in range(ranks)]
    alone_result_blobs = [
        pickle.dumps((CompactResults(write_results(p, r)), PlanColumns.of(p))) for r, p in enumerate(alone_plans)
    ]
    md = global_metadata(ranks, tensors)
    load_plan_blobs = [pickle.dumps(local_load_plan(r, md, tensors)) for r in range(ranks)]
    flag_blobs = [pickle.dumps(0) for _ in range(ranks)]
    # The plan's settle also carries each rank's 16-byte plan digest (Comm.settle_with).
    settle_blobs = [pickle.dumps((0, bytes(16))) for _ in range(ranks)]
    agree_blobs = [pickle.dumps((None, "", None)) for _ in range(ranks)]
    sent: dict[str, int] = {}

    def _writer(dcp: bool = False) -> FileSystemWriter:
        writer = (FileSystemWriter if dcp else FastFileSystemWriter)(folder, sync_files=False)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        return writer

    def finish(metadata: Metadata, dcp: bool = False) -> int:
        got, buf = _gather(dcp_result_blobs if dcp else result_blobs)
        _writer(dcp).finish(metadata=metadata, results=gathered_results(got))
        return buf

    def dcp_save() -> int:
        got, buf = _gather(plan_blobs)
        final, metadata = DefaultSavePlanner(dedup_save_to_lowest_rank=True).create_global_plan(got)
        final = FileSystemWriter(folder, sync_files=False).prepare_global_plan(final)
        sent["dcp_save"] = _scatter(final)
        return max(buf, finish(metadata, dcp=True))

    def cold() -> int:
        got, buf = _gather(alone_blobs)
        assert all(a == got[0][2] for _, _, a in got)  # every rank can finish its plan alone
        gathered, rbuf = _gather(alone_result_blobs)
        metadata = compact_metadata(build_metadata([cols for _, cols in gathered]))
        write_metadata(_writer(), metadata, [r for r, _ in gathered], None)
        return max(buf, rbuf)

    def cold_central() -> int:
        got, buf = _gather(plan_blobs)
        planner = EngineSavePlanner()
        final, metadata = planner.create_global_plan(got)
        writer = FastFileSystemWriter(folder, sync_files=False)
        final = writer.prepare_global_plan(final)
        sent["cold_central"] = _scatter(final)
        compact_metadata(metadata)
        return max(buf, finish(metadata))

    # the plan cache after a cold save: its metadata, and the .metadata it wrote for these results
    warm_cache = SavePlanCache(metadata=compact_metadata(global_metadata(ranks, tensors)))
    write_metadata(
        _writer(),
        warm_cache.metadata,
        [pickle.loads(b) for b in result_blobs],
        warm_cache,  # type: ignore[arg-type]
    )
    assert warm_cache.written is not None

    def warm() -> int:
        got, buf = _gather(digest_blobs)
        assert all(hit for hit, _, _ in got)
        results, rbuf = _gather(result_blobs)
        reused = warm_cache.metadata_reused
        write_metadata(_writer(), warm_cache.metadata, results, warm_cache)  # type: ignore[arg-type]
        assert warm_cache.metadata_reused == reused + 1  # the last .metadata, a new storage_meta
        return max(buf, rbuf)

    def engine_load() -> int:
        bufs = [_gather(agree_blobs)[1], _gather(agree_blobs)[1]]  # validate: checks, metadata checks
        sent["engine_load"] = len(pickle.dumps([{"model": md_bytes}]))  # the metadata broadcast's payload
        for blobs in (settle_blobs, flag_blobs):  # settle: plan (with the plan digests), read
            failed = [r for r, f in enumerate(_gather(blobs)[0]) if (f[0] if isinstance(f, tuple) else f)]
            assert not failed
            bufs.append(len(blobs) * max(map(len, blobs)))
        return max(bufs)

    def dcp_load() -> int:
        got, buf = _gather(load_plan_blobs)
        final = DefaultLoadPlanner().create_global_plan(got)
        sent["dcp_load"] = _scatter(final)
        return buf

    out: dict[str, Any] = {"ranks": ranks, "tensors": tensors}
    out["save_cold"] = measure(paused(cold), reps)
    out["save_cold_central"] = measure(paused(cold_central), reps)
    with open(os.path.join(folder, ".metadata"), "rb") as f:
        md_bytes = f.read()  # what the load's validation broadcasts
    out["metadata_bytes"] = len(md_bytes)
    out["save_warm"] = measure(paused(warm), reps)
    out["engine_load"] = measure(paused(engine_load), reps)
    out["dcp_save"] = measure(dcp_save, reps)
    out["dcp_load"] = measure(dcp_load, reps)
    results_bytes = sum(map(len, result_blobs))
    out["bytes_through_rank0"] = {
        "save_cold": sum(map(len, alone_blobs)) + sum(map(len, alone_result_blobs)),
        "save_cold_central": sum(map(len, plan_blobs)) + sent["cold_central"] + results_bytes,
        "save_warm": sum(map(len, digest_blobs)) + results_bytes,
        "dcp_save": sum(map(len, plan_blobs)) + sent["dcp_save"] + sum(map(len, dcp_result_blobs)),
        "engine_load": 2 * sum(map(len, agree_blobs)) + 2 * sum(map(len, flag_blobs)),
        "engine_load_metadata_broadcast_payload": sent["engine_load"],
        "dcp_load": sum(map(len, load_plan_blobs)) + sent["dcp_load"],
    }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--tensors", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="16 ranks x 10 tensors, one repetition")
    args = ap.parse_args(argv)
    if args.smoke:
        args.ranks, args.tensors, args.reps = 16, 10, 1
    doc = run(args.ranks, args.tensors, args.reps)
    doc["load_average"] = os.getloadavg()
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
