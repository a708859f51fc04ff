"""2 ranks: load Hugging Face safetensors shards (bf16) into an FSDP2 model through ``load_path``.

argv: work dir. Rank 0 writes ``hf/`` (2 shards + index, bf16) and ``full.pt`` (the fp32 values
the load must give); each rank then loads, reports whether its local shards match, how many
tensor bytes its second load read (the reader's count, and ``rchar`` from ``/proc/self/io``; the first
load imports what a load needs) against the
total, and finally the model is saved as a 2-rank DCP checkpoint in ``ckpt/`` for the test to
convert back. Last, a load whose ``pre_load_plan`` skips ``0.bias`` on rank 1 only: every rank
must refuse it (``diverged``) and leave the model as it was.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from _common import ckpt_test_exit, cpu_mesh, init, local, make_model, report, shard_fsdp2
from safetensors.torch import save_file
from torch.distributed.tensor import distribute_tensor

from ckpt_engine import CheckpointEngine, hookimpl
from ckpt_engine._dcpio import hf_read

#: Large enough that the bytes read dominate anything else the load reads.
SIZES = ((512, 1024), (1024, 256), (256, 1))


class SkipOnRank1:
    name = "skip_on_rank_1"

    @hookimpl
    def pre_load_plan(self, ctx: Any, entries: Any) -> Any:
        if ctx.rank != 1:
            return None
        return [e.skip("keep rank 1's own") if e.dest_key == "0.bias" else e for e in entries]


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def main() -> None:
    work = sys.argv[1]
    rank, _ = init()
    hf = os.path.join(work, "hf")
    if rank == 0:
        os.makedirs(hf)
        src = {k: v.to(torch.bfloat16) for k, v in make_model(seed=3, sizes=SIZES).state_dict().items()}
        keys = sorted(src)
        weight_map = {}
        for i, part in enumerate((keys[0::2], keys[1::2])):
            name = f"model-{i + 1:05d}-of-00002.safetensors"
            save_file({k: src[k] for k in part}, os.path.join(hf, name), metadata={"format": "pt"})
            weight_map |= dict.fromkeys(part, name)
        with open(os.path.join(hf, "model.safetensors.index.json"), "w") as f:
            json.dump(
                {"metadata": {"total_size": sum(v.numel() * 2 for v in src.values())}, "weight_map": weight_map}, f
            )
        torch.save({k: v.float() for k, v in src.items()}, os.path.join(work, "full.pt"))
    dist.barrier()
    expected = torch.load(os.path.join(work, "full.pt"), weights_only=True)
    mesh = cpu_mesh()
    model = shard_fsdp2(make_model(seed=0, sizes=SIZES), mesh)

    counted: list[int] = []
    original = hf_read.SafetensorsReader.read_data

    def counting(self: hf_read.SafetensorsReader, plan, planner):  # type: ignore[no-untyped-def]
        out = original(self, plan, planner)
        counted.append(self.bytes_read)
        return out

    hf_read.SafetensorsReader.read_data = counting  # type: ignore[method-assign]
    with CheckpointEngine({"save_dir": os.path.join(work, "ckpt"), "load_path": hf}) as engine:
        engine.load(model=shard_fsdp2(make_model(seed=1, sizes=SIZES), mesh))  # imports done: rchar counts data
        counted.clear()
        before = rchar()
        result = engine.load(model=model)
        read = rchar() - before
        exact = True
        for name, p in model.named_parameters():
            want = local(distribute_tensor(expected[name], mesh, p.placements))
            exact &= bool(torch.equal(local(p.detach()), want))
        engine.save(1, model=model)
    # A pre_load_plan that keeps rank 1's own 0.bias: both ranks refuse the load, nothing changes.
    fresh = shard_fsdp2(make_model(seed=2, sizes=SIZES), mesh)
    before = [local(p.detach()).clone() for p in fresh.parameters()]
    with CheckpointEngine(
        {"save_dir": os.path.join(work, "ckpt2"), "load_path": hf}, plugins=[SkipOnRank1()]
    ) as engine:
        try:
            engine.load(model=fresh)
            diverged = "no error"
        except Exception as err:  # the test checks the type
            diverged = type(err).__name__
    unchanged = all(torch.equal(a, local(p.detach())) for a, p in zip(before, fresh.parameters(), strict=True))
    total = sum(v.numel() * 2 for v in expected.values())
    report(
        {
            "exact": exact,
            "source": result.source,
            "cast": sorted(result.report["model"].cast),
            "floats": sorted(expected),
            "bytes_read": counted[0],
            "rchar": read,
            "total": total,
            "diverged": diverged,
            "diverged_unchanged": unchanged,
        }
    )
    dist.barrier()


if __name__ == "__main__":
    main()
    ckpt_test_exit()
