"""``engine.save_on_preemption()``: a real SIGTERM becomes a save at the next step boundary and a
clean exit; the resumed run continues bit-exactly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from ckpt_engine import CheckpointEngine, InvalidArgumentError

SCRIPT = Path(__file__).parent / "crash_scripts" / "preempt_train.py"


def _run(save_dir: Path, until: int, every: int, pause: float = 0.0) -> tuple[int, dict[int, str], str]:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(save_dir), str(until), str(every), str(pause)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return proc.returncode, _losses(proc.stdout), proc.stdout + proc.stderr


def _losses(stdout: str) -> dict[int, str]:
    return {int(p[1]): p[2] for p in (line.split() for line in stdout.splitlines()) if p and p[0] == "STEP"}


def test_sigterm_saves_at_the_step_boundary_and_the_resume_is_bit_exact(tmp_path: Path) -> None:
    code, straight, out = _run(tmp_path / "straight", 30, every=10)
    assert code == 0 and sorted(straight) == list(range(1, 31)), out
    saved = sorted(p.name for p in (tmp_path / "straight").glob("iter_*"))
    assert saved == ["iter_000000010", "iter_000000020", "iter_000000030"]  # the save interval

    save_dir = tmp_path / "preempted"
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(save_dir), "30", "100", "0.05"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("STEP 5 "):
            proc.send_signal(signal.SIGTERM)  # a real signal, mid-run
            break
    rest, err = proc.communicate(timeout=60)
    stdout = "".join(lines) + rest
    assert proc.returncode == 0, stdout + err  # a clean exit
    assert "DONE" not in stdout
    first = _losses(stdout)
    stopped = max(first)
    assert 5 <= stopped < 30
    assert (save_dir / "latest_checkpoint.txt").read_text().strip() == f"iter_{stopped:09}"
    assert f"preempted: saved iteration {stopped}" in err

    code, resumed, out = _run(save_dir, 30, every=100)
    assert code == 0, out
    assert f"START {stopped}" in out
    assert sorted(resumed) == list(range(stopped + 1, 31))
    assert {**first, **resumed} == straight  # bit for bit (loss reprs), dropout included


def test_request_saves_once_and_exits(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    with CheckpointEngine({"save_dir": str(tmp_path / "ck")}) as engine:
        with engine.save_on_preemption(every=2, exit_code=3) as saver:
            assert saver.step_done(1, model=model) is None
            assert saver.step_done(2, model=model) is not None
            saver.request()
            with pytest.raises(SystemExit) as info:
                saver.step_done(2, model=model)  # already saved: no second save of iteration 2
        assert info.value.code == 3
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone again
    assert sorted(p.name for p in (tmp_path / "ck").glob("iter_*")) == ["iter_000000002"]


def test_every_must_be_positive(tmp_path: Path) -> None:
    with CheckpointEngine({"save_dir": str(tmp_path / "ck")}) as engine, pytest.raises(InvalidArgumentError):
        engine.save_on_preemption(every=0)
