"""Verifying what a path names, one checkpoint or every checkpoint of a save folder, with
checksums failing closed: what ``ckpt-engine verify`` prints, computed as data."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from .._engine.load_guard import fail_unverified
from .._format.layout import component_dirs
from .._format.names import LATEST_FILE
from .._format.pointer import list_checkpoints, read_latest
from .._format.verify import VerifyLevel, VerifyReport, verify_checkpoint
from .._storage.store import open_store
from ..errors import CheckpointNotFoundError, UsageError
from .reader import exists, is_component_dir, is_save_dir, isdir

__all__ = ["PathVerification", "verify_path"]


class Meter(Protocol):
    """Where the bytes checked so far go (the command line's progress bar)."""

    def update(self, done: int, total: int | None = None) -> None: ...

    def close(self) -> None: ...


#: ``(checkpoint folder) -> Meter``, one per verified checkpoint.
MeterFactory = Callable[[str], Meter]


@dataclass
class PathVerification:
    """The reports of every checkpoint ``path`` names, oldest first, and the save folder's own
    problems (``latest_checkpoint.txt`` naming a checkpoint that does not exist)."""

    path: str
    reports: list[VerifyReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports) and not self.problems


def verify_path(
    path: str,
    level: VerifyLevel = "checksums",
    *,
    allow_unverified: bool = False,
    meter: MeterFactory | None = None,
) -> PathVerification:
    """Verify the checkpoint folder ``path``, or every checkpoint of the save folder ``path``.
    At ``level="checksums"`` a checkpoint whose checksums cannot be checked fails unless
    ``allow_unverified``. Raises :class:`CheckpointNotFoundError` for a path that is no
    checkpoint and :class:`UsageError` for a component folder."""
    result = PathVerification(path)
    paths = _checkpoints_of(path, result.problems)
    reports = [_verify_one(p, level, meter) for p in paths]
    result.reports = [fail_unverified(r, allow_unverified) for r in reports]  # checksums fail closed
    return result


def _checkpoints_of(path: str, problems: list[str]) -> list[str]:
    """The checkpoint folders ``path`` names; a save folder's own problems go to ``problems``."""
    if not exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not isdir(path):
        raise CheckpointNotFoundError(f"{path} is a file, not a checkpoint folder")
    if is_component_dir(path):
        raise UsageError(f"{path} is one component; verify its checkpoint: ckpt-engine verify {os.path.dirname(path)}")
    if is_save_dir(path):
        paths = [p for _, p in list_checkpoints(path)]
        latest = read_latest(path)
        if latest is not None and not isdir(os.path.join(path, latest)):
            problems.append(f"{os.path.join(path, LATEST_FILE)} names {latest!r}, which does not exist")
        return paths
    if not open_store(path).list_dir(path):
        raise CheckpointNotFoundError(f"{path} is empty: not a checkpoint")
    if not component_dirs(path):
        raise CheckpointNotFoundError(
            f"{path} is not a checkpoint: it has no component folders (model/, optim/, ...) and no iter_* checkpoints"
        )
    return [path]


def _verify_one(path: str, level: VerifyLevel, meter: MeterFactory | None) -> VerifyReport:
    if meter is None:
        return verify_checkpoint(path, level=level)
    bar = meter(path)
    try:
        return verify_checkpoint(path, level=level, progress=bar.update)
    finally:
        bar.close()
