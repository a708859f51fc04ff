"""The lineage of the node-local tier's steps on 4 gloo ranks as 2 simulated nodes
(``ranks_per_node: 2``, ``<base>/node0`` and ``<base>/node1``), every scenario in one launch.

``tier_lineage.py ROOT``: a job trains steps 1-7 (durable every 3rd) in ``ROOT/run``; each rank's
state at each step goes to ``ROOT/expected_<gen>_<rank>_<step>.pt``. Then, each reported as
``{"scenario": ..., ...}``:

* ``resave``: a new engine (``allow_overwrite``) resumes 7 and saves another step 7 while the
  rank-local writes of ranks 2-3 fail with ENOSPC (injected at the write); every rank reports the
  save's error; the folders are copied to ``ROOT/after_fail``; then the same engine saves 8
  (local) and 9 (durable), reported;
* ``after_fail``: a resume of that copy (must be one save of 7 on every rank);
* ``rollback``: a copy of the first job's folders with ``save_dir`` rolled back to 3;
* ``new_run``: the first job's ``local_dir`` beside an empty ``save_dir``;
* ``views``: ranks 2-3 given a copy of ``save_dir`` rolled back to 3 (ranks 0-1: its latest, 6);
* ``symlink``: rank 1's own copy of step 7 with a data file replaced by a symlink to a file of
  the same bytes outside it.

Each resume reports the iteration, the bytes by source, the error (``attempt``) and whether the
state equals the expected one of the step it names, bit for bit.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from typing import Any

import torch
import torch.distributed as dist
from _common import attempt, ckpt_test_exit, init, make_model, report, step

import ckpt_engine.defaults
from ckpt_engine import CheckpointEngine
from ckpt_engine._dcpio.coordination import RANK_LOCAL
from ckpt_engine._tier.lineage import COMMITTED_FILE

#: Ranks whose rank-local writes fail with ENOSPC while set.
FAIL_RANKS: set[int] = set()
_write_component = ckpt_engine.defaults.write_component


def _failing_write(state_dict: dict[str, Any], **kw: Any) -> Any:
    if kw.get("process_group") is RANK_LOCAL and dist.get_rank() in FAIL_RANKS:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), kw.get("path"))
    return _write_component(state_dict, **kw)


ckpt_engine.defaults.write_component = _failing_write  # type: ignore[assignment]


def config(base: str, rank: int, save_dir: str | None = None, **extra: Any) -> dict[str, Any]:
    return {
        "save_dir": save_dir or os.path.join(base, "durable"),
        "local_dir": os.path.join(base, f"node{rank // 2}"),
        "ranks_per_node": 2,
        "persist_every": 3,
        "local_keep_last": 3,
        **extra,
    }


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed=7)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def state(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"p.{n}": p.detach().clone() for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out.update({f"{f}.{n}": optim.state[p][f].clone() for f in ("exp_avg", "exp_avg_sq")})
    return out


def keep(root: str, gen: str, rank: int, it: int, model: torch.nn.Module, optim: torch.optim.Optimizer) -> None:
    torch.save(state(model, optim), os.path.join(root, f"expected_{gen}_{rank}_{it}.pt"))


def same(root: str, gen: str, rank: int, it: int, model: torch.nn.Module, optim: torch.optim.Optimizer) -> bool:
    path = os.path.join(root, f"expected_{gen}_{rank}_{it}.pt")
    if not os.path.exists(path):
        return False
    expected, got = torch.load(path, weights_only=True), state(model, optim)
    return sorted(expected) == sorted(got) and all(torch.equal(expected[k], got[k]) for k in expected)


def copy_tree(src: str, dst: str) -> None:
    """Rank 0 copies, every rank waits for it."""
    if dist.get_rank() == 0:
        shutil.copytree(src, dst, symlinks=True)
    dist.barrier()


def resume(root: str, scenario: str, cfg: dict[str, Any]) -> None:
    rank = dist.get_rank()
    model, optim = build()
    out: dict[str, Any] = {}

    def load() -> None:
        with CheckpointEngine(cfg) as engine:
            result = engine.load(model=model, optimizer=optim)
        out.update(iteration=result.iteration, by_source=dict(result.bytes_by_source))

    outcome = attempt(load)
    it = out.get("iteration")
    matches = {g: same(root, g, rank, it, model, optim) for g in ("a", "b")} if it else {}
    report({"scenario": scenario, **outcome, **out, "same": matches})


def train(root: str, base: str, rank: int) -> None:
    model, optim = build()
    with CheckpointEngine(config(base, rank)) as engine:
        for it in range(1, 8):
            step(model, optim, seed=it)
            keep(root, "a", rank, it, model, optim)
            engine.save(it, model=model, optimizer=optim).result()
        engine.wait_replicated()
    # Only rank 0 records a durable commit: it made it (the others cannot know it finished).
    record = os.path.join(base, f"node{rank // 2}", f"rank_{rank:05d}", COMMITTED_FILE)
    report({"scenario": "records", "recorded": os.path.exists(record)})


def resave(root: str, base: str, rank: int) -> None:
    """Another save of 7 that fails on node 1, then the saves after it, in the same engine."""
    model, optim = build()
    with CheckpointEngine(config(base, rank, allow_overwrite=True)) as engine:
        loaded = engine.load(model=model, optimizer=optim).iteration
        step(model, optim, seed=100)
        keep(root, "b", rank, 7, model, optim)
        FAIL_RANKS.update({2, 3})
        failed = attempt(lambda: engine.save(7, model=model, optimizer=optim).result())
        FAIL_RANKS.clear()
        dist.barrier()
        copy_tree(base, os.path.join(root, "after_fail"))
        later = []
        for it in (8, 9):
            step(model, optim, seed=100 + it)
            saved = attempt(lambda i=it: engine.save(i, model=model, optimizer=optim).result().tier, keep_value=True)
            later.append(saved)
        engine.wait_replicated()
    report({"scenario": "resave", "loaded": loaded, "failed": failed, "later": later})


def main() -> None:
    rank, _ = init()
    root = sys.argv[1]
    run = os.path.join(root, "run")
    train(root, run, rank)
    for name in ("rollback", "new_run", "views", "symlink"):
        copy_tree(run, os.path.join(root, name))
    if rank == 0:
        rolled = os.path.join(root, "rollback", "durable")
        shutil.rmtree(os.path.join(rolled, "iter_000000006"))
        with open(os.path.join(rolled, "latest_checkpoint.txt"), "w") as f:
            f.write("iter_000000003\n")
        other_view = os.path.join(root, "views", "durable_b")
        shutil.copytree(os.path.join(root, "views", "durable"), other_view)
        shutil.rmtree(os.path.join(other_view, "iter_000000006"))
        with open(os.path.join(other_view, "latest_checkpoint.txt"), "w") as f:
            f.write("iter_000000003\n")
        own = os.path.join(root, "symlink", "node0", "rank_00001", "iter_000000007", "model")
        data = sorted(n for n in os.listdir(own) if n.endswith(".distcp"))[0]
        planted = os.path.join(root, "symlink", "planted.distcp")
        shutil.copyfile(os.path.join(own, data), planted)
        os.remove(os.path.join(own, data))
        os.symlink(planted, os.path.join(own, data))
    dist.barrier()
    resave(root, run, rank)
    resume(root, "after_fail", config(os.path.join(root, "after_fail"), rank))
    resume(root, "rollback", config(os.path.join(root, "rollback"), rank))
    resume(root, "new_run", config(os.path.join(root, "new_run"), rank, os.path.join(root, "new_run", "empty")))
    views = os.path.join(root, "views")
    resume(root, "views", config(views, rank, os.path.join(views, "durable" if rank < 2 else "durable_b")))
    resume(root, "symlink", config(os.path.join(root, "symlink"), rank, fallback_to_last_complete=True))
    ckpt_test_exit()


if __name__ == "__main__":
    main()
