"""Two checkpoints compared component by component and key by key, streamed (one batch of A,
then the same keys of B): what ``ckpt-engine diff`` prints, computed as data.

Either side may be of any format the command line reads (:mod:`.sources`): an engine checkpoint
against its Hugging Face export compares its ``model`` with the export's tensors. A side that
holds one state dict (a file, a DCP folder) has nothing to compare with the other side's other
components: those are listed as not compared, and are no difference."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import UsageError
from .keys import DEFAULT_BUDGET, Unreadable, batches, match_keys, summarize_value
from .parts import Part
from .sources import ComponentSource, open_component
from .target import KIND_NAMES, Target

__all__ = ["CheckpointDiff", "ComponentDiff", "compare_checkpoints"]


class Meter(Protocol):
    """Where the bytes compared so far go (the command line's progress bar)."""

    def advance(self, n: int) -> None: ...

    def close(self) -> None: ...


#: ``(component, total_bytes) -> Meter``, one per compared component.
MeterFactory = Callable[[str, int], Meter]


class _NoMeter:
    def advance(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class ComponentDiff:
    """One component of two checkpoints compared. ``only_in`` is ``"a"`` or ``"b"`` for a
    component one side lacks (then nothing else is filled in)."""

    name: str
    only_in: str | None = None
    #: Why a component only one side has is not compared (the other side holds one state dict).
    not_compared: str | None = None
    only_a: list[str] = field(default_factory=list)
    only_b: list[str] = field(default_factory=list)
    #: ``(key, twin, side)``: ``key``, held by ``side`` only, is a tied weight there: equal to
    #: ``twin``, a key both sides hold and compare (``save_pretrained`` stores tied weights once,
    #: so a model's ``lm_head.weight`` is absent from its own export). Compared as one tensor.
    tied: list[tuple[str, str, str]] = field(default_factory=list)
    #: ``(key, spec in a, spec in b)`` of keys whose kind, shape or dtype changed.
    changed: list[tuple[str, str, str]] = field(default_factory=list)
    #: Tensor key -> its largest absolute difference (only those above ``atol``).
    diffs: dict[str, float] = field(default_factory=dict)
    #: Non-tensor key -> its two values, summarized.
    value_changes: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: Keys in both (after the key filter), and how many of those compared equal.
    common: int = 0
    equal: int = 0
    #: Side (``"a"``, ``"b"``) -> what it holds, where it is one rank's part (a rank-local checkpoint).
    parts: dict[str, Part] = field(default_factory=dict)
    #: Tensors in both that a side holds only part of: not compared (nothing is filled in), so the
    #: component is not called identical.
    partial: list[str] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        if self.not_compared:
            return False
        return bool(
            self.only_in or self.only_a or self.only_b or self.changed or self.diffs or self.value_changes
        ) or bool(self.partial)

    def to_json(self) -> dict[str, Any]:
        if self.only_in is not None:
            return {"only_in": self.only_in, **({"not_compared": self.not_compared} if self.not_compared else {})}
        return {
            "only_in_a": self.only_a,
            "only_in_b": self.only_b,
            "tied": [{"key": k, "tied_to": t, "in": side} for k, t, side in self.tied],
            "changed": [{"key": k, "a": x, "b": y} for k, x, y in self.changed],
            "max_abs_diff": self.diffs,
            "values_changed": {k: {"a": x, "b": y} for k, (x, y) in self.value_changes.items()},
            "equal": self.equal,
            **({"parts": {side: p.to_json() for side, p in self.parts.items()}} if self.parts else {}),
            **({"not_compared_partial": self.partial} if self.partial else {}),
        }


@dataclass
class CheckpointDiff:
    a: Target
    b: Target
    components: list[ComponentDiff] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return not any(c.differs for c in self.components)

    def to_json(self) -> dict[str, Any]:
        return {
            "a": self.a.checkpoint,
            "b": self.b.checkpoint,
            "components": {c.name: c.to_json() for c in self.components},
            "identical": self.identical,
        }


def compare_checkpoints(
    a: Target,
    b: Target,
    components: Sequence[str] = (),
    keys: Sequence[str] = (),
    *,
    atol: float = 0.0,
    budget: int = DEFAULT_BUDGET,
    trust: bool = False,
    meter: MeterFactory | None = None,
) -> CheckpointDiff:
    """Compare ``components`` (default: every component of either) of ``a`` and ``b``, keys
    matching the globs ``keys``; tensors differing by at most ``atol`` count as equal. Memory is
    bounded by ``budget`` bytes of tensors per side (or the largest tensor). Raises
    :class:`UsageError` for a component neither checkpoint has."""
    result = CheckpointDiff(a, b)
    new_meter: MeterFactory = meter or (lambda _name, _total: _NoMeter())
    if components:  # a side that holds one state dict stands for the component asked for
        a, b = _named(a, components), _named(b, components)
    for name in components or sorted(set(a.components) | set(b.components)):
        if name not in a.components or name not in b.components:
            side = "a" if name in a.components else "b" if name in b.components else None
            if side is None:
                raise UsageError(f"neither checkpoint has component {name!r}")
            other = b if side == "a" else a
            why = f"{'b' if side == 'a' else 'a'} is {KIND_NAMES[other.via]}: one state dict" if other.single else None
            result.components.append(ComponentDiff(name, only_in=side, not_compared=why))
            continue
        ra, rb = open_component(a, name, trust), open_component(b, name, trust)
        result.components.append(_compare_component(name, ra, rb, keys, atol, budget, new_meter))
    return result


def _named(target: Target, components: Sequence[str]) -> Target:
    """``target``, its one state dict named as the component asked for when it holds one."""
    if not target.single or len(components) != 1 or components[0] in target.components:
        return target
    return dataclasses.replace(target, components={components[0]: next(iter(target.components.values()))})


def _compare_component(
    name: str,
    ra: ComponentSource,
    rb: ComponentSource,
    patterns: Sequence[str],
    atol: float,
    budget: int,
    meter: MeterFactory,
) -> ComponentDiff:
    keys_a = match_keys(ra.keys, patterns)
    keys_b = match_keys(rb.keys, patterns)
    common = [k for k in keys_a if k in rb.keys]
    out = ComponentDiff(
        name, only_a=[k for k in keys_a if k not in rb.keys], only_b=[k for k in keys_b if k not in ra.keys]
    )
    out.common = len(common)
    out.parts = {side: src.part for side, src in (("a", ra), ("b", rb)) if src.part is not None}
    _find_tied(ra, out.only_a, common, "a", out)
    _find_tied(rb, out.only_b, common, "b", out)
    comparable: list[str] = []
    for k in common:
        ia, ib = ra.keys[k], rb.keys[k]
        if ia.is_tensor != ib.is_tensor or ia.shape != ib.shape:
            out.changed.append((k, ia.spec(), ib.spec()))
        elif ia.held is not None or ib.held is not None:  # one rank's part: never compared as a whole
            out.partial.append(k)
        else:
            if ia.dtype_name != ib.dtype_name:
                out.changed.append((k, ia.spec(), ib.spec()))
            comparable.append(k)
    bar = meter(name, sum(ra.keys[k].nbytes for k in comparable))
    try:
        _compare_values(ra, rb, comparable, atol, budget, bar, out)
    finally:
        bar.close()
    out.equal = len(comparable) - len(out.diffs) - len(out.value_changes)
    return out


def _find_tied(source: ComponentSource, only: list[str], common: list[str], side: str, out: ComponentDiff) -> None:
    """Move each tensor of ``only`` (keys ``side`` alone holds) that is equal, on that side, to a
    tensor of the same shape and dtype that both sides hold into ``out.tied``: a tied weight, so
    comparing its twin compares it. Reads only those candidates, one pair at a time."""
    for key in list(only):
        info = source.keys[key]
        if not info.is_tensor:
            continue
        if info.held is not None:  # one rank's part: never read as a whole
            continue
        twins = [
            c
            for c in common
            if source.keys[c].is_tensor
            and source.keys[c].held is None
            and source.keys[c].shape == info.shape
            and source.keys[c].dtype_name == info.dtype_name
        ]
        for twin in twins:
            values = source.read([key, twin])
            if max_abs_diff(values[key], values[twin]) == 0.0 and not _constant(values[key]):
                only.remove(key)
                out.tied.append((key, twin, side))
                break


def _compare_values(
    ra: ComponentSource,
    rb: ComponentSource,
    comparable: list[str],
    atol: float,
    budget: int,
    bar: Meter,
    out: ComponentDiff,
) -> None:
    # Streamed: one batch of a, then the same keys of b; never both checkpoints at once.
    merged = {k: ra.keys[k] if ra.keys[k].nbytes >= rb.keys[k].nbytes else rb.keys[k] for k in comparable}
    for batch in batches(comparable, merged, budget):
        va = ra.read(batch)
        vb = rb.read(batch)
        for k in batch:
            x, y = va.pop(k), vb.pop(k)
            if ra.keys[k].is_tensor:
                d = max_abs_diff(x, y)
                if d > atol:
                    out.diffs[k] = d
                bar.advance(ra.keys[k].nbytes)
            elif not same_value(x, y, ra.stored.get(k), rb.stored.get(k)):
                out.value_changes[k] = (summarize_value(x), summarize_value(y))


def _constant(tensor: Any) -> bool:
    """Whether every element of ``tensor`` is one value (a bias at zeros, a norm weight at ones):
    such a tensor equals any other of its shape and value by chance, never shows a tied weight."""
    flat = tensor.reshape(-1)
    return bool(flat.numel() <= 1 or (flat == flat[0]).all())


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest ``|a - b|`` of two same-shape tensors (NaN where both are NaN counts as equal,
    NaN on one side as infinitely far; booleans differ by 1)."""
    import torch

    if torch.equal(a, b):
        return 0.0
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return float((a.to(torch.int8) != b.to(torch.int8)).any())
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    x, y = a.to(wide), b.to(wide)
    d = (x - y).abs()
    if d.is_complex():
        d = d.real
    both_nan = torch.isnan(x) & torch.isnan(y) if not x.is_complex() else torch.zeros_like(d, dtype=torch.bool)
    d = torch.where(both_nan, torch.zeros_like(d), d)
    d = torch.nan_to_num(d, nan=float("inf"))
    largest = float(d.max()) if d.numel() else 0.0
    if not (a.is_floating_point() or a.is_complex() or b.is_floating_point() or b.is_complex()):
        # integers past 2**53 (64-bit seeds, counters) round to one float64: unequal integers differ by 1 at least
        return max(largest, 1.0)
    return largest


def same_value(x: Any, y: Any, stored_x: bytes | None, stored_y: bytes | None) -> bool:
    """Equal stored bytes are equal values, read or not (a value ``weights_only`` refuses, such
    as the original checkpointer's ``_extra_state``, compares by them); else the read values."""
    if stored_x is not None and stored_x == stored_y:
        return True
    if isinstance(x, Unreadable) or isinstance(y, Unreadable):
        return False
    return _values_equal(x, y)


def _values_equal(x: Any, y: Any) -> bool:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
    try:
        return bool(x == y)
    except Exception:
        return False
