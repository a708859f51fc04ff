"""Launch a script under ``torchrun --standalone`` with gloo ranks, with a hard time limit.

torchrun's agent and every rank are forked from the test process's fork server (tests/_forked.py):
the agent runs ``python -m torch.distributed.run`` as it would, with the ``python`` stand-in
(tests/_forked_python.py) as its ``sys.executable``, so each ``python -u SCRIPT`` it starts has the
server fork the real rank, and passes torchrun's environment, signals and the rank's exit status
through. A launch of two ranks then costs
about 1.5 CPU-s instead of 12-14. ``CKPT_ENGINE_TEST_RANKS=fresh`` starts the agent and the ranks
as new interpreters instead, as users' jobs do.

Scripts in ``tests/dist_scripts/`` record results with ``_common.report()`` (one JSON line per
call, in a per-rank file) that tests parse with ``TorchrunResult.results()``. They end with
``ckpt_test_exit()`` (flush, destroy the process group, ``os._exit``) to avoid gloo's occasional
SIGABRT at interpreter teardown.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _forked

SCRIPTS = Path(__file__).parent / "dist_scripts"
#: Cleared by the conftest while a test without the ``dist`` marker runs.
launch_allowed = True


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


def launch_env() -> dict[str, str]:
    """The environment of a torchrun launch of ``tests/dist_scripts`` (CPU, one thread, unbuffered)."""
    if not launch_allowed:
        raise AssertionError("a torchrun launch from a test without @pytest.mark.dist (tests/conftest.py)")
    env = dict(os.environ)
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""})
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env.get("PYTHONPATH", "")])
    return env


def run_torchrun(
    script: str, *args: str, nproc: int = 2, timeout: float = 120.0, preload: tuple[str, ...] = ()
) -> TorchrunResult:
    """Run ``tests/dist_scripts/<script>`` on ``nproc`` CPU ranks; fail the test on timeout.
    ``preload``: modules the fork server imports once before forking the ranks (``lightning``)."""
    if not launch_allowed:
        raise AssertionError(f"{script}: a torchrun launch from a test without @pytest.mark.dist (tests/conftest.py)")
    env = launch_env()
    results_dir = tempfile.mkdtemp(prefix="ckpt-torchrun-results-")
    env["CKPT_TEST_RESULTS_DIR"] = results_dir
    options = ["--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0"]
    try:
        if forked_ranks():
            env[_forked.PRELOAD_VAR] = ",".join(preload)
            proc = _run_forked_agent(script, args, options, env, timeout)
        else:
            cmd = [sys.executable, "-m", "torch.distributed.run", *options, str(SCRIPTS / script), *args]
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


def start_torchrun(script: str, *args: str, nproc: int = 2, hang_guard: float = 600.0) -> Any:
    """A launch of ``tests/dist_scripts/<script>`` left running for the test to watch and kill: a
    ``subprocess.Popen``-like object (text ``stdout``, stderr merged into it) whose agent leads a
    session of its own. Use it in a ``with`` block; the ranks are killed by the pids they report."""
    env = launch_env()
    options = ["--standalone", f"--nproc-per-node={nproc}"]
    if forked_ranks():
        return _forked_agent(script, args, options, env, hang_guard, stdout=_forked.PIPE, stderr=_forked.STDOUT)
    cmd = [sys.executable, "-m", "torch.distributed.run", *options, str(SCRIPTS / script), *args]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )


def forked_ranks() -> bool:
    """Whether launches fork their agent and ranks (the default) or start new interpreters."""
    return os.environ.get("CKPT_ENGINE_TEST_RANKS", "forked") == "forked"


def _forked_agent(
    script: str,
    args: tuple[str, ...],
    options: list[str],
    env: dict[str, str],
    timeout: float,
    stdout: int | None = None,
    stderr: int | None = None,
) -> _forked.ForkedProcess:
    """``python -m torch.distributed.run OPTIONS`` forked, each rank started through the ``python``
    stand-in, in a session of its own so that the hang guard (``timeout``) kills it with its
    stand-ins (and, through them, the ranks)."""
    return _forked.popen(
        _forked.Module("torch.distributed.run"),
        *options,
        str(SCRIPTS / script),
        *args,
        env=env,
        inherit_env=False,
        start_new_session=True,
        timeout=timeout,
        preload=("torch.distributed.run",),
        stdout=stdout,
        stderr=stderr,
        python=_forked.python_stand_in(),
    )


def _run_forked_agent(
    script: str, args: tuple[str, ...], options: list[str], env: dict[str, str], timeout: float
) -> Any:
    """A forked launch run to its end, as ``subprocess.run(capture_output=True)``."""
    with _forked_agent(script, args, options, env, timeout) as proc:
        try:
            out, err = proc.communicate()
        except _forked.ForkedTimeout as hang:
            raise AssertionError(f"torchrun {script} did not finish within {timeout}s (a hang)\n{hang}") from None
        return subprocess.CompletedProcess(proc.args, proc.wait(), out, err)


def run_ranks(
    script: str, *args: str, nproc: int = 2, timeout: float = 120.0, fresh_writers: bool = False
) -> TorchrunResult:
    """Run ``tests/dist_scripts/<script>`` as ``nproc`` plain processes (``env://`` rendezvous on a
    free loopback port), without torchrun's agent: a rank that dies or stops is not followed by
    the agent killing the others, so a test can see what the survivors do. Ranks still running
    at ``timeout`` are killed (SIGKILL, after SIGCONT) and the test fails. ``fresh_writers``: the
    ranks start ``pinned_staging`` writers as users' jobs do, in new interpreters, not forked."""
    import signal
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results_dir = tempfile.mkdtemp(prefix="ckpt-ranks-results-")
    base = dict(os.environ)
    base.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""})
    base.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(nproc)})
    base["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), base.get("PYTHONPATH", "")])
    base["CKPT_TEST_RESULTS_DIR"] = results_dir
    if fresh_writers:
        base[_forked.WRITERS_VAR] = "fresh"
    procs: list[Any] = []
    for r in range(nproc):
        env = {**base, "RANK": str(r), "LOCAL_RANK": str(r)}
        proc: Any
        if forked_ranks():
            proc = _forked.popen(
                SCRIPTS / script, *args, env=env, inherit_env=False, stderr=_forked.STDOUT, timeout=None
            )
        else:
            cmd = [sys.executable, str(SCRIPTS / script), *args]
            proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        procs.append(proc)
    try:
        outputs = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                out = ""
            outputs.append(out or "")
        lines = "".join(Path(results_dir, name).read_text(encoding="utf-8") for name in sorted(os.listdir(results_dir)))
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.kill()
                proc.wait()
            if isinstance(proc, _forked.ForkedProcess):
                proc.close()
        shutil.rmtree(results_dir, ignore_errors=True)
    return TorchrunResult(procs[0].returncode, "\n".join(outputs), "", lines)
