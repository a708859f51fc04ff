"""A save to S3 that is SIGKILLed mid-upload (run by tests/storage/test_object_store.py).

``python s3_killed_save.py CONFIG_JSON FLAG_FILE``: saves iteration 1 completely, then starts
iteration 2 and, once its first data object is uploaded, creates FLAG_FILE and waits to be
killed. The wait is the only test hook: it makes the kill land between the first upload and the
completion marker every time, instead of by chance.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from ckpt_engine import CheckpointEngine
from ckpt_engine._storage.store import FsspecStore
from ckpt_engine.testing import TinyTrainingState

config, flag = json.loads(sys.argv[1]), sys.argv[2]
state = TinyTrainingState.create(seed=1, hidden=64)
with CheckpointEngine(config) as engine:
    engine.save(1, **state.objects())

real_upload = FsspecStore.upload


def upload_then_hang(self: FsspecStore, local: str, remote: str, part_concurrency: int = 1) -> int:
    real_upload(self, local, remote, part_concurrency)
    with open(flag, "w") as f:
        f.write(remote)
    while True:
        time.sleep(1)


FsspecStore.upload = upload_then_hang  # type: ignore[method-assign]
state.train(1)
torch.manual_seed(0)
engine = CheckpointEngine(config)
engine.save(2, **state.objects())
print("not killed", file=sys.stderr)
sys.exit(3)
