"""Helpers of the adversarial tests: real checkpoints, tampered as an attacker would."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from ckpt_engine import CheckpointEngine, LoadResult
from ckpt_engine._format.hashing import hash_file
from ckpt_engine._format.manifest import MANIFEST_FILE
from ckpt_engine._format.metadata import read_metadata
from ckpt_engine.testing import TinyTrainingState


def ckpt(save_dir: str, iteration: int) -> Path:
    return Path(save_dir, f"iter_{iteration:09}")


def save(save_dir: str, *iterations: int, **config: Any) -> dict[int, dict[str, torch.Tensor]]:
    """Save each iteration (state seeded by it); returns the model state of each."""
    out = {}
    with CheckpointEngine({"save_dir": save_dir, **config}) as engine:
        for it in iterations:
            state = TinyTrainingState.create(seed=it, steps=1)
            engine.save(it, **state.objects())
            out[it] = {k: v.clone() for k, v in state.model.state_dict().items()}
    return out


def load(save_dir: str, state: TinyTrainingState | None = None, **config: Any) -> tuple[LoadResult, TinyTrainingState]:
    state = state or TinyTrainingState.create(seed=999, steps=0)
    with CheckpointEngine({"save_dir": save_dir, **config}) as engine:
        return engine.load(**state.objects()), state


def rehash(checkpoint: Path) -> None:
    """Re-write the manifest's entries from the files as they are now (an attacker's cover-up)."""
    path = checkpoint / MANIFEST_FILE
    doc = json.loads(path.read_text())
    for rel in doc["files"]:
        entry = hash_file(str(checkpoint / rel), doc["checksum_algorithm"])
        doc["files"][rel] = {"size": entry.size, "checksum": entry.checksum}
    path.write_text(json.dumps(doc))


def tamper_metadata(component: Path, change: Callable[[Metadata], None]) -> None:
    """Rewrite ``component/.metadata`` with ``change`` applied, and re-hash the manifest."""
    md = read_metadata(component)
    change(md)
    with open(component / ".metadata", "wb") as f:
        pickle.dump(md, f)
    rehash(component.parent)


def edit_manifest(checkpoint: Path, **fields: Any) -> None:
    path = checkpoint / MANIFEST_FILE
    doc = json.loads(path.read_text())
    doc.update(fields)
    path.write_text(json.dumps(doc))


def flip_byte(path: Path, offset: int = -64) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


def files_under(root: Path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)


def objects() -> dict[str, Any]:
    """A ``--model`` factory for ``ckpt-engine plan``: fresh training objects."""
    return TinyTrainingState.create(seed=5, steps=0).objects()
