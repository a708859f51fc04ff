"""Launch a script under ``torchrun --standalone`` with gloo ranks, with a hard time limit.

Scripts in ``tests/dist_scripts/`` print lines of the form ``RESULT <rank> <json>`` that tests
parse; they end with ``ckpt_test_exit()`` (flush, destroy the process group, ``os._exit``) to
avoid gloo's occasional SIGABRT at interpreter teardown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).parent / "dist_scripts"


@dataclass
class TorchrunResult:
    returncode: int
    stdout: str
    stderr: str

    def results(self) -> dict[int, list[Any]]:
        """Parsed ``RESULT <rank> <json>`` lines, by rank."""
        out: dict[int, list[Any]] = {}
        for line in self.stdout.splitlines():
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
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(
            f"torchrun {script} did not finish within {timeout}s (a hang)\n"
            f"stdout: {(err.stdout or b'')[-3000:]!r}\nstderr: {(err.stderr or b'')[-3000:]!r}"
        ) from err
    return TorchrunResult(proc.returncode, proc.stdout, proc.stderr)
