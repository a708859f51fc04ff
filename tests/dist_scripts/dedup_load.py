"""Loads with ``dedup_reads`` (reads several ranks share: each byte read once, then broadcast).

argv: JSON objects ``{"mode": ..., "config": {engine config}, ...}``, run one after another in one
launch (each from the seed a fresh process has). Modes:

* ``replicated``: load the plain model + AdamW of a checkpoint one process wrote (``load_path``
  in ``config``) into every rank, with ``dedup_reads: off`` and then ``on``; then the same
  load into a model with one layer too wide (strict: every rank must raise the same error).
  Reports, rank-ordered, each load's ``bytes_read`` and a SHA-256 of every loaded tensor.
* ``fsdp_save`` / ``fsdp_load``: save / load (``dedup_reads`` from ``config``) an FSDP2 model +
  AdamW of seed ``seed`` (``hsdp``: HSDP, 2 replicas of FSDP2 over half the ranks); a load
  reports the full parameters and exp_avg values and its ``bytes_read``, under the spec's
  ``name``.
* ``fault``: like ``replicated`` with ``dedup_reads: on``, but rank ``victim`` sends itself
  ``signal`` (KILL or STOP) just before its ``at``-th broadcast of the shared reads. The
  survivors report what ``load()`` raised and how long each barrier that carried the failed
  broadcast's deadline waited; with STOP, rank 0 then wakes the stopped rank and waits for its
  report.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from typing import Any

import torch
from _common import (
    ckpt_test_exit,
    cpu_mesh,
    full,
    init,
    make_model,
    report,
    report_ordered,
    shard_fsdp2,
    step,
)

from ckpt_engine import CheckpointEngine, CkptEngineError
from ckpt_engine._dcpio import dedup_read
from ckpt_engine._dcpio.watch import CollectiveWatch

#: Layers of the replicated model: several items of a few KiB to a few hundred KiB each.
SIZES = ((64, 256), (256, 512), (512, 64), (64, 8))


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def replicated_state(width: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed=123, sizes=SIZES)
    if width:  # one layer too wide: strict loading must refuse it
        model[-1] = torch.nn.Linear(SIZES[-1][0], SIZES[-1][1] + width)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(4, SIZES[0][0], generator=torch.Generator().manual_seed(3))
    model(x).pow(2).mean().backward()  # optimizer state that the load must overwrite
    optim.step()
    optim.zero_grad()
    return model, optim


def hashes(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, str]:
    out = {f"param {n}": digest(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in optim.state[p].items():
            out[f"optim {n} {key}"] = digest(value)
    return out


def outcome(fn: Any) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        fn()
    except Exception as err:  # the test checks type and message
        return {
            "type": type(err).__name__,
            "typed": isinstance(err, CkptEngineError),
            "message": str(err),
            "seconds": time.monotonic() - t0,
        }
    return {"type": None, "seconds": time.monotonic() - t0}


def replicated(spec: dict[str, Any]) -> None:
    out: dict[str, Any] = {}
    for mode in ("off", "on"):
        model, optim = replicated_state()
        with CheckpointEngine({**spec["config"], "dedup_reads": mode}) as engine:
            result = engine.load(model=model, optimizer=optim)
        out[mode] = {"bytes_read": result.bytes_read, "hashes": hashes(model, optim), "iteration": result.iteration}
    wide, _ = replicated_state(width=8)
    with CheckpointEngine({**spec["config"], "dedup_reads": "on"}) as engine:
        out["strict"] = outcome(lambda: engine.load(model=wide))
    report_ordered(out)


def fsdp(spec: dict[str, Any]) -> None:
    mesh = cpu_mesh()
    if spec.get("hsdp"):  # 2 replicas of an FSDP2 group of world / 2 ranks
        from torch.distributed.device_mesh import init_device_mesh

        world = torch.distributed.get_world_size()
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    model = shard_fsdp2(make_model(seed=spec["seed"]), mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    step(model, optim, spec["seed"])
    with CheckpointEngine(spec["config"]) as engine:
        if spec["mode"] == "fsdp_save":
            engine.save(spec["iteration"], model=model, optimizer=optim)
            result = None
        else:
            result = engine.load(model=model, optimizer=optim)
    values = {n: full(p.detach()).tolist() for n, p in model.named_parameters()}
    avg = {n: full(optim.state[p]["exp_avg"]).tolist() for n, p in model.named_parameters()}
    report_ordered(
        {
            "params": values,
            "exp_avg": avg,
            "bytes_read": result.bytes_read if result else None,
            "components": list(result.components) if result else [],
            "name": spec.get("name", spec["mode"]),
        }
    )


def fault(spec: dict[str, Any], rank: int) -> None:
    pid_file = os.path.join(spec["work"], "victim.pid")
    calls = [0]
    broadcast = dedup_read._broadcast

    def hit(tensor: torch.Tensor, src: int, group: Any) -> None:
        calls[0] += 1
        if rank == spec["victim"] and calls[0] == spec["at"]:
            with open(pid_file, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), getattr(signal, f"SIG{spec['signal']}"))
        broadcast(tensor, src, group)

    dedup_read._broadcast = hit  # type: ignore[assignment]
    # How long each barrier given a deadline by the failed broadcast (``expect_by``) waited: what
    # the rank had left of the broadcast's timeout, not a whole new one.
    roll_waits: list[float] = []
    wait_s = CollectiveWatch._wait_s

    def recorded(watch: CollectiveWatch) -> float:
        shortened = watch._deadline is not None
        seconds = wait_s(watch)
        if shortened:
            roll_waits.append(seconds)
        return seconds

    CollectiveWatch._wait_s = recorded  # type: ignore[method-assign]
    model, optim = replicated_state()
    with CheckpointEngine({**spec["config"], "dedup_reads": "on"}) as engine:
        got = outcome(lambda: engine.load(model=model, optimizer=optim))
    report({"rank": rank, "load": got, "roll_waits": roll_waits})
    if rank == 0 and spec["signal"] == "STOP":
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGCONT)
        done = os.path.join(os.environ["CKPT_TEST_RESULTS_DIR"], f"rank{spec['victim']}.jsonl")
        for _ in range(300):
            if os.path.exists(done):
                break
            time.sleep(0.1)
    ckpt_test_exit(0)


def main() -> None:
    rank, _ = init()
    for arg in sys.argv[1:]:
        spec: dict[str, Any] = json.loads(arg)
        torch.manual_seed(0)  # as init() leaves a fresh process
        if spec["mode"] == "replicated":
            replicated(spec)
        elif spec["mode"] in ("fsdp_save", "fsdp_load"):
            fsdp(spec)
        else:
            fault(spec, rank)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
