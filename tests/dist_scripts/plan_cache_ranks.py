"""The plan of an unchanged structure is reused at several ranks too (fast_save's plan cache).

argv: SAVE_DIR. An FSDP2 model and AdamW: save 1 plans; an optimizer step (new values, same
structure), save 2 must reuse the plan on every rank; a model of other shapes plans again.
Every rank reports its cache counters (misses, hits) after each save, and the full parameters
of iteration 2 loaded into a fresh model.
"""

from __future__ import annotations

import sys

import torch
from _common import ckpt_test_exit, cpu_mesh, init, make_model, params_full, report_ordered, shard_fsdp2, step

from ckpt_engine import CheckpointEngine
from ckpt_engine._dcpio.fast_save import plan_cache


def counters(engine: CheckpointEngine) -> list[int]:
    cache = plan_cache(engine._plan_prefix + "model")
    return [cache.misses, cache.hits]


def main() -> None:
    save_dir = sys.argv[1]
    init()
    mesh = cpu_mesh()
    model = shard_fsdp2(make_model(seed=0), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    out: dict[str, object] = {}
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        step(model, optim, 1)
        engine.save(1, model=model, optimizer=optim)
        out["after_1"] = counters(engine)
        step(model, optim, 2)
        engine.save(2, model=model, optimizer=optim)
        out["after_2"] = counters(engine)
        out["saved"] = params_full(model)
        fresh = shard_fsdp2(make_model(seed=99), mesh)
        engine.load(model=fresh)
        out["loaded"] = params_full(fresh)
        other = shard_fsdp2(make_model(seed=0, sizes=((8, 16), (16, 6), (6, 1))), mesh)
        engine.save(3, model=other)
        out["after_3"] = counters(engine)
    report_ordered(out)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
