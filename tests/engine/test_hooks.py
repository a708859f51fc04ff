"""The pluggy host: plugin loading, fold order, providers, contract checks."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import pluggy
import pytest
import torch
from torch import nn

from ckpt_engine import (
    CheckpointEngine,
    CheckpointLoadError,
    CheckpointSaveError,
    EngineConfig,
    HookContractError,
    LoadContext,
    ObserverError,
    PlanEntry,
    PluginConfigError,
    PluginConflictError,
    PluginEntry,
    PluginLoadError,
    RemapContext,
    SaveResult,
    StagedState,
    hookimpl,
)
from ckpt_engine.defaults import DEFAULT_PLUGIN_NAME
from ckpt_engine.pipeline import Pipeline
from ckpt_engine.plugin_manager import build_plugin_manager
from ckpt_engine.testing import TinyTrainingState, bare_plugin_manager, make_engine


class Appender:
    """remap_keys plugin appending a tag to every storage key (to observe fold order)."""

    def __init__(self, name: str, tag: str, calls: list[str]) -> None:
        self.name, self.tag, self.calls = name, tag, calls

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> dict[str, str]:
        self.calls.append(self.name)
        return {d: s + self.tag for d, s in key_map.items()}


def _pipeline(save_dir: str, plugins: Sequence[Any], names: Sequence[str] = ()) -> Pipeline:
    cfg = EngineConfig(save_dir=save_dir, plugins=list(names))
    return Pipeline(build_plugin_manager(cfg, plugins))


def _remap_ctx() -> RemapContext:
    return RemapContext(
        component="model", direction="load", storage_keys=frozenset(), checkpoint_path="x", rank=0, world_size=1
    )


@pytest.mark.parametrize("order", [["a", "b", "c"], ["c", "a", "b"]])
def test_fold_runs_in_config_order_not_registration_order(save_dir: str, order: list[str]) -> None:
    calls: list[str] = []
    plugins = [Appender(n, f"+{n}", calls) for n in ("a", "b", "c")]  # registered a, b, c
    pipe = _pipeline(save_dir, plugins, order)
    out = pipe.remap_keys(_remap_ctx(), ["w"])
    assert calls == order
    assert out == {"w": "w" + "".join(f"+{n}" for n in order)}


def test_objects_not_listed_in_config_fold_after_listed_ones(save_dir: str) -> None:
    calls: list[str] = []
    plugins = [Appender(n, n, calls) for n in ("x", "y")]
    pipe = _pipeline(save_dir, plugins, ["y"])
    pipe.remap_keys(_remap_ctx(), ["k"])
    assert calls == ["y", "x"]


def test_two_providers_of_one_hook_is_a_config_error_naming_both(save_dir: str) -> None:
    cfg = EngineConfig(save_dir=save_dir, plugins=["fake_stager_a", "fake_stager_b"])
    with pytest.raises(PluginConflictError) as info:
        CheckpointEngine(cfg)
    msg = str(info.value)
    assert "'stage'" in msg and "fake_stager_a" in msg and "fake_stager_b" in msg
    assert "ckpt-engine-fake 1.0" in msg  # the distribution is named


def test_single_provider_replaces_the_default(save_dir: str) -> None:
    pipe = _pipeline(save_dir, [], ["fake_stager_a"])
    assert pipe.providers == {"stage": "fake_stager_a", "write": DEFAULT_PLUGIN_NAME}
    default = _pipeline(save_dir, [])
    assert default.providers == {"stage": DEFAULT_PLUGIN_NAME, "write": DEFAULT_PLUGIN_NAME}


def test_defaults_are_hookimpls_in_the_plugin_manager(save_dir: str) -> None:
    loaded = build_plugin_manager(EngineConfig(save_dir=save_dir))
    impls = {i.plugin_name for i in loaded.pm.hook.write.get_hookimpls()}
    assert impls == {DEFAULT_PLUGIN_NAME}
    assert {i.plugin_name for i in loaded.pm.hook.stage.get_hookimpls()} == {DEFAULT_PLUGIN_NAME}


def test_unknown_plugin_name_lists_installed_ones(save_dir: str) -> None:
    with pytest.raises(PluginLoadError) as info:
        CheckpointEngine({"save_dir": save_dir, "plugins": ["no_such_plugin"]})
    msg = str(info.value)
    assert "'no_such_plugin'" in msg and "size_mismatch" in msg and "te_extra_state" in msg


def test_import_failure_names_plugin_and_distribution(save_dir: str) -> None:
    with pytest.raises(PluginLoadError, match=r"fake_broken.*ckpt-engine-fake 1\.0.*import failed"):
        CheckpointEngine({"save_dir": save_dir, "plugins": ["fake_broken"]})


def test_entry_point_naming_a_function_is_refused(save_dir: str) -> None:
    with pytest.raises(PluginLoadError, match="names a function"):
        CheckpointEngine({"save_dir": save_dir, "plugins": ["fake_function"]})


def test_misspelled_hook_name_fails_at_build(save_dir: str) -> None:
    with pytest.raises(PluginLoadError, match=r"remap_key.*the engine's hooks: remap_keys") as raised:
        CheckpointEngine({"save_dir": save_dir, "plugins": ["fake_misspelled"]})
    assert isinstance(raised.value.__cause__, pluggy.PluginValidationError)


def test_a_hook_with_an_argument_the_hook_has_not_fails_at_build_naming_the_plugin(save_dir: str) -> None:
    class Extra:
        name = "extra_arg"

        @hookimpl
        def on_save_done(self, result: SaveResult, when: float) -> None:
            pass

    with pytest.raises(PluginLoadError, match=r"(?s)plugin 'extra_arg'.*'when'"):
        make_engine(save_dir, Extra())


class _Broken:
    """An observer with a bug: it raises at the save of iteration 1."""

    name = "broken"

    @hookimpl
    def on_save_done(self, result: SaveResult) -> None:
        if result.iteration == 1:
            raise RuntimeError("observer bug")


def test_every_observer_runs_and_one_that_raises_is_an_observer_error_naming_it(save_dir: str) -> None:
    """An ``on_save_done`` that raised stopped the observers after it and reached the caller as
    a bare exception; with ``pinned_staging`` the next save raised it again and was never made."""
    seen: list[int] = []

    class Counter:
        name = "counter"

        @hookimpl
        def on_save_done(self, result: SaveResult) -> None:
            seen.append(result.iteration)

    state = TinyTrainingState.create()
    with make_engine(save_dir, Counter(), _Broken()) as engine:  # pluggy calls _Broken first
        with pytest.raises(ObserverError, match="plugin 'broken' raised RuntimeError: observer bug") as raised:
            engine.save(1, model=state.model)
        assert isinstance(raised.value.__cause__, RuntimeError) and seen == [1]
        assert engine.save(2, model=state.model).result().succeeded
    assert seen == [1, 2]
    with open(os.path.join(save_dir, "latest_checkpoint.txt")) as latest:
        assert latest.read().strip() == "iter_000000002"


@pytest.mark.full  # a pinned_staging writer process start-up
def test_an_observer_error_of_a_background_save_is_raised_once_and_the_next_save_is_made(save_dir: str) -> None:
    state = TinyTrainingState.create()
    engine = CheckpointEngine({"save_dir": save_dir, "plugins": ["pinned_staging"]}, plugins=[_Broken()])
    try:
        first = engine.save(1, model=state.model)
        with pytest.raises(ObserverError, match="plugin 'broken'"):
            first.result()
        second = engine.save(2, model=state.model)  # raised iteration 1's error again, and was not made
        assert second.result().succeeded
    finally:
        engine.close()
    with open(os.path.join(save_dir, "latest_checkpoint.txt")) as latest:
        assert latest.read().strip() == "iter_000000002"


def test_disabled_plugin_is_never_imported(save_dir: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    monkeypatch.setenv("CKPT_FAKE_SIDE_EFFECT_MARKER", str(marker))
    sys.modules.pop("ckpt_fake_plugins.side_effect", None)
    CheckpointEngine({"save_dir": save_dir, "plugins": [{"name": "fake_side_effect", "enabled": False}]})
    assert not marker.exists()
    assert "ckpt_fake_plugins.side_effect" not in sys.modules
    CheckpointEngine({"save_dir": save_dir, "plugins": ["fake_side_effect"]})  # the control
    assert marker.read_text() == "imported"


def test_plugin_options_are_validated_by_the_plugin(save_dir: str) -> None:
    with pytest.raises(PluginConfigError) as info:
        CheckpointEngine({"save_dir": save_dir, "plugins": [{"name": "fake_prefix", "options": {"prefx": "m."}}]})
    assert "prefx" in str(info.value) and "fake_prefix" in str(info.value)


def test_module_plugin_takes_no_options(save_dir: str) -> None:
    with pytest.raises(PluginConfigError, match="module"):
        CheckpointEngine({"save_dir": save_dir, "plugins": [{"name": "fake_module", "options": {"x": 1}}]})


def test_module_plugin_observes_saves(save_dir: str) -> None:
    from ckpt_fake_plugins import module_plugin  # type: ignore[import-not-found]

    module_plugin.RESULTS.clear()
    state = TinyTrainingState.create()
    engine = CheckpointEngine({"save_dir": save_dir, "plugins": ["fake_module"]})
    engine.save(7, **state.objects())
    [result] = module_plugin.RESULTS
    assert result.succeeded and result.iteration == 7 and result.bytes_written > 0
    assert result.components == ("model", "optim", "scheduler", "trainer", "rng")
    # A synchronous save blocks through write and commit: blocked covers the write, equals total.
    assert result.write_seconds <= result.blocked_seconds <= result.total_seconds
    assert result.total_seconds - result.blocked_seconds < 0.01


def test_path_plugin_by_module_attr(save_dir: str) -> None:
    engine = CheckpointEngine({"save_dir": save_dir, "plugins": ["ckpt_fake_plugins.prefix:PrefixRemap"]})
    assert engine.plugin_names == ("te_extra_state", "ckpt_fake_plugins.prefix:PrefixRemap")


def test_bad_module_attr_path_is_a_load_error(save_dir: str) -> None:
    with pytest.raises(PluginLoadError, match="has no attribute 'Nope'"):
        CheckpointEngine({"save_dir": save_dir, "plugins": ["ckpt_fake_plugins.prefix:Nope"]})
    with pytest.raises(PluginLoadError, match="cannot import module 'no_such_mod'"):
        CheckpointEngine({"save_dir": save_dir, "plugins": ["no_such_mod:X"]})


def test_two_objects_with_one_name_conflict(save_dir: str) -> None:
    calls: list[str] = []
    with pytest.raises(PluginConflictError, match="'a'"):
        make_engine(save_dir, Appender("a", "1", calls), Appender("a", "2", calls))


# -- contract checks --------------------------------------------------------------------------


class BadRemap:
    name = "bad_remap"

    def __init__(self, result: Any) -> None:
        self.result = result

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> Any:
        return self.result(key_map) if callable(self.result) else self.result


@pytest.mark.parametrize(
    ("result", "match"),
    [
        (["not", "a", "map"], "must return a mapping"),
        (lambda m: {**m, "extra": "x"}, "must keep exactly the destination keys"),
        (lambda m: {k: 3 for k in m}, "non-string"),
    ],
)
def test_remap_contract_violations_name_the_plugin(save_dir: str, result: Any, match: str) -> None:
    pipe = _pipeline(save_dir, [BadRemap(result)])
    with pytest.raises(HookContractError, match=match) as info:
        pipe.remap_keys(_remap_ctx(), ["a", "b"])
    assert "bad_remap" in str(info.value)


def test_many_to_one_remap_on_save_is_an_error(save_dir: str) -> None:
    state = TinyTrainingState.create()
    engine = make_engine(save_dir, BadRemap(lambda m: dict.fromkeys(m, "same")))
    with pytest.raises(CheckpointSaveError, match="both map to storage key 'same'"):
        engine.save(1, model=state.model)
    assert not (save_dir and __import__("os").path.exists(f"{save_dir}/latest_checkpoint.txt"))


class PlanPlugin:
    name = "plan_plugin"

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    @hookimpl
    def pre_load_plan(self, ctx: LoadContext, entries: tuple[PlanEntry, ...]) -> Any:
        return self.fn(entries)


def _saved(save_dir: str) -> TinyTrainingState:
    state = TinyTrainingState.create()
    make_engine(save_dir).save(1, model=state.model)
    return state


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda es: es[:-1], "returned 3 entries for 4"),
        (lambda es: [e.overlap() if e.dest_key.endswith("bias") else e for e in es], None),  # legal
        (lambda es: [__import__("dataclasses").replace(e, storage_key="zz") for e in es], "identity"),
        (lambda es: "nope", "must return a sequence"),
    ],
)
def test_pre_load_plan_contract(save_dir: str, fn: Any, match: str | None) -> None:
    _saved(save_dir)
    engine = make_engine(save_dir, PlanPlugin(fn))
    fresh = TinyTrainingState.create(seed=1)
    if match is None:
        result = engine.load(model=fresh.model)
        assert set(result.report["model"].overlap) == {"0.bias", "2.bias"}
        assert all(r.plugin == "plan_plugin" for r in result.report["model"].overlap.values())
    else:
        with pytest.raises(HookContractError, match=match) as info:
            engine.load(model=fresh.model)
        assert "plan_plugin" in str(info.value)


def test_overlap_on_non_tensor_is_refused(save_dir: str) -> None:
    state = _saved(save_dir)
    engine = make_engine(save_dir, PlanPlugin(lambda es: [e.overlap() for e in es]))
    with pytest.raises(HookContractError, match="overlap needs a stored tensor"):
        engine.load(model=state.model, grad_scaler=state.grad_scaler)


def test_hook_exception_during_load_is_an_ordinary_exception(save_dir: str) -> None:
    """DCP wraps planner errors in CheckpointException (a BaseException); the engine unwraps it."""
    _saved(save_dir)

    def boom(entries: Any) -> Any:
        raise RuntimeError("plugin exploded")

    engine = make_engine(save_dir, PlanPlugin(boom))
    with pytest.raises(CheckpointLoadError, match="plugin exploded") as info:
        engine.load(model=TinyTrainingState.create().model)
    assert isinstance(info.value, Exception)


def test_on_save_done_sees_failures(save_dir: str) -> None:
    seen: list[SaveResult] = []

    class Observer:
        name = "observer"

        @hookimpl
        def on_save_done(self, result: SaveResult) -> None:
            seen.append(result)

    class FailingWriter:
        name = "failing_writer"

        @hookimpl
        def write(self, ctx: Any, state_dict: Any) -> Any:
            raise OSError(28, "No space left on device")

    state = TinyTrainingState.create()
    engine = make_engine(save_dir, Observer(), FailingWriter())
    with pytest.raises(CheckpointSaveError, match="No space left on device"):
        engine.save(4, model=state.model)
    [result] = seen
    assert not result.succeeded and isinstance(result.error, OSError)
    import os

    assert not os.path.exists(os.path.join(save_dir, "latest_checkpoint.txt"))
    assert not os.path.exists(os.path.join(save_dir, ".iter_000000004.partial"))
    assert not os.path.exists(os.path.join(save_dir, "iter_000000004"))


def _odd_stage(change: str) -> Any:
    class OddStage:
        name = "odd_stage"

        @hookimpl
        def stage(self, ctx: Any, state: Any) -> StagedState:
            comps = {c: dict(sd) for c, sd in state.items()}
            model = comps["model"]
            if change == "drop":
                model.pop("bias")
            elif change == "extra":
                model["ghost"] = torch.ones(3)
            elif change == "shape":
                model["weight"] = torch.zeros(2, 2)
            elif change == "dtype":
                model["weight"] = model["weight"].double()
            else:
                model["weight"] = "not a tensor"
            return StagedState(components=comps, is_copy=False)

    return OddStage()


@pytest.mark.parametrize("change", ["drop", "extra", "shape", "dtype", "nontensor"])
def test_a_stage_that_returns_another_structure_fails_the_save_naming_it(save_dir: str, change: str) -> None:
    """A stage provider that dropped, added or reshaped a key was committed as latest: the next
    load failed on a missing key without naming the plugin (or loaded what it made up)."""
    with (
        make_engine(save_dir, _odd_stage(change)) as engine,
        pytest.raises(CheckpointSaveError, match=r"plugin 'odd_stage'.*stage returned component 'model' with") as err,
    ):
        engine.save(1, model=nn.Linear(4, 4))
    assert isinstance(err.value.__cause__, HookContractError)
    assert not os.path.exists(os.path.join(save_dir, "iter_000000001"))


def test_bare_plugin_manager_has_specs_only() -> None:
    pm = bare_plugin_manager()
    assert pm.get_plugins() == set()
    assert {"remap_keys", "pre_load_plan", "stage", "write", "on_save_done"} <= set(dir(pm.hook))


def test_user_remap_plugin_renames_on_save_and_load(save_dir: str) -> None:
    """A key-remap plugin enabled by 'module:attr' renames keys on save; loading maps them back."""
    import torch.distributed.checkpoint as dcp

    state = TinyTrainingState.create()
    cfg = {
        "save_dir": save_dir,
        "plugins": [{"name": "pfx", "path": "ckpt_fake_plugins.prefix:PrefixRemap", "options": {"prefix": "module."}}],
    }
    CheckpointEngine(cfg).save(2, model=state.model)
    md = dcp.FileSystemReader(f"{save_dir}/iter_000000002/model").read_metadata()
    assert set(md.state_dict_metadata) == {"module.0.weight", "module.0.bias", "module.2.weight", "module.2.bias"}

    fresh = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    result = CheckpointEngine(cfg).load(model=fresh)
    for a, b in zip(state.model.state_dict().values(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert result.report["model"].renamed == {k: "module." + k for k in fresh.state_dict()}
    # Without the plugin the renamed checkpoint does not fit: strict load lists every key.
    from ckpt_engine import LoadStrictnessError

    with pytest.raises(LoadStrictnessError) as info:
        CheckpointEngine({"save_dir": save_dir}).load(model=fresh)
    assert sorted(info.value.missing) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_close_calls_plugin_close_once_in_reverse_fold_order(save_dir: str) -> None:
    closed: list[str] = []

    class Resource:
        def __init__(self, name: str) -> None:
            self.name = name

        @hookimpl
        def on_save_done(self, result: SaveResult) -> None:
            pass

        def close(self) -> None:
            closed.append(self.name)

    engine = make_engine(save_dir, Resource("first"), Resource("second"))
    engine.close()
    engine.close()
    assert closed == ["second", "first"]


def test_first_failure_unwraps_dcp_checkpoint_exception() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from ckpt_engine.errors import first_failure

    inner1, inner3 = ValueError("rank 1 broke"), KeyError("rank 3")
    exc = CheckpointException("plan", {3: (inner3, None), 1: (inner1, None)})
    assert first_failure(exc) == (inner1, [1, 3])
    plain = RuntimeError("not DCP")
    assert first_failure(plain) == (plain, [])


def test_an_exception_in_a_plugins_hook_names_the_plugin(save_dir: str) -> None:
    """A plugin's own exception keeps its type for the engine's handling, and the engine's error
    names the plugin and the hook it came from (a load and a save alike)."""
    _saved(save_dir)

    class Exploding:
        name = "exploding"

        @hookimpl
        def pre_load_plan(self, ctx: Any, entries: Any) -> Any:
            raise RuntimeError("plugin exploded")

        @hookimpl
        def remap_keys(self, ctx: Any, key_map: Any) -> Any:
            if ctx.direction == "save":
                raise KeyError("no such key")
            return None

    engine = make_engine(save_dir, Exploding())
    with pytest.raises(
        CheckpointLoadError, match=r"plugin exploded \(raised by plugin 'exploding'.* pre_load_plan hook\)"
    ):
        engine.load(model=TinyTrainingState.create().model)
    with pytest.raises(CheckpointSaveError, match=r"raised by plugin 'exploding'.* remap_keys hook"):
        engine.save(9, model=TinyTrainingState.create().model)


@pytest.mark.parametrize("entry", ["ema", {"name": "ema"}, PluginEntry(name="ema")])
def test_a_config_entry_passed_as_a_plugin_object_is_refused(save_dir: str, entry: Any) -> None:
    """``plugins=`` takes objects. A name there was registered as a plugin named 'str' that
    implements nothing: the EMA swap a user asked for silently did not happen."""
    with pytest.raises(PluginConfigError, match="is a config entry; list it in the config's `plugins`"):
        CheckpointEngine({"save_dir": save_dir}, plugins=[entry])


def test_make_engine_takes_config_entries_and_objects_in_the_order_given(save_dir: str) -> None:
    """As ``plan_load`` does (docs/testing-plugins.md): names and objects, placed in that order."""

    class Observer:
        name = "observer"

        @hookimpl
        def on_save_done(self, result: Any) -> None:
            pass

    engine = make_engine(save_dir, "size_mismatch", Observer(), {"name": "ema", "options": {"when": "every_load"}})
    assert engine.plugin_names[-3:] == ("size_mismatch", "observer", "ema")


def test_a_plugin_whose_components_name_no_component_of_the_load_is_said(
    save_dir: str, caplog: pytest.LogCaptureFixture
) -> None:
    """``components: ["modle"]`` validated and switched the plugin off for ``model``; the load's
    strictness error then advised enabling the plugin, which was enabled. The load now says which
    name matches nothing."""
    state = TinyTrainingState.create()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=state.model)
    entry = {"name": "size_mismatch", "options": {"policy": "skip", "components": ["modle", "model"]}}
    with (
        caplog.at_level("WARNING", logger="ckpt_engine"),
        CheckpointEngine({"save_dir": save_dir, "plugins": [entry]}) as engine,
    ):
        engine.load(model=TinyTrainingState.create().model)
    warned = [r.getMessage() for r in caplog.records if "components option names" in r.getMessage()]
    assert len(warned) == 1 and "'modle'" in warned[0] and "'model'" not in warned[0].split("(they")[0], warned


def test_an_observer_wrapper_still_wraps_the_observers(save_dir: str) -> None:
    """Observers run one by one (so one that raises stops no other); a ``wrapper=True``
    implementation is pluggy's to run around the others, and still does."""
    calls: list[str] = []

    class Wrapper:
        name = "wrapper"

        @hookimpl(wrapper=True)
        def on_save_done(self, result: SaveResult) -> Any:
            calls.append("before")
            out = yield
            calls.append("after")
            return out

    class Plain:
        name = "plain"

        @hookimpl
        def on_save_done(self, result: SaveResult) -> None:
            calls.append(f"saw {result.iteration}")

    with make_engine(save_dir, Wrapper(), Plain()) as engine:
        engine.save(1, model=TinyTrainingState.create().model)
    assert calls == ["before", "saw 1", "after"]


def test_with_a_wrapper_a_failing_observer_does_not_claim_the_others_ran(save_dir: str) -> None:
    """With a ``wrapper=True`` observer pluggy runs the observers as one chain, which a failure
    stops: the error said every other observer ran."""

    class Wrapper:
        name = "wrapper"

        @hookimpl(wrapper=True)
        def on_save_done(self, result: SaveResult) -> Any:
            return (yield)

    with (
        make_engine(save_dir, Wrapper(), _Broken()) as engine,
        pytest.raises(ObserverError, match="did not run") as raised,
    ):
        engine.save(1, model=TinyTrainingState.create().model)
    assert "every other observer ran" not in str(raised.value)
