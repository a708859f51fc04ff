"""2 ranks: a rank stuck in a hook makes the other raise ``CollectiveTimeoutError`` naming it.

argv: save_dir. ``collective_timeout_s`` is 3 s; the stuck rank (rank 1) sleeps 6 s. Steps
(every rank runs each; each reports what it got, with how long the call took):

* ``save_remap``: rank 1 sleeps in ``remap_keys`` during a save: rank 0 gives up at the
  ``prepare`` collective, naming rank 1 and its phase ``remap_keys``; rank 1, arriving late,
  raises too;
* ``save_again``: the same engine saves again, nobody sleeping: it succeeds on both ranks;
* ``load_plan``: rank 1 sleeps in ``pre_load_plan`` during a load of that checkpoint: rank 0
  gives up at the ``plan`` collective, naming rank 1 and its phase ``plan``;
* ``closed``: ``close()`` after all that returns promptly on both ranks.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from _common import attempt, ckpt_test_exit, cpu_mesh, make_model, report_ordered, shard_fsdp2

from ckpt_engine import CheckpointEngine, hookimpl
from ckpt_engine.types import LoadContext, PlanEntry, RemapContext

TIMEOUT_S = 3.0
SLEEP_S = 6.0
STUCK_RANK = 1


class Sleeper:
    """Sleeps ``SLEEP_S`` in the hook named by ``where`` on the stuck rank."""

    def __init__(self) -> None:
        self.where: str | None = None

    def _maybe_sleep(self, hook: str, rank: int) -> None:
        if self.where == hook and rank == STUCK_RANK:
            time.sleep(SLEEP_S)

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> Mapping[str, str] | None:
        if ctx.direction == "save" and ctx.component == "model":
            self._maybe_sleep("remap_keys", ctx.rank)
        return None

    @hookimpl
    def pre_load_plan(self, ctx: LoadContext, entries: tuple[PlanEntry, ...]) -> Sequence[PlanEntry] | None:
        if ctx.component == "model":
            self._maybe_sleep("pre_load_plan", ctx.rank)
        return None


def main() -> None:
    save_dir = sys.argv[1]
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = cpu_mesh()
    model = shard_fsdp2(make_model(seed=1), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    sleeper = Sleeper()
    engine = CheckpointEngine(
        {"save_dir": os.path.join(save_dir, "ckpt"), "collective_timeout_s": TIMEOUT_S}, plugins=[sleeper]
    )

    def step(name: str, where: str | None, fn: Callable[[], Any]) -> None:
        sleeper.where = where
        out = attempt(fn)
        dist.barrier()  # the test's own sync: the stuck rank has woken up and given up too
        report_ordered({"step": name, **out})

    step("save_remap", "remap_keys", lambda: engine.save(1, model=model, optimizer=optim))
    step("save_again", None, lambda: engine.save(2, model=model, optimizer=optim))
    step("load_plan", "pre_load_plan", lambda: engine.load(model=model, optimizer=optim))
    step("closed", None, engine.close)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
