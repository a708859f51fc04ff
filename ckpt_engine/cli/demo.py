"""``ckpt-engine demo``: the demo (:mod:`ckpt_engine.demo`) as a command."""

from __future__ import annotations

import argparse

from ..demo import add_demo_arguments, run_demo_safely
from ._command import Command


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo_safely(args)


COMMAND = Command(
    name="demo",
    summary="train, SIGKILL mid-save, resume, check the losses match",
    example="ckpt-engine demo\nckpt-engine demo --fast\nckpt-engine demo --ranks 2 --steps 40 --out runs/demo2",
    description="Trains a small model with checkpoints every few steps (async with pinned_staging when "
    "installed), kills the training process with SIGKILL in the middle of a save, resumes from "
    "latest_checkpoint.txt in a fresh process, and checks that the resumed losses equal an "
    "uninterrupted run's, step for step.",
    add_arguments=add_demo_arguments,
    run=cmd_demo,
)
