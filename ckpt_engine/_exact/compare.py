"""What :func:`ckpt_engine.testing.check_exact_resume` compares, and its report: a snapshot of the
training state (parameters and buffers, optimizer, scheduler, grad scaler, the extra states, every
random generator) by key, and two runs' snapshots compared bit for bit, causes before effects.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["KINDS", "Difference", "ExactResumeReport", "compare", "describe", "snapshot"]

#: The order the kinds of state are compared in: what a step reads before what it writes, so the
#: first difference names the cause (a scheduler not resumed) rather than its effect (parameters).
KINDS = ("rng", "extra", "scheduler", "grad_scaler", "optimizer", "buffer", "parameter")


@dataclass(frozen=True)
class Difference:
    """Where a resumed run first differs from the uninterrupted one.

    ``step`` is the step after which the states were compared (``save_at`` itself: right after the
    resume, before step ``save_at + 1``); ``key`` names the state (``model/0.weight``,
    ``optimizer/state/0/exp_avg``, ``scheduler/last_epoch``, ``extra/data/position``, ``rng/torch``);
    ``kind`` is one of :data:`KINDS`."""

    step: int
    key: str
    kind: str
    description: str
    #: True at ``save_at``: the state the resume restored already differs.
    after_resume: bool = False

    def __str__(self) -> str:
        when = f"right after the resume at step {self.step}" if self.after_resume else f"after step {self.step}"
        return f"{self.kind} {self.key!r} {when}: {self.description}"


@dataclass(frozen=True)
class ExactResumeReport:
    """What :func:`~ckpt_engine.testing.check_exact_resume` found."""

    steps: int
    save_at: int
    keys_compared: int
    first_difference: Difference | None
    #: Every difference at the first step that has one (the first is :attr:`first_difference`).
    differences: tuple[Difference, ...] = field(default=())

    @property
    def exact(self) -> bool:
        """True when every state was bit-identical after every compared step."""
        return self.first_difference is None

    def __str__(self) -> str:
        span = f"steps {self.save_at}..{self.steps}, saved at {self.save_at} and resumed in a new process"
        if self.first_difference is None:
            return f"exact resume: {self.keys_compared} keys bit-identical after every step ({span})"
        first = self.first_difference
        lines = [f"NOT an exact resume ({span}): first difference: {first}"]
        more = self.differences[1:]
        lines += [f"  also at step {first.step}: {d.kind} {d.key!r}" for d in more[:9]]
        if len(more) > 9:
            lines.append(f"  ... and {len(more) - 9} more keys")
        return "\n".join(lines)

    def raise_if_not_exact(self) -> None:
        """Raise ``AssertionError`` with :meth:`__str__` unless the resume was exact."""
        if not self.exact:
            raise AssertionError(str(self))


# -- snapshots of the training state ---------------------------------------------------------


def _leaves(prefix: str, value: Any) -> Iterator[tuple[str, Any]]:
    """``value`` flattened to ``(key, leaf)``: nested mappings and sequences by key and index;
    leaves are CPU tensors, plain values, or ``<TypeName>`` for objects compared by type only."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _leaves(f"{prefix}/{k}", v)
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _leaves(f"{prefix}/{i}", v)
    elif isinstance(value, torch.Tensor):
        yield prefix, value.detach().to("cpu", copy=True)
    elif isinstance(value, bytes):
        yield prefix, torch.tensor(list(value), dtype=torch.uint8)
    elif value is None or isinstance(value, (bool, int, float, str)):
        yield prefix, value
    elif type(value).__module__ == "numpy" and hasattr(value, "tolist"):
        yield prefix, torch.as_tensor(value.copy()) if getattr(value, "ndim", 0) else value.item()
    else:
        yield prefix, f"<{type(value).__qualname__}>"


def _rng_state() -> dict[str, Any]:
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": {"version": version, "state": torch.tensor(internal), "gauss": gauss}}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        pass
    else:
        legacy: Any = np.random.get_state()
        kind, keys, pos, has_gauss, cached = legacy
        state["numpy"] = {"kind": kind, "keys": keys.astype("int64"), "pos": pos, "gauss": (has_gauss, cached)}
    state["torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def snapshot(objs: Mapping[str, Any]) -> dict[str, tuple[str, Any]]:
    """Every state of the training objects, by key: ``(kind, value)``."""
    out: dict[str, tuple[str, Any]] = {}

    def add(kind: str, prefix: str, value: Any) -> None:
        out.update((k, (kind, v)) for k, v in _leaves(prefix, value))

    modules = _as_list(objs.get("model"))
    for i, module in enumerate(modules):
        tag = "model" if len(modules) == 1 else f"model[{i}]"
        add("parameter", tag, dict(module.named_parameters()))
        add("buffer", tag, dict(module.named_buffers()))
    optimizers = _as_list(objs.get("optimizer"))
    for i, optimizer in enumerate(optimizers):
        add("optimizer", "optimizer" if len(optimizers) == 1 else f"optimizer[{i}]", optimizer.state_dict())
    for name in ("scheduler", "grad_scaler"):
        if objs.get(name) is not None:
            add(name, name, objs[name].state_dict())
    for name, obj in (objs.get("extra") or {}).items():
        add("extra", f"extra/{name}", obj.state_dict())
    add("rng", "rng", _rng_state())
    return out


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


# -- the comparison ----------------------------------------------------------------------------


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes, one row an element (a bool tensor: itself, one column)."""
    flat = t.contiguous().reshape(-1)
    return (flat if flat.dtype == torch.bool else flat.view(torch.uint8)).reshape(t.numel(), -1)


def describe(a: Any, b: Any) -> str | None:
    """``None`` when ``a`` (uninterrupted) and ``b`` (resumed) are bit-identical, else how they differ."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{a.dtype} {tuple(a.shape)} uninterrupted, {b.dtype} {tuple(b.shape)} resumed"
        if a.numel() == 0 or torch.equal(_bits(a), _bits(b)):
            return None
        n = int((_bits(a) != _bits(b)).any(dim=1).sum())
        text = f"{n} of {a.numel()} element(s) differ"
        if a.is_floating_point():
            diff = (a.double() - b.double()).abs()
            text += f", max |difference| {float(torch.where(diff.isnan(), math.inf, diff).max()):.3g}"
        return text
    same_float = isinstance(a, float) and isinstance(b, float) and (a == b or (a != a and b != b))
    if type(a) is type(b) and (same_float or a == b):
        return None
    return f"{_short(a)} uninterrupted, {_short(b)} resumed"


def _short(value: Any) -> str:
    text = "a tensor" if isinstance(value, torch.Tensor) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def compare(
    straight: Mapping[int, Mapping[str, tuple[str, Any]]],
    resumed: Mapping[int, Mapping[str, tuple[str, Any]]],
    steps: int,
    save_at: int,
) -> ExactResumeReport:
    """The report of the snapshots of steps ``save_at..steps`` of both runs."""
    keys = 0
    for step in range(save_at, steps + 1):
        a, b = straight[step], resumed[step]
        keys = max(keys, len(a))
        found = []
        recorded = {k: i for i, k in enumerate([*a, *(k for k in b if k not in a)])}  # kinds' own order
        for key in sorted(recorded, key=lambda k: (KINDS.index((a.get(k) or b[k])[0]), recorded[k])):
            kind = (a.get(key) or b[key])[0]
            if key not in b or key not in a:
                what = "the resumed run" if key not in b else "the uninterrupted run"
                found.append(Difference(step, key, kind, f"missing from {what}", step == save_at))
                continue
            text = describe(a[key][1], b[key][1])
            if text is not None:
                found.append(Difference(step, key, kind, text, step == save_at))
        if found:
            return ExactResumeReport(steps, save_at, keys, found[0], tuple(found))
    return ExactResumeReport(steps, save_at, keys, None)
