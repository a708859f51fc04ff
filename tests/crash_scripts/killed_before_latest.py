"""A save SIGKILLed after its commit and before ``latest_checkpoint.txt`` moves (tests/engine/test_lost_work.py).

``python killed_before_latest.py CONFIG_JSON``: saves iteration 1, trains a step, then saves
iteration 2 and kills itself with SIGKILL the moment the commit moves ``latest`` for it (``move_latest``):
iteration 2 is committed (renamed into place locally, its manifest uploaded on an object store)
and the pointer still names iteration 1. The kill is real; only its moment is chosen, so that it
lands in that window every time instead of by chance (the window found by an outside
crash-consistency tool).
"""

from __future__ import annotations

import json
import os
import signal
import sys

from ckpt_engine import CheckpointEngine
from ckpt_engine._engine import targets
from ckpt_engine.testing import TinyTrainingState

config = json.loads(sys.argv[1])
state = TinyTrainingState.create(seed=1, hidden=64)
real_move = targets.move_latest


def move_or_die(folder: str, name: str, *args: object) -> None:
    if name.endswith("000000002"):
        os.kill(os.getpid(), signal.SIGKILL)
    real_move(folder, name, *args)  # type: ignore[arg-type]


targets.move_latest = move_or_die  # type: ignore[assignment]
with CheckpointEngine(config) as engine:
    engine.save(1, **state.objects()).result()
    state.train(1)
    engine.save(2, **state.objects()).result()
print("not killed", file=sys.stderr)
sys.exit(3)
