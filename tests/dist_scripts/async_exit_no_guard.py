"""A training script with no ``if __name__ == "__main__":`` guard that never closes its engine.

argv: save_dir. It saves iteration 1, pauses its writer process (SIGSTOP) so that the next save
is certainly still in flight, saves iteration 2, overwrites the weights, schedules a SIGCONT for
one second later and ends. Interpreter exit must still commit iteration 2. A writer that
re-imported this script (multiprocessing's spawn does) would print a second RESULT line.
"""

import json
import os
import signal
import sys
import threading

import torch
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin

from ckpt_engine import CheckpointEngine

torch.manual_seed(0)
model = torch.nn.Linear(32, 32)
plugin = PinnedStagingPlugin()
engine = CheckpointEngine({"save_dir": sys.argv[1]}, plugins=[plugin])
engine.save(1, model=model).result(timeout=60)
writer_pid = plugin.writer_pid
assert writer_pid is not None
os.kill(writer_pid, signal.SIGSTOP)
handle = engine.save(2, model=model)
weight_sum = model.weight.sum().item()
with torch.no_grad():
    model.weight.add_(1.0)
timer = threading.Timer(1.0, os.kill, (writer_pid, signal.SIGCONT))
timer.daemon = True
timer.start()
report = {
    "pid": os.getpid(),
    "writer_pid": writer_pid,
    "pending_at_exit": not handle.done(),
    "weight_sum": weight_sum,
    "weight_sum_after": model.weight.sum().item(),
}
print("RESULT " + json.dumps(report), flush=True)
