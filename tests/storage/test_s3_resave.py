"""An S3 re-save (``allow_overwrite``) killed between any two of its store operations keeps the
old checkpoint or the new one, never neither: the new copy is committed under
``.iter_n.replacing/`` beside the old one and only then moved over it, and the next engine
started on the folder finishes a move a kill interrupted.

A real moto S3 server on loopback, a real SIGKILL (the child kills itself at the N-th operation
that changes the bucket, so each kill lands exactly between two steps). By default the kill
points are one per kind of step; ``CKPT_ENGINE_SLOW_TESTS=1`` kills at every operation.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import _forked
import pytest
import torch
from _paths import CRASH_SCRIPTS, TESTS

from ckpt_engine import CheckpointEngine
from ckpt_engine.testing import TinyTrainingState

pytestmark = pytest.mark.full  # a re-save killed between each two of its store operations

SCRIPT = CRASH_SCRIPTS / "s3_resave_kill.py"


def _config(bucket: Any, tmp_path: Path) -> dict[str, Any]:
    return {
        "save_dir": bucket.url,
        "storage": {**bucket.storage, "max_concurrency": 1, "spool_dir": str(tmp_path / "spool")},
    }


def _child(config: dict[str, Any], kill_at: int) -> subprocess.CompletedProcess[str]:
    """One re-save in a forked child (torch and s3fs imported once, by the fork server)."""
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    return _forked.run(SCRIPT, json.dumps(config), str(kill_at), env=env, timeout=300, preload=["s3fs"])


def _states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    old = TinyTrainingState.create(seed=1, hidden=64)
    new = TinyTrainingState.create(seed=1, hidden=64)
    new.train(1)
    return old.model.state_dict(), new.model.state_dict()


def _loaded(config: dict[str, Any]) -> dict[str, torch.Tensor]:
    fresh = TinyTrainingState.create(seed=99, hidden=64)
    with CheckpointEngine({**config, "verify": "checksums"}) as engine:  # starting it finishes a move
        result = engine.load(**fresh.objects())
    assert result.iteration == 1 and result.verified
    return fresh.model.state_dict()


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _kill_points(operations: list[str]) -> list[int]:
    """1-based indices into ``operations``: every one with the slow variant, else the first of
    each kind of step and the first after the old copy's marker is gone."""
    if os.environ.get("CKPT_ENGINE_SLOW_TESTS") == "1":
        return list(range(1, len(operations) + 1))
    points, kinds = [], set()
    for i, op in enumerate(operations, 1):
        kind = op.split()[0] + (" marker" if "ckpt_engine_manifest.json" in op else "")
        if kind not in kinds:
            kinds.add(kind)
            points.append(i)
    marker_gone = next(i for i, op in enumerate(operations, 1) if op.startswith("remove_file"))
    return sorted({*points, marker_gone + 1})


def test_a_resave_killed_at_any_step_keeps_the_old_or_the_new_checkpoint(s3_bucket: Any, tmp_path: Path) -> None:
    config = _config(s3_bucket, tmp_path)
    old, new = _states()
    baseline = TinyTrainingState.create(seed=1, hidden=64)

    def reset() -> None:  # iteration 1 holds the old state again
        with CheckpointEngine({**config, "allow_overwrite": True}) as engine:
            engine.save(1, **baseline.objects())

    reset()
    dry = _child(config, 0)
    assert dry.returncode == 0, dry.stderr[-3000:]
    operations = dry.stdout.splitlines()
    assert _same(_loaded(config), new)
    assert any(".replacing" in op for op in operations), operations  # uploaded beside the old copy
    kept = {"old": 0, "new": 0}
    for kill_at in _kill_points(operations):
        reset()
        child = _child(config, kill_at)
        assert child.returncode == -9, (kill_at, operations[kill_at - 1], child.stderr[-3000:])
        state = _loaded(config)
        which = "old" if _same(state, old) else "new" if _same(state, new) else None
        assert which is not None, f"killed at {operations[kill_at - 1]!r}: neither copy"
        kept[which] += 1
        leftovers = [k for k in s3_bucket.objects() if ".replacing" in k]
        assert not leftovers, (kill_at, operations[kill_at - 1], leftovers)
    assert kept["old"] and kept["new"], kept  # kills landed on both sides of the commit
