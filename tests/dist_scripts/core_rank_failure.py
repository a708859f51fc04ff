"""2 ranks: a plugin that fails on rank 1 only must fail the load (and the save) on both ranks.

A scenario of ``core.py`` (argument: save_dir). Saves iteration 1 (FSDP2 model + AdamW), then:

* ``load``: a plugin whose ``pre_load_plan`` raises on rank 1 only;
* ``save``: a plugin whose ``remap_keys`` raises on rank 1 only, on save (iteration 2);
* ``write``: a ``write`` provider that raises on rank 1 only, outside any collective, while rank
  0 writes (iteration 1, in ``<save_dir>-write``); rank 0 must not wait for rank 1 at its next
  collective. Then ``write_again``: the same engine saves iteration 1 on both ranks (the ranks
  are still in step);
* ``diverge``: a ``pre_load_plan`` that skips a parameter on rank 1 only (a hook that depends
  on the rank): both ranks refuse the load, naming the key and what each rank planned, and
  nothing is loaded;
* ``recover``: a plain engine loads iteration 1 into a fresh model on both ranks.

Each rank returns, per step, the error type and message it got and the seconds it took.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from _common import attempt, cpu_mesh, make_model, params_full, shard_fsdp2

from ckpt_engine import CheckpointEngine, WriteContext, WriteResult, hookimpl
from ckpt_engine.defaults import DefaultIO

FAILING_RANK = 1


class FailPlanOnRank:
    name = "fail_plan_on_rank"

    @hookimpl
    def pre_load_plan(self, ctx: Any, entries: Any) -> None:
        if ctx.rank == FAILING_RANK:
            raise RuntimeError(f"planned pre_load_plan failure on rank {ctx.rank} ({ctx.component})")


class FailSaveRemapOnRank:
    name = "fail_save_remap_on_rank"

    @hookimpl
    def remap_keys(self, ctx: Any, key_map: Any) -> None:
        if ctx.direction == "save" and ctx.rank == FAILING_RANK:
            raise RuntimeError(f"planned remap_keys failure on rank {ctx.rank} ({ctx.component})")


class SkipOnRank:
    """A ``pre_load_plan`` that keeps parameter ``0.bias`` on rank 1 only (a rank-dependent bug)."""

    name = "skip_on_rank"

    @hookimpl
    def pre_load_plan(self, ctx: Any, entries: Any) -> Any:
        if ctx.rank != FAILING_RANK or ctx.component != "model":
            return None
        return [e.skip("keep rank 1's own bias") if e.dest_key == "0.bias" else e for e in entries]


class FailWriteOnRankOnce:
    """The default write, except that the first one on rank 1 raises before writing anything."""

    name = "fail_write_on_rank_once"

    def __init__(self) -> None:
        self.failed = False

    @hookimpl
    def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> WriteResult:
        if ctx.rank == FAILING_RANK and not self.failed:
            self.failed = True
            raise OSError(28, "No space left on device")
        return DefaultIO().write(ctx, state_dict)


def scenario(save_dir: str) -> list[Any]:
    mesh = cpu_mesh()
    src = shard_fsdp2(make_model(seed=0), mesh)
    src_optim = torch.optim.AdamW(src.parameters(), lr=0.1)
    src(torch.ones(2, 8)).sum().backward()
    src_optim.step()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=src, optimizer=src_optim)
    saved = params_full(src)

    dst = shard_fsdp2(make_model(seed=3), mesh)
    dst_optim = torch.optim.AdamW(dst.parameters(), lr=0.1)
    load_engine = CheckpointEngine({"save_dir": save_dir}, plugins=[FailPlanOnRank()])
    load = attempt(lambda: load_engine.load(model=dst, optimizer=dst_optim))

    save_engine = CheckpointEngine({"save_dir": save_dir}, plugins=[FailSaveRemapOnRank()])
    save = attempt(lambda: save_engine.save(2, model=src, optimizer=src_optim))
    save["listing"] = sorted(os.listdir(save_dir))
    save["latest"] = _latest(save_dir)

    write_dir = f"{save_dir}-write"
    with CheckpointEngine({"save_dir": write_dir}, plugins=[FailWriteOnRankOnce()]) as engine:
        write = attempt(lambda: engine.save(1, model=src, optimizer=src_optim))
        write["listing"] = sorted(os.listdir(write_dir))
        write_again = attempt(lambda: engine.save(1, model=src, optimizer=src_optim).result())
        write_again["latest"] = _latest(write_dir)

    fresh = shard_fsdp2(make_model(seed=5), mesh)
    before = params_full(fresh)
    with CheckpointEngine({"save_dir": save_dir}, plugins=[SkipOnRank()]) as engine:
        diverge = attempt(lambda: engine.load(model=fresh))
    diverge["unchanged"] = params_full(fresh) == before

    good = shard_fsdp2(make_model(seed=4), mesh)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        result = engine.load(model=good)
    recover = {"iteration": result.iteration, "equal": params_full(good) == saved}
    return [
        {
            "load": load,
            "save": save,
            "write": write,
            "write_again": write_again,
            "diverge": diverge,
            "recover": recover,
            "plugins": list(load_engine.plugin_names),
        }
    ]


def _latest(save_dir: str) -> str:
    with open(os.path.join(save_dir, "latest_checkpoint.txt")) as f:
        return f.read()
