"""``ckpt-engine demo``: train, get killed with SIGKILL in the middle of a save, resume, compare.

1. A worker process trains the model for ``--steps`` steps without interruption: the reference.
2. The same worker then trains the same model from scratch with a checkpoint every
   ``--save-every`` steps (async with the ``pinned_staging`` plugin when it is installed, else
   synchronous). From step ``--kill-at`` on, it watches its next save; as soon as the save has
   started writing files, it pauses itself (SIGSTOP) and the demo kills it, and every process
   under it, with SIGKILL: the save is never committed.
3. A fresh worker process resumes from ``latest_checkpoint.txt`` and trains to the end.
4. The resumed losses must equal the reference losses, bit for bit, step for step.

``--ranks 2`` runs every worker under ``torchrun`` with 2 gloo ranks and an FSDP2-sharded model.
Workers talk to the demo through ``DEMO {json}`` lines on stdout.

The parts, one job each: ``settings`` (options and defaults), ``job`` (model, data, training
step), ``worker`` (the process that trains and saves), ``supervisor`` (starting workers, reading
their events, killing process trees), ``narration`` (what the user sees) and ``plot``.
"""

from __future__ import annotations

from .narration import run_demo, run_demo_safely
from .settings import FAST, Settings, add_demo_arguments, check_settings, settings_from_args
from .supervisor import DemoFailure
from .worker import worker_main

__all__ = [
    "FAST",
    "DemoFailure",
    "Settings",
    "add_demo_arguments",
    "check_settings",
    "run_demo",
    "run_demo_safely",
    "settings_from_args",
    "worker_main",
]
