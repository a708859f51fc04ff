"""2 ranks: FSDP2 model, ``pinned_staging`` with ``overlap: true``.

argv: save_dir. Saves iteration 2 and steps at once (the step pre-hook waits for the background
copy), saves iteration 3 after one more step, then rank 1 edits a parameter in place right after
``save(4)``: save 4 must fail on both ranks (rank 1 with ``SnapshotChangedError``; rank 0 because
its writer group agreed to abort), and save 5 must work. Reports (rank-ordered) the full
parameters and exp_avg at each successful ``save()``, the failure each rank saw, and whether the
step hooks were gone after each save.
"""

from __future__ import annotations

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
    model = shard_fsdp2(make_model(seed=0), cpu_mesh())
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    for i in range(2):
        step(model, optim, i)
    options = {"overlap": True, "close_timeout_s": 60}
    engine = CheckpointEngine({"save_dir": save_dir, "plugins": [{"name": "pinned_staging", "options": options}]})
    saves: list[dict[str, Any]] = []
    for iteration in (2, 3):
        handle = engine.save(iteration, model=model, optimizer=optim)
        expected = {"params": params_full(model), "exp_avg": optim_full(model, optim, "exp_avg")}
        step(model, optim, 10 + iteration)  # overlaps the copy; its pre-hook waits for it
        result = handle.result(timeout=60)
        saves.append(
            {
                **expected,
                "iteration": iteration,
                "succeeded": result.succeeded,
                "background_copy": result.background_copy_seconds,
                "hooks_left": len(optim._optimizer_step_pre_hooks),  # introspection only
            }
        )
    failed = engine.save(4, model=model, optimizer=optim)
    if rank == 1:
        with torch.no_grad():
            next(iter(model.parameters())).to_local().add_(1.0)
    try:
        failed.result(timeout=60)
        failure = None
    except CheckpointSaveError as err:
        failure = f"{type(err.__cause__).__name__}: {err}"
    # The failure was seen through its handle: the next save proceeds (it used to raise it again).
    try:
        recovered = engine.save(5, model=model, optimizer=optim)
        with_reported = False
    except CheckpointSaveError:
        with_reported = True
        recovered = engine.save(6, model=model, optimizer=optim)
    after = {"params": params_full(model), "exp_avg": optim_full(model, optim, "exp_avg")}
    recovered_ok = recovered.result(timeout=90).succeeded
    engine.close()
    report_ordered(
        {
            "saves": saves,
            "failure": failure,
            "reported_again": with_reported,
            "recovered": {**after, "succeeded": recovered_ok},
        }
    )
    ckpt_test_exit()


if __name__ == "__main__":
    main()
