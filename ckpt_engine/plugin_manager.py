"""Building the plugin manager: entry points, ``module:attr`` plugins and plugin objects.

Only enabled plugins are imported (a disabled plugin's import side effects never run), each is
instantiated with its validated options, and ``check_pending()`` catches misspelled hook names.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import pluggy
from pydantic import BaseModel, ValidationError

from . import hookspecs
from ._config_errors import describe_validation_error
from ._markers import PROJECT_NAME
from .config import EngineConfig, PluginEntry
from .defaults import DEFAULT_PLUGIN_NAME, DefaultIO
from .errors import PluginConfigError, PluginConflictError, PluginLoadError

__all__ = ["LoadedPlugins", "build_plugin_manager", "describe_entry_point", "installed_plugins", "split_plugins"]


@dataclass(frozen=True)
class LoadedPlugins:
    """A plugin manager plus what the engine needs to call it: fold order and descriptions."""

    pm: pluggy.PluginManager
    #: Registered plugin names in fold order (config order, then ``plugins=`` objects).
    order: tuple[str, ...]
    #: name -> human description ("plugin 'x' (module:attr, from dist 1.0)").
    descriptions: dict[str, str]


def installed_plugins() -> dict[str, EntryPoint]:
    """Entry points of the ``ckpt_engine`` group, by name.

    Finding them reads the metadata of every installed distribution: milliseconds a call with a
    hundred distributions, paid by every engine (a resume builds one). The answer is kept while
    the import path and the modification times of its folders stay the same: installing or
    removing a distribution creates or deletes its ``.dist-info`` folder in one of them, which
    changes that folder's time, and a folder added to ``sys.path`` changes the path.
    """
    global _installed
    state = _path_state()
    if _installed is None or _installed[0] != state:
        _installed = (state, {ep.name: ep for ep in entry_points(group=PROJECT_NAME)})
        _descriptions.clear()
    return dict(_installed[1])


#: What :func:`installed_plugins` found, and the state of the import path it found it in.
_installed: tuple[tuple[tuple[str, int], ...], dict[str, EntryPoint]] | None = None
#: :func:`describe_entry_point`'s answers since :func:`installed_plugins` last looked.
_descriptions: dict[tuple[str, str, str], str] = {}


def _path_state() -> tuple[tuple[str, int], ...]:
    """Each ``sys.path`` entry with its modification time in nanoseconds (-1: cannot be read)."""
    out = []
    for entry in sys.path:
        try:
            out.append((entry, os.stat(entry or ".").st_mtime_ns))
        except OSError:
            out.append((entry, -1))
    return tuple(out)


def describe_entry_point(ep: EntryPoint) -> str:
    """``plugin 'name' (module:attr, from dist 1.0)``; the distribution's name and version are
    read from its metadata once per state of the import path (see :func:`installed_plugins`)."""
    key = (ep.group, ep.name, ep.value)
    described = _descriptions.get(key)
    if described is None:  # another thread may empty the dict meanwhile: keep this answer
        dist = f", from {ep.dist.name} {ep.dist.version}" if ep.dist is not None else ""
        described = _descriptions[key] = f"plugin {ep.name!r} ({ep.value}{dist})"
    return described


def _import_path(path: str, who: str) -> Any:
    module_name, _, attr = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:
        raise PluginLoadError(f"{who}: cannot import module {module_name!r}: {err}") from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise PluginLoadError(f"{who}: module {module_name!r} has no attribute {attr!r}") from err
    return obj


def instantiate(obj: Any, options: dict[str, Any], who: str) -> Any:
    """Turn what an entry point or ``module:attr`` names into a registrable plugin.

    * a module or an instance: registered as is; ``options`` must be empty;
    * a class with a pydantic ``Options`` model: ``cls(cls.Options.model_validate(options))``;
    * a class without ``Options``: ``cls()``; ``options`` must be empty.
    """
    if inspect.isclass(obj):
        opts_model = getattr(obj, "Options", None)
        if isinstance(opts_model, type) and issubclass(opts_model, BaseModel):
            try:
                validated = opts_model.model_validate(options)
            except ValidationError as err:
                raise PluginConfigError(
                    f"{who} has invalid options:\n{describe_validation_error(err, opts_model)}"
                ) from err
            try:
                return obj(validated)  # type: ignore[call-arg]
            except Exception as err:
                raise PluginLoadError(f"{who}: constructing {obj.__qualname__} failed: {err}") from err
        if options:
            raise PluginConfigError(
                f"{who} takes no options (its class has no pydantic `Options` model), got {sorted(options)}"
            )
        try:
            return obj()
        except Exception as err:
            raise PluginLoadError(f"{who}: constructing {obj.__qualname__}() failed: {err}") from err
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        raise PluginLoadError(
            f"{who} names a function ({getattr(obj, '__qualname__', obj)!r}); a plugin is a module, "
            "a class or an object with @hookimpl methods"
        )
    if options:
        raise PluginConfigError(
            f"{who} is a {'module' if isinstance(obj, types.ModuleType) else 'plugin object'} and takes "
            f"no options, got {sorted(options)}; give it a class with a pydantic `Options` model"
        )
    return obj


def _load_entry(entry: PluginEntry, installed: dict[str, EntryPoint]) -> tuple[Any, str]:
    if entry.path is not None:
        who = f"plugin {entry.name!r} ({entry.path})"
        return instantiate(_import_path(entry.path, who), dict(entry.options), who), who
    ep = installed.get(entry.name)
    if ep is None:
        available = ", ".join(sorted(installed)) or "(none)"
        raise PluginLoadError(
            f"plugin {entry.name!r} is enabled in EngineConfig.plugins but no installed distribution "
            f"provides it; installed plugins: {available}. For a plugin of your own, give "
            "'package.module:attr' (or an entry with `path`)"
        )
    who = describe_entry_point(ep)
    try:
        obj = ep.load()
    except Exception as err:
        raise PluginLoadError(f"{who}: import failed: {err}") from err
    return instantiate(obj, dict(entry.options), who), who


def _object_name(obj: Any) -> str:
    name = getattr(obj, "name", None)
    if isinstance(name, str) and name:
        return name
    if isinstance(obj, types.ModuleType):
        return obj.__name__
    return type(obj).__name__ if not inspect.isclass(obj) else obj.__name__


def split_plugins(plugins: Any) -> tuple[list[Any], list[Any]]:
    """``plugins`` in fold order, plugin objects (or classes) and config entries (a name, a
    ``"module:Class"`` path, a mapping, a :class:`PluginEntry`) mixed, as ``(entries, objects)``:
    each object's name is an entry too, which places it in the fold order (one item alone may be
    given bare)."""
    if isinstance(plugins, (str, Mapping, PluginEntry)) or not isinstance(plugins, Iterable):
        plugins = [plugins]
    entries: list[Any] = []
    objects: list[Any] = []
    for item in plugins:
        if isinstance(item, (str, Mapping, PluginEntry)):
            entries.append(item)
            continue
        if inspect.isclass(item):
            item = instantiate(item, {}, f"plugin object {item.__qualname__}")
        name = _object_name(item)
        if name in entries:
            raise PluginConflictError(f"two plugins are both named {name!r}; give them distinct `name`s")
        objects.append(item)
        entries.append(name)
    return entries, objects


def build_plugin_manager(config: EngineConfig, objects: Sequence[Any] = ()) -> LoadedPlugins:
    """Build a fresh manager for ``config`` plus plugin ``objects`` (``CheckpointEngine(plugins=...)``).

    Objects are named by their ``name`` attribute (else their class name). A config entry with
    the same name (and no ``path``) places an object in the fold order instead of importing.
    """
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs.CkptSpecs)
    pm.register(DefaultIO(), name=DEFAULT_PLUGIN_NAME)

    by_name: dict[str, Any] = {}
    for obj in objects:
        if isinstance(obj, (str, Mapping, PluginEntry)):  # registered as is, it would implement nothing
            raise PluginConfigError(
                f"plugins= takes plugin objects, and {str(obj)[:80]!r} is a config entry; list it in the "
                "config's `plugins` (it is placed in the fold order there)"
            )
        if inspect.isclass(obj):
            obj = instantiate(obj, {}, f"plugin object {obj.__qualname__}")
        name = _object_name(obj)
        if name in by_name:
            raise PluginConflictError(f"two plugin objects are both named {name!r}; give them distinct `name`s")
        by_name[name] = obj

    installed: dict[str, EntryPoint] | None = None
    order: list[str] = []
    descriptions: dict[str, str] = {}
    for entry in config.enabled_plugins():
        if entry.path is None and entry.name in by_name:
            if entry.options:
                raise PluginConfigError(
                    f"plugin {entry.name!r} is passed as an object; options in the config cannot apply to it"
                )
            plugin, who = by_name.pop(entry.name), f"plugin {entry.name!r} (object)"
        else:
            if installed is None:
                installed = installed_plugins()
            plugin, who = _load_entry(entry, installed)
        _register(pm, plugin, entry.name, who)
        order.append(entry.name)
        descriptions[entry.name] = who
    for name, obj in by_name.items():
        if any(e.name == name and not e.enabled for e in config.plugins):
            continue  # disabled in config: not registered
        who = f"plugin {name!r} (object {type(obj).__qualname__})"
        _register(pm, obj, name, who)
        order.append(name)
        descriptions[name] = who
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        raise PluginLoadError(
            f"{err} (the engine's hooks: {', '.join(hookspecs.HOOK_KINDS)}; docs/hooks.md); rename the method, or "
            "leave it undecorated if it is no hook"
        ) from err
    return LoadedPlugins(pm=pm, order=tuple(order), descriptions=descriptions)


def _register(pm: pluggy.PluginManager, plugin: Any, name: str, who: str) -> None:
    if name == DEFAULT_PLUGIN_NAME or pm.has_plugin(name):
        raise PluginConflictError(f"{who}: the name {name!r} is already taken; rename the plugin")
    if pm.is_registered(plugin):
        raise PluginConflictError(f"{who}: this plugin object is already registered under another name")
    try:
        pm.register(plugin, name=name)
    except pluggy.PluginValidationError as err:
        raise PluginLoadError(
            f"{who}: {err} (the engine's hooks: {', '.join(hookspecs.HOOK_KINDS)}; docs/hooks.md gives each "
            "one's arguments)"
        ) from err
    except ValueError as err:
        raise PluginConflictError(f"{who}: {err}") from err
