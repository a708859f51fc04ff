"""Helpers shared by the torchrun test scripts (imported with tests/dist_scripts on sys.path)."""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def init() -> tuple[int, int]:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size()


def report(payload: Any) -> None:
    """Record a JSON result for the test.

    Results go to a per-rank file in ``$CKPT_TEST_RESULTS_DIR`` (set by ``run_torchrun``): ranks
    share torchrun's stdout pipe, where lines from two ranks can interleave. Without the
    variable (a script run by hand) they are printed.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    line = f"RESULT {rank} {json.dumps(payload)}\n"
    results_dir = os.environ.get("CKPT_TEST_RESULTS_DIR")
    if results_dir:
        with open(os.path.join(results_dir, f"rank{rank}.jsonl"), "a", encoding="utf-8") as f:
            f.write(line)
    else:
        sys.stdout.write(line)
        sys.stdout.flush()


def ckpt_test_exit(code: int = 0) -> None:
    """Flush, tear down the process group and exit without interpreter teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    finally:
        os._exit(code)


# -- helpers for the core_*.py scripts ---------------------------------------------------------


def report_ordered(payload: Any) -> None:
    """``report()`` from every rank in turn (rank 0 first), with a barrier after each.

    Keeps the results of all ranks in rank order; every rank must call it.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    for r in range(world):
        if r == rank:
            report(payload)
        dist.barrier()


#: Layer sizes of the test model: dim 0 of the weights/biases is 16 (even shards), 5 (3 + 2) and
#: 1 (1 + an empty shard on rank 1) when sharded over 2 ranks.
LINEAR_SIZES = ((8, 16), (16, 5), (5, 1))


def make_model(seed: int, sizes: tuple[tuple[int, int], ...] = LINEAR_SIZES) -> torch.nn.Sequential:
    """``Sequential(Linear, ReLU, Linear, Linear)``: keys ``0.*``, ``2.*``, ``3.*``."""
    torch.manual_seed(seed)
    first, *rest = sizes
    layers: list[torch.nn.Module] = [torch.nn.Linear(*first), torch.nn.ReLU()]
    layers += [torch.nn.Linear(*s) for s in rest]
    return torch.nn.Sequential(*layers)


def cpu_mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (dist.get_world_size(),))


def shard_fsdp2(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """FSDP2: every Linear is its own group, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def step(model: torch.nn.Module, optim: torch.optim.Optimizer, seed: int) -> None:
    """One AdamW step on a batch drawn from ``seed``."""
    x = torch.randn(4, LINEAR_SIZES[0][0], generator=torch.Generator().manual_seed(seed))
    model(x).pow(2).mean().backward()
    optim.step()
    optim.zero_grad()


def train_inputs() -> torch.Tensor:
    return torch.randn(4, LINEAR_SIZES[0][0], generator=torch.Generator().manual_seed(1234))


def full(t: torch.Tensor) -> torch.Tensor:
    """The full value of a (D)Tensor (a collective for a DTensor: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def params_full(model: torch.nn.Module) -> dict[str, list[Any]]:
    return {n: full(p.detach()).tolist() for n, p in model.named_parameters()}


def optim_full(model: torch.nn.Module, optim: torch.optim.Optimizer, field: str) -> dict[str, Any]:
    out = {}
    for n, p in model.named_parameters():
        value = optim.state[p][field]
        out[n] = full(value).tolist()
    return out


def attempt(fn: Callable[[], Any], *, keep_value: bool = False) -> dict[str, Any]:
    """Run ``fn`` and describe the outcome for a JSON report: ``raised`` (the engine error's
    class name, ``NOT-ENGINE:module.Class`` for anything else, which a test treats as a
    failure), ``message``, ``missing`` (the late ranks of an engine error that names them),
    ``value`` (``fn``'s result, with ``keep_value``) and ``seconds``."""
    from ckpt_engine import CkptEngineError

    t0 = time.monotonic()
    out: dict[str, Any] = {"raised": None, "message": ""}
    try:
        value = fn()
        if keep_value:
            out["value"] = value
    except CkptEngineError as err:
        out = {"raised": type(err).__name__, "message": str(err), "missing": list(getattr(err, "missing", ()))}
    except BaseException as err:  # a non-engine error (e.g. DCP's CheckpointException) is a failure
        out = {"raised": f"NOT-ENGINE:{type(err).__module__}.{type(err).__name__}", "message": str(err)}
    out["seconds"] = round(time.monotonic() - t0, 2)
    return out


def wait_for_file(path: str, limit_s: float = 120.0) -> bool:
    """Poll for ``path``, a file another rank writes when it has done something: one rank waits
    on another's progress. ``limit_s`` is a hang guard only; returns whether the file appeared."""
    end = time.monotonic() + limit_s
    while not os.path.exists(path):
        if time.monotonic() > end:
            return False
        time.sleep(0.05)
    return True
