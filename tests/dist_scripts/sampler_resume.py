"""One epoch of a sampled dataset under torchrun, saved and resumed through the engine with the
sampler as an extra component (``extra={"sampler": sampler}``).

argv: SAVE_DIR SAVE_AT STOP_AT [--replay]. Resumes from SAVE_DIR's latest checkpoint (a fresh
start without one) and trains on a ``DataLoader`` with ``num_workers=2`` over a
``ResumableDistributedSampler``, reporting each batch to the sampler with ``advance``; saves at
iteration SAVE_AT and stops after iteration STOP_AT (0: neither; the epoch's end stops it anyway).
With ``--replay``, a second job in the same processes (new model, sampler and loader) then resumes
from the latest checkpoint and trains to the epoch's end. Reports, per rank: the iteration each
job resumed from, the indices of each batch it trained on (with the iteration), the sampler's
state when it saved and at the end.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from _common import ckpt_test_exit, init, report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt_engine import CheckpointEngine
from ckpt_engine.data import ResumableDistributedSampler

N = 120  # divides evenly among 2, 3 and 4 ranks at the positions the test saves at
BATCH = 3


def job(save_dir: str, save_at: int, stop_at: int) -> dict[str, Any]:
    """A training job over one epoch, as docs/data.md writes it."""
    dataset = TensorDataset(torch.arange(N), torch.randn(N, 4, generator=torch.Generator().manual_seed(0)))
    sampler = ResumableDistributedSampler(dataset, seed=5)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2)
    # data parallel, as a sampler over ranks is used: DDP keeps the replicas identical (the ranks'
    # gradients averaged), as the engine's per-rank state check requires of plain tensors
    model = nn.parallel.DistributedDataParallel(nn.Linear(4, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    out: dict[str, Any] = {"batches": []}
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        it = out["resumed_from"] = engine.load(model=model, optimizer=optimizer, extra={"sampler": sampler}).iteration
        for epoch in range(sampler.epoch, 1):
            sampler.set_epoch(epoch)
            for index, x in loader:
                model(x).pow(2).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
                sampler.advance(len(index))  # the samples this step trained on; prefetched ones are not
                it += 1
                out["batches"].append([it, index.tolist()])
                if it == save_at:
                    engine.save(it, model=model, optimizer=optimizer, extra={"sampler": sampler})
                    out["saved_state"] = sampler.state_dict()
                if it == stop_at:
                    break
    out["end_state"] = sampler.state_dict()
    return out


def main() -> None:
    init()
    save_dir, save_at, stop_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out = job(save_dir, save_at, stop_at)
    if "--replay" in sys.argv[4:]:
        out["replay"] = job(save_dir, 0, 0)
    report(out)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
