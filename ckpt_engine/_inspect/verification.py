"""Verifying what a path names, with checksums failing closed: one engine checkpoint or every
checkpoint of a save folder, or a DCP folder, safetensors file, Hugging Face folder or
``torch.save`` file; what ``ckpt-engine verify`` prints, computed as data.

Nothing here imports torch: engine checkpoints are checked against their manifest
(:func:`ckpt_engine._format.verify.verify_checkpoint`, ``.metadata`` read into torch-free
records), safetensors headers must describe every byte of their files, and a ``torch.save``
file's records are checked against its pickle and, at ``checksums``, against the CRC-32 its zip
directory records. A format without checksums (safetensors, a DCP folder without the engine's
manifest) is complete at best: at ``checksums`` it fails unless ``allow_unverified``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from .._format.layout import check_component_files, component_dirs
from .._format.metadata_read import is_rank_local, read_metadata
from .._format.metadata_types import records_without_dcp
from .._format.names import LATEST_FILE
from .._format.pointer import list_checkpoints, read_latest
from .._format.safetensors_header import is_weights_folder, read_weights_folder
from .._format.verify import VerifyLevel, VerifyReport, verify_checkpoint
from .._storage.store import open_store
from .._storage.urls import is_url
from ..errors import CheckpointNotFoundError, CkptEngineError, CorruptCheckpointError, UsageError
from .files import exists, is_component_dir, isdir
from .keys import key_infos
from .parts import Part, part_of
from .pt_file import crc_problems, read_pt_file, tensor_problems
from .target import KIND_NAMES, Target, inside_checkpoint, is_save_dir, sniff_file

__all__ = ["PathVerification", "Verdict", "verdict_of", "verify_path", "verify_target"]

#: What verify concludes of a checkpoint: ``ok`` (checked at the level asked), ``unverified``
#: (complete, sizes and structure check, but nothing holds checksums to check its content against)
#: or ``damaged`` (incomplete, truncated, corrupt). Worst last.
Verdict = Literal["ok", "unverified", "damaged"]
VERDICTS: tuple[Verdict, ...] = ("ok", "unverified", "damaged")


class Meter(Protocol):
    """Where the bytes checked so far go (the command line's progress bar)."""

    def update(self, done: int, total: int | None = None) -> None: ...

    def close(self) -> None: ...


#: ``(checkpoint folder, its number from 1, how many) -> Meter``, one per verified checkpoint.
MeterFactory = Callable[[str, int, int], Meter]


@dataclass
class PathVerification:
    """The reports of every checkpoint ``path`` names, oldest first, and the save folder's own
    problems (``latest_checkpoint.txt`` naming a checkpoint that does not exist)."""

    path: str
    reports: list[VerifyReport] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    #: report path -> ``engine`` or the single target's kind (``safetensors``, ``hf``, ``torch``, ``dcp``).
    kinds: dict[str, str] = field(default_factory=dict)
    #: report path -> component -> what it holds, for a checkpoint that is one rank's part (a
    #: rank-local checkpoint of the node-local tier): complete as that part, never as the whole.
    parts: dict[str, dict[str, Part]] = field(default_factory=dict)
    #: An unverified checkpoint passes (``ok``): the caller accepts content it cannot check.
    allow_unverified: bool = False

    @property
    def verdict(self) -> Verdict:
        """The worst verdict of the reports: ``damaged`` > ``unverified`` > ``ok``."""
        if self.problems:
            return "damaged"
        return max((verdict_of(r) for r in self.reports), key=VERDICTS.index, default="ok")

    @property
    def ok(self) -> bool:
        verdict = self.verdict
        return verdict == "ok" or (verdict == "unverified" and self.allow_unverified)


def verdict_of(report: VerifyReport) -> Verdict:
    """``damaged`` for a report with problems or incomplete; ``unverified`` for a complete one whose
    checksums were asked for (``level="checksums"``) but could not be checked; else ``ok``."""
    if not report.ok:
        return "damaged"
    return "unverified" if report.level == "checksums" and not report.verified else "ok"


def verify_path(
    path: str,
    level: VerifyLevel = "checksums",
    *,
    allow_unverified: bool = False,
    meter: MeterFactory | None = None,
) -> PathVerification:
    """Verify what ``path`` names: a checkpoint folder, every checkpoint of a save folder, or one
    file or folder of another format. At ``level="checksums"`` a complete checkpoint whose checksums
    cannot be checked is ``unverified`` (:func:`verdict_of`); ``allow_unverified`` lets it pass.
    Raises :class:`CheckpointNotFoundError` for a path that is none of these and
    :class:`UsageError` for a component folder."""
    result = PathVerification(path, allow_unverified=allow_unverified)
    found = _checkpoints_of(path, result.problems)
    for number, (p, kind) in enumerate(found, 1):
        result.kinds[p] = kind
        report = _verify_one(p, kind, level, _numbered(meter, number, len(found)))
        result.reports.append(report)
        if report.ok and kind in ("engine", "dcp"):
            parts = rank_local_parts(p, kind)
            if parts:
                result.parts[p] = parts
    return result


def _numbered(meter: MeterFactory | None, number: int, count: int) -> Callable[[str], Meter] | None:
    """``meter`` for checkpoint ``number`` of ``count``."""
    if meter is None:
        return None
    return lambda path: meter(path, number, count)


def rank_local_parts(path: str, kind: str) -> dict[str, Part]:
    """Component -> what it holds, for the components of the (complete) checkpoint ``path`` that are
    one rank's part; empty for a checkpoint that holds its tensors whole."""
    store = open_store(path)
    folders = (
        {os.path.basename(path): path}
        if kind == "dcp"
        else {name: store.join(path, name) for name in component_dirs(path, store)}
    )
    out: dict[str, Part] = {}
    for name, folder in folders.items():
        with records_without_dcp():
            md = read_metadata(folder, store)
        part = part_of(folder, is_rank_local(md), key_infos(md))
        if part is not None:
            out[name] = part
    return out


def verify_target(target: Target, level: VerifyLevel = "sizes") -> VerifyReport:
    """The report of the checkpoint ``target`` resolved to (``inspect``'s completeness line)."""
    return _verify_one(target.checkpoint, target.kind, level, None)


def _checkpoints_of(path: str, problems: list[str]) -> list[tuple[str, str]]:
    """``(path, kind)`` of what ``path`` names; a save folder's own problems go to ``problems``."""
    if not exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not isdir(path):
        kind = None if is_url(path) else sniff_file(path)
        if kind is None:
            raise CheckpointNotFoundError(
                f"{path} is a file, but neither a safetensors file nor a torch.save file; verify reads those, "
                "DCP folders and engine checkpoints"
            )
        return [(path, kind)]
    if is_component_dir(path):
        if inside_checkpoint(path):
            raise UsageError(
                f"{path} is one component; verify its checkpoint: ckpt-engine verify {os.path.dirname(path)}"
            )
        return [(path, "dcp")]
    if is_save_dir(path):
        paths = [(p, "engine") for _, p in list_checkpoints(path)]
        latest = read_latest(path)
        if latest is not None and not isdir(os.path.join(path, latest)):
            problems.append(f"{os.path.join(path, LATEST_FILE)} names {latest!r}, which does not exist")
        return paths
    if not open_store(path).list_dir(path):
        raise CheckpointNotFoundError(f"{path} is empty: not a checkpoint")
    if not is_url(path) and is_weights_folder(path) and not component_dirs(path):
        return [(path, "hf")]
    if not component_dirs(path):
        raise CheckpointNotFoundError(
            f"{path} is not a checkpoint: it has no component folders (model/, optim/, ...) and no iter_* checkpoints"
        )
    return [(path, "engine")]


def _verify_one(path: str, kind: str, level: VerifyLevel, meter: Callable[[str], Meter] | None) -> VerifyReport:
    bar = meter(path) if meter is not None else None
    try:
        if kind == "engine":  # it reads fields and hands nothing to DCP: the torch-free records serve
            with records_without_dcp():
                return verify_checkpoint(path, level=level, progress=bar.update if bar else None)
        try:
            return _VERIFIERS[kind](path, level, bar)
        except CkptEngineError as err:  # the format's own check failed: damage, not a usage error
            why = "damaged" if isinstance(err, CorruptCheckpointError) else "incomplete"
            corrupt = isinstance(err, CorruptCheckpointError)
            return VerifyReport(path, False, False, why, [str(err)], level=level, corrupt=corrupt)
    finally:
        if bar is not None:
            bar.close()


def _verify_dcp(path: str, level: VerifyLevel, bar: Meter | None) -> VerifyReport:
    """A DCP folder the engine did not write: complete when every byte range its ``.metadata``
    names exists; there is no manifest to verify against."""
    store = open_store(path)
    with records_without_dcp():
        md = read_metadata(path, store)
    check_component_files(path, md, store)
    infos = list((md.storage_data or {}).values())
    nbytes = sum(int(i.length) for i in infos)
    return VerifyReport(
        path, True, False, f"{KIND_NAMES['dcp']} without the engine's manifest", [],
        len({i.relative_path for i in infos}) + 1, nbytes, level,
    )  # fmt: skip


def _verify_weights(path: str, level: VerifyLevel, bar: Meter | None) -> VerifyReport:
    """Safetensors: every header checked, describing every byte of its file (a truncated file
    fails); an index naming shards that exist and hold what it says. The format holds no checksums."""
    folder = read_weights_folder(path)
    problems = [
        f"{folder.index}: {file} holds {name}, which the index does not name (no loader reads it)"
        for file, name in folder.unlisted
    ]
    files = len(folder.headers) + (folder.index is not None)
    nbytes = sum(h.file_size for h in folder.headers)
    if bar is not None:
        bar.update(nbytes, nbytes)
    checked = level == "sizes" and not problems
    reason = "the safetensors format holds no checksums; --level sizes checks all it has" if not checked else None
    return VerifyReport(path, True, checked, reason, problems, files, nbytes, level)


def _verify_torch(path: str, level: VerifyLevel, bar: Meter | None) -> VerifyReport:
    """A ``torch.save`` file: its zip records, each tensor's storage present and large enough, and at
    ``checksums`` every record's CRC-32 against the zip directory."""
    pt = read_pt_file(path)
    problems = tensor_problems(pt)
    total = sum(r.size for r in pt.archive.records.values())
    if level == "checksums" and not problems:
        done = [0]

        def tick(n: int) -> None:
            done[0] += n
            if bar is not None:
                bar.update(done[0], total)

        problems += crc_problems(pt.archive, tick)
    reason = f"{len(problems)} problem(s) found" if problems else None
    return VerifyReport(path, True, not problems, reason, problems, len(pt.archive.records), pt.archive.size, level)


_VERIFIERS: dict[str, Callable[[str, VerifyLevel, Meter | None], VerifyReport]] = {
    "dcp": _verify_dcp,
    "safetensors": _verify_weights,
    "hf": _verify_weights,
    "torch": _verify_torch,
}
