"""Describing plugins and configuration from their pydantic models.

Used by ``ckpt-engine plugins`` and by the generator of ``docs/configuration.md``
(``ckpt-engine docs-config``), so the reference cannot drift from the code.
"""

from __future__ import annotations

import dataclasses
import enum
import inspect
import json
import re
import types
import typing
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint
from typing import Any

import pluggy
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from .. import hookspecs
from .._markers import PROJECT_NAME
from ..config import DEFAULT_PLUGINS, EngineConfig, PluginEntry, StorageOptions
from ..plugin_manager import installed_plugins

__all__ = ["OptionInfo", "PluginInfo", "config_reference", "describe_plugins", "hook_kind"]

DIST_NAME = "ckpt-engine"
HOOK_NAMES = tuple(n for n, _ in inspect.getmembers(hookspecs.CkptSpecs, inspect.isfunction))


def hook_kind(name: str) -> str:
    return hookspecs.HOOK_KINDS.get(name, "?")


@dataclass(frozen=True)
class OptionInfo:
    name: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class PluginInfo:
    name: str
    value: str
    dist: str | None
    version: str | None
    default_on: bool
    summary: str = ""
    hooks: tuple[str, ...] = ()
    options: tuple[OptionInfo, ...] = ()
    #: Nested option models (e.g. a rule type) -> their fields.
    models: dict[str, tuple[OptionInfo, ...]] = field(default_factory=dict)
    error: str | None = None

    @property
    def builtin(self) -> bool:
        return self.dist is not None and _norm(self.dist) == _norm(DIST_NAME)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "entry_point": self.value,
            "distribution": self.dist,
            "version": self.version,
            "default": self.default_on,
            "summary": self.summary,
            "hooks": {h: hook_kind(h) for h in self.hooks},
            "options": [o.__dict__ for o in self.options],
            "error": self.error,
        }


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# -- types and defaults ---------------------------------------------------------------------


def type_name(tp: Any) -> str:
    """A readable name for a field annotation (``tuple[str, ...]`` reads as ``list[str]``)."""
    if tp is type(None):
        return "null"
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (tuple, list, set, frozenset):
        inner = args[0] if args else Any
        return f"list[{type_name(inner)}]"
    if origin is dict:
        return "mapping"
    if tp is Any:
        return "any"
    if inspect.isclass(tp):
        if issubclass(tp, BaseModel):
            return tp.__name__
        if issubclass(tp, enum.Enum):
            return " | ".join(json.dumps(m.value) for m in tp)
        return {"str": "string", "int": "integer", "float": "number", "bool": "boolean"}.get(tp.__name__, tp.__name__)
    return str(tp).replace("typing.", "")


def _jsonable(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, (tuple, list, set, frozenset)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, enum.Enum):
        return value.value
    return value


def default_text(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.default_factory() if info.default_factory is not None else info.default  # type: ignore[call-arg]
    return json.dumps(_jsonable(value))


def _constraints(info: FieldInfo) -> str:
    parts = []
    for m in info.metadata:
        for attr, label in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"), ("min_length", "min length")):
            v = getattr(m, attr, None)
            if v is not None:
                parts.append(f"{label} {v}")
    return f" ({', '.join(parts)})" if parts else ""


def model_options(model: type[BaseModel]) -> tuple[OptionInfo, ...]:
    return tuple(
        OptionInfo(
            name=name,
            type=type_name(info.annotation),
            default=default_text(info),
            description=(info.description or "") + _constraints(info),
        )
        for name, info in model.model_fields.items()
    )


def nested_models(model: type[BaseModel]) -> list[type[BaseModel]]:
    """Pydantic models used in ``model``'s field types (e.g. a list of rules), depth first."""
    found: list[type[BaseModel]] = []

    def walk(tp: Any) -> None:
        if inspect.isclass(tp) and issubclass(tp, BaseModel):
            if tp not in found:
                found.append(tp)
                for info in tp.model_fields.values():
                    walk(info.annotation)
            return
        for arg in typing.get_args(tp):
            walk(arg)

    for info in model.model_fields.values():
        walk(info.annotation)
    return found


# -- plugins --------------------------------------------------------------------------------


def _first_paragraph(doc: str | None) -> str:
    if not doc:
        return ""
    text = " ".join(inspect.cleandoc(doc).split("\n\n", 1)[0].split())
    return text.replace("``", "`")  # reStructuredText literals -> Markdown


def _implemented_hooks(obj: Any) -> tuple[str, ...]:
    pm = pluggy.PluginManager(PROJECT_NAME)
    return tuple(name for name in HOOK_NAMES if hasattr(obj, name) and pm.parse_hookimpl_opts(obj, name) is not None)


def describe_entry_point(ep: EntryPoint) -> PluginInfo:
    """Import the plugin an entry point names and describe it; an import failure is recorded."""
    dist = ep.dist.name if ep.dist is not None else None
    version = ep.dist.version if ep.dist is not None else None
    base = PluginInfo(name=ep.name, value=ep.value, dist=dist, version=version, default_on=ep.name in DEFAULT_PLUGINS)
    try:
        obj = ep.load()
    except Exception as err:
        return dataclasses.replace(base, error=f"cannot import: {type(err).__name__}: {err}")
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return dataclasses.replace(base, error="names a function, not a plugin (a module, class or object)")
    options: tuple[OptionInfo, ...] = ()
    models: dict[str, tuple[OptionInfo, ...]] = {}
    opts_model = getattr(obj, "Options", None) if inspect.isclass(obj) else None
    if isinstance(opts_model, type) and issubclass(opts_model, BaseModel):
        options = model_options(opts_model)
        models = {m.__name__: model_options(m) for m in nested_models(opts_model)}
    return dataclasses.replace(
        base,
        summary=_first_paragraph(inspect.getdoc(obj)),
        hooks=_implemented_hooks(obj),
        options=options,
        models=models,
    )


def describe_plugins(builtin_only: bool = False) -> list[PluginInfo]:
    """Every installed plugin (entry points of the ``ckpt_engine`` group), sorted by name."""
    infos = [describe_entry_point(ep) for _, ep in sorted(installed_plugins().items())]
    return [i for i in infos if i.builtin] if builtin_only else infos


# -- docs/configuration.md ------------------------------------------------------------------


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _options_table(options: tuple[OptionInfo, ...], first: str = "option") -> list[str]:
    lines = [f"| {first} | type | default | description |", "|---|---|---|---|"]
    lines += [f"| `{o.name}` | {_cell(o.type)} | `{_cell(o.default)}` | {_cell(o.description)} |" for o in options]
    return lines


_CONFIG_INTRO = """\
# Configuration reference

<!-- Generated from the pydantic models by `ckpt-engine docs-config -o docs/configuration.md`.
     Do not edit by hand: tests/cli/test_cli.py fails when this file and the models disagree. -->

`EngineConfig` holds everything the engine needs. Give `CheckpointEngine` an `EngineConfig`, a
dict of its fields, or the path of a YAML (`.yaml`, `.yml`), TOML (`.toml`) or JSON (`.json`)
file. A file may hold the fields at top level or under a `ckpt_engine` key (a `[ckpt_engine]`
table in TOML), so the engine's settings can live in your project's config file.

- Unknown fields are errors that name the field, in the engine's config and in every plugin's
  `options`.
- The config is frozen: nothing, no plugin either, changes it after it is built.
- Paths (`save_dir`, `load_dir`, `load_path`, `storage.spool_dir`, `storage.local_dir`): `~` is
  the home folder, and a relative path is relative to the working directory of the process that
  builds the engine, not to the config file's folder. An invalid config raises `ConfigError`,
  naming the field and, for a misspelled one, the closest field name.
- Plugins are listed in `plugins`, in fold order. Each plugin validates its own `options`
  (its pydantic `Options` model, below).

```python
from pathlib import Path

from ckpt_engine import CheckpointEngine, EngineConfig

Path("engine.yaml").write_text(
    \"\"\"
save_dir: runs/exp1/checkpoints
keys_not_to_resume: [optim]
plugins:
  - name: size_mismatch
    options: {policy: overlap, patterns: ["*.stem.weight"]}
\"\"\"
)
config = EngineConfig.from_file("engine.yaml")
print([p.name for p in config.plugins])  # ['te_extra_state', 'size_mismatch']: the default comes first
with CheckpointEngine(config) as engine:
    print(engine.plugin_names)
```

The command line shows what a config enables, with every installed plugin's options and
defaults: `ckpt-engine plugins --config engine.yaml`.
"""

_PLUGIN_ENTRY_INTRO = """\
## Plugin entries

Each item of `plugins` is one of:

- a name: `size_mismatch`, an installed plugin (an entry point in the `ckpt_engine` group);
- a `package.module:attr` string: a plugin of your own that is not installed as an entry point;
- a mapping with the fields below, e.g. `{name: size_mismatch, options: {policy: skip}}`.

The default plugins (%s) come first unless the list names them; list one with
`enabled: false` to turn it off. A disabled plugin is never imported.
"""


_STORAGE_INTRO = """## storage fields

`storage` says how to reach a `save_dir`, `load_dir` or `load_path` given as a URL (`s3://...`,
or any filesystem fsspec knows); local paths ignore it. [storage.md](storage.md) explains the
commit rule on object stores and the two-tier mode.
"""


def config_reference() -> str:
    """The Markdown of ``docs/configuration.md``."""
    lines = [_CONFIG_INTRO, "## EngineConfig fields", ""]
    lines += _options_table(model_options(EngineConfig), "field")
    lines += ["", _STORAGE_INTRO]
    lines += _options_table(model_options(StorageOptions), "field")
    lines += ["", _PLUGIN_ENTRY_INTRO % ", ".join(f"`{n}`" for n in DEFAULT_PLUGINS)]
    lines += _options_table(model_options(PluginEntry), "field")
    lines += [
        "",
        "## Built-in plugins",
        "",
        "The plugins that ship with ckpt-engine, with their options. [plugins.md](plugins.md) explains",
        "when to use each; [hooks.md](hooks.md) defines the hooks.",
    ]
    for info in describe_plugins(builtin_only=True):
        lines += ["", f"### {info.name}", ""]
        if info.error:
            lines += [f"Not importable: {info.error}"]
            continue
        lines += [info.summary, ""] if info.summary else []
        hooks = ", ".join(f"`{h}` ({hook_kind(h)})" for h in info.hooks) or "none"
        lines += [f"- entry point: `{info.name} = {info.value}`", f"- hooks: {hooks}"]
        lines += ["- on by default" if info.default_on else "- off unless listed in `plugins`", ""]
        if info.options:
            lines += _options_table(info.options)
        else:
            lines += ["No options."]
        for model_name, fields in info.models.items():
            lines += ["", f"`{model_name}`:", ""]
            lines += _options_table(fields, "field")
    return "\n".join(lines).rstrip() + "\n"
