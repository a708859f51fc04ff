"""Two ranks whose state DCP would keep one copy of differs: a plain buffer (expert weights held
by one rank each) and a data position passed in ``extra``.

argv: root folder. Saves, each into its own folder under it:

* ``mismatch``: the differing buffer, no configuration: the save must fail on both ranks;
* ``per_rank``: the same with ``per_rank_keys: [model.expert]`` and the extras (a data position,
  a parameter held per rank), then every value scrambled and loaded back;
* ``extras``: the same weights on both ranks and differing extras (a plain ``Stateful`` and one
  declaring ``repartitions_state``), for the test's own one-process load;
* ``same`` and ``same_off``: identical state with the check on and off (the test compares them);
* ``tier``: the differing data position saved at steps 5 (durable) and 6 (the node-local tier
  only), each rank its own simulated node, for the test's one-process resume;
* ``ddp_bn_broadcast`` and ``ddp_bn_own``: a DDP model whose BatchNorm statistics differ across
  the ranks, with ``broadcast_buffers`` (saved: rank 0's) and without (refused);
* ``async_mismatch`` and ``async_same``: ``pinned_staging`` saves, the buffer checked from the
  staged copy after ``save()`` returned: the first must fail before its commit, the second commit;
  ``async_mismatch_tier`` and ``async_mismatch_both_tiers`` as the first, into the node-local tier
  only and into both tiers: no tier may commit it.

Reports per rank one dict: the error of ``mismatch``, what ``per_rank`` restored, the async outcomes.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

import torch
from _common import ckpt_test_exit, init, report
from torch import nn

from ckpt_engine import CheckpointEngine


class Position:
    """A data position, different on each rank (a plain ``Stateful`` of non-tensor values)."""

    def __init__(self, epoch: int = -1, index: int = -1) -> None:
        self.epoch, self.index = epoch, index

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.index = int(sd["epoch"]), int(sd["index"])


class TaggedParameter(nn.Parameter):
    """A parameter subclass that only tags (as libraries mark special weights): DCP keeps one
    copy of it as of a plain parameter."""


class Temperature:
    """A learned value held per rank as a parameter, handed over without ``detach()``: DCP keeps
    one copy of an ``nn.Parameter`` as of a plain tensor."""

    def __init__(self, value: float, kind: type[nn.Parameter] = nn.Parameter) -> None:
        self.t = kind(torch.full((2,), value))

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with torch.no_grad():
            self.t.copy_(sd["t"])


class Shards(Position):
    """The same, declaring that it re-partitions the state one rank saved."""

    repartitions_state = True


def model_with_expert(expert: float) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    model.register_buffer("expert", torch.full((3,), expert))
    return model


def attempt_mismatch(root: str, rank: int) -> dict[str, Any]:
    save_dir = os.path.join(root, "mismatch")
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        try:
            engine.save(1, model=model_with_expert(float(rank)))
        except Exception as err:  # reported, compared by the test
            return {"type": type(err).__name__, "message": str(err), "latest": os.listdir(save_dir)}
    return {"type": None}


def per_rank_round_trip(root: str, rank: int) -> dict[str, Any]:
    config = {"save_dir": os.path.join(root, "per_rank"), "per_rank_keys": ["model.expert"]}
    model = model_with_expert(float(rank))
    with CheckpointEngine(config) as engine:
        extra = {
            "loader": Position(2, 100 + rank),
            "temperature": Temperature(rank + 1.0),
            "tagged": Temperature(rank + 5.0, TaggedParameter),
        }
        engine.save(1, model=model, extra=extra)
        scrambled, temperature, tagged = Position(0, 0), Temperature(-7.0), Temperature(-7.0, TaggedParameter)
        model.expert.fill_(-1.0)
        result = engine.load(model=model, extra={"loader": scrambled, "temperature": temperature, "tagged": tagged})
    return {
        "expert": model.expert.tolist(),
        "loader": [scrambled.epoch, scrambled.index],
        "temperature": temperature.t.tolist(),
        "tagged": tagged.t.tolist(),
        "loader_renamed": result.report["loader"].renamed,
    }


def _iters(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("iter_")) if os.path.isdir(folder) else []


def async_saves(root: str, rank: int) -> dict[str, Any]:
    """The ``async_*`` cases; ``*_tier`` also save into a node-local tier (each rank its own
    node): ``persist_every`` 100 saves the tier only, 1 both tiers."""
    out: dict[str, Any] = {}
    cases = (
        ("async_mismatch", float(rank), None),
        ("async_same", 0.5, None),
        ("async_mismatch_tier", float(rank), 100),
        ("async_mismatch_both_tiers", float(rank), 1),
    )
    for name, expert, persist_every in cases:
        save_dir = os.path.join(root, name)
        config: dict[str, Any] = {
            "save_dir": save_dir,
            "plugins": [{"name": "pinned_staging", "options": {"close_timeout_s": 60}}],
        }
        if persist_every is not None:
            local_dir = os.path.join(root, f"{name}_nodes", f"node{rank}")
            config.update(local_dir=local_dir, ranks_per_node=1, persist_every=persist_every)
        engine = CheckpointEngine(config)
        handle = engine.save(1, model=model_with_expert(expert))  # returns: the check runs after it
        try:
            handle.result()
            out[name] = {"error": None}
        except Exception as err:  # reported, compared by the test
            out[name] = {"error": type(err).__name__, "message": str(err)}
        with contextlib.suppress(Exception):  # close() raises the failed save again
            engine.close()
        out[name]["committed"] = _iters(save_dir)
        if persist_every is not None:
            out[name]["committed_in_tier"] = _iters(os.path.join(local_dir, f"rank_{rank:05d}"))
    return out


def ddp_batchnorm(root: str, rank: int) -> dict[str, Any]:
    """A DDP model with BatchNorm (``broadcast_buffers`` True by default, and False), one training
    step on each rank's own batch: the running statistics differ across the ranks at the save.
    With broadcasting, DDP gives every rank rank 0's at the next forward: the save takes rank 0's
    (it was refused as diverged ranks). Without, it must still be refused."""
    from torch.nn.parallel import DistributedDataParallel

    out: dict[str, Any] = {}
    for broadcast, per_rank in ((True, False), (False, False), (True, True)):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), broadcast_buffers=broadcast)
        ddp(torch.randn(8, 4, generator=torch.Generator().manual_seed(rank))).sum().backward()
        name = "ddp_bn_per_rank" if per_rank else f"ddp_bn_{'broadcast' if broadcast else 'own'}"
        config: dict[str, Any] = {"save_dir": os.path.join(root, name)}
        if per_rank:  # named per rank by the user: saved per rank, broadcast or not
            config["per_rank_keys"] = ["model.1.running_*"]
        try:
            with CheckpointEngine(config) as engine:
                engine.save(1, model=ddp)
            out[name] = {"error": None, "running_mean": ddp.module[1].running_mean.tolist()}
        except Exception as err:  # reported, compared by the test
            out[name] = {"error": type(err).__name__, "message": str(err)}
    return out


def main() -> None:
    rank, _ = init()
    root = sys.argv[1]
    out: dict[str, Any] = {"mismatch": attempt_mismatch(root, rank), "per_rank": per_rank_round_trip(root, rank)}
    with CheckpointEngine({"save_dir": os.path.join(root, "extras")}) as engine:
        extra = {"loader": Position(2, 100 + rank), "shards": Shards(5, 10 + rank)}
        engine.save(1, model=model_with_expert(0.5), extra=extra)
    for name, check in (("same", True), ("same_off", False)):
        with CheckpointEngine({"save_dir": os.path.join(root, name), "check_replicated": check}) as engine:
            engine.save(1, model=model_with_expert(0.5), extra={"loader": Position(2, 100)})
    out["async"] = async_saves(root, rank)
    out["ddp"] = ddp_batchnorm(root, rank)
    tier = {
        "save_dir": os.path.join(root, "tier"),
        "local_dir": os.path.join(root, "tier_nodes", f"node{rank}"),
        "ranks_per_node": 1,
        "persist_every": 5,
    }
    with CheckpointEngine(tier) as engine:
        for it in (5, 6):
            engine.save(it, model=model_with_expert(0.5), extra={"loader": Position(it, 100 + rank)})
        engine.wait()
    report(out)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
