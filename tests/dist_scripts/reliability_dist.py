"""2 ranks: the commit protocol, verification, fallback, the lock and one-rank failures.

argv: save_dir. Steps (every rank runs each; each reports what it got):

* ``commit``: FSDP2 model + AdamW (and each rank's RNG state: ``rng`` is on by default) saved at
  iterations 1, 2, 3 with ``keep_last=2``: the manifest lists both ranks' files (each rank
  checksummed its own), retention keeps 2 and 3;
* ``verified``: a ``verify="checksums"`` load (files split among ranks) restores iteration 3;
* ``flip``: rank 0 flips one byte in the model file rank 1 wrote; a ``verify="checksums"`` load
  raises ``IntegrityError`` on both ranks, naming the file, with nothing loaded;
* ``fallback``: the same load with ``fallback_to_last_complete`` restores iteration 2 on both;
* ``read_flip`` and ``read_fallback``: the same with the default ``verify``, where only rank 1's
  read finds the damage: both ranks raise; with the option, both restore iteration 2;
* ``read_error``: rank 1 alone gets an I/O error reading a data file: both ranks raise;
* ``check_error``: rank 1 alone gets a permission error in the pre-load checks: both raise;
* ``lock``: while engine A (rank 0 holds the save_dir lock) is open, engine B's save fails on
  both ranks; after ``A.close()`` it succeeds;
* ``leftover``: a ``.partial`` folder is removed when engines start (by rank 0 only).

The process group has a 60 s timeout, so a hang becomes an error rather than a stuck job.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from _common import attempt, ckpt_test_exit, cpu_mesh, make_model, params_full, report_ordered, shard_fsdp2
from torch.distributed.checkpoint import FileSystemReader

import ckpt_engine._engine.loader as engine_module
from ckpt_engine import CheckpointEngine
from ckpt_engine.errors import CheckpointPermissionError

FAILING_RANK = 1


def trained(seed: int, mesh: Any, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = shard_fsdp2(make_model(seed=seed), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(steps):
        model(torch.ones(2, 8)).sum().backward()
        optim.step()
        optim.zero_grad()
    return model, optim


def main() -> None:
    save_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    torch.manual_seed(0)
    rank = dist.get_rank()
    mesh = cpu_mesh()
    out: dict[str, Any] = {}

    # -- commit + retention ------------------------------------------------------------------
    saved: dict[int, Any] = {}
    with CheckpointEngine({"save_dir": save_dir, "keep_last": 2}) as engine:
        for it in (1, 2, 3):
            model, optim = trained(seed=it, mesh=mesh, steps=1)
            engine.save(it, model=model, optimizer=optim)
            saved[it] = params_full(model)
    dist.barrier()
    with open(os.path.join(save_dir, "iter_000000003", "ckpt_engine_manifest.json")) as f:
        manifest = json.load(f)
    out["commit"] = {
        "listing": sorted(os.listdir(save_dir)),
        "world_size": manifest["world_size"],
        "files": sorted(manifest["files"]),
        "algorithm": manifest["checksum_algorithm"],
        "all_checksummed": all(e["checksum"] for e in manifest["files"].values()),
    }

    # -- verified load -------------------------------------------------------------------------
    def load(**cfg: Any) -> dict[str, Any]:
        model = shard_fsdp2(make_model(seed=100), mesh)
        with CheckpointEngine({"save_dir": save_dir} | cfg) as eng:  # cfg may override save_dir
            result = eng.load(model=model)
        return {
            "iteration": result.iteration,
            "verified": result.verified,
            "fell_back_from": result.fell_back_from,
            "equal_to": [it for it, p in saved.items() if p == params_full(model)],
        }

    out["verified"] = attempt(lambda: load(verify="checksums"), keep_value=True)

    # -- flipped byte in the file rank 1 wrote -------------------------------------------------
    victim = os.path.join(save_dir, "iter_000000003", "model", "__1_0.distcp")
    if rank == 0:
        with open(victim, "r+b") as f:
            f.seek(os.path.getsize(victim) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    dist.barrier()
    untouched = shard_fsdp2(make_model(seed=100), mesh)
    before = params_full(untouched)

    def load_into_untouched() -> None:
        with CheckpointEngine({"save_dir": save_dir, "verify": "checksums"}) as eng:
            eng.load(model=untouched)

    out["flip"] = attempt(load_into_untouched, keep_value=True)
    out["flip"]["untouched"] = params_full(untouched) == before
    out["fallback"] = attempt(lambda: load(verify="checksums", fallback_to_last_complete=True), keep_value=True)
    # the same damage found only by the read (verify: read, the default): rank 1 reads that file
    out["read_flip"] = attempt(load, keep_value=True)
    out["read_fallback"] = attempt(lambda: load(fallback_to_last_complete=True), keep_value=True)

    # -- a read error on one rank only ---------------------------------------------------------
    empty, iter2 = save_dir + "-empty", os.path.join(save_dir, "iter_000000002")  # rule 2: load_path
    # Rank 1's reader takes DCP's own read path (no direct reads) and the file read fails there.
    reader_cls = engine_module.FastFileSystemReader
    original_init, original_read = reader_cls.__init__, FileSystemReader.read_data

    def slow_init(self: Any, path: Any, metadata: Any = None, *, direct: bool = True) -> None:
        original_init(self, path, metadata, direct=False)

    def failing_read(self: Any, plan: Any, planner: Any) -> Any:
        raise OSError(errno.EIO, "Input/output error (injected)")

    if rank == FAILING_RANK:
        reader_cls.__init__ = slow_init  # type: ignore[method-assign]
        FileSystemReader.read_data = failing_read  # type: ignore[method-assign]
    out["read_error"] = attempt(lambda: load(save_dir=empty, load_path=iter2), keep_value=True)
    reader_cls.__init__ = original_init  # type: ignore[method-assign]
    FileSystemReader.read_data = original_read  # type: ignore[method-assign]

    # -- an error in the pre-load checks, which rank 0 runs for every rank -----------------------
    import ckpt_engine._engine.load_guard as guard_module

    original_check = guard_module.check_complete

    def denied(path: Any, *args: Any, **kwargs: Any) -> Any:
        raise CheckpointPermissionError(f"cannot stat {path}/model/__0_0.distcp: permission denied (injected)")

    if rank == 0:
        guard_module.check_complete = denied
    out["check_error"] = attempt(lambda: load(save_dir=empty, load_path=iter2), keep_value=True)
    guard_module.check_complete = original_check

    # -- the lock --------------------------------------------------------------------------------
    lock_dir = save_dir + "-lock"
    model, optim = trained(seed=7, mesh=mesh, steps=1)
    a = CheckpointEngine({"save_dir": lock_dir})
    a.save(1, model=model, optimizer=optim)
    b = CheckpointEngine({"save_dir": lock_dir})
    out["lock"] = attempt(lambda: b.save(2, model=model, optimizer=optim), keep_value=True)
    a.close()
    out["lock_after_close"] = attempt(
        lambda: b.save(2, model=model, optimizer=optim).result().succeeded, keep_value=True
    )
    b.close()
    dist.barrier()
    with open(os.path.join(lock_dir, "latest_checkpoint.txt")) as f:
        out["lock_latest"] = f.read()

    # -- leftovers -------------------------------------------------------------------------------
    leftover = os.path.join(lock_dir, ".iter_000000009.partial")
    if rank == 0:
        os.makedirs(os.path.join(leftover, "model"))
    dist.barrier()
    CheckpointEngine({"save_dir": lock_dir}).close()
    dist.barrier()
    out["leftover_removed"] = not os.path.exists(leftover)

    report_ordered(out)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
