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

from pluggy import HookCaller

from .defaults import DEFAULT_PLUGIN_NAME
from .errors import HookContractError, PluginConflictError
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

FOLD_HOOKS = ("remap_keys", "pre_load_plan")
PROVIDER_HOOKS = ("stage", "write")


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
        results = self._caller(hook, plugin_name)(**kwargs)
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
        self.pm.hook.on_save_done(result=result)


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
