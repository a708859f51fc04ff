"""2 ranks, FSDP2, saves to an S3 server (moto, started by the test) and a resharded load back.

argv: CONFIG_JSON (an engine config whose save_dir is an s3:// URL and whose storage reaches the
server). Iteration 1 is saved synchronously (every rank uploads its own files; the ranks agree
by a collective; rank 0 writes the marker). Iteration 2 is saved through ``pinned_staging``
(background commit: every rank reports its upload in an object, rank 0 waits for both). Each
rank then loads iteration 2 into a freshly sharded model and reports whether it equals what was
saved, plus the full parameters of both saves (rank-ordered).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from _common import ckpt_test_exit, cpu_mesh, init, make_model, params_full, report_ordered, shard_fsdp2, step

from ckpt_engine import CheckpointEngine


def main() -> None:
    config: dict[str, Any] = json.loads(sys.argv[1])
    init()
    mesh = cpu_mesh()
    model = shard_fsdp2(make_model(seed=0), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, optim, 0)
    saved: dict[int, Any] = {}
    with CheckpointEngine(config) as engine:
        engine.save(1, model=model, optimizer=optim)
        saved[1] = params_full(model)
    step(model, optim, 1)
    with CheckpointEngine({**config, "plugins": ["pinned_staging"]}) as engine:
        handle = engine.save(2, model=model, optimizer=optim)
        saved[2] = params_full(model)
        result = handle.result(timeout=90)
    fresh = shard_fsdp2(make_model(seed=9), mesh)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    step(fresh, fresh_optim, 5)
    with CheckpointEngine({**config, "verify": "checksums"}) as engine:
        loaded = engine.load(model=fresh, optimizer=fresh_optim)
    report_ordered(
        {
            "saved": saved,
            "async_succeeded": result.succeeded,
            "loaded_iteration": loaded.iteration,
            "loaded_verified": loaded.verified,
            "loaded_equal": params_full(fresh) == saved[2],
        }
    )
    ckpt_test_exit()


if __name__ == "__main__":
    main()
