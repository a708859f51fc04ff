"""2 ranks: FSDP2 model, async saves through ``pinned_staging`` (enabled by name, via its entry point).

argv: save_dir. Saves iteration 2, overwrites every parameter and the optimizer state right
after ``save()`` returns (the checkpoint must hold the values of the save), trains one more
step and saves iteration 3. Then rank 1's writer is killed during save 4, and save 5 must work
again on both ranks. Reports (rank-ordered) the full parameters and exp_avg at each save, the
writer pids, the staging buffer pointers, and what each rank saw of the failure.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

import torch
from _common import (
    ckpt_test_exit,
    cpu_mesh,
    init,
    make_model,
    optim_full,
    params_full,
    report_ordered,
    shard_fsdp2,
    step,
)

from ckpt_engine import CheckpointEngine, CheckpointSaveError


def main() -> None:
    save_dir = sys.argv[1]
    rank, _ = init()
    mesh = cpu_mesh()
    model = shard_fsdp2(make_model(seed=0), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for i in range(2):
        step(model, optim, i)
    engine = CheckpointEngine(
        {"save_dir": save_dir, "plugins": [{"name": "pinned_staging", "options": {"close_timeout_s": 60}}]}
    )
    plugin: Any = engine._plugins.pm.get_plugin("pinned_staging")  # introspection only
    saves: list[dict[str, Any]] = []
    for iteration in (2, 3):
        handle = engine.save(iteration, model=model, optimizer=optim)
        # The content is fixed now: record it, then overwrite the live state in place.
        expected = {"params": params_full(model), "exp_avg": optim_full(model, optim, "exp_avg")}
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(-1000.0)
                optim.state[p]["exp_avg"].to_local().fill_(-1000.0)
        result = handle.result(timeout=60)
        sets = plugin.buffer_sets()
        saves.append(
            {
                **expected,
                "iteration": iteration,
                "succeeded": result.succeeded,
                "blocked": result.blocked_seconds,
                "total": result.total_seconds,
                "writer_pid": plugin.writer_pid,
                "buffers": [(s.set_id, s.data_ptr) for s in sets],
            }
        )
        # Train on from the overwritten state: save 3 must hold whatever it is then.
        step(model, optim, 10 + iteration)
    # Rank 1's writer dies during save 4: every rank's save fails (rank 0's writer was waiting for
    # rank 1's in their group), every rank replaces its writer, and save 5 works everywhere.
    old_pid = plugin.writer_pid
    if rank == 1:
        os.kill(old_pid, signal.SIGSTOP)
    failed = engine.save(4, model=model, optimizer=optim)
    if rank == 1:
        os.kill(old_pid, signal.SIGKILL)
    try:
        failed.result(timeout=60)
        failure = None
    except CheckpointSaveError as err:
        failure = str(err)
    # The failure was seen through its handle: the next save proceeds (it used to raise it again).
    try:
        recovered = engine.save(5, model=model, optimizer=optim)
        reported_again = False
    except CheckpointSaveError:
        reported_again = True
        recovered = engine.save(6, model=model, optimizer=optim)
    after = {"params": params_full(model), "exp_avg": optim_full(model, optim, "exp_avg")}
    recovered_ok = recovered.result(timeout=90).succeeded
    engine.close()
    report_ordered(
        {
            "saves": saves,
            "writer_gone": plugin.writer_pid is None,
            "failure": failure,
            "reported_again": reported_again,
            "old_writer": old_pid,
            "recovered": {**after, "succeeded": recovered_ok},
        }
    )
    ckpt_test_exit()


if __name__ == "__main__":
    main()
