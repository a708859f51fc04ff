"""Helpers for testing ckpt-engine plugins (yours and ours), on CPU.

* :func:`plan_load` / :func:`plan_reads`: the engine's real load planner and hooks on a
  described checkpoint, without files (see ``docs/testing-plugins.md``);
* :func:`make_engine`, :class:`TinyTrainingState`, :func:`assert_state_dicts_equal`: round trips
  through real DCP checkpoints;
* :func:`check_exact_resume`: does a training script resume bit for bit? It trains uninterrupted,
  and again with a save and a resume in a new process, and names the first step and state
  (parameter, optimizer state, scheduler, extra state such as the data position, random
  generator) where the two differ;
* :mod:`ckpt_engine.strategies`: hypothesis strategies for property tests, also importable from
  here (``from ckpt_engine.testing import state_dicts``), loaded on first use: this module does
  not need ``hypothesis``, the strategies do.

>>> from ckpt_engine.testing import TinyTrainingState, make_engine
>>> state = TinyTrainingState.create(seed=0)                       # doctest: +SKIP
>>> engine = make_engine(tmp_path / "ckpt", MyRemapPlugin())       # doctest: +SKIP
>>> engine.save(3, **state.objects())                              # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pluggy
import torch
from torch import nn

from ._dcpio.described import plan_component
from ._engine.engine import CheckpointEngine
from ._exact.compare import Difference, ExactResumeReport
from ._exact.runs import ExactResumeRunError, reference_of, run_check
from ._markers import PROJECT_NAME
from .config import EngineConfig
from .errors import InvalidArgumentError
from .hookspecs import CkptSpecs
from .plugin_manager import split_plugins
from .report import ComponentReport

__all__ = [
    "Difference",
    "ExactResumeReport",
    "ExactResumeRunError",
    "TinyTrainingState",
    "assert_state_dicts_equal",
    "bare_plugin_manager",
    "check_exact_resume",
    "make_engine",
    "plan_load",
    "plan_reads",
]


def plan_load(
    target: Mapping[str, Any],
    stored: Mapping[str, Any],
    *,
    plugins: Any = (),
    strict: bool = False,
    component: str = "model",
    warm_start: bool = False,
) -> ComponentReport:
    """The :class:`ComponentReport` loading ``stored`` into ``target`` would produce; no files.

    It runs ``dcp.load`` with the engine's own load planner (``remap_keys``, ``pre_load_plan``,
    strictness), exactly as ``CheckpointEngine.load`` does for one component, with a storage
    reader that serves metadata built from ``stored`` and reads nothing. ``target`` is left as
    it was.

    * ``target``: the state dict being loaded into (nested dicts allowed; tensors may be meta
      tensors; non-tensor values are allowed).
    * ``stored``: the checkpoint, by storage key (flattened, as ``ckpt-engine inspect`` lists
      them): a tensor, a ``(shape, dtype)`` pair, or any other value (a non-tensor entry).
    * ``plugins``: in fold order, plugin objects (or classes) and config entries (``"size_mismatch"``,
      ``{"name": ..., "options": ...}``, ``"package.module:Class"``). As in ``EngineConfig``,
      ``te_extra_state`` is on unless listed with ``enabled: false``.
    * ``strict=True`` raises what a strict load raises (``LoadStrictnessError`` listing every
      unresolved key; a plugin's error as ``load()`` reports it).
    * ``warm_start=True`` plans a load by the ``load_path`` rule (``RemapContext.warm_start``):
      the remaps meant for a warm start (``ema``, ``rename``) apply; by default, a resume's.
    """
    return plan_component(
        target, stored, plugins=plugins, strict=strict, component=component, warm_start=warm_start
    ).report


def plan_reads(
    target: Mapping[str, Any],
    stored: Mapping[str, Any],
    *,
    plugins: Any = (),
    strict: bool = False,
    component: str = "model",
    warm_start: bool = False,
) -> list[Any]:
    """The DCP ``ReadItem`` s the same plan hands the storage reader (arguments as :func:`plan_load`).

    ``item.storage_index.fqn`` is the storage key read, ``item.dest_index.fqn`` the destination
    it lands in; a storage key that feeds several destinations is read once (the copies are made
    after the read and have no item of their own). An empty tensor has no read item.
    """
    return plan_component(
        target, stored, plugins=plugins, strict=strict, component=component, warm_start=warm_start
    ).items


def bare_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager with the ckpt_engine hookspecs and no plugins at all."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(CkptSpecs)
    return pm


def make_engine(save_dir: str | os.PathLike[str], *plugins: Any, **config: Any) -> CheckpointEngine:
    """An engine saving to ``save_dir`` with ``plugins`` after the configured ones, in the order
    given: plugin objects (or classes) and config entries (``"pinned_staging"``,
    ``{"name": "rename", "options": {...}}``, ``"my_project.plugins:Cls"``), as :func:`plan_load`
    takes them."""
    entries, objects = split_plugins(plugins)
    configured = tuple(config.pop("plugins", ()))
    return CheckpointEngine(
        EngineConfig(save_dir=os.fspath(save_dir), plugins=(*configured, *entries), **config), plugins=objects
    )


@dataclass
class TinyTrainingState:
    """A small model, AdamW, StepLR and a CPU GradScaler, trained a few steps."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    grad_scaler: Any
    losses: list[float] = field(default_factory=list)

    @classmethod
    def create(cls, seed: int = 0, hidden: int = 16, steps: int = 2) -> TinyTrainingState:
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        state = cls(model, optimizer, scheduler, torch.amp.GradScaler("cpu", init_scale=2.0**10))
        state.train(steps, seed=seed)
        return state

    def train(self, steps: int, seed: int = 0) -> list[float]:
        gen = torch.Generator().manual_seed(seed)
        out = []
        for _ in range(steps):
            x = torch.randn(16, 8, generator=gen)
            y = torch.randn(16, 4, generator=gen)
            loss = nn.functional.mse_loss(self.model(x), y)
            self.optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
            self.scheduler.step()
            out.append(loss.item())
        self.losses += out
        return out

    def objects(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "grad_scaler": self.grad_scaler,
        }


def assert_state_dicts_equal(a: Mapping[str, Any], b: Mapping[str, Any], path: str = "") -> None:
    """Recursive, bit-exact comparison of (nested) state dicts; tensors must match dtype too."""
    assert set(a) == set(b), f"{path or '<root>'}: keys differ: {sorted(set(a) ^ set(b))}"
    for key in a:
        va, vb, where = a[key], b[key], f"{path}.{key}" if path else str(key)
        if isinstance(va, torch.Tensor):
            assert isinstance(vb, torch.Tensor), f"{where}: tensor vs {type(vb).__name__}"
            assert va.dtype == vb.dtype, f"{where}: dtype {va.dtype} != {vb.dtype}"
            assert torch.equal(va, vb), f"{where}: values differ"
        elif isinstance(va, Mapping):
            assert isinstance(vb, Mapping), f"{where}: mapping vs {type(vb).__name__}"
            assert_state_dicts_equal(va, vb, where)
        elif isinstance(va, (list, tuple)) and any(isinstance(x, (Mapping, torch.Tensor)) for x in va):
            assert isinstance(vb, (list, tuple)) and len(va) == len(vb), f"{where}: sequence differs"
            assert_state_dicts_equal(
                {str(i): x for i, x in enumerate(va)}, {str(i): x for i, x in enumerate(vb)}, where
            )
        else:
            assert va == vb, f"{where}: {va!r} != {vb!r}"


#: The strategies of :mod:`ckpt_engine.strategies`, re-exported on first use (they need hypothesis).
_STRATEGIES = frozenset(
    {
        "dotted_keys",
        "optimizer_state_dicts",
        "renamed_keys",
        "shapes",
        "state_dicts",
        "stored_like",
        "KeyRenames",
    }
)


def __getattr__(name: str) -> Any:
    if name in _STRATEGIES:
        from . import strategies

        return getattr(strategies, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_exact_resume(
    build: Callable[[], Mapping[str, Any]] | str,
    step: Callable[[Mapping[str, Any], int], Any] | str,
    *,
    steps: int,
    save_at: int,
    config: EngineConfig | Mapping[str, Any] | None = None,
    workdir: str | os.PathLike[str] | None = None,
) -> ExactResumeReport:
    """Whether a training script resumes bit for bit through the engine, and where it does not.

    ``build()`` returns the training objects as ``CheckpointEngine.save`` takes them: a dict with
    ``model`` and any of ``optimizer``, ``scheduler``, ``grad_scaler`` and ``extra`` (a dict of
    ``Stateful`` objects: the data position, a sampler, ...). ``step(objs, i)``
    runs training step ``i`` (1-based) on them. Both run in new processes, so each must be a
    module-level function of an importable module (or a ``"package.module:function"`` string); a
    lambda, a nested function or a function of ``__main__`` is refused with
    :class:`~ckpt_engine.ArgumentTypeError`.

    Three processes, one rank each, with every generator seeded with 0 before ``build()``, run:
    ``steps`` steps uninterrupted; ``save_at`` steps then ``CheckpointEngine.save(save_at, ...)``
    with ``config`` (its ``save_dir`` is set to ``workdir/checkpoints``); fresh objects from
    ``build()``, ``CheckpointEngine.load(...)`` and the steps after ``save_at``. The state right
    after the resume and after every later step (every parameter and buffer, the optimizer's,
    scheduler's and grad scaler's state dicts, every extra state, the Python, NumPy, torch and CUDA
    generators) is compared with the uninterrupted run's, bit for bit. ``workdir`` (default: a
    temporary folder, removed after) keeps the checkpoints (replaced by each check), each run's log
    and snapshots. A run that fails raises :class:`ExactResumeRunError` with its output.

    >>> report = check_exact_resume("train:build", "train:step", steps=6, save_at=3)  # doctest: +SKIP
    >>> report.raise_if_not_exact()                                                    # doctest: +SKIP
    """
    if not 1 <= save_at < steps:
        raise InvalidArgumentError(f"save_at={save_at} must be at least 1 and below steps={steps}")
    refs = reference_of(build, "build"), reference_of(step, "step")
    with tempfile.TemporaryDirectory(prefix="ckpt-exact-resume-") as tmp:
        folder = os.fspath(workdir) if workdir is not None else tmp
        os.makedirs(folder, exist_ok=True)
        save_dir = os.path.join(os.path.abspath(folder), "checkpoints")
        shutil.rmtree(save_dir, ignore_errors=True)  # a previous check's: this one saves save_at again
        if isinstance(config, EngineConfig):
            coerced = config.model_copy(update={"save_dir": save_dir})
        else:
            coerced = EngineConfig.coerce({**(config or {}), "save_dir": save_dir})
        return run_check(*refs, steps, save_at, coerced.model_dump(mode="json"), folder)
