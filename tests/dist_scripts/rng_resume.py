"""Two ranks with different random state save it (``rng: true``), draw on, then scramble their
generators, load, and draw again: each rank must get its own draws back.

argv: save_dir. Reports, per rank: {"after_save": [...], "after_load": [...]}.
"""

from __future__ import annotations

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


def main() -> None:
    rank, _ = init()
    save_dir = sys.argv[1]
    torch.manual_seed(0)
    model = nn.Linear(4, 4)  # the same weights on every rank, as data parallelism holds them
    random.seed(100 + rank)
    np.random.seed(200 + rank)
    torch.manual_seed(300 + rank)
    draws()
    with CheckpointEngine({"save_dir": save_dir, "rng": True, "strict_unexpected": True}) as engine:
        engine.save(1, model=model)
        after_save = draws()
        random.seed(7)
        np.random.seed(7)
        torch.manual_seed(7)
        result = engine.load(model=model)
        after_load = draws()
    report({"after_save": after_save, "after_load": after_load, "components": list(result.components)})
    ckpt_test_exit()


if __name__ == "__main__":
    main()
