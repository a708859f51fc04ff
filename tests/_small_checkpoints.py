"""Small checkpoints for the single-process tests of the save folder's units: each iteration saved
with its own tiny training state, then listed, damaged and loaded back.

The names start with an underscore, so that in the test modules that import them they read as
helpers, not tests.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ckpt_engine import CheckpointEngine
from ckpt_engine.testing import TinyTrainingState

MODEL_FILE = ("model", "__0_0.distcp")


def _state(seed: int) -> TinyTrainingState:
    return TinyTrainingState.create(seed=seed, steps=1)


def _save(save_dir: str, *iterations: int, **config: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Save each iteration with its own state (seed = iteration); returns model state by iteration."""
    out = {}
    with CheckpointEngine({"save_dir": save_dir, **config}) as engine:
        for it in iterations:
            state = _state(it)
            engine.save(it, **state.objects())
            out[it] = {k: v.clone() for k, v in state.model.state_dict().items()}
    return out


def _ckpt(save_dir: str, it: int) -> Path:
    return Path(save_dir, f"iter_{it:09}")


def _flip(path: Path, offset: int | None = None) -> None:
    raw = bytearray(path.read_bytes())
    i = len(raw) // 2 if offset is None else offset
    raw[i] ^= 0xFF
    path.write_bytes(bytes(raw))


def _listing(save_dir: str) -> list[str]:
    return sorted(os.listdir(save_dir))


def _latest(save_dir: str) -> str:
    return Path(save_dir, "latest_checkpoint.txt").read_text()


def _load(save_dir: str, **config: Any) -> tuple[Any, TinyTrainingState]:
    fresh = _state(999)
    with CheckpointEngine({"save_dir": save_dir, **config}) as engine:
        result = engine.load(**fresh.objects())
    return result, fresh


def _iters(save_dir: str) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(save_dir) if n.startswith("iter_"))
