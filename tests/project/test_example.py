"""The README's demo: train, SIGKILL the worker mid-run, resume, losses equal step for step."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _paths import ROOT

pytestmark = pytest.mark.full  # the README example: train, SIGKILL, resume

EXAMPLE = ROOT / "examples" / "train_resume.py"


def test_example_resumes_after_sigkill_with_identical_losses(tmp_path: Path) -> None:
    out = tmp_path / "ckpt"
    proc = subprocess.run(
        [sys.executable, str(EXAMPLE), "--steps", "10", "--save-every", "3", "--kill-after", "7", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "worker killed with SIGKILL (exit code -9)" in proc.stdout
    assert f"resumed from {out / 'iter_000000006'} at iteration 6" in proc.stdout
    assert "OK: the resumed run matches the uninterrupted run for all 4 steps" in proc.stdout
    assert (out / "latest_checkpoint.txt").read_text() == "iter_000000006\n"
