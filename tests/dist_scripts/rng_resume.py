"""Two ranks with different random state save it (``rng`` is on by default), draw on, then
scramble their generators, load, and draw again: each rank must get its own draws back. Then both
ranks resume a checkpoint one process saved (a resume into more ranks): rank 0 takes its state
back, rank 1 is seeded from it and its rank, the same on every load, with one warning in all.

argv: save_dir, one_rank_dir. Reports, per rank: {"after_save": [...], "after_load": [...],
"components": [...], "grown": [[...], [...]], "grown_components": [...], "warnings": n}.
"""

from __future__ import annotations

import logging
import random
import sys

import numpy as np
import torch
from _common import ckpt_test_exit, init, report
from torch import nn

from ckpt_engine import CheckpointEngine


def draws() -> list[float]:
    return [
        random.random(),
        random.gauss(0.0, 1.0),
        float(np.random.rand()),
        float(np.random.randn()),
        torch.rand(1).item(),
    ]


def scramble(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.n = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.n += "not bit-exact" in record.getMessage()


def main() -> None:
    rank, _ = init()
    save_dir, one_rank_dir = sys.argv[1], sys.argv[2]
    count = Count()
    logging.getLogger("ckpt_engine").addHandler(count)
    torch.manual_seed(0)
    model = nn.Linear(4, 4)  # the same weights on every rank, as data parallelism holds them
    scramble(100 + rank)
    draws()
    with CheckpointEngine({"save_dir": save_dir, "strict_unexpected": True}) as engine:
        engine.save(1, model=model)
        after_save = draws()
        scramble(7)
        result = engine.load(model=model)
        after_load = draws()
    assert count.n == 0, "a resume into the same world size is bit-exact"
    grown = []
    with CheckpointEngine({"save_dir": one_rank_dir, "strict_unexpected": True}) as engine:
        for seed in (11, 12):  # whatever the job did before: the load decides the draws
            scramble(seed + rank)
            grown_result = engine.load(model=model)
            grown.append(draws())
    report(
        {
            "after_save": after_save,
            "after_load": after_load,
            "components": list(result.components),
            "grown": grown,
            "grown_components": list(grown_result.components),
            "warnings": count.n,
        }
    )
    ckpt_test_exit()


if __name__ == "__main__":
    main()
