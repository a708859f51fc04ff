"""The node-local tier benchmark's 2-rank worker (``benchmarks/tier_bench.py`` runs it under
``torch.distributed.run --standalone --nproc_per_node 2``): each rank is a node of its own
(``ranks_per_node: 1``) with its ``local_dir`` on tmpfs. Rank 0 prints one ``RESULT {json}`` line.

``spec`` (JSON, argv[1]): ``mib`` (state per rank: parameters plus AdamW's two moments),
``rounds``, ``work`` (a folder on disk), ``shm`` (a folder on tmpfs), ``s3`` (endpoint, key,
secret, bucket; or null), ``phases`` (of ``blocked``, ``step``, ``recover``), ``smoke`` (the
test suite's run: no untimed warm-up round or block, and the step phase's engine with replicas
is the blocked phase's local-tier engine, same configuration, so no second writer per rank
starts; the measured runs never do either).

* ``blocked``: ``save()``'s blocked seconds of an async durable save (``pinned_staging`` to
  ``save_dir``), of a local-tier save (``pinned_staging`` to ``local_dir``, replicated) and of a
  local-tier save with the default synchronous write, in alternating rounds (the replicas of
  each round copied before the next, untimed), and the copy floor (the same bytes into
  preallocated buffers);
* ``step``: a training loop whose step computes for ``compute_ms`` and then waits ``idle_ms``
  (standing for time on an accelerator: CPU to spare), a local-tier save every ``save_every``
  steps, without and with peer replicas in alternating blocks: the step time of each;
* ``recover``: ``load()`` seconds (the slowest rank) after a restart (local tier intact), after a
  node loss (node 1's ``local_dir`` wiped: its part comes from node 0's replica), and from
  ``save_dir`` alone on disk and on the S3 server.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ckpt_engine import CheckpointEngine

warnings.filterwarnings("ignore")
MIB = 2**20
#: the smoke run's local-tier engine, handed from the blocked phase to the step phase
_KEPT: dict[str, CheckpointEngine] = {}


class Model(nn.Module):
    """Parameters of ``mib / 3`` MiB in 48 tensors (AdamW's moments make the state ``mib``)."""

    def __init__(self, mib: float, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        numel = max(1, int(mib * MIB / 3) // 4 // 48)
        self.params = nn.ParameterList([nn.Parameter(torch.randn(numel, generator=gen)) for _ in range(48)])


def _state(mib: float, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = Model(mib, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _train(model, opt)
    return model, opt


def _train(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    """One optimizer step (every byte of the state changes, as in training)."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    opt.step()


def _slowest(seconds: float) -> float:
    box = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(box, op=dist.ReduceOp.MAX)
    return float(box.item())


def _config(spec: dict[str, Any], name: str, *, local: bool, **extra: Any) -> dict[str, Any]:
    rank = dist.get_rank()
    cfg: dict[str, Any] = {"save_dir": os.path.join(spec["work"], name), "collective_timeout_s": 600}
    # Each rank's state is its own (as a shard is), so every byte of it is saved, replicated and
    # recovered: declared per rank, or the save's check refuses it as diverged replicated state.
    cfg["per_rank_keys"] = ["model.*", "optim.state.*"]
    if local:
        cfg.update(local_dir=os.path.join(spec["shm"], name, f"node{rank}"), ranks_per_node=1)
    cfg.update(extra)
    return cfg


def copy_floor(model: nn.Module, opt: torch.optim.Optimizer, rounds: int) -> float:
    sources = [p.detach() for p in model.parameters()]
    sources += [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim()]
    buffers = [torch.empty_like(t) for t in sources]
    times = []
    for _ in range(rounds + 1):
        t0 = time.perf_counter()
        for b, t in zip(buffers, sources, strict=True):
            b.copy_(t)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def blocked(spec: dict[str, Any]) -> dict[str, Any]:
    model, opt = _state(spec["mib"], seed=dist.get_rank())
    async_cfg = _config(spec, "blocked-durable", local=False, plugins=["pinned_staging"], keep_last=1)
    local_cfg = _config(spec, "blocked-local", local=True, plugins=["pinned_staging"], persist_every=10**6, keep_last=1)
    sync_cfg = _config(spec, "blocked-sync", local=True, persist_every=10**6)
    durable, local, sync = CheckpointEngine(async_cfg), CheckpointEngine(local_cfg), CheckpointEngine(sync_cfg)
    durable.wait_ready()
    local.wait_ready()
    out: dict[str, list[float]] = {"durable_async": [], "local": [], "local_sync": []}
    engines = (("durable_async", durable), ("local", local), ("local_sync", sync))
    warm = 0 if spec.get("smoke") else 1
    for it in range(1, spec["rounds"] + 1 + warm):  # round 1 (but in smoke): buffers allocated, untimed
        for name, engine in engines:
            _train(model, opt)
            dist.barrier()
            result = engine.save(it, model=model, optimizer=opt).result()
            engine.wait_replicated()
            if it > warm:
                out[name].append(_slowest(result.blocked_seconds))
    for name, engine in engines:
        if name == "local" and spec.get("smoke") and "step" in spec["phases"]:
            _KEPT["replicas"] = engine  # the step phase's "replicas" engine: its configuration
        else:
            engine.close()
    floor = _slowest(copy_floor(model, opt, spec["rounds"]))
    return {"floor_s": floor, **{f"{k}_s": statistics.median(v) for k, v in out.items()}, "runs": out}


def _steps(
    engine: CheckpointEngine, model: nn.Module, opt: torch.optim.Optimizer, spec: dict[str, Any], first: int
) -> list[float]:
    """``spec['block']`` steps with a save every ``save_every``; each step's seconds (without the
    time inside ``save()``: what replication adds is what the step itself loses)."""
    a = torch.randn(256, 256)
    times = []
    for n in range(spec["block"]):
        t0 = time.perf_counter()
        end = t0 + spec["compute_ms"] / 1000
        while time.perf_counter() < end:
            a = torch.tanh(a @ a * 1e-3)
        time.sleep(spec["idle_ms"] / 1000)
        _train(model, opt)
        times.append(time.perf_counter() - t0)
        if (n + 1) % spec["save_every"] == 0:
            engine.save(first + n, model=model, optimizer=opt)
    engine.wait()
    return times


def step(spec: dict[str, Any]) -> dict[str, Any]:
    model, opt = _state(spec["mib"], seed=dist.get_rank())
    kept = _KEPT.pop("replicas", None)  # the smoke run: the blocked phase's, past its iterations
    engines = {
        "no_replicas": CheckpointEngine(
            _config(spec, "step-none", local=True, plugins=["pinned_staging"], persist_every=10**6, peer_replicas=0)
        ),
        "replicas": kept
        or CheckpointEngine(
            _config(spec, "step-peer", local=True, plugins=["pinned_staging"], persist_every=10**6, peer_replicas=1)
        ),
    }
    for engine in engines.values():
        engine.wait_ready()
    times: dict[str, list[float]] = {k: [] for k in engines}
    first = 1 if kept is None else spec["rounds"] + 2
    warm = 0 if spec.get("smoke") else 1
    for block in range(spec["rounds"] + warm):
        for name, engine in engines.items():
            dist.barrier()
            got = _steps(engine, model, opt, spec, first)
            first += spec["block"]
            if block >= warm:  # block 0 (but in smoke) warms the writers and buffers up
                times[name] += got
    for engine in engines.values():
        engine.close()
    mean = {k: _slowest(statistics.mean(v)) for k, v in times.items()}
    return {f"{k}_step_s": v for k, v in mean.items()} | {"slowdown": mean["replicas"] / mean["no_replicas"] - 1}


def _timed_load(cfg: dict[str, Any], mib: float) -> tuple[float, dict[str, int], int]:
    model, opt = _state(mib, seed=99)
    dist.barrier()
    t0 = time.perf_counter()
    with CheckpointEngine(cfg) as engine:
        result = engine.load(model=model, optimizer=opt)
    seconds = _slowest(time.perf_counter() - t0)
    return seconds, dict(result.bytes_by_source), result.iteration


def recover(spec: dict[str, Any]) -> dict[str, Any]:
    rank = dist.get_rank()
    model, opt = _state(spec["mib"], seed=rank)
    tier = _config(spec, "recover", local=True, persist_every=1)  # the saved step is in both tiers
    durable = _config(spec, "recover", local=False)
    with CheckpointEngine(tier) as engine:
        engine.save(1, model=model, optimizer=opt)
        engine.wait_replicated()
    configs = {"restart": tier, "node_loss": tier, "durable_disk": durable}
    if spec["s3"] is not None:
        s3 = spec["s3"]
        storage = {"endpoint_url": s3["endpoint"], "access_key_id": s3["key"], "secret_access_key": s3["secret"]}
        s3_cfg = {"save_dir": f"s3://{s3['bucket']}/recover", "storage": storage, "collective_timeout_s": 600}
        s3_cfg["per_rank_keys"] = _config(spec, "recover", local=False)["per_rank_keys"]
        with CheckpointEngine(s3_cfg) as engine:
            engine.save(1, model=model, optimizer=opt)
        configs["durable_s3"] = s3_cfg
    out: dict[str, list[float]] = {k: [] for k in configs}
    sources: dict[str, Any] = {}
    for _ in range(spec["rounds"]):
        for name, cfg in configs.items():
            if name == "node_loss" and rank == 1:
                shutil.rmtree(cfg["local_dir"])
            seconds, by_source, iteration = _timed_load(cfg, spec["mib"])
            assert iteration == 1, (name, iteration)
            out[name].append(seconds)
            every: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(every, by_source)
            sources[name] = every
    return {f"{k}_s": statistics.median(v) for k, v in out.items()} | {"runs": out, "bytes_by_source": sources}


def main() -> None:
    spec = json.loads(sys.argv[1])
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    result: dict[str, Any] = {"mib": spec["mib"]}
    for phase in spec["phases"]:
        result[phase] = {"blocked": blocked, "step": step, "recover": recover}[phase](spec)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
