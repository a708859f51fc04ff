"""Loads with ``dedup_reads: on`` (each shared byte read by one rank, then broadcast) of a
checkpoint whose manifest has whole-file digests only, with one byte of its model file flipped.

argv: the checkpoint folder (``load_path``), a folder for ``save_dir``. Reports per rank what the
load raised (``None``: it loaded).
"""

from __future__ import annotations

import sys

from _common import ckpt_test_exit, init, report
from torch import nn

from ckpt_engine import CheckpointEngine


def main() -> None:
    init()
    checkpoint, save_dir = sys.argv[1], sys.argv[2]
    model = nn.Sequential(nn.Linear(64, 256), nn.Linear(256, 512), nn.Linear(512, 64))
    try:
        with CheckpointEngine({"save_dir": save_dir, "load_path": checkpoint, "dedup_reads": "on"}) as engine:
            engine.load(model=model)
        out = {"raised": None}
    except Exception as err:  # reported, compared by the test
        out = {"raised": type(err).__name__, "message": str(err)}
    report(out)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
