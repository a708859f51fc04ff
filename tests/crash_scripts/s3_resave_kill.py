"""A re-save of a committed iteration on S3 (``allow_overwrite``), SIGKILLed at one of its store
operations (run by tests/storage/test_s3_resave.py).

``python s3_resave_kill.py CONFIG_JSON KILL_AT``: re-saves iteration 1 with the state
``TinyTrainingState.create(seed=1, hidden=64)`` trained one step. Every operation that changes
the bucket (an upload, a write, a delete, a server-side copy) is counted; the ``KILL_AT``-th is
not performed: the process SIGKILLs itself instead, so the kill lands exactly between two of the
save's steps. ``KILL_AT`` 0 kills nothing and prints the operations, one per line, to stdout.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

from ckpt_engine import CheckpointEngine
from ckpt_engine._storage.store import FsspecStore
from ckpt_engine.testing import TinyTrainingState

config, kill_at = json.loads(sys.argv[1]), int(sys.argv[2])
MUTATING = ("upload", "write_bytes", "remove_file", "remove_files", "copy_files")
seen: list[str] = []


def counted(name: str, real: Any) -> Any:
    def op(self: FsspecStore, *args: Any, **kwargs: Any) -> Any:
        seen.append(f"{name} {str(args[0])[-60:]}")
        if len(seen) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    return op


for name in MUTATING:
    setattr(FsspecStore, name, counted(name, getattr(FsspecStore, name)))

state = TinyTrainingState.create(seed=1, hidden=64)
state.train(1)
with CheckpointEngine({**config, "allow_overwrite": True}) as engine:
    engine.save(1, **state.objects())
for line in seen:
    print(line)
sys.exit(0 if kill_at == 0 else 3)  # 3: the kill point was never reached
