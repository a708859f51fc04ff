"""``ckpt-engine plan``: a dry-run load into the user's model, with the real planner and plugins."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from ..errors import UsageError
from ._command import Command
from ._output import JSON_HELP
from ._user_code import make_cwd_importable


def import_factory(spec: str) -> Callable[[], Any]:
    """``package.module:attr`` -> the callable; the current folder is importable, as with ``python -m``."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise UsageError(f"--model {spec!r} must be 'package.module:factory' (a callable that builds the model)")
    make_cwd_importable()
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:
        raise UsageError(
            f"cannot import module {module_name!r} (from --model {spec}): {type(err).__name__}: {err}"
        ) from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise UsageError(f"module {module_name!r} has no attribute {attr!r} (from --model {spec})") from err
    if not callable(obj):
        raise UsageError(f"--model {spec} is a {type(obj).__name__}, not a callable that builds the model")
    factory: Callable[[], Any] = obj
    return factory


_LOAD_ARGS = ("model", "optimizer", "scheduler", "grad_scaler", "extra")


def _build_objects(spec: str) -> Any:
    import torch
    from torch import nn

    from .._engine.state import TrainingObjects

    built = import_factory(spec)
    try:
        made = built()
    except Exception as err:
        raise UsageError(f"--model factory {spec} raised {type(err).__name__}: {err}") from err
    if isinstance(made, Mapping):
        unknown = sorted(set(made) - set(_LOAD_ARGS))
        if unknown:
            raise UsageError(
                f"--model factory {spec} returned unknown keys {unknown}; allowed: {', '.join(_LOAD_ARGS)}"
            )
        kwargs = dict(made)
    elif isinstance(made, (list, tuple)) and len(made) == 2 and isinstance(made[1], torch.optim.Optimizer):
        kwargs = {"model": made[0], "optimizer": made[1]}  # the common `return model, optimizer`
    elif isinstance(made, nn.Module) or (isinstance(made, (list, tuple)) and made):
        kwargs = {"model": made}
    else:
        raise UsageError(
            f"--model factory {spec} returned a {type(made).__name__}; return an nn.Module, a list of modules, "
            "(model, optimizer), or a dict of engine.load() arguments (model=, optimizer=, scheduler=, "
            "grad_scaler=, extra=)"
        )
    try:
        return TrainingObjects.from_args(
            kwargs.get("model"),
            kwargs.get("optimizer"),
            kwargs.get("scheduler"),
            kwargs.get("grad_scaler"),
            kwargs.get("extra"),
        )
    except (TypeError, ValueError) as err:
        raise UsageError(f"--model factory {spec}: {err}") from err


def cmd_plan(args: argparse.Namespace) -> int:
    from .._inspect.plan import plan_load

    make_cwd_importable()  # the factory's module and a config's `module:attr` plugins
    return plan_load(args, _build_objects(args.model))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument("--model", required=True, metavar="PACKAGE.MODULE:FACTORY")
    parser.add_argument("--config", metavar="FILE", help="engine config (YAML/TOML/JSON): plugins, strictness")
    parser.add_argument("--component", action="append", metavar="C", help="only this component (repeatable)")
    parser.add_argument("--all", action="store_true", help="list every key, not a collapsed summary")
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


COMMAND = Command(
    name="plan",
    summary="dry-run a load into your model: what would load, skip, be missing",
    example="ckpt-engine plan runs/exp1/checkpoints --model my_project.models:build --config engine.yaml",
    description="Builds the model with FACTORY (a callable taking no arguments that returns an nn.Module, "
    "a list of modules, or a dict of engine.load() arguments), then runs the engine's real load planner "
    "with the configured plugins against the checkpoint's metadata. Prints the load report: what would "
    "load, be skipped, overlap-loaded, renamed, be missing or unexpected. Reads no tensor data and "
    "writes nothing. Exit code 1 when the load would fail.",
    add_arguments=add_arguments,
    run=cmd_plan,
)
