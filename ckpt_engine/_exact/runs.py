"""The processes behind :func:`ckpt_engine.testing.check_exact_resume`.

Three fresh interpreters (each with the caller's ``sys.path``, running :func:`child`) run the
user's ``build``/``step``, imported by reference: one trains ``steps`` steps uninterrupted; one
trains ``save_at`` steps and saves through :class:`CheckpointEngine`; one builds fresh objects,
resumes through the engine and trains on. Each writes the snapshots
(:func:`~ckpt_engine._exact.compare.snapshot`) of ``save_at`` (the resumed one: right after the
resume) and every later step, which :func:`run_check` compares.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import subprocess
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from .._engine.engine import CheckpointEngine
from ..config import EngineConfig
from ..errors import ArgumentTypeError, CkptEngineError, InvalidArgumentError
from .compare import ExactResumeReport, compare, snapshot

__all__ = ["ExactResumeRunError", "child", "reference_of", "resolve", "run_check"]

OBJECT_KEYS = ("model", "optimizer", "scheduler", "grad_scaler", "extra")


class ExactResumeRunError(CkptEngineError):
    """A process of :func:`~ckpt_engine.testing.check_exact_resume` failed (the user's ``build`` or
    ``step`` raised, or the save or the resume did); the message holds its output's tail."""


# -- references to build/step, importable in a new process ------------------------------------


def reference_of(func: Any, what: str) -> str:
    """``"module:qualname"`` of ``func`` (or ``func`` itself, a string of that form), checked by
    importing it here as the new process will."""
    if isinstance(func, str):
        ref = func
    elif callable(func):
        module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", "")
        if "<lambda>" in qualname or "<locals>" in qualname or not module:
            raise ArgumentTypeError(
                f"{what} ({qualname or func!r}) is a lambda or a function defined inside another function: a new "
                f"process cannot import it. Define {what} at module level, or pass 'package.module:function'"
            )
        if module == "__main__":
            raise ArgumentTypeError(
                f"{what} ({qualname}) is defined in __main__, which a new process does not import: move it into a "
                f"module on sys.path, or pass 'package.module:function'"
            )
        ref = f"{module}:{qualname}"
    else:
        raise ArgumentTypeError(f"{what} is a {type(func).__name__}: pass a module-level function or 'module:func'")
    resolve(ref, what)
    return ref


def resolve(ref: str, what: str) -> Callable[..., Any]:
    module, sep, qualname = ref.partition(":")
    if not sep or not module or not qualname:
        raise InvalidArgumentError(f"{what} reference {ref!r} is not of the form 'package.module:function'")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as err:
        raise InvalidArgumentError(
            f"{what} reference {ref!r} cannot be imported ({type(err).__name__}: {err}); check the module is on "
            "sys.path and the name is right"
        ) from err
    if not callable(obj):
        raise ArgumentTypeError(f"{what} reference {ref!r} names a {type(obj).__name__}, not a function")
    return obj  # type: ignore[no-any-return]


# -- the processes -----------------------------------------------------------------------------


def _engine_kwargs(objs: Any, ref: str) -> dict[str, Any]:
    if not isinstance(objs, Mapping) or set(objs) - set(OBJECT_KEYS):
        got = sorted(objs) if isinstance(objs, Mapping) else type(objs).__name__
        raise ArgumentTypeError(
            f"build ({ref}) returned {got}: it must return a dict with keys among {', '.join(OBJECT_KEYS)} "
            "(what CheckpointEngine.save takes); put other Stateful objects under 'extra'"
        )
    return {k: v for k, v in objs.items() if v is not None}


def child(spec: Mapping[str, Any]) -> None:
    """One run (``spec["role"]``: ``straight``, ``first`` or ``resumed``); writes its snapshots."""
    build, step = resolve(spec["build"], "build"), resolve(spec["step"], "step")
    role, steps, save_at = spec["role"], spec["steps"], spec["save_at"]
    _seed_every_generator(0)  # the runs start equal, also in the generators the script does not seed
    objs = build()
    kwargs = _engine_kwargs(objs, spec["build"])
    snapshots: dict[int, Any] = {}
    start = 1
    if role == "resumed":
        with CheckpointEngine(EngineConfig.model_validate(spec["config"])) as engine:
            start = engine.load(**kwargs).iteration + 1
        if start != save_at + 1:
            raise ExactResumeRunError(f"the resume loaded iteration {start - 1}, not {save_at}")
        snapshots[save_at] = snapshot(objs)
    for i in range(start, (save_at if role == "first" else steps) + 1):
        step(objs, i)
        if (role == "straight" and i >= save_at) or role == "resumed":
            snapshots[i] = snapshot(objs)
    if role == "first":
        with CheckpointEngine(EngineConfig.model_validate(spec["config"])) as engine:
            engine.save(save_at, **kwargs)
    torch.save(snapshots, spec["out"])


def _seed_every_generator(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    else:
        np.random.seed(seed)
    torch.manual_seed(seed)  # and every CUDA device


def _launch(spec: dict[str, Any], workdir: str, role: str) -> tuple[subprocess.Popen[str], str]:
    path = os.path.join(workdir, f"{role}.json")
    out = os.path.join(workdir, f"{role}.pt")
    with open(path, "w", encoding="utf-8") as f:
        json.dump({**spec, "role": role, "out": out}, f)
    # the caller's sys.path first, so that the child imports this ckpt_engine and the user's modules
    boot = (
        "import json, sys; spec = json.load(open(sys.argv[1])); sys.path[:0] = spec['sys_path']; "
        f"from {__name__} import child; child(spec)"
    )
    cmd = [sys.executable, "-c", boot, path]
    with open(os.path.join(workdir, f"{role}.log"), "w", encoding="utf-8") as log:  # the child holds its own copy
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True), out


def _wait(proc: subprocess.Popen[str], out: str, role: str) -> Any:
    code = proc.wait()
    log_path = out[: -len(".pt")] + ".log"
    if code != 0 or not os.path.isfile(out):
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = f.read()[-4000:]
        raise ExactResumeRunError(f"the {role} run exited with status {code} ({log_path}):\n{tail}")
    return torch.load(out, weights_only=True)


def run_check(
    build: str, step: str, steps: int, save_at: int, config: dict[str, Any], workdir: str
) -> ExactResumeReport:
    """Run the three processes in ``workdir`` (the uninterrupted run beside the first part) and compare."""
    spec = {"build": build, "step": step, "steps": steps, "save_at": save_at, "config": config}
    spec["sys_path"] = [os.path.abspath(p) for p in sys.path if p]
    started = [_launch(spec, workdir, role) for role in ("straight", "first")]
    try:
        straight = _wait(*started[0], "uninterrupted")
        _wait(*started[1], "first")
    finally:
        for proc, _ in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    resumed = _wait(*_launch(spec, workdir, "resumed"), "resumed")
    return compare(straight, resumed, steps, save_at)
