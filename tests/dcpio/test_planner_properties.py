"""Hypothesis property tests of the load planner and the built-in plan plugins.

Random state dicts (nested dicts, tensors of many dtypes and shapes including 0-d and empty,
non-tensor values) and checkpoints derived from them (keys dropped, added, renamed, reshaped,
retyped) meet random plugin configurations. Everything goes through public surfaces only:

* ``ckpt_engine.testing.plan_load`` / ``plan_reads``: the engine's real planner and hooks on a
  described checkpoint, no files;
* a real ``CheckpointEngine.load`` of a checkpoint written with plain ``dcp.save`` (the layout of
  docs/design.md, section 2), where the loaded values themselves are checked, and to show that
  ``plan_load`` gives the report such a load gives.

The expected outcome of every key is computed independently here (:func:`oracle`) from the
documented rules.

Profiles (registered in ``conftest.py``): ``ci`` (default, 40 examples, derandomized) and
``thorough`` (600 examples): ``CKPT_ENGINE_HYPOTHESIS=thorough pytest tests/dcpio/test_planner_properties.py``.
"""

from __future__ import annotations

import copy
import os
import re
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import event, example, given
from hypothesis import strategies as st
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ckpt_engine import CheckpointEngine, ComponentReport, EngineConfig, LoadStrictnessError, RemapContext, hookimpl
from ckpt_engine._dcpio.planner import flat_keys
from ckpt_engine.strategies import DTYPES  # the dtypes plugin authors' strategies draw
from ckpt_engine.testing import plan_load, plan_reads

#: The component the real loads go through (an ``extra=`` component: any nested state dict).
COMPONENT = "state"

# -- values ------------------------------------------------------------------------------------

SEGMENTS = ["a", "b", "w", "blk", "net", "_extra_state"]

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)
seeds = st.integers(0, 2**31 - 1)
plain_values = st.one_of(
    st.integers(-1000, 1000),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(alphabet="xyz!", max_size=4),
    st.booleans(),
    st.lists(st.integers(0, 9), max_size=3),
)


def make_tensor(dtype: torch.dtype, shape: Sequence[int], seed: int) -> torch.Tensor:
    """Values every dtype represents exactly (multiples of 1/4 below 50, small ints, bools)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype is torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=gen).bool()
    if dtype.is_floating_point:
        return (torch.randint(0, 200, tuple(shape), generator=gen) / 4).to(dtype)
    return torch.randint(0, 50, tuple(shape), generator=gen).to(dtype)


@st.composite
def tensors(draw: st.DrawFn, dtype: torch.dtype | None = None, shape: tuple[int, ...] | None = None) -> torch.Tensor:
    return make_tensor(
        draw(st.sampled_from(DTYPES)) if dtype is None else dtype,
        draw(shapes) if shape is None else shape,
        draw(seeds),
    )


leaves = st.one_of(tensors(), tensors(), plain_values)  # tensors twice as likely


@st.composite
def key_paths(draw: st.DrawFn, min_keys: int = 0, max_keys: int = 8) -> list[tuple[str, ...]]:
    """Unique key paths of which none is a prefix of another (a key is a leaf or a dict)."""
    raw = draw(
        st.lists(
            st.lists(st.sampled_from(SEGMENTS), min_size=1, max_size=3).map(tuple),
            min_size=min_keys,
            max_size=max_keys,
            unique=True,
        )
    )
    kept: list[tuple[str, ...]] = []
    for path in raw:
        if not any(path[: len(k)] == k or k[: len(path)] == path for k in kept):
            kept.append(path)
    return kept


def nest(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    root: dict[str, Any] = {}
    for path, value in flat.items():
        cur = root
        for part in path[:-1]:
            cur = cur.setdefault(part, {})
        cur[path[-1]] = value
    return root


@st.composite
def state_dicts(draw: st.DrawFn, min_keys: int = 0) -> dict[tuple[str, ...], Any]:
    """A flat description (path -> value) of a nested state dict; :func:`nest` builds it."""
    return {path: draw(leaves) for path in draw(key_paths(min_keys=min_keys))}


def template_like(value: Any) -> Any:
    """A same-shaped, same-dtype value that differs from ``value``."""
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, True) if value.dtype is torch.bool else torch.full_like(value, 77)
    return ("template", repr(value))


def flatten(nested: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in nested.items():
        if isinstance(v, Mapping):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def has_data(value: Any) -> bool:
    """Whether loading ``value`` reads anything (DCP makes no read item for an empty tensor)."""
    return not (isinstance(value, torch.Tensor) and value.numel() == 0)


def assert_same_value(got: Any, want: Any, key: str) -> None:
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), key
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert torch.equal(got, want), key
    else:
        assert type(got) is type(want) and got == want, f"{key}: {got!r} != {want!r}"


# -- running a load ----------------------------------------------------------------------------


class Holder:
    """A ``Stateful`` extra component whose state dict is ``sd`` (loaded in place)."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self.sd = sd

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sd = sd


def save_flat(sd: Mapping[str, Any], save_dir: str) -> None:
    """A checkpoint of one component written with plain ``dcp.save`` (no engine files)."""
    dcp.save(dict(sd), checkpoint_id=os.path.join(save_dir, "iter_000000001", COMPONENT))
    with open(os.path.join(save_dir, "latest_checkpoint.txt"), "w") as f:
        f.write("iter_000000001\n")


def for_component(plugins: Sequence[Any]) -> list[Any]:
    """Config entries of the built-in plan plugins made to apply to :data:`COMPONENT`."""
    out: list[Any] = []
    for p in plugins:
        if isinstance(p, Mapping) and p["name"] in ("te_extra_state", "size_mismatch"):
            p = {**p, "options": {**p.get("options", {}), "components": [COMPONENT]}}
        out.append(p)
    return out


def real_load(template: dict[str, Any], save_dir: str, *, strict: bool, plugins: Sequence[Any] = ()) -> ComponentReport:
    """``CheckpointEngine.load`` of ``save_dir``'s checkpoint into ``template`` (filled in place).

    ``plugins`` mixes config entries and plugin objects, in fold order (as ``plan_load`` takes them).
    """
    entries = [p if isinstance(p, (str, Mapping)) else p.name for p in plugins]
    objects = [p for p in plugins if not isinstance(p, (str, Mapping))]
    holder = Holder(template)
    # A one-component checkpoint has no trainer: resume it without (rule 1 refuses that otherwise).
    cfg = EngineConfig(save_dir=save_dir, strict=strict, plugins=for_component(entries), keys_not_to_resume=["trainer"])
    with CheckpointEngine(cfg, plugins=objects) as engine:
        report = engine.load(extra={COMPONENT: holder}).report[COMPONENT]
    assert holder.sd is template
    return report


def plan_as_real(template: dict[str, Any], stored: Mapping[str, Any], *, strict: bool, plugins: Sequence[Any]) -> Any:
    """``plan_load`` with the plugins and component of :func:`real_load`."""
    return plan_load(template, stored, strict=strict, plugins=for_component(plugins), component=COMPONENT)


def without_dir(report: ComponentReport) -> dict[str, Any]:
    """A report's content, but where the checkpoint is (``plan_load`` has no folder)."""
    d = report.to_dict()
    del d["checkpoint_dir"]
    return d


def nest_flat(flat: Mapping[str, Any]) -> dict[str, Any]:
    return nest({tuple(k.split(".")): v for k, v in flat.items()})


# -- derived checkpoints and plugin configurations ---------------------------------------------

OPS = ["keep", "cast", "drop", "rename", "reshape", "reshape", "reshape", "rendim", "retype"]
POLICIES = ["error", "skip", "overlap", "overlap"]
GLOBS = ["*", "a*", "*w", "*.b", "blk.*", "*a*"]


class StripModulePrefix:
    """Test remap plugin: read ``module.<key>`` where the checkpoint has it and not ``<key>``."""

    name = "strip_module"

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> dict[str, str] | None:
        if ctx.direction != "load" or ctx.storage_keys is None:
            return None
        keys = ctx.storage_keys
        return {d: (f"module.{s}" if s not in keys and f"module.{s}" in keys else s) for d, s in key_map.items()}


@dataclass
class Case:
    dest: dict[str, Any]  # flat destination key -> template value
    stored: dict[str, Any]  # flat storage key -> saved value
    te: bool
    strip: bool
    size_mismatch: dict[str, Any] | None
    order: list[str] = field(default_factory=list)  # config order of the plan plugins

    def config_plugins(self) -> list[Any]:
        entries: dict[str, Any] = {"te_extra_state": {"name": "te_extra_state", "enabled": self.te}}
        if self.size_mismatch is not None:
            entries["size_mismatch"] = {"name": "size_mismatch", "options": self.size_mismatch}
        if self.strip:
            entries["strip_module"] = "strip_module"
        return [entries[n] for n in self.order if n in entries]

    def objects(self) -> list[Any]:
        return [StripModulePrefix()] if self.strip else []

    def plugins(self) -> list[Any]:
        """Config entries and the remap object in one list, in fold order (``plan_load``'s form)."""
        return [StripModulePrefix() if e == "strip_module" else e for e in self.config_plugins()]


def changed_shape(draw: st.DrawFn, shape: tuple[int, ...], same_ndim: bool) -> tuple[int, ...]:
    if same_ndim:
        new = tuple(draw(st.lists(st.integers(0, 5), min_size=len(shape), max_size=len(shape))))
        return new if new != shape else (*shape[:-1], shape[-1] + 1) if shape else shape
    if shape and draw(st.booleans()):
        return shape[:-1]
    return (*shape, draw(st.integers(1, 3)))


@st.composite
def cases(draw: st.DrawFn) -> Case:
    dest_paths = draw(state_dicts(min_keys=1))
    dest = {".".join(p): template_like(v) for p, v in dest_paths.items()}
    stored: dict[str, Any] = {}
    for key, value in dest_paths.items():
        k = ".".join(key)
        op = draw(st.sampled_from(OPS))
        is_tensor = isinstance(value, torch.Tensor)
        if op == "drop":
            continue
        if op == "rename":
            stored[f"module.{k}"] = value
        elif op == "cast" and is_tensor:
            stored[k] = value.to(draw(st.sampled_from(DTYPES)))
        elif op in ("reshape", "rendim") and is_tensor:
            same_ndim = op == "reshape" and value.dim() > 0  # a 0-d tensor can only change ndim
            new_shape = changed_shape(draw, tuple(value.shape), same_ndim=same_ndim)
            stored[k] = make_tensor(draw(st.sampled_from(DTYPES)), new_shape, draw(seeds))
        elif op == "retype":
            stored[k] = draw(plain_values) if is_tensor else draw(tensors())
        else:
            stored[k] = value
    for i in range(draw(st.integers(0, 2))):  # keys the destination does not have
        stored[f"zz.extra{i}"] = draw(leaves)
    size_mismatch = None
    if draw(st.integers(0, 3)) > 0:
        size_mismatch = {
            "policy": draw(st.sampled_from(POLICIES)),
            "patterns": draw(st.lists(st.sampled_from(GLOBS), max_size=2)),
            "rules": [
                {"pattern": p, "policy": pol}
                for p, pol in draw(st.lists(st.tuples(st.sampled_from(GLOBS), st.sampled_from(POLICIES)), max_size=2))
            ],
        }
    order = draw(st.permutations(["te_extra_state", "size_mismatch", "strip_module"]))
    return Case(
        dest, stored, te=draw(st.booleans()), strip=draw(st.booleans()), size_mismatch=size_mismatch, order=order
    )


# -- the oracle --------------------------------------------------------------------------------


def is_mismatch(stored: Any, target: Any) -> bool:
    if isinstance(stored, torch.Tensor) != isinstance(target, torch.Tensor):
        return True
    return isinstance(stored, torch.Tensor) and stored.shape != target.shape


def policy_for(options: Mapping[str, Any] | None, key: str) -> str:
    if options is None:
        return "error"
    for rule in options["rules"]:
        if fnmatchcase(key, rule["pattern"]):
            return str(rule["policy"])
    if not options["patterns"] or any(fnmatchcase(key, p) for p in options["patterns"]):
        return str(options["policy"])
    return "error"


@dataclass
class Expected:
    storage: dict[str, str]  # dest -> storage key
    decision: dict[str, str]  # dest -> load | overlap | skip | missing | mismatch

    def keys(self, *decisions: str) -> set[str]:
        return {k for k, d in self.decision.items() if d in decisions}


def oracle(case: Case) -> Expected:
    storage: dict[str, str] = {}
    decision: dict[str, str] = {}
    for d, target in case.dest.items():
        s = d
        if case.strip and s not in case.stored and f"module.{s}" in case.stored:
            s = f"module.{s}"
        storage[d] = s
        if case.te and "_extra_state" in d.split("."):
            decision[d] = "skip"
        elif s not in case.stored:
            decision[d] = "missing"
        elif not is_mismatch(case.stored[s], target):
            decision[d] = "load"
        else:
            policy = policy_for(case.size_mismatch, d)
            stored = case.stored[s]
            if policy == "error":
                decision[d] = "mismatch"
            elif (
                policy == "overlap"
                and isinstance(stored, torch.Tensor)
                and isinstance(target, torch.Tensor)
                and stored.dim() == target.dim()
            ):
                decision[d] = "overlap"
            else:
                decision[d] = "skip"
    return Expected(storage, decision)


# -- properties --------------------------------------------------------------------------------

NO_TE = {"name": "te_extra_state", "enabled": False}


@given(state=state_dicts())
def test_round_trip_into_same_shaped_template(state: dict[tuple[str, ...], Any]) -> None:
    saved = nest(state)
    template = nest({p: template_like(v) for p, v in state.items()})
    planned = plan_as_real(copy.deepcopy(template), flatten(saved), strict=True, plugins=[NO_TE])
    with tempfile.TemporaryDirectory() as path:
        save_flat(copy.deepcopy(saved), path)
        report = real_load(template, path, strict=True, plugins=[NO_TE])
    flat_saved, flat_loaded = flatten(saved), flatten(template)
    assert flat_loaded.keys() == flat_saved.keys()
    for key, want in flat_saved.items():
        assert_same_value(flat_loaded[key], want, key)
    assert set(report.loaded) == set(flat_saved)
    assert not (report.missing or report.skipped or report.unexpected or report.overlap)
    assert without_dir(planned) == without_dir(report)


@given(case=cases())
def test_report_partitions_destination_and_storage_keys(case: Case) -> None:
    expected = oracle(case)
    for decision in set(expected.decision.values()):
        event(f"has a {decision!r} key")  # shown by --hypothesis-show-statistics
    rep = plan_load(nest_flat(case.dest), case.stored, strict=False, plugins=case.plugins())
    groups = {
        "loaded": set(rep.loaded),
        "overlap": set(rep.overlap),
        "skipped": set(rep.skipped),
        "missing": set(rep.missing),
    }
    # every destination key is in exactly one group
    assert sum(len(g) for g in groups.values()) == len(case.dest)
    assert set().union(*groups.values()) == set(case.dest)
    # ... the one the documented rules give (non-strict: unresolved mismatches are skipped)
    assert groups["loaded"] == expected.keys("load")
    assert groups["overlap"] == expected.keys("overlap")
    assert groups["skipped"] == expected.keys("skip", "mismatch")
    assert groups["missing"] == expected.keys("missing")
    # every storage key is consumed (some destination reads it) or unexpected, never both
    consumed = {expected.storage[d] for d in case.dest} & set(case.stored)
    assert set(rep.unexpected) == set(case.stored) - consumed
    assert {d: s for d, s in expected.storage.items() if d != s} == dict(rep.renamed)


@given(case=cases(), strict=st.booleans())
def test_plan_load_agrees_with_a_real_load(case: Case, strict: bool) -> None:
    """Same report (or the same error) from ``plan_load`` as from ``CheckpointEngine.load``."""
    planned: ComponentReport | LoadStrictnessError
    try:
        planned = plan_as_real(nest_flat(case.dest), case.stored, strict=strict, plugins=case.plugins())
    except LoadStrictnessError as err:
        planned = err
    with tempfile.TemporaryDirectory() as path:
        save_flat(case.stored, path)
        if isinstance(planned, LoadStrictnessError):
            with pytest.raises(LoadStrictnessError) as info:
                real_load(nest_flat(case.dest), path, strict=strict, plugins=case.plugins())
            assert (info.value.component, info.value.missing, info.value.mismatched) == (
                planned.component,
                planned.missing,
                planned.mismatched,
            )
            assert str(info.value) == str(planned)
            return
        report = real_load(nest_flat(case.dest), path, strict=strict, plugins=case.plugins())
    assert without_dir(planned) == without_dir(report)


@given(case=cases())
def test_read_items_stay_inside_stored_and_destination(case: Case) -> None:
    expected = oracle(case)
    items: list[ReadItem] = plan_reads(nest_flat(case.dest), case.stored, strict=False, plugins=case.plugins())
    not_read = expected.keys("skip", "mismatch", "missing")
    read_dests = {it.dest_index.fqn for it in items}
    assert not (read_dests & not_read), "a skipped or missing key has a read item"
    # every loaded key with data is read (directly, or as a copy of one read of its storage key)
    storage_read = {it.storage_index.fqn for it in items}
    must_read = {expected.storage[d] for d in expected.keys("load") if has_data(case.dest[d])}
    assert must_read <= storage_read
    for it in items:
        assert it.storage_index.fqn == expected.storage.get(it.dest_index.fqn, it.storage_index.fqn)
        stored, target = case.stored[it.storage_index.fqn], case.dest[it.dest_index.fqn]
        if it.type is LoadItemType.BYTE_IO:
            assert not isinstance(stored, torch.Tensor) and not isinstance(target, torch.Tensor)
            continue
        s_off = [a + b for a, b in zip(it.storage_index.offset or (), it.storage_offsets, strict=True)]
        d_off = [
            a + b for a, b in zip(it.dest_index.offset or [0] * len(it.dest_offsets), it.dest_offsets, strict=True)
        ]
        assert len(it.lengths) == stored.dim() == target.dim()
        for dim, length in enumerate(it.lengths):
            assert s_off[dim] >= 0 and s_off[dim] + length <= stored.shape[dim], (it, stored.shape)
            assert d_off[dim] >= 0 and d_off[dim] + length <= target.shape[dim], (it, target.shape)


def poison_like(t: torch.Tensor) -> torch.Tensor:
    if t.dtype is torch.bool:
        return torch.ones_like(t)
    return torch.full_like(t, -99 if t.dtype.is_signed or t.dtype.is_floating_point else 251)


@st.composite
def overlap_cases(draw: st.DrawFn) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Destination tensors and stored tensors of the same ndim, other shapes and dtypes."""
    n = draw(st.integers(1, 5))
    dest: dict[str, torch.Tensor] = {}
    stored: dict[str, torch.Tensor] = {}
    for i in range(n):
        shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple))
        dest[f"t{i}"] = poison_like(make_tensor(draw(st.sampled_from(DTYPES)), shape, 0))
        saved_shape = tuple(draw(st.lists(st.integers(0, 5), min_size=len(shape), max_size=len(shape))))
        stored[f"t{i}"] = make_tensor(draw(st.sampled_from(DTYPES)), saved_shape, draw(seeds))
    return dest, stored


@pytest.mark.full  # over 2 s on 2 cores: hundreds of hypothesis examples
@given(case=overlap_cases())
def test_overlap_writes_exactly_the_shared_region(
    case: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]],
) -> None:
    dest, stored = case
    poisoned = {k: v.clone() for k, v in dest.items()}
    with tempfile.TemporaryDirectory() as path:
        save_flat(stored, path)
        rep = real_load(dest, path, strict=True, plugins=[{"name": "size_mismatch", "options": {"policy": "overlap"}}])
    for key, got in dest.items():
        src = stored[key]
        region = tuple(slice(0, min(a, b)) for a, b in zip(got.shape, src.shape, strict=True))
        expect = poisoned[key].clone()
        expect[region] = src[region].to(got.dtype)
        assert torch.equal(got, expect), f"{key}: saved {tuple(src.shape)} into {tuple(got.shape)}"
        if src.shape == got.shape:
            assert key in rep.loaded
        else:
            rec = rep.overlap[key]
            assert (rec.saved_shape, rec.target_shape) == (tuple(src.shape), tuple(got.shape))
        assert (key in rep.cast) == (src.dtype != got.dtype)


@given(case=cases())
def test_strict_raises_iff_unresolved_and_lists_all(case: Case) -> None:
    expected = oracle(case)
    unresolved_missing = expected.keys("missing")
    unresolved_mismatch = expected.keys("mismatch")
    template = nest_flat(case.dest)
    if not (unresolved_missing or unresolved_mismatch):
        plan_load(template, case.stored, strict=True, plugins=case.plugins())
        return
    with pytest.raises(LoadStrictnessError) as info:
        plan_load(template, case.stored, strict=True, plugins=case.plugins())
    err = info.value
    assert {m.split(" (reads ")[0] for m in err.missing} == unresolved_missing
    assert {m.split(": stored ")[0] for m in err.mismatched} == unresolved_mismatch
    text = str(err)
    for key in unresolved_missing | unresolved_mismatch:
        assert f": {key}" in text
    counts = text.splitlines()[0]
    if unresolved_missing:
        assert f"{len(unresolved_missing)} missing key(s)" in counts
    if unresolved_mismatch:
        assert f"{len(unresolved_mismatch)} mismatch(es)" in counts


# -- remaps ------------------------------------------------------------------------------------


class RemapOp:
    """A test remap plugin applying one string rule to the storage side of the key map; every
    call is recorded in ``calls`` (shared by the plugins of one load), so the fold order shows."""

    def __init__(self, name: str, kind: str, a: str, b: str = "", calls: list[str] | None = None) -> None:
        self.name, self.kind, self.a, self.b = name, kind, a, b
        self.calls = calls if calls is not None else []

    def apply(self, storage: str) -> str:
        if self.kind == "add":
            return self.a + storage
        if self.kind == "strip":
            return storage.removeprefix(self.a) or storage
        return storage.replace(self.a, self.b)

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> dict[str, str]:
        self.calls.append(f"{self.name}:{ctx.direction}")
        return {d: self.apply(s) for d, s in key_map.items()}


remap_ops = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(["m.", "x.", "a."]), st.just("")),
    st.tuples(st.just("strip"), st.sampled_from(["m.", "a.", "x."]), st.just("")),
    st.tuples(st.just("replace"), st.sampled_from(["a", "b", "x", "a.b"]), st.sampled_from(["b", "x", "q"])),
)


@pytest.mark.full  # over 2 s on 2 cores: hundreds of hypothesis examples
@given(
    paths=key_paths(max_keys=6).filter(bool),
    ops=st.lists(remap_ops, min_size=1, max_size=4),
    registration=st.randoms(use_true_random=False),
)
def test_composed_remap_is_deterministic_and_in_config_order(
    paths: list[tuple[str, ...]], ops: list[tuple[str, str, str]], registration: Any
) -> None:
    dest_keys = [".".join(p) for p in paths]
    names = [f"op{i}" for i in range(len(ops))]
    expected = {}
    for d in dest_keys:
        s = d
        for kind, a, b in ops:  # config order
            s = RemapOp("", kind, a, b).apply(s)
        expected[d] = s
    storage_values = {s: make_tensor(torch.float32, (3,), i) for i, s in enumerate(sorted(set(expected.values())))}

    results = []
    for _ in range(2):
        calls: list[str] = []
        objects = [RemapOp(n, *op, calls=calls) for n, op in zip(names, ops, strict=True)]
        registration.shuffle(objects)  # registration order must not matter
        by_name = {o.name: o for o in objects}
        template = {d: torch.zeros(3) for d in dest_keys}
        with tempfile.TemporaryDirectory() as path:
            save_flat(storage_values, path)
            # config order: names; the objects are registered in the shuffled order
            cfg = EngineConfig(save_dir=path, strict=True, plugins=[NO_TE, *names], keys_not_to_resume=["trainer"])
            with CheckpointEngine(cfg, plugins=objects) as engine:
                report = engine.load(extra={COMPONENT: Holder(template)}).report[COMPONENT]
        assert calls == [f"{n}:load" for n in names]
        key_map = {d: report.renamed.get(d, d) for d in dest_keys}
        assert key_map == expected
        planned = plan_load(
            {d: torch.zeros(3) for d in dest_keys},
            storage_values,
            strict=True,
            plugins=[NO_TE, *(by_name[n] for n in names)],
            component=COMPONENT,
        )
        assert {d: planned.renamed.get(d, d) for d in dest_keys} == expected
        for d in dest_keys:
            assert torch.equal(template[d], storage_values[expected[d]]), d
        results.append((key_map, {d: template[d].tolist() for d in dest_keys}, dict(report.renamed)))
    assert results[0] == results[1]


class FixedRemap:
    name = "fixed_remap"

    def __init__(self, mapping: Mapping[str, str]) -> None:
        self.mapping = dict(mapping)

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> dict[str, str] | None:
        if ctx.direction != "load":
            return None
        return {d: self.mapping.get(d, s) for d, s in key_map.items()}


@st.composite
def many_to_one(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """Storage keys, each read by 1-4 destinations of the same shape (dtypes may differ)."""
    stored: dict[str, Any] = {}
    dest: dict[str, Any] = {}
    mapping: dict[str, str] = {}
    for i in range(draw(st.integers(1, 4))):
        s = f"s{i}"
        value = draw(leaves)
        stored[s] = value
        for j in range(draw(st.integers(1, 4))):
            d = f"d{i}_{j}"
            mapping[d] = s
            if isinstance(value, torch.Tensor):
                dest[d] = poison_like(make_tensor(draw(st.sampled_from(DTYPES)), tuple(value.shape), 0))
            else:
                dest[d] = ("template", j)
    return stored, dest, mapping


@pytest.mark.full  # over 2 s on 2 cores: hundreds of hypothesis examples
@given(case=many_to_one())
def test_many_to_one_reads_each_storage_key_once_and_fills_every_destination(
    case: tuple[dict[str, Any], dict[str, Any], dict[str, str]],
) -> None:
    stored, dest, mapping = case
    plugins = [NO_TE, FixedRemap(mapping)]
    items: list[ReadItem] = plan_reads(dest, stored, strict=True, plugins=plugins)
    reads = Counter(it.storage_index.fqn for it in items)
    nonempty = {s for s, v in stored.items() if has_data(v)}
    assert {s: n for s, n in reads.items()} == dict.fromkeys(sorted(reads), 1)
    assert nonempty <= set(reads)
    with tempfile.TemporaryDirectory() as path:
        save_flat(stored, path)
        report = real_load(dest, path, strict=True, plugins=plugins)
    assert set(report.loaded) == set(dest)
    for d, s in mapping.items():
        want = stored[s]
        if isinstance(want, torch.Tensor):
            assert torch.equal(dest[d], want.to(dest[d].dtype)), d
        else:
            assert_same_value(dest[d], want, d)
    # non-tensor values are copies: mutating one destination leaves the others alone
    for s, value in stored.items():
        readers = [d for d, t in mapping.items() if t == s]
        if isinstance(value, list) and len(readers) > 1:
            assert all(dest[a] is not dest[b] for a in readers for b in readers if a != b)


_LEAVES = st.one_of(
    st.integers(-3, 3),
    st.none(),
    st.text(max_size=3),
    st.builds(torch.zeros, st.integers(0, 3)),
    st.tuples(st.integers(), st.builds(torch.ones, st.just(1))),
)
_VALUES = st.recursive(
    _LEAVES,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=2), inner, max_size=3),
    max_leaves=8,
)


@pytest.mark.full  # over 2 s on 2 cores: hundreds of hypothesis examples
@given(sd=st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 5)), _VALUES, max_size=6))
@example(sd={"": 0, 3: [], "3": []})  # 3 and "3" flatten to one key: DCP refuses the dict
def test_flat_keys_are_the_keys_dcp_saves_under(sd: dict[Any, Any]) -> None:
    """``flat_keys`` skips DCP's walk for flat state dicts: the keys must be exactly DCP's, and a
    state dict DCP refuses is refused with DCP's error."""
    planner = DefaultSavePlanner()
    try:
        planner.set_up_planner(sd, None, False)
    except ValueError as refused:
        with pytest.raises(ValueError, match=re.escape(str(refused))):
            flat_keys(sd)
        return
    assert flat_keys(sd) == list(planner.state_dict)
