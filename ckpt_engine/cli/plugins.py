"""``ckpt-engine plugins``: installed plugins, their hooks and options; what a config enables."""

from __future__ import annotations

import argparse
import textwrap
from typing import Any

from ._command import Command
from ._output import EXIT_OK, JSON_HELP, print_json, print_lines
from ._user_code import make_cwd_importable


def cmd_plugins(args: argparse.Namespace) -> int:
    from .._inspect.describe import describe_plugins, hook_kind
    from .._inspect.files import table

    infos = describe_plugins()
    enabled: dict[str, Any] | None = None
    if args.config:
        enabled = _describe_config(args.config)
    if args.json:
        print_json({"plugins": [i.to_dict() for i in infos], "config": enabled})
        return EXIT_OK
    lines = ["installed plugins (entry points of the 'ckpt_engine' group):"]
    for info in infos:
        origin = f"{info.value}" + (f", from {info.dist} {info.version}" if info.dist else "")
        flag = "  [on by default]" if info.default_on else ""
        lines += ["", f"{info.name}  ({origin}){flag}"]
        if info.error:
            lines.append(f"  {info.error}")
            continue
        if info.summary:
            lines += textwrap.wrap(info.summary, 96, initial_indent="  ", subsequent_indent="  ")
        hooks = ", ".join(f"{h} ({hook_kind(h)})" for h in info.hooks) or "none"
        lines.append(f"  hooks: {hooks}")
        if info.options:
            lines.append("  options:")
            rows = [[o.name, o.type, o.default, o.description] for o in info.options]
            lines += ["    " + r for r in table(rows, ["name", "type", "default", "description"])]
        else:
            lines.append("  options: none")
    if not infos:
        lines.append("  (none)")
    if enabled is not None:
        lines += ["", f"with {args.config}:"]
        lines.append("  enabled, in fold order: " + (", ".join(enabled["order"]) or "(none)"))
        for hook, names in enabled["fold_order"].items():
            lines.append(f"  {hook}: {' -> '.join(names) or '(no plugin)'}")
        for hook, name in enabled["providers"].items():
            lines.append(f"  {hook}: {name}")
    print_lines(*lines)
    return EXIT_OK


def _describe_config(path: str) -> dict[str, Any]:
    from ..config import EngineConfig
    from ..defaults import DEFAULT_PLUGIN_NAME
    from ..pipeline import Pipeline
    from ..plugin_manager import build_plugin_manager

    config = EngineConfig.from_file(path)
    make_cwd_importable()  # a `module:attr` plugin imports as it does for `plan --config`
    loaded = build_plugin_manager(config)
    pipeline = Pipeline(loaded)
    try:
        return {
            "order": list(loaded.order),
            "fold_order": {h: list(v) for h, v in pipeline.fold_order.items()},
            "providers": {
                h: ("the engine's default" if n == DEFAULT_PLUGIN_NAME else n) for h, n in pipeline.providers.items()
            },
        }
    finally:
        pipeline.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", help="also show what this engine config enables")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


COMMAND = Command(
    name="plugins",
    summary="installed plugins, their hooks and options",
    example="ckpt-engine plugins\nckpt-engine plugins --config engine.yaml    # what this config enables",
    description="Every installed plugin (built-in and third-party entry points of the 'ckpt_engine' "
    "group), the hooks it implements, and its options with defaults. With --config, also the plugins "
    "the config enables, in fold order, and the provider of each provider hook.",
    add_arguments=add_arguments,
    run=cmd_plugins,
)
