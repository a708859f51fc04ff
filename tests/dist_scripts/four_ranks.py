"""Any number of ranks (the 4-rank tests): FSDP2 save, load, strict refusal, async save.

argv: ``NAME:MODE:SAVE_DIR[:async]`` steps, run one after another in one launch (a 4-rank launch
costs more than these steps), each reporting under its NAME. MODE ``save``: 2 AdamW steps, then
``engine.save(2)`` (with ``pinned_staging`` when ``async``). ``load``: a fresh FSDP2 model and
optimizer resumed from SAVE_DIR. ``strict``: a model of other shapes, whose strict load must raise
on every rank. Every step reports (rank-ordered) the full parameters and AdamW ``exp_avg`` it
holds, or the error.
"""

from __future__ import annotations

import sys

import torch
from _common import ckpt_test_exit, cpu_mesh, init, make_model, optim_full, params_full, report_ordered, shard_fsdp2

from ckpt_engine import CheckpointEngine, LoadStrictnessError


def run_step(mode: str, save_dir: str, use_async: bool) -> dict[str, object]:
    mesh = cpu_mesh()
    sizes = ((8, 16), (16, 6), (6, 1)) if mode == "strict" else ((8, 16), (16, 5), (5, 1))
    model = shard_fsdp2(make_model(seed=0 if mode == "save" else 99, sizes=sizes), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    config = {"save_dir": save_dir, "plugins": ["pinned_staging"] if use_async else []}
    out: dict[str, object] = {}
    with CheckpointEngine(config) as engine:
        if mode == "save":
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1234))
            for _ in range(2):
                model(x).pow(2).mean().backward()
                optim.step()
                optim.zero_grad()
            out["saved"] = engine.save(2, model=model, optimizer=optim).result(timeout=120).succeeded
        elif mode == "load":
            out["iteration"] = engine.load(model=model, optimizer=optim).iteration
        else:
            try:
                engine.load(model=model, optimizer=optim)
                out["error"] = None
            except LoadStrictnessError as err:
                out["error"] = type(err).__name__
    if mode != "strict":
        out["params"] = params_full(model)
        out["exp_avg"] = optim_full(model, optim, "exp_avg")
    return out


def main() -> None:
    init()
    for spec in sys.argv[1:]:
        name, mode, save_dir, *flags = spec.split(":")
        torch.manual_seed(0)  # as init() leaves a fresh process
        report_ordered({"scenario": name, **run_step(mode, save_dir, "async" in flags)})
    ckpt_test_exit()


if __name__ == "__main__":
    main()
