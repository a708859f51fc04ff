"""The outside crash-consistency tool ``ckpt-chaos`` on a small job using the engine (marker ``chaos``).

``ckpt-chaos run`` kills the job of ``tests/crash_scripts/chaos_train.py`` at every file event of
its saves (and, for files written by ``torch.save``, once more with the file cut in half),
resumes it, and gives each kill point a verdict: PASS, HARD_FAIL (the resume raised),
SILENT_DIVERGENCE (other weights than a run never killed) or LOST_WORK (resumed from an older
checkpoint than a complete one on disk). Every verdict but PASS fails the test. It is not part of
the default run (each kill point is a new process: minutes); run it with::

    pip install -c constraints.txt ".[test,chaos]"
    CKPT_ENGINE_CHAOS=1 pytest -m chaos tests/reliability/test_chaos.py -s
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _paths import CRASH_SCRIPTS

SCRIPT = CRASH_SCRIPTS / "chaos_train.py"
RUN = os.environ.get("CKPT_ENGINE_CHAOS") == "1"

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.skipif(not RUN, reason="set CKPT_ENGINE_CHAOS=1 (and pip install ckpt-chaos) to run it"),
]


@pytest.mark.timeout(3600)  # each of ~40 kill points is a new process and a resume: minutes, not the suite's 420 s
@pytest.mark.parametrize("mode", ["sync", "pinned_staging", "incremental"])
def test_ckpt_chaos_finds_no_torn_resume_no_divergence_and_no_lost_work(tmp_path: Path, mode: str) -> None:
    tool = shutil.which("ckpt-chaos") or str(Path(sys.executable).with_name("ckpt-chaos"))
    if not os.path.exists(tool):
        pytest.fail('CKPT_ENGINE_CHAOS=1 but ckpt-chaos is not installed: pip install -c constraints.txt ".[chaos]"')
    cmd = [
        tool,
        "run",
        "--work",
        str(tmp_path / "runs"),
        "--checkpoint-glob",
        "{out}/ckpt/iter_*",
        "--ckpt-ignore-size",  # manifests record inode numbers and times: sizes differ by a few bytes
        "--step-regex",
        r"resumed from step (\d+)",
        "--result-file",
        "{out}/final.bin",
        "--fail-on",
        "HARD_FAIL,SILENT_DIVERGENCE,LOST_WORK",
        "--max-points",
        os.environ.get("CKPT_ENGINE_CHAOS_POINTS", "40"),
        "--timeout",
        "300",
        "--",
        sys.executable,
        str(SCRIPT),
        "--out",
        "{out}",
        "--mode",
        mode,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=7200)
    print(proc.stdout[-3000:])  # the tool's verdict table, shown with -s
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    assert "PASS" in proc.stdout
