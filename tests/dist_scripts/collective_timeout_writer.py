"""2 ranks, ``pinned_staging``: a writer process that does not reach a collective is named.

argv: save_dir. ``collective_timeout_s`` is 3 s. Steps (each rank reports what it got):

* ``save_stopped``: after a first save, rank 1 stops its writer process (SIGSTOP) and both ranks
  save again. Rank 0's writer gives up at the writers' ``agree`` collective after 3 s, and rank
  0's ``result()`` raises ``CheckpointSaveError`` naming writer rank 1 and its last phase. Then
  rank 1 resumes its writer, which arrives late and fails that save on rank 1 too;
* ``save_again``: the next save succeeds on both ranks (the writers are replaced);
* ``closed``: ``close()`` returns on rank 0 while rank 1 waits outside the engine for it, then
  on rank 1: closing needs no other rank.
"""

from __future__ import annotations

import os
import signal
import sys

import torch
import torch.distributed as dist
from _common import attempt, ckpt_test_exit, cpu_mesh, make_model, report_ordered, shard_fsdp2, wait_for_file
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin

from ckpt_engine import CheckpointEngine

TIMEOUT_S = 3.0


def main() -> None:
    save_dir = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = shard_fsdp2(make_model(seed=1), cpu_mesh())
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    plugin = PinnedStagingPlugin()
    engine = CheckpointEngine(
        {"save_dir": os.path.join(save_dir, "ckpt"), "collective_timeout_s": TIMEOUT_S}, plugins=[plugin]
    )
    plugin.wait_ready(120)
    engine.save(1, model=model, optimizer=optim).result(timeout=120)
    writer = plugin.writer_pid
    assert writer is not None
    dist.barrier()
    if rank == 1:
        os.kill(writer, signal.SIGSTOP)
    handle = engine.save(2, model=model, optimizer=optim)
    if rank == 0:
        out = attempt(lambda: handle.result(timeout=60))
        dist.barrier()
    else:
        dist.barrier()  # rank 0's writer has given up: let this one arrive late
        os.kill(writer, signal.SIGCONT)
        out = attempt(lambda: handle.result(timeout=60))
    report_ordered({"step": "save_stopped", **out})
    report_ordered({"step": "save_again", **attempt(lambda: engine.save(3, model=model, optimizer=optim).result(60))})
    # Rank 1 closes only once rank 0's close() has returned: closing needs no other rank.
    closed = os.path.join(save_dir, "rank0-closed")
    if rank == 0:
        out = attempt(engine.close)
        with open(closed, "w"):
            pass
    else:
        out = {"waited_for_rank_0": wait_for_file(closed), **attempt(engine.close)}
    report_ordered({"step": "closed", **out})
    ckpt_test_exit()


if __name__ == "__main__":
    main()
