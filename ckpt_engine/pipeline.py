"""The only module that calls hooks.

It runs folds in config order, resolves providers (one per hook), and checks every value a
plugin returns against the hook's contract, so a plugin bug is reported with the plugin's name
instead of surfacing later as a corrupt checkpoint.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from types import MappingProxyType
from typing import Any

import torch
from pluggy import HookCaller

from .defaults import DEFAULT_PLUGIN_NAME
from .errors import CkptEngineError, HookContractError, ObserverError, PluginConflictError
from .hookspecs import HOOK_KINDS
from .lifecycle import (
    BoundsPendingSaves,
    Closeable,
    ClosesInTwoSteps,
    SavesInBackground,
    StartsInBackground,
    WritesRankLocal,
)
from .plugin_manager import LoadedPlugins
from .types import (
    Decision,
    LoadContext,
    PlanEntry,
    RemapContext,
    SaveContext,
    SaveResult,
    StagedState,
    WriteContext,
    WriteResult,
)

logger = logging.getLogger("ckpt_engine")

FOLD_HOOKS = tuple(hook for hook, kind in HOOK_KINDS.items() if kind == "fold")
PROVIDER_HOOKS = tuple(hook for hook, kind in HOOK_KINDS.items() if kind == "provider")


class Pipeline:
    """Typed facade over the plugin manager."""

    def __init__(self, plugins: LoadedPlugins) -> None:
        self._plugins = plugins
        self.pm = plugins.pm
        self._callers: dict[tuple[str, str], HookCaller] = {}
        self.providers: dict[str, str] = {hook: self._resolve_provider(hook) for hook in PROVIDER_HOOKS}
        self.fold_order: dict[str, tuple[str, ...]] = {hook: self._fold_order(hook) for hook in FOLD_HOOKS}

    # -- plumbing ---------------------------------------------------------------------------

    def describe(self, name: str) -> str:
        if name == DEFAULT_PLUGIN_NAME:
            return "the engine's default"
        return self._plugins.descriptions.get(name, f"plugin {name!r}")

    def _implementers(self, hook: str) -> list[str]:
        caller: HookCaller = getattr(self.pm.hook, hook)
        return [impl.plugin_name for impl in caller.get_hookimpls()]

    def _caller(self, hook: str, plugin_name: str) -> HookCaller:
        key = (hook, plugin_name)
        caller = self._callers.get(key)
        if caller is None:
            plugin = self.pm.get_plugin(plugin_name)
            others = [p for p in self.pm.get_plugins() if p is not plugin]
            caller = self.pm.subset_hook_caller(hook, remove_plugins=others)
            self._callers[key] = caller
        return caller

    def _call_one(self, hook: str, plugin_name: str, **kwargs: Any) -> Any:
        try:
            results = self._caller(hook, plugin_name)(**kwargs)
        except CkptEngineError:
            raise
        except Exception as err:
            if plugin_name == DEFAULT_PLUGIN_NAME:
                raise  # the engine's own: its callers map OSError and the like to typed errors
            # The plugin's own error goes on (SaveResult.error and the disk-full hint read its
            # type), carrying who raised it: the engine's messages show the note (errors.described).
            err.add_note(f"raised by {self.describe(plugin_name)} in its {hook} hook")
            raise
        # A single implementation: pluggy drops None results, so [] means "returned None".
        return results[0] if results else None

    def _resolve_provider(self, hook: str) -> str:
        plugins = [n for n in self._implementers(hook) if n != DEFAULT_PLUGIN_NAME]
        if len(plugins) > 1:
            who = " and ".join(self.describe(n) for n in sorted(plugins))
            raise PluginConflictError(f"hook {hook!r} is provided by both {who}; enable only one of them")
        return plugins[0] if plugins else DEFAULT_PLUGIN_NAME

    def _fold_order(self, hook: str) -> tuple[str, ...]:
        implementers = set(self._implementers(hook))
        return tuple(n for n in self._plugins.order if n in implementers)

    # -- folds ------------------------------------------------------------------------------

    def remap_keys(self, ctx: RemapContext, keys: Sequence[str]) -> dict[str, str]:
        """Run the ``remap_keys`` fold from the identity map over ``keys``."""
        key_map: dict[str, str] = {k: k for k in keys}
        for name in self.fold_order["remap_keys"]:
            noted = len(ctx.notes)
            result = self._call_one("remap_keys", name, ctx=ctx, key_map=MappingProxyType(key_map))
            ctx.notes[noted:] = [f"{name}: {n}" for n in ctx.notes[noted:]]
            if result is None:
                continue
            key_map = self._check_key_map(name, ctx, key_map, result)
        if ctx.direction == "save":
            seen: dict[str, str] = {}
            for dest, storage in key_map.items():
                if storage in seen:
                    raise HookContractError(
                        f"remap_keys on save of component {ctx.component!r}: keys {seen[storage]!r} and "
                        f"{dest!r} both map to storage key {storage!r}; on save each storage key must "
                        f"come from one key (fold order: {', '.join(self.fold_order['remap_keys'])})"
                    )
                seen[storage] = dest
            for note in ctx.notes:
                logger.info("save of component %r: %s", ctx.component, note)
        return key_map

    def _check_key_map(self, name: str, ctx: RemapContext, before: Mapping[str, str], result: Any) -> dict[str, str]:
        who = self.describe(name)
        if not isinstance(result, Mapping):
            raise HookContractError(f"{who}: remap_keys must return a mapping or None, got {type(result).__name__}")
        out = dict(result)
        if out.keys() != before.keys():
            added = sorted(set(out) - set(before))[:5]
            removed = sorted(set(before) - set(out))[:5]
            raise HookContractError(
                f"{who}: remap_keys for component {ctx.component!r} must keep exactly the destination keys "
                f"it was given (added {added}, removed {removed}); to leave a key unloaded, mark it "
                "skip in pre_load_plan"
            )
        bad = [k for k, v in out.items() if not isinstance(v, str) or not v]
        if bad:
            raise HookContractError(f"{who}: remap_keys mapped {bad[:5]} to non-string or empty storage keys")
        return out

    def pre_load_plan(self, ctx: LoadContext, entries: tuple[PlanEntry, ...]) -> tuple[PlanEntry, ...]:
        for name in self.fold_order["pre_load_plan"]:
            result = self._call_one("pre_load_plan", name, ctx=ctx, entries=entries)
            if result is None:
                continue
            entries = self._check_entries(name, ctx, entries, result)
        return entries

    def _check_entries(
        self, name: str, ctx: LoadContext, before: tuple[PlanEntry, ...], result: Any
    ) -> tuple[PlanEntry, ...]:
        who = self.describe(name)
        if isinstance(result, (str, bytes)) or not isinstance(result, Sequence):
            raise HookContractError(
                f"{who}: pre_load_plan must return a sequence of PlanEntry or None, got {type(result).__name__}"
            )
        if len(result) != len(before):
            raise HookContractError(
                f"{who}: pre_load_plan for component {ctx.component!r} returned {len(result)} entries for "
                f"{len(before)}; return every entry, in order"
            )
        out: list[PlanEntry] = []
        for old, new in zip(before, result, strict=True):
            if not isinstance(new, PlanEntry):
                raise HookContractError(f"{who}: pre_load_plan returned a {type(new).__name__}, not a PlanEntry")
            if not old.same_identity(new):
                raise HookContractError(
                    f"{who}: pre_load_plan changed the identity of entry {old.dest_key!r} (keys, target or "
                    "stored spec); only the decision may change: use entry.skip(), .overlap() or .load()"
                )
            if new.decision is not old.decision or new.reason != old.reason:
                _check_decision(who, new)
                new = dataclasses.replace(new, decided_by=name)
            out.append(new)
        return tuple(out)

    # -- providers --------------------------------------------------------------------------

    def stage(self, ctx: SaveContext, state: Mapping[str, dict[str, Any]]) -> StagedState:
        name = self.providers["stage"]
        result = self._call_one("stage", name, ctx=ctx, state=state)
        if not isinstance(result, StagedState):
            raise HookContractError(
                f"{self.describe(name)}: stage must return a StagedState, got {type(result).__name__}"
            )
        if set(result.components) != set(state):
            raise HookContractError(
                f"{self.describe(name)}: stage returned components {sorted(result.components)}, "
                f"expected {sorted(state)}"
            )
        for component, live in state.items():
            problem = _staged_unlike(live, result.components[component])
            if problem is not None:
                raise HookContractError(
                    f"{self.describe(name)}: stage returned component {component!r} {problem}: a stage copies the "
                    "state it is given, key for key, each tensor with its shape and dtype (the save would commit "
                    "another state than the training's)"
                )
        return result

    def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> WriteResult | Future[WriteResult]:
        name = self.providers["write"]
        result = self._call_one("write", name, ctx=ctx, state_dict=state_dict)
        if not isinstance(result, (WriteResult, Future)):
            raise HookContractError(
                f"{self.describe(name)}: write must return a WriteResult or a Future of one, "
                f"got {type(result).__name__}"
            )
        return result

    def check_write_result(self, result: Any) -> WriteResult:
        if not isinstance(result, WriteResult):
            raise HookContractError(
                f"{self.describe(self.providers['write'])}: write's future must resolve to a WriteResult, "
                f"got {type(result).__name__}"
            )
        return result

    # -- observers --------------------------------------------------------------------------

    def on_save_done(self, result: SaveResult) -> None:
        """Every observer, in pluggy's order, each on its own: one that raises does not keep the
        others from running. The first failure is raised once all ran, as :class:`ObserverError`
        naming its plugin."""
        failed: list[tuple[str, Exception]] = []
        impls = self.pm.hook.on_save_done.get_hookimpls()
        chained = any(impl.wrapper or impl.hookwrapper for impl in impls)
        if chained:  # pluggy runs a wrapper around the rest, as one chain a failure stops
            try:
                self.pm.hook.on_save_done(result=result)
            except Exception as err:
                failed.append(("one of " + ", ".join(repr(impl.plugin_name) for impl in impls), err))
            impls = []
        for impl in reversed(impls):
            try:
                impl.function(*[{"result": result}[name] for name in impl.argnames])
            except Exception as err:
                failed.append((impl.plugin_name, err))
        if failed:
            name, first = failed[0]
            more = f"; {len(failed) - 1} other observer(s) raised too (logged)" if len(failed) > 1 else ""
            for other, other_err in failed[1:]:
                logger.error("the on_save_done observer of plugin %r raised %r", other, other_err)
            state = "is committed" if result.succeeded else "failed on its own"
            ran = (
                "the observers after it in pluggy's chain did not run (a wrapper=True observer makes them one chain)"
                if chained
                else "every other observer ran"
            )
            who = name if chained else repr(name)
            raise ObserverError(
                f"the on_save_done observer of plugin {who} raised {type(first).__name__}: {first}{more}. The save of "
                f"iteration {result.iteration} {state}; {ran}. Fix the plugin, or leave it out of the engine's plugins"
            ) from first

    # -- lifecycle (ckpt_engine.lifecycle) ---------------------------------------------------

    def _plugins_in_order(self) -> list[tuple[str, object]]:
        return [(name, self.pm.get_plugin(name)) for name in self._plugins.order]

    def max_saves_in_flight(self) -> int:
        """The ``stage`` provider's bound on pending saves (:class:`BoundsPendingSaves`), else 1."""
        provider = self.pm.get_plugin(self.providers["stage"])
        if not isinstance(provider, BoundsPendingSaves):
            return 1
        limit = provider.max_saves_in_flight
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise HookContractError(
                f"{self.describe(self.providers['stage'])}: max_saves_in_flight must be an int >= 1, got {limit!r}"
            )
        return limit

    def saves_in_background(self) -> SavesInBackground | None:
        """The plugin that provides both ``stage`` and ``write``, if it is a :class:`SavesInBackground`."""
        stage = self.pm.get_plugin(self.providers["stage"])
        write = self.pm.get_plugin(self.providers["write"])
        return stage if stage is write and isinstance(stage, SavesInBackground) else None

    def rank_local_writer(self) -> str | None:
        """``None`` when the ``write`` provider can write the node-local tier (the default, or a
        :class:`WritesRankLocal` that says so); else its description, for the error."""
        name = self.providers["write"]
        provider = self.pm.get_plugin(name)
        if name == DEFAULT_PLUGIN_NAME or (
            isinstance(provider, WritesRankLocal) and provider.writes_rank_local() is True
        ):
            return None
        return self.describe(name)

    def wait_ready(self, timeout: float | None = None) -> float:
        """Wait for every plugin that starts in the background (:class:`StartsInBackground`);
        returns the longest start-up seconds (0 when none)."""
        waited = [p.wait_ready(timeout) for _, p in self._plugins_in_order() if isinstance(p, StartsInBackground)]
        return max(waited, default=0.0)

    def begin_close(self) -> None:
        """``begin_close()`` of every plugin that has one, in fold order; failures are logged (the
        close goes on: this only starts deadlines)."""
        for name, plugin in self._plugins_in_order():
            if isinstance(plugin, ClosesInTwoSteps):
                try:
                    plugin.begin_close()
                except Exception as err:
                    logger.error("%s: begin_close() failed: %s", self.describe(name), err)

    def close(self) -> None:
        """``close()`` of every plugin that has one, in reverse fold order; every one is closed,
        then the first failure is raised as a :class:`CkptEngineError`."""
        errors: list[BaseException] = []
        for name, plugin in reversed(self._plugins_in_order()):
            if isinstance(plugin, Closeable):
                try:
                    plugin.close()
                except Exception as err:
                    errors.append(err)
                    logger.error("closing %s failed: %s", self.describe(name), err)
        if errors:
            raise CkptEngineError(f"closing plugins failed: {errors[0]}") from errors[0]


def _check_decision(who: str, entry: PlanEntry) -> None:
    d, stored, target = entry.decision, entry.stored, entry.target
    if d is Decision.SKIP and not entry.reason:
        raise HookContractError(f"{who}: entry {entry.dest_key!r} was marked skip without a reason")
    if d is Decision.OVERLAP:
        if stored is None or not (stored.is_tensor and target.is_tensor):
            raise HookContractError(
                f"{who}: entry {entry.dest_key!r} was marked overlap, but overlap needs a stored tensor and a "
                f"tensor destination (stored: {stored}, target: {target})"
            )
        if len(stored.shape or ()) != len(target.shape or ()):
            raise HookContractError(
                f"{who}: entry {entry.dest_key!r} was marked overlap, but stored {stored} and target {target} "
                "have different numbers of dimensions; skip it instead"
            )
    if d is Decision.LOAD and (stored is None or entry.shape_mismatch):
        raise HookContractError(
            f"{who}: entry {entry.dest_key!r} was marked load, but "
            + ("the checkpoint lacks it" if stored is None else f"stored {stored} does not fit target {target}")
        )
    if d in (Decision.MISSING, Decision.MISMATCH):
        raise HookContractError(
            f"{who}: entry {entry.dest_key!r}: plugins may mark entries skip, overlap or load, not {d.value!r}"
        )


def _staged_unlike(live: Mapping[str, Any], staged: Any) -> str | None:
    """How a staged component differs in structure from the live one it copies (keys; each plain
    tensor's shape and dtype), or ``None``. Tensor subclasses (a DTensor's staged local copy) and
    values are not compared."""
    if not isinstance(staged, Mapping):
        return f"as a {type(staged).__name__}, not a state dict"
    if staged.keys() != live.keys():
        lost, new = sorted(set(live) - set(staged))[:4], sorted(set(staged) - set(live))[:4]
        return f"with other keys (without {lost}, with {new})"
    for key, value in live.items():
        copy = staged[key]
        if type(value) is not torch.Tensor:
            continue
        if not isinstance(copy, torch.Tensor):
            return f"with {key!r} as a {type(copy).__name__}, not a tensor"
        if type(copy) is torch.Tensor and (copy.shape != value.shape or copy.dtype != value.dtype):
            return f"with {key!r} as {copy.dtype} {tuple(copy.shape)}, not {value.dtype} {tuple(value.shape)}"
    return None
