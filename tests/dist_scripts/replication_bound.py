"""Replication behind a slow link on 2 gloo ranks as 2 nodes (``ranks_per_node: 1``): every save
replicates to the other node through ``peer_bandwidth_mb_s`` (far slower than the saves).

``run BASE MODES STEPS``: a model (1 MB, and AdamW's 2 MB) per rank saved ``STEPS`` times back to back with
``replication_when_behind: MODE`` and the defaults ``replication_max_in_flight: 2``,
``local_keep_last: 2``. After every save it reports the replication rounds this rank has in
flight (that pin a step) and the steps its local folder holds; at the end, how many saves
skipped replication (their warnings), and the steps held once replication caught up.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import torch
from _common import ckpt_test_exit, init, make_model, report, step

from ckpt_engine import CheckpointEngine


class _Skips(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "is not replicated" in record.getMessage():
            self.count += 1


def _held(folder: str) -> list[int]:
    return sorted(int(n.split("_")[1]) for n in os.listdir(folder) if n.startswith("iter_"))


def run(base: str, mode: str, steps: int, rank: int) -> None:
    from ckpt_engine._tier import transfer

    transfer.CHUNK_BYTES = 64 << 10  # small chunks: the throttle paces each round evenly
    skips = _Skips()
    logging.getLogger("ckpt_engine").addHandler(skips)
    model = make_model(seed=3 + rank, sizes=((8, 512), (512, 512), (512, 8)))  # about 3 MB a round
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    local_dir = os.path.join(base, mode, f"node{rank}")
    config: dict[str, Any] = {
        "save_dir": os.path.join(base, mode, "durable"),
        "local_dir": local_dir,
        "ranks_per_node": 1,
        "persist_every": 1000,
        "peer_bandwidth_mb_s": 1.0,
        "replication_when_behind": mode,
        "collective_timeout_s": 120,
        # Each rank's state differs on purpose (so that every byte of it travels): declared per rank,
        # or the save's per-rank state check rightly refuses it as diverged replicated state.
        "per_rank_keys": ["model.*", "optim.state.*"],
    }
    own = os.path.join(local_dir, f"rank_{rank:05d}")
    saves = []
    with CheckpointEngine(config) as engine:
        for it in range(1, steps + 1):
            step(model, optim, seed=100 * rank + it)  # each rank its own bytes: all of them travel
            engine.save(it, model=model, optimizer=optim).result()
            replicator = engine._tiers.nearer[0]._replicator  # what pins steps: asserted by the test
            saves.append({"in_flight": len(replicator.in_flight()), "held": len(_held(own))})
        engine.wait_replicated()
        after = _held(own)
    report({"mode": mode, "saves": saves, "skipped": skips.count, "held_after": after})


def main() -> None:
    rank, _ = init()
    base, steps = sys.argv[1], int(sys.argv[3])
    for mode in sys.argv[2].split(","):
        run(base, mode, steps, rank)
    ckpt_test_exit()


if __name__ == "__main__":
    main()
