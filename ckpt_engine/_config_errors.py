"""Readable config errors: pydantic's ``ValidationError`` as one line per problem, with the
closest field name suggested for an unknown one ("did you mean keep_last?")."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from .errors import ConfigError

__all__ = ["describe_validation_error", "raised_config_error", "suggest"]


def raised_config_error(err: ValidationError) -> ConfigError | None:
    """The :class:`ConfigError` a model's own ``__init__`` raised, which pydantic wrapped into
    ``err`` (it is a ``ValueError``); ``None`` if there is none."""
    for problem in err.errors(include_url=False):
        inner = (problem.get("ctx") or {}).get("error")
        if isinstance(inner, ConfigError) and not problem.get("loc"):
            return inner
    return None


def suggest(name: str, choices: list[str]) -> str:
    """``"; did you mean X?"`` for the choice closest to ``name``, or ``""``."""
    lowered = {c.lower(): c for c in choices}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return f"; did you mean {lowered[close[0]]}?" if close else ""


def _model_at(model: type[BaseModel], loc: tuple[int | str, ...]) -> type[BaseModel] | None:
    """The model class whose field set the last element of ``loc`` belongs to."""
    current: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue  # an index into a tuple of models: same model
        field = current.model_fields.get(part) if isinstance(current, type) and issubclass(current, BaseModel) else None
        if field is None:
            return None
        annotation = field.annotation
        inner = [a for a in getattr(annotation, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)]
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            current = annotation
        elif inner:
            current = inner[0]
        else:
            return None
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def describe_validation_error(err: ValidationError, model: type[BaseModel]) -> str:
    """One line per problem: ``field: message``, with a suggestion for unknown fields."""
    lines = []
    for problem in err.errors(include_url=False):
        loc = tuple(problem.get("loc", ()))
        where = ".".join(str(p) for p in loc) or "(config)"
        message = str(problem.get("msg", "invalid"))
        if problem.get("type") == "extra_forbidden" and loc and isinstance(loc[-1], str):
            owner = _model_at(model, loc)
            fields = sorted(owner.model_fields) if owner is not None else []
            hint = suggest(loc[-1], fields)
            message = f"unknown field{hint or ''}" + ("" if hint else f"; known fields: {', '.join(fields)}")
        elif problem.get("type") == "value_error":
            message = message.removeprefix("Value error, ")
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)
