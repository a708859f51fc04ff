"""2 ranks: an FSDP2 model with a frozen part, saved three times incrementally (sync, then
``pinned_staging`` when argv[2] says so), training the head in between.

argv: save_dir [plugin]. Reports per save this rank's ``bytes_written``, ``bytes_reused`` and
``carried_by``, and (rank 0) the SHA-256 of every full parameter after each save, which the test
compares with what plain ``dcp.load`` reads from each checkpoint in one process.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any

import torch
from _common import ckpt_test_exit, cpu_mesh, full, init, report_ordered

from ckpt_engine import CheckpointEngine

FROZEN = (1024, 2048)  # 8 MiB of fp32: each rank's shard (4 MiB) is a file of its own


def make() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(*FROZEN), torch.nn.ReLU(), torch.nn.Linear(FROZEN[1], 16))
    for p in model[0].parameters():
        p.requires_grad_(False)
    return model


def digest(model: torch.nn.Module) -> dict[str, str]:
    return {n: hashlib.sha256(full(p.detach()).numpy().tobytes()).hexdigest() for n, p in model.named_parameters()}


def main() -> None:
    save_dir = sys.argv[1]
    plugins: list[Any] = [sys.argv[2]] if len(sys.argv) > 2 else []
    init()
    from torch.distributed.fsdp import fully_shard

    mesh = cpu_mesh()
    model = make()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    x = torch.randn(4, FROZEN[0], generator=torch.Generator().manual_seed(1))
    saves, digests = [], []
    with CheckpointEngine({"save_dir": save_dir, "incremental": True, "plugins": plugins}) as engine:
        for it in (1, 2, 3):
            model(x).square().mean().backward()
            optim.step()
            optim.zero_grad()
            result = engine.save(it, model=model, optimizer=optim).result(timeout=120)
            saves.append(
                {
                    "ok": result.succeeded,
                    "written": result.bytes_written,
                    "reused": result.bytes_reused,
                    "how": result.carried_by,
                }
            )
            digests.append(digest(model))
    report_ordered({"saves": saves, "digests": digests})
    ckpt_test_exit()


if __name__ == "__main__":
    main()
