"""2 ranks, started without torchrun's agent (which would kill rank 0 as soon as rank 1 dies):
rank 1 is SIGKILLed or SIGSTOPped at one collective of the save of iteration 3.

argv: save_dir, signal ("KILL" or "STOP"), step (the collective at which rank 1 is hit:
``commit``, before rank 0 commits, or ``committed``, after it). Rank 1 signals itself when it
reaches that barrier. Rank 0 reports what ``save(3)`` raised (type, message, ``committed``), what
``latest_checkpoint.txt`` names, then what ``save(4)`` raised.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

import torch
from _common import ckpt_test_exit, init, report

from ckpt_engine import CheckpointEngine, CkptEngineError
from ckpt_engine._dcpio import watch as watch_module


def outcome(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except Exception as err:  # the test checks the type
        return {
            "type": type(err).__name__,
            "typed": isinstance(err, CkptEngineError),
            "message": str(err),
            "committed": getattr(err, "committed", "absent"),
        }
    return {"type": None}


def main() -> None:
    save_dir, sig, step = sys.argv[1], sys.argv[2], sys.argv[3]
    rank, _ = init()
    model = torch.nn.Linear(8, 8)
    engine = CheckpointEngine({"save_dir": save_dir, "collective_timeout_s": 3})
    engine.save(1, model=model)
    engine.save(2, model=model)
    barrier = watch_module.CollectiveWatch._barrier

    pid_file = os.path.join(save_dir, "rank1.pid")

    def hit(self: Any, name: str) -> None:
        if rank == 1 and name == step and not os.path.exists(pid_file):
            with open(pid_file, "w") as f:
                f.write(str(os.getpid()))
            os.kill(os.getpid(), getattr(signal, f"SIG{sig}"))
        barrier(self, name)

    watch_module.CollectiveWatch._barrier = hit  # type: ignore[method-assign]
    third = outcome(lambda: engine.save(3, model=model))
    with open(os.path.join(save_dir, "latest_checkpoint.txt")) as f:
        latest = f.read().strip()
    fourth = outcome(lambda: engine.save(4, model=model))
    report({"rank": rank, "third": third, "latest": latest, "fourth": fourth})
    if rank == 0 and sig == "STOP":
        # Wake the stopped rank and keep the job's store (hosted here) up until it has reported.
        with open(pid_file) as f:
            os.kill(int(f.read()), signal.SIGCONT)
        done = os.path.join(os.environ["CKPT_TEST_RESULTS_DIR"], "rank1.jsonl")
        for _ in range(600):
            if os.path.exists(done):
                break
            time.sleep(0.1)
    ckpt_test_exit(0)


if __name__ == "__main__":
    main()
