"""The demo's supervisor side: starts worker processes, reads their events, and kills their process trees."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import UsageError
from .settings import Settings
from .worker import EVENT_PREFIX

MARKER = ".ckpt-engine-demo"


class DemoFailure(Exception):
    pass


@dataclass
class RunLog:
    """What the demo learned from one worker's events."""

    losses: dict[int, float] = field(default_factory=dict)
    reference: dict[int, float] = field(default_factory=dict)
    saves: dict[int, dict[str, Any]] = field(default_factory=dict)
    loaded: dict[str, Any] | None = None
    kill: dict[str, Any] | None = None
    returncode: int | None = None
    seconds: float = 0.0

    def record(self, ev: dict[str, Any]) -> dict[str, Any] | None:
        """Fold one event in; return a ``save-complete`` event once both halves of a save are in."""
        kind = ev["event"]
        if kind == "step":
            self.losses[int(ev["step"])] = float(ev["loss"])
        elif kind == "reference-step":
            self.reference[int(ev["step"])] = float(ev["loss"])
        elif kind in ("saved", "save-returned"):
            # Merged per iteration: "call" is how long save() blocked the training loop,
            # measured around the call (a sync save commits inside it, an async one after).
            entry = self.saves.setdefault(int(ev["iteration"]), {})
            if kind == "saved":
                entry.update(ev)
            else:
                entry["call"] = ev["blocked"]
            if "call" in entry and "event" in entry:
                return {**entry, "event": "save-complete"}
        elif kind == "loaded":
            self.loaded = ev
        elif kind == "kill-point":
            self.kill = ev
        return None


def _worker_cmd(role: str, s: Settings, save_dir: str, async_saves: bool, ranks: int) -> list[str]:
    args = ["--worker", role, "--settings", json.dumps(dataclasses.asdict(s)), "--save-dir", save_dir]
    if async_saves:
        args.append("--async-saves")
    if ranks == 1:
        return [sys.executable, "-m", "ckpt_engine.demo", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--max-restarts=0",
        "-m",
        "ckpt_engine.demo",
        *args,
    ]


def _events(stream: Any) -> Iterator[dict[str, Any]]:
    for line in stream:
        if line.startswith(EVENT_PREFIX):
            try:
                yield json.loads(line[len(EVENT_PREFIX) :])
            except json.JSONDecodeError:
                continue


def run_worker_process(
    role: str,
    s: Settings,
    out: str,
    save_dir: str,
    async_saves: bool,
    ranks: int,
    timeout: float,
    on_event: Callable[[dict[str, Any]], None],
) -> RunLog:
    log = RunLog()
    err_path = os.path.join(out, f"worker-{role}.log")
    t0 = time.perf_counter()
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            _worker_cmd(role, s, save_dir, async_saves, ranks),
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
            start_new_session=True,
            env=_worker_env(),
        )
        timer = threading.Timer(timeout, lambda: _kill_group(proc))
        timer.start()
        try:
            assert proc.stdout is not None
            _follow(proc, proc.stdout, log, on_event)
            proc.wait(timeout=60)
            proc.stdout.close()
        finally:
            timer.cancel()
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
    log.returncode = proc.returncode
    log.seconds = time.perf_counter() - t0
    if log.kill is None and proc.returncode != 0:
        with open(err_path) as f:
            tail = f.read()[-3000:]
        raise DemoFailure(
            f"the {role} worker failed (exit code {proc.returncode}); its log, {err_path}, ends with:\n{tail}"
        )
    return log


def _worker_env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds ckpt_engine/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    return env


def _follow(proc: subprocess.Popen[str], stream: Any, log: RunLog, on_event: Callable[[dict[str, Any]], None]) -> None:
    """Read the worker's events into ``log`` and pass them on, until it ends or reaches the kill
    point (then it is killed at once, with every process under it)."""
    for ev in _events(stream):
        if ev["event"] == "kill-point":
            _kill_group(proc)
        complete = log.record(ev)
        if complete is not None:
            on_event(complete)
        on_event(ev)
        if log.kill is not None:
            break


def _children() -> dict[int, list[int]]:
    """ppid -> child pids of every process (``/proc`` on Linux, ``ps`` elsewhere)."""
    tree: dict[int, list[int]] = {}
    pairs: list[tuple[int, int]] = []
    if os.path.isdir("/proc/self"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            pairs.append((int(name), int(fields[1])))
    else:  # pragma: no cover - macOS and other POSIX systems
        text = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True, text=True).stdout
        pairs = [(int(a), int(b)) for a, b in (line.split() for line in text.splitlines() if line.strip())]
    for pid, ppid in pairs:
        tree.setdefault(ppid, []).append(pid)
    return tree


def _descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the worker and every process under it: torchrun puts each rank in a session of its
    own, so killing the worker's process group alone would leave the ranks (and their writer
    processes) running. Everything is frozen first, so nothing can start new processes."""
    seen: set[int] = set()
    for _ in range(3):
        new = [p for p in _descendants(proc.pid) if p not in seen]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        seen.update(new)
    for pid in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def prepare_out(out: str) -> str:
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise UsageError(f"--out {out} is a file")
        if os.listdir(out) and not os.path.exists(os.path.join(out, MARKER)):
            raise UsageError(f"--out {out} exists and was not made by the demo; choose another folder or empty it")
        shutil.rmtree(out)
    os.makedirs(out)
    with open(os.path.join(out, MARKER), "w") as f:
        f.write("made by `ckpt-engine demo`; the demo deletes and recreates this folder\n")
    return os.path.join(out, "checkpoints")
