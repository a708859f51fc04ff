"""2 ranks: a rank stuck in a hook makes the other raise ``CollectiveTimeoutError`` naming it.

argv: save_dir. ``collective_timeout_s`` is 3 s. The stuck rank (rank 1) stays in its hook until
rank 0's call has returned (rank 0 writes a file then): rank 0 cannot have waited for it, so
the order of events, not a clock, shows that rank 0 gave up by itself. Steps (every rank runs
each; each reports what it got, with how long the call took):

* ``save_remap``: rank 1 is stuck in ``remap_keys`` during a save: rank 0 gives up at the
  ``prepare`` collective, naming rank 1 and its phase ``remap_keys``; rank 1, arriving late,
  raises too;
* ``save_again``: the same engine saves again, nobody stuck: it succeeds on both ranks;
* ``load_plan``: rank 1 is stuck in ``pre_load_plan`` during a load of that checkpoint: rank 0
  gives up at the ``plan`` collective, naming rank 1 and its phase ``plan``;
* ``closed``: ``close()`` after all that returns on rank 0 while rank 1 waits outside the engine
  for it, then on rank 1: closing needs no other rank.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from _common import attempt, ckpt_test_exit, cpu_mesh, make_model, report_ordered, shard_fsdp2, wait_for_file

from ckpt_engine import CheckpointEngine, hookimpl
from ckpt_engine.types import LoadContext, PlanEntry, RemapContext

TIMEOUT_S = 3.0
STUCK_RANK = 1


class Sleeper:
    """Holds the stuck rank in the hook named by ``where`` until ``release`` exists."""

    def __init__(self) -> None:
        self.where: str | None = None
        self.release = ""
        #: Whether the last hold ended because rank 0 released it (not by the hang guard).
        self.released: bool | None = None

    def _maybe_hold(self, hook: str, rank: int) -> None:
        if self.where == hook and rank == STUCK_RANK:
            self.released = wait_for_file(self.release)

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> Mapping[str, str] | None:
        if ctx.direction == "save" and ctx.component == "model":
            self._maybe_hold("remap_keys", ctx.rank)
        return None

    @hookimpl
    def pre_load_plan(self, ctx: LoadContext, entries: tuple[PlanEntry, ...]) -> Sequence[PlanEntry] | None:
        if ctx.component == "model":
            self._maybe_hold("pre_load_plan", ctx.rank)
        return None


def main() -> None:
    save_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    mesh = cpu_mesh()
    model = shard_fsdp2(make_model(seed=1), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sleeper = Sleeper()
    engine = CheckpointEngine(
        {"save_dir": os.path.join(save_dir, "ckpt"), "collective_timeout_s": TIMEOUT_S}, plugins=[sleeper]
    )

    def step(name: str, where: str | None, fn: Callable[[], Any], *, rank_1_after_rank_0: bool = False) -> None:
        done = os.path.join(save_dir, f"rank0-returned-{name}")
        sleeper.where, sleeper.release, sleeper.released = where, done, None
        if rank_1_after_rank_0 and rank == STUCK_RANK:
            out = {"waited_for_rank_0": wait_for_file(done), **attempt(fn)}
        else:
            out = attempt(fn)
        if rank == 0:
            with open(done, "w"):
                pass
        dist.barrier()  # the test's own sync: the stuck rank has been released and given up too
        report_ordered({"step": name, "released": sleeper.released, **out})

    step("save_remap", "remap_keys", lambda: engine.save(1, model=model, optimizer=optim))
    step("save_again", None, lambda: engine.save(2, model=model, optimizer=optim))
    step("load_plan", "pre_load_plan", lambda: engine.load(model=model, optimizer=optim))
    step("closed", None, engine.close, rank_1_after_rank_0=True)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
