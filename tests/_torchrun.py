"""Launch a script under ``torchrun --standalone`` with gloo ranks, with a hard time limit.

Scripts in ``tests/dist_scripts/`` record results with ``_common.report()`` (one JSON line per
call, in a per-rank file) that tests parse with ``TorchrunResult.results()``. They end with
``ckpt_test_exit()`` (flush, destroy the process group, ``os._exit``) to avoid gloo's occasional
SIGABRT at interpreter teardown.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).parent / "dist_scripts"


@dataclass
class TorchrunResult:
    returncode: int
    stdout: str
    stderr: str
    #: ``RESULT <rank> <json>`` lines the ranks wrote to their result files.
    result_lines: str = ""

    def results(self) -> dict[int, list[Any]]:
        """Parsed ``RESULT <rank> <json>`` lines, by rank, in the order each rank wrote them."""
        out: dict[int, list[Any]] = {}
        for line in self.result_lines.splitlines():
            if line.startswith("RESULT "):
                _, rank, payload = line.split(" ", 2)
                out.setdefault(int(rank), []).append(json.loads(payload))
        return out

    def describe(self) -> str:
        return f"rc={self.returncode}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-6000:]}"


def run_torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 120.0) -> TorchrunResult:
    """Run ``tests/dist_scripts/<script>`` on ``nproc`` CPU ranks; fail the test on timeout."""
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""})
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    results_dir = tempfile.mkdtemp(prefix="ckpt-torchrun-results-")
    env["CKPT_TEST_RESULTS_DIR"] = results_dir
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        str(SCRIPTS / script),
        *args,
    ]
    try:
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired as err:
            raise AssertionError(
                f"torchrun {script} did not finish within {timeout}s (a hang)\n"
                f"stdout: {(err.stdout or b'')[-3000:]!r}\nstderr: {(err.stderr or b'')[-3000:]!r}"
            ) from err
        lines = "".join(Path(results_dir, name).read_text(encoding="utf-8") for name in sorted(os.listdir(results_dir)))
    finally:
        shutil.rmtree(results_dir, ignore_errors=True)
    return TorchrunResult(proc.returncode, proc.stdout, proc.stderr, lines)
