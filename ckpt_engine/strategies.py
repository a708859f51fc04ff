"""Hypothesis strategies for property tests of plugins (needs ``hypothesis``).

They draw the inputs of :func:`ckpt_engine.testing.plan_load`: target state dicts, checkpoint
descriptions related to them (same keys with other shapes, dtypes, keys dropped or added) and
key sets with renames. ``docs/testing-plugins.md`` writes a property test with them.

>>> from hypothesis import given
>>> from ckpt_engine import strategies as cst
>>> @given(target=cst.state_dicts(), data=cst.st.data())      # doctest: +SKIP
... def test_my_plugin(target, data):
...     stored = data.draw(cst.stored_like(target))
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from hypothesis import strategies as st

__all__ = [
    "DTYPES",
    "SEGMENTS",
    "KeyRenames",
    "dotted_keys",
    "optimizer_state_dicts",
    "renamed_keys",
    "shapes",
    "st",
    "state_dicts",
    "stored_like",
]

#: dtypes drawn by default (every one a checkpoint can hold and ``Tensor.copy_`` casts between).
DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
)
#: Key segments drawn by default, including the ones built-in plugins look at.
SEGMENTS: tuple[str, ...] = ("a", "b", "w", "blk", "net", "layers", "0", "1", "weight", "bias", "_extra_state")

Shape = tuple[int, ...]
Described = tuple[Shape, torch.dtype]


def shapes(*, max_dims: int = 3, max_side: int = 4) -> st.SearchStrategy[Shape]:
    """Tensor shapes, 0-d and empty ones included."""
    return st.lists(st.integers(0, max_side), max_size=max_dims).map(tuple)


@st.composite
def dotted_keys(
    draw: st.DrawFn,
    *,
    segments: Sequence[str] = SEGMENTS,
    min_size: int = 0,
    max_size: int = 8,
    max_depth: int = 3,
) -> list[str]:
    """Distinct dotted keys, none of which is a dotted prefix of another (as in a flat state dict)."""
    paths = draw(
        st.lists(
            st.lists(st.sampled_from(list(segments)), min_size=1, max_size=max_depth).map(tuple),
            min_size=min_size,
            max_size=max_size,
            unique=True,
        )
    )
    kept: list[tuple[str, ...]] = []
    for path in paths:
        if not any(path[: len(k)] == k or k[: len(path)] == path for k in kept):
            kept.append(path)
    return [".".join(p) for p in kept]


@st.composite
def state_dicts(
    draw: st.DrawFn,
    *,
    keys: st.SearchStrategy[list[str]] | None = None,
    dtypes: Sequence[torch.dtype] = DTYPES,
    max_dims: int = 3,
    max_side: int = 4,
    meta: bool = True,
) -> dict[str, torch.Tensor]:
    """Flat target state dicts: key -> tensor (meta tensors by default: no memory, no data)."""
    names = draw(keys if keys is not None else dotted_keys())
    device = "meta" if meta else "cpu"
    return {
        k: torch.zeros(
            draw(shapes(max_dims=max_dims, max_side=max_side)), dtype=draw(st.sampled_from(list(dtypes))), device=device
        )
        for k in names
    }


#: What :func:`stored_like` may do to each target key.
OPS: tuple[str, ...] = ("keep", "keep", "cast", "drop", "reshape", "rendim")


def _other_shape(draw: st.DrawFn, shape: Shape, same_ndim: bool, max_side: int) -> Shape:
    if same_ndim and shape:
        new = tuple(draw(st.lists(st.integers(0, max_side), min_size=len(shape), max_size=len(shape))))
        return new if new != shape else (*shape[:-1], shape[-1] + 1)
    drop_last: bool = draw(st.booleans())
    if shape and drop_last:
        return shape[:-1]
    return (*shape, draw(st.integers(1, 3)))


@st.composite
def stored_like(
    draw: st.DrawFn,
    target: Mapping[str, torch.Tensor],
    *,
    ops: Sequence[str] = OPS,
    dtypes: Sequence[torch.dtype] = DTYPES,
    max_extra: int = 2,
    max_side: int = 4,
) -> dict[str, Described]:
    """A checkpoint description related to ``target``: per key, kept, cast to another dtype,
    dropped, reshaped (same number of dimensions) or given another number of dimensions; plus
    up to ``max_extra`` keys the target lacks (``zz.extra<i>``). Values are ``(shape, dtype)``."""
    stored: dict[str, Described] = {}
    for key, value in target.items():
        op = draw(st.sampled_from(list(ops)))
        shape, dtype = tuple(value.shape), value.dtype
        if op == "drop":
            continue
        if op == "cast":
            dtype = draw(st.sampled_from(list(dtypes)))
        elif op in ("reshape", "rendim"):
            shape = _other_shape(draw, shape, same_ndim=op == "reshape", max_side=max_side)
        stored[key] = (shape, dtype)
    for i in range(draw(st.integers(0, max_extra))):
        stored[f"zz.extra{i}"] = (draw(shapes(max_side=max_side)), draw(st.sampled_from(list(dtypes))))
    return stored


@dataclass(frozen=True)
class KeyRenames:
    """Model keys and the checkpoint keys they are stored under.

    ``mapping`` is model key -> checkpoint key (identical for keys outside the renamed prefix);
    ``rule`` is the ``rename`` plugin rule that maps them (``{"checkpoint": ..., "model": ...}``).
    """

    model_keys: tuple[str, ...]
    mapping: Mapping[str, str]
    rule: Mapping[str, str]

    @property
    def checkpoint_keys(self) -> tuple[str, ...]:
        return tuple(self.mapping[k] for k in self.model_keys)


#: Prefixes :func:`renamed_keys` draws from.
PREFIXES: tuple[str, ...] = ("", "module.", "encoder.", "backbone.", "model.", "net_ema.", "_orig_mod.")


@st.composite
def renamed_keys(
    draw: st.DrawFn,
    *,
    keys: st.SearchStrategy[list[str]] | None = None,
    prefixes: Sequence[str] = PREFIXES,
) -> KeyRenames:
    """Key sets where one prefix was swapped for another: ``model + rest`` is stored as
    ``checkpoint + rest``; when neither prefix is empty, some keys (under ``keep.``) are outside
    both and keep their names (so the swapped rule maps the checkpoint keys back)."""
    model_prefix, checkpoint_prefix = draw(
        st.lists(st.sampled_from(list(prefixes)), min_size=2, max_size=2, unique=True)
    )
    rests = draw(keys if keys is not None else dotted_keys(min_size=1))
    mapping: dict[str, str] = {}
    for rest in rests:
        if model_prefix and checkpoint_prefix and draw(st.integers(0, 3)) == 0:
            mapping[f"keep.{rest}"] = f"keep.{rest}"
        else:
            mapping[model_prefix + rest] = checkpoint_prefix + rest
    return KeyRenames(
        model_keys=tuple(mapping),
        mapping=mapping,
        rule={"checkpoint": checkpoint_prefix, "model": model_prefix},
    )


#: Per-parameter optimizer statistics :func:`optimizer_state_dicts` draws (AdamW's, SGD's, Adagrad's).
STATS: tuple[str, ...] = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum")
#: Per-parameter hyperparameters of the flattened ``param_groups`` (what DCP writes for each fqn).
GROUP_FIELDS: tuple[str, ...] = ("lr", "weight_decay", "eps", "betas", "amsgrad", "maximize")


@st.composite
def optimizer_state_dicts(
    draw: st.DrawFn,
    params: Mapping[str, torch.Tensor],
    *,
    stats: Sequence[str] = STATS,
    fields: Sequence[str] = GROUP_FIELDS,
    meta: bool = True,
) -> dict[str, object]:
    """Flat ``optim`` target state dicts shaped as the engine saves them (DCP's
    ``flatten_optimizer_state_dict``) for the parameters ``params`` (fqn -> tensor, e.g. one drawn
    by :func:`state_dicts`): ``state.<fqn>.step`` (a 0-d float32 tensor) and some of ``stats`` as
    ``state.<fqn>.<stat>`` (tensors of the parameter's shape and dtype) for each parameter that
    has state, and ``param_groups.<fqn>.<field>`` for every parameter (plain Python values:
    floats, bools, a pair of floats for ``betas``)."""
    device = "meta" if meta else "cpu"
    chosen = draw(st.lists(st.sampled_from(list(stats)), min_size=1, max_size=len(stats), unique=True))
    group = draw(st.lists(st.sampled_from(list(fields)), min_size=1, max_size=len(fields), unique=True))
    out: dict[str, object] = {}
    for fqn, param in params.items():
        if draw(st.booleans()):  # this parameter has stepped: it has state
            out[f"state.{fqn}.step"] = torch.zeros((), dtype=torch.float32, device=device)
            for stat in chosen:
                out[f"state.{fqn}.{stat}"] = torch.zeros(param.shape, dtype=param.dtype, device=device)
        for name in group:
            out[f"param_groups.{fqn}.{name}"] = _group_value(draw, name)
    return out


def _group_value(draw: st.DrawFn, name: str) -> object:
    if name in ("amsgrad", "maximize"):
        return draw(st.booleans())
    if name == "betas":
        return (draw(st.floats(0.0, 1.0)), draw(st.floats(0.0, 1.0)))
    return draw(st.floats(0.0, 1.0))
