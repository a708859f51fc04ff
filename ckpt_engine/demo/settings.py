"""The demo's settings: defaults, the ``--fast`` form, command-line options, and what makes a run possible."""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass

ASYNC_PLUGIN = "pinned_staging"


@dataclass(frozen=True)
class Settings:
    steps: int = 60
    save_every: int = 10
    kill_at: int = 43  # default_kill_at(Settings()): what the demo uses unless --kill-at is given
    hidden: int = 512
    layers: int = 6
    batch: int = 128
    in_dim: int = 32
    seed: int = 0
    lr: float = 1e-3


FAST = Settings(steps=12, save_every=3, kill_at=9, hidden=64, layers=2, batch=32)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--steps", type=int, help=f"training steps (default {d.steps}; --fast: {FAST.steps})")
    p.add_argument(
        "--save-every", type=int, help=f"checkpoint every N steps (default {d.save_every}; --fast: {FAST.save_every})"
    )
    p.add_argument("--hidden", type=int, help=f"model width (default {d.hidden}; --fast: {FAST.hidden})")
    p.add_argument("--layers", type=int, help=f"residual blocks (default {d.layers}; --fast: {FAST.layers})")
    p.add_argument("--batch", type=int, help=f"global batch size (default {d.batch}; --fast: {FAST.batch})")
    p.add_argument(
        "--kill-at",
        type=int,
        help="kill during the first save at or after this step (default: just past 70%% of --steps, "
        f"{default_kill_at(d)} for the defaults; --fast: {default_kill_at(FAST)})",
    )
    p.add_argument("--out", default=os.path.join("runs", "demo"), help="output folder (default runs/demo)")
    p.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="1 process, or 2 gloo ranks under torchrun")
    p.add_argument("--fast", action="store_true", help="a tiny model and few steps (a few seconds; what CI runs)")
    p.add_argument("--sync", action="store_true", help=f"synchronous saves even if {ASYNC_PLUGIN} is installed")
    p.add_argument("--no-plot", action="store_true", help="do not save the loss plot")
    p.add_argument("--timeout", type=float, default=600.0, help="give up on a worker after this many seconds")


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = FAST if args.fast else Settings()
    changes = {
        name: getattr(args, name)
        for name in ("steps", "save_every", "kill_at", "hidden", "layers", "batch")
        if getattr(args, name, None) is not None
    }
    s = dataclasses.replace(base, **changes)
    if "kill_at" not in changes:
        s = dataclasses.replace(s, kill_at=default_kill_at(s))
    return s


def default_kill_at(s: Settings) -> int:
    """The default kill point keeps its place relative to the run: just past 70% of it."""
    return max(s.save_every + 1, int(s.steps * 0.7) + 1)


def check_settings(s: Settings, ranks: int) -> str | None:
    if min(s.steps, s.save_every, s.hidden, s.layers, s.batch) < 1:
        return "--steps, --save-every, --hidden, --layers and --batch must be positive"
    if s.batch % ranks:
        return f"--batch {s.batch} must be divisible by --ranks {ranks}"
    first_save = s.save_every
    kill_save = -(-s.kill_at // s.save_every) * s.save_every
    if s.kill_at <= first_save:
        return f"--kill-at {s.kill_at} must come after the first save (step {first_save}), so there is one to resume"
    if kill_save > s.steps:
        return f"no save at or after --kill-at {s.kill_at} within --steps {s.steps} (saves every {s.save_every})"
    return None
