"""2 ranks: the built-in plugins on sharded models (FSDP2 and DTensor), CPU mesh, gloo.

argv: work_dir one_rank_checkpoint. Scenarios, each reported as one ``RESULT`` per rank:

* ``ema``: a diffusion-like model (``net`` + ``net_ema`` + ``logvar``, Transformer-Engine-style
  extra state in both networks) sharded with FSDP2 is saved, then loaded with the ``ema`` plugin
  into an FSDP2 model with an EMA copy (both networks get the EMA weights, each storage key read
  once per rank, extra state of another size skipped by ``te_extra_state`` in strict mode) and
  into one without (``net`` gets the EMA weights).
* ``fsdp_overlap``: an FSDP2 model saved with a 4-channel stem conv and a 10-row head is loaded
  into one with a 6-channel stem (overlap on an unsharded dim) and a 12-row head (overlap on the
  sharded dim 0) with ``size_mismatch`` ``overlap``.
* ``ema_error``: the ``ema`` plugin on that checkpoint, which has no EMA keys: every rank raises
  the same error (it is raised inside DCP's planning step, so no rank is left waiting).
* ``dtensor_overlap``: a checkpoint written by one process (the test) is loaded into DTensor
  parameters sharded on dim 1 (and dim 0), grown and shrunk, with ``size_mismatch`` ``overlap``.

The models and their values are built by functions here that the test imports, so the test
computes every expected value itself. Full values are gathered with ``full_tensor()``.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any

import torch
from torch import nn

POISON = -999.0


class TeLike(nn.Module):
    """A layer with Transformer-Engine-style extra state: a uint8 tensor of ``size`` entries."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.extra = torch.arange(size, dtype=torch.uint8)

    def get_extra_state(self) -> Any:
        return self.extra

    def set_extra_state(self, state: Any) -> None:
        self.extra = state


class Net(nn.Module):
    def __init__(self, te_size: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 5)])
        self.te = TeLike(te_size)


class Diffusion(nn.Module):
    def __init__(self, ema: bool, te_size: int = 3) -> None:
        super().__init__()
        self.net = Net(te_size)
        if ema:
            self.net_ema = Net(te_size)
        self.logvar = nn.Parameter(torch.zeros(3))


class Vision(nn.Module):
    def __init__(self, in_ch: int, head: int) -> None:
        super().__init__()
        self.stem = nn.Conv2d(in_ch, 8, 3)
        self.body = nn.Linear(8, 8)
        self.head = nn.Linear(8, head)


class Plain(nn.Module):
    """Parameters ``w``, ``v``, ``u`` of the given shapes (the one-rank checkpoint and targets)."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        super().__init__()
        for name, shape in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))


#: One-rank checkpoint shapes, and the targets' shapes and placements (dim of Shard).
ONE_RANK_SHAPES = {"w": (6, 10), "v": (7, 6), "u": (5,)}
TARGET_SHAPES = {"w": (8, 7), "v": (5, 9), "u": (9,)}
TARGET_SHARD_DIM = {"w": 1, "v": 1, "u": 0}


def fill(module: nn.Module, start: float) -> nn.Module:
    """Distinct, recognisable values that every rank and the test compute alike."""
    with torch.no_grad():
        for i, (_, t) in enumerate(sorted(module.named_parameters())):
            t.copy_(torch.arange(t.numel(), dtype=t.dtype).reshape(t.shape) / 8 + start + 100 * i)
    return module


def poison(module: nn.Module) -> nn.Module:
    with torch.no_grad():
        for p in module.parameters():
            p.fill_(POISON)
    return module


def ema_source() -> Diffusion:
    src = Diffusion(ema=True, te_size=3)
    fill(src.net, 1.0)
    fill(src.net_ema, -50.0)
    with torch.no_grad():
        src.logvar.copy_(torch.tensor([1.5, 2.5, 3.5]))
    return src


def vision_source() -> Vision:
    return fill(Vision(in_ch=4, head=10), 0.5)


def one_rank_source() -> Plain:
    return fill(Plain(ONE_RANK_SHAPES), 2.0)


# -- the torchrun side -------------------------------------------------------------------------


def full_state(module: nn.Module) -> dict[str, list[Any]]:
    """Every parameter's full value (collective: every rank calls it in the same order)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in sorted(module.named_parameters()):
        t = p.detach()
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).tolist()
    return out


def shard(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for module in list(model.modules()):
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


class ReadCounter:
    """Counts this rank's read items per storage key: the final plan DCP gives ``finish_plan``."""

    def __init__(self) -> None:
        from ckpt_engine._dcpio.planner import EngineLoadPlanner

        self.counts: Counter[str] = Counter()
        self._original = EngineLoadPlanner.finish_plan
        counts, original = self.counts, self._original

        def finish_plan(planner: Any, plan: Any) -> Any:
            final = original(planner, plan)
            counts.update(item.storage_index.fqn for item in final.items)
            return final

        EngineLoadPlanner.finish_plan = finish_plan

    def close(self) -> dict[str, int]:
        from ckpt_engine._dcpio.planner import EngineLoadPlanner

        EngineLoadPlanner.finish_plan = self._original
        return dict(self.counts)


def report_of(result: Any) -> dict[str, Any]:
    rep = result.report["model"]
    return {
        "loaded": sorted(rep.loaded),
        "missing": sorted(rep.missing),
        "unexpected": sorted(rep.unexpected),
        "skipped": {k: [v.reason, v.plugin] for k, v in sorted(rep.skipped.items())},
        "overlap": {k: [list(v.saved_shape), list(v.target_shape), v.plugin] for k, v in sorted(rep.overlap.items())},
        "renamed": dict(sorted(rep.renamed.items())),
    }


def _warm_start(checkpoints: str) -> dict[str, Any]:
    """A new run that starts from ``checkpoints``' latest with the ``ema`` plugin (it applies on a
    warm start, a load by the ``load_path`` rule)."""
    return {"save_dir": checkpoints + "_run", "load_path": checkpoints, "plugins": ["ema"]}


def scenario_ema(work_dir: str, mesh: Any) -> dict[str, Any]:
    from ckpt_engine import CheckpointEngine

    save_dir = os.path.join(work_dir, "ema")
    src = shard(ema_source(), mesh)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=src)

    with_ema = shard(fill(Diffusion(ema=True, te_size=5), 9.0), mesh)
    counter = ReadCounter()
    try:
        result = CheckpointEngine(_warm_start(save_dir)).load(model=with_ema)
    finally:
        reads = counter.close()
    extra = [with_ema.net.te.extra.tolist(), with_ema.net_ema.te.extra.tolist()]
    out_with = {"report": report_of(result), "reads": reads, "params": full_state(with_ema), "extra": extra}

    without_ema = shard(fill(Diffusion(ema=False, te_size=5), 9.0), mesh)
    result = CheckpointEngine(_warm_start(save_dir)).load(model=without_ema)
    out_without = {"report": report_of(result), "params": full_state(without_ema)}
    return {"with_ema": out_with, "without_ema": out_without}


def scenario_fsdp_overlap(work_dir: str, mesh: Any) -> dict[str, Any]:
    from ckpt_engine import CheckpointEngine

    save_dir = os.path.join(work_dir, "overlap")
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=shard(vision_source(), mesh))
    target = shard(poison(Vision(in_ch=6, head=12)), mesh)
    config = {"save_dir": save_dir, "plugins": [{"name": "size_mismatch", "options": {"policy": "overlap"}}]}
    result = CheckpointEngine(config).load(model=target)
    local_rows = target.head.weight.to_local().shape[0]
    return {"report": report_of(result), "params": full_state(target), "head_local_rows": local_rows}


def scenario_ema_error(work_dir: str, mesh: Any) -> dict[str, Any]:
    """The ``ema`` plugin on a checkpoint without EMA keys: every rank gets the same error."""
    from ckpt_engine import CheckpointEngine

    target = shard(Diffusion(ema=False), mesh)
    config = _warm_start(os.path.join(work_dir, "overlap"))  # a Vision checkpoint
    try:
        CheckpointEngine(config).load(model=target)
    except Exception as err:
        return {"error": type(err).__name__, "message": str(err)}
    return {"error": None, "message": ""}


def scenario_dtensor_overlap(one_rank_checkpoint: str, work_dir: str, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    from ckpt_engine import CheckpointEngine

    target = Plain(TARGET_SHAPES)
    poison(target)
    for name, dim in TARGET_SHARD_DIM.items():
        value = getattr(target, name).detach()
        target.register_parameter(name, nn.Parameter(distribute_tensor(value, mesh, [Shard(dim)])))
    config = {
        "save_dir": os.path.join(work_dir, "unused"),
        "load_path": one_rank_checkpoint,
        "plugins": [{"name": "size_mismatch", "options": {"policy": "overlap"}}],
    }
    result = CheckpointEngine(config).load(model=target)
    locals_ = {n: list(p.to_local().shape) for n, p in sorted(target.named_parameters())}
    return {"report": report_of(result), "params": full_state(target), "local_shapes": locals_}


def main() -> None:
    from _common import ckpt_test_exit, init, report
    from torch.distributed.device_mesh import init_device_mesh

    work_dir, one_rank_checkpoint = sys.argv[1], sys.argv[2]
    rank, world = init()
    mesh = init_device_mesh("cpu", (world,))
    results = {
        "ema": scenario_ema(work_dir, mesh),
        "fsdp_overlap": scenario_fsdp_overlap(work_dir, mesh),
        "ema_error": scenario_ema_error(work_dir, mesh),
        "dtensor_overlap": scenario_dtensor_overlap(one_rank_checkpoint, work_dir, mesh),
    }
    for name, payload in results.items():
        report({"scenario": name, "rank": rank, "world": world, **payload})
    ckpt_test_exit(0)


if __name__ == "__main__":
    main()
