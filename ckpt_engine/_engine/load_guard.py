"""Checks a load makes before it reads anything.

* **Checksums fail closed.** ``verify: checksums`` that cannot be done (no manifest, a sizes-only
  or newer manifest, an algorithm not available here) refuses the load with
  :class:`UnverifiableCheckpointError` saying why, unless ``allow_unverified`` is set.
* **The folder is the checkpoint it claims to be.** A manifest records its iteration; a folder
  ``iter_000000010`` whose manifest says 5 (say, a symlink to another run's checkpoint) is
  refused.

The lock a load holds while it reads is :mod:`ckpt_engine._format.read_lock`.
"""

from __future__ import annotations

import dataclasses

from .._format.manifest import Manifest
from .._format.verify import VerifyReport, iteration_problem
from ..errors import CorruptCheckpointError, UnverifiableCheckpointError

__all__ = [
    "check_manifest_iteration",
    "fail_unverified",
    "missing_for_resume",
    "require_verifiable",
]


def require_verifiable(path: str, level: str, checked: bool, reason: str | None, allow: bool) -> None:
    """Refuse a ``checksums`` load whose checksums could not all be checked (``checked`` false,
    ``reason`` why), unless ``allow`` (``allow_unverified``)."""
    if level != "checksums" or checked or allow:
        return
    raise UnverifiableCheckpointError(
        f"verify='checksums' was asked for, but the checksums of {path} cannot be checked: {reason or 'unknown'}; "
        "nothing was loaded. Set allow_unverified=True to load it unverified (e.g. a checkpoint of plain DCP or "
        "the original checkpointer), or verify='sizes'"
    )


def fail_unverified(report: VerifyReport, allow: bool) -> VerifyReport:
    """``report`` of ``verify_checkpoint(level="checksums")``, failed (a problem added) when its
    checksums could not be checked, unless ``allow``."""
    if report.level != "checksums" or report.verified or not report.ok or allow:
        return report
    why = report.unverified_reason or "no manifest"
    problem = f"{report.path}: checksums cannot be checked ({why}); pass --allow-unverified to accept that"
    return dataclasses.replace(report, problems=[*report.problems, problem])


def check_manifest_iteration(path: str, manifest: Manifest) -> None:
    """Refuse a checkpoint folder whose name's iteration differs from its manifest's."""
    problem = iteration_problem(path, manifest)
    if problem is not None:
        raise CorruptCheckpointError(f"{problem}; nothing was loaded")


def missing_for_resume(path: str, name: str, present: tuple[str, ...]) -> str:
    """The message refusing to resume (rule 1) from ``path``, which lacks component ``name``."""
    what = (
        "its iteration: training would silently restart at iteration 0 with the state of a later one"
        if name == "trainer"
        else "state you passed in: it would keep its fresh values while the rest resumes"
    )
    return (
        f"cannot resume from {path}: it has no component {name!r} (it has: {', '.join(present) or 'none'}), which "
        f"holds {what}. Restore {name}/, add {name!r} to keys_not_to_resume to resume without it, or point "
        "latest_checkpoint.txt at a complete checkpoint"
    )
