"""Checks a load makes before it reads anything.

* **Checksums fail closed.** ``verify: checksums`` that cannot be done (no manifest, a sizes-only
  or newer manifest, an algorithm not available here) refuses the load with
  :class:`UnverifiableCheckpointError` saying why, unless ``allow_unverified`` is set.
* **The folder is the checkpoint it claims to be.** A manifest records its iteration; a folder
  ``iter_000000010`` whose manifest says 5 (say, a symlink to another run's checkpoint) is
  refused.

* **One read of each ``.metadata`` per load.** With several ranks, rank 0 reads each
  component's ``.metadata`` (:func:`capturing` keeps the bytes its checks saw,
  :func:`metadata_bytes` adds those of metadata this process wrote itself) and broadcasts them,
  with those of each compact index beside them; the other ranks build the records from the
  index where it describes exactly those bytes, else parse them (:func:`parse_shared_metadata`),
  instead of reading the files.

The lock a load holds while it reads is :mod:`ckpt_engine._format.read_lock`.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .._dcpio import dist as _dist
from .._format.layout import CheckedCheckpoint, check_complete
from .._format.manifest import Manifest, lookup_manifest, referenced_files, shard_files
from .._format.metadata import validate_metadata
from .._format.metadata_index import read_index
from .._format.metadata_parser import parse_metadata
from .._format.metadata_read import indexed_metadata
from .._format.names import MANIFEST_FILE, METADATA_FILE, METADATA_INDEX_FILE
from .._format.read_lock import ReadLock
from .._format.verify import VerifyReport, check_against_manifest, iteration_problem, metadata_checker
from .._storage.store import Store
from ..config import EngineConfig
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    IntegrityError,
    UnverifiableCheckpointError,
)

__all__ = [
    "Validated",
    "capturing",
    "check_manifest_iteration",
    "check_share",
    "fail_unverified",
    "metadata_bytes",
    "missing_for_resume",
    "parse_shared_metadata",
    "raise_problems",
    "require_verifiable",
    "run_checks",
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


def raise_problems(path: str, problems: list[str]) -> None:
    """Refuse the checkpoint at ``path`` if its files do not match the manifest (``problems``)."""
    if problems:
        shown = problems[:20]
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise IntegrityError(
            f"checkpoint {path} does not match its manifest ({len(problems)} problem(s); nothing "
            "was loaded):\n  " + "\n  ".join(shown) + more
        )


def capturing(check: Callable[[str, bytes], None] | None, into: dict[str, bytes]) -> Callable[[str, bytes], None]:
    """A ``.metadata`` bytes check that runs ``check`` (if any) and keeps the bytes ``into`` by path."""

    def run(path: str, data: bytes) -> None:
        if check is not None:
            check(path, data)
        into[path] = data

    return run


def metadata_bytes(
    checked: CheckedCheckpoint, captured: dict[str, bytes], store: Store
) -> dict[str, tuple[bytes, bytes | None]]:
    """Each component's ``.metadata`` bytes (as the checks read them, ``captured``, or, for
    metadata this process wrote and recalled without reading, from the local file) and those of
    its compact index where one lies beside it (a local folder)."""
    out = {}
    for name in checked.components:
        folder = store.join(checked.path, name)
        path = store.join(folder, METADATA_FILE)
        data = captured.get(path)
        if data is None:
            with open(os.fspath(path), "rb") as f:
                data = f.read()
        local = store.capabilities.local_files
        out[name] = (data, read_index(os.path.join(folder, METADATA_INDEX_FILE), data) if local else None)
    return out


def parse_shared_metadata(path: str, data: bytes, index: bytes | None = None) -> Any:
    """The ``Metadata`` of ``path`` from the bytes rank 0 read (and already parsed and checked):
    from its compact index where ``index`` describes exactly ``data``, else parsed."""
    md = indexed_metadata(index, data, path)
    if md is not None:
        return md
    try:
        md = parse_metadata(data)
    except ValueError as err:
        raise CorruptCheckpointError(f"{path} (as rank 0 read it) is not a valid DCP metadata file: {err}") from err
    validate_metadata(md, path)
    return md


@dataclass(frozen=True)
class Validated:
    """A checkpoint that passed the pre-load checks."""

    checked: CheckedCheckpoint
    verified: bool
    reason: str | None
    store: Store
    #: Held until the load has read everything (retention skips a folder being read).
    lock: ReadLock | None = None


def check_share(validated: Validated) -> None:
    """``verify: checksums`` on a rank other than 0: its share of the checksums."""
    path, store = validated.checked.path, validated.store
    lookup = lookup_manifest(path, store)
    assert lookup.manifest is not None  # rank 0 verified against it
    rank, world = _dist.rank(), _dist.world_size()
    found = check_against_manifest(
        path,
        lookup.manifest,
        "checksums",
        referenced=referenced_files(validated.checked),
        checksum_only=shard_files(lookup.manifest.files, world)[rank],
        store=store,
        listing=validated.checked.listing,
    )
    raise_problems(path, found.problems)


def run_checks(
    config: EngineConfig, path: str, store: Store, missing_hint: str | None, capture: dict[str, bytes] | None
) -> Validated:
    """The checks of ``Loader.validate`` on this rank (``capture``: each ``.metadata``'s bytes by path)."""
    level = config.verify
    rank, world = _dist.rank(), _dist.world_size()
    if not store.isdir(path):
        raise CheckpointNotFoundError(missing_hint or f"checkpoint folder {path} does not exist")
    marker_commit = not store.capabilities.commit_by_rename  # the manifest is the completion marker
    lookup = lookup_manifest(path, store) if level != "off" or marker_commit else None
    if marker_commit and (lookup is None or lookup.manifest is None):
        raise IncompleteCheckpointError(
            f"{path} has no {MANIFEST_FILE}, its completion marker: on an object store the marker is "
            "written last, so this is an interrupted save (or a checkpoint written by another tool; copy "
            "that to a local folder to load it)"
        )
    manifest = lookup.manifest if lookup is not None and level != "off" else None
    checker = metadata_checker(path, manifest, store) if manifest else None
    checked = check_complete(path, store, checker if capture is None else capturing(checker, capture))
    if level == "off" or lookup is None:
        return Validated(checked, False, "verify='off'", store)
    if lookup.manifest is None:
        require_verifiable(path, level, False, lookup.reason, config.allow_unverified)
        return Validated(checked, False, lookup.reason, store)
    check_manifest_iteration(path, lookup.manifest)
    share = shard_files(lookup.manifest.files, world)[rank] if level == "checksums" else None
    found = check_against_manifest(
        path,
        lookup.manifest,
        "checksums" if level == "checksums" else "sizes",  # "read": the reads are checked as they read
        referenced=referenced_files(checked),
        checksum_only=share,
        store=store,
        listing=checked.listing,
    )
    raise_problems(path, found.problems)
    require_verifiable(path, level, found.complete_check, found.reason, config.allow_unverified)
    return Validated(checked, found.complete_check, found.reason, store)
