"""A save folder's checkpoints as rows (iteration, components, size, files, status, latest, and
for incremental saves the bytes each one wrote and carried over), the folder's real disk use,
and their text table: what ``ckpt-engine ls`` prints and the demo shows, computed once."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from .._format.layout import component_dirs, find_leftovers
from .._format.names import LATEST_FILE, iter_dirname, parse_iteration
from .._format.pointer import list_checkpoints, read_latest
from .._format.verify import verify_checkpoint
from .._storage.urls import is_url
from ..errors import CkptEngineError
from .files import disk_usage, human_bytes, shared_once_usage, table, uncommitted_dirs

__all__ = ["SaveDirListing", "list_save_dir", "listing_table"]


@dataclass
class SaveDirListing:
    """One row per checkpoint (committed or interrupted) of ``save_dir``, oldest first."""

    save_dir: str
    latest: str | None
    rows: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: Bytes the folder's files really use, each file shared between checkpoints (incremental
    #: saves: hard links) counted once; ``None`` for an object store (copies there are copies).
    disk_bytes: int | None = None

    @property
    def incremental(self) -> bool:
        """Some checkpoint carried files over from an earlier one (``incremental`` saves)."""
        return any(r.get("reused", 0) for r in self.rows)

    @property
    def problem(self) -> bool:
        """Something is wrong: a warning, or an incomplete or corrupt checkpoint."""
        return bool(self.warnings) or any(r["status"] in ("INCOMPLETE", "CORRUPT") for r in self.rows)


class ListingMeter(Protocol):
    """Where each listed checkpoint's bytes go (the command line's progress bar)."""

    def advance(self, n: int) -> None: ...

    def close(self) -> None: ...


def list_save_dir(
    save_dir: str, *, verify: bool = False, meter: Callable[[int], ListingMeter] | None = None
) -> SaveDirListing:
    """The rows of ``save_dir``; with ``verify``, checksums are compared too (reads all data).
    ``meter(checkpoints)`` gets each checkpoint's bytes once its row is read (a progress bar)."""
    warnings: list[str] = []
    try:
        latest = read_latest(save_dir)
    except CkptEngineError as err:
        latest = None
        warnings.append(f"warning: {err}")
    level: Literal["sizes", "checksums"] = "checksums" if verify else "sizes"
    committed = _committed(save_dir)
    bar = meter(len(committed)) if meter is not None else None
    rows = []
    try:
        for iteration, path, note in committed:
            rows.append(_committed_row(iteration, path, note, level, latest))
            if bar is not None:
                bar.advance(int(rows[-1].get("bytes") or 0))
    finally:
        if bar is not None:
            bar.close()
    rows += [_uncommitted_row(iteration, path) for iteration, path in uncommitted_dirs(save_dir)]
    rows.sort(key=lambda r: (r["iteration"], r["status"] == "uncommitted"))
    if latest is not None and not any(r["latest"] for r in rows):
        warnings.append(f"warning: {LATEST_FILE} names {latest!r}, which does not exist")
    for r in rows:
        if r["latest"] and r["status"] in ("INCOMPLETE", "CORRUPT"):
            warnings.append(f"warning: {LATEST_FILE} names {r['name']}, which is {r['status'].lower()}")
    disk = None if is_url(save_dir) else shared_once_usage(save_dir)
    return SaveDirListing(save_dir, latest, rows, warnings, disk)


def _committed_row(
    iteration: int, path: str, note: str | None, level: Literal["sizes", "checksums"], latest: str | None
) -> dict[str, Any]:
    report = verify_checkpoint(path, level=level)
    reused = report.reused_bytes
    if report.corrupt or (report.complete and report.problems):
        status = "CORRUPT"  # a file is damaged (a .metadata failing its checksum), not missing
    elif not report.complete:
        status = "INCOMPLETE"
    elif report.verified:
        status = "verified"
    else:
        status = "complete"
    return {
        "iteration": iteration,
        "name": iter_dirname(iteration),
        "path": path,
        "components": component_dirs(path),
        # Counted as `verify` counts them: the checkpoint's data and metadata files.
        "bytes": report.bytes,
        # Incremental saves: what this save wrote, and what it carried over from the previous one.
        "written": max(report.bytes - reused, 0),
        "reused": reused,
        "files": report.files,
        "status": status,
        "verified": report.verified,
        "problems": list(report.problems),
        "latest": iter_dirname(iteration) == latest,
        "note": note,
    }


def _uncommitted_row(iteration: int, path: str) -> dict[str, Any]:
    size, files = disk_usage(path)
    return {
        "iteration": iteration,
        "name": os.path.basename(path),
        "path": path,
        "components": component_dirs(path),
        "bytes": size,
        "written": size,
        "reused": 0,
        "files": files,
        "status": "uncommitted",
        "verified": False,
        "problems": [
            "an interrupted save: never committed, never loaded; the next save of "
            f"{iter_dirname(iteration)} replaces it"
        ],
        "latest": False,
        "note": None,
    }


def listing_table(listing: SaveDirListing) -> list[str]:
    """The rows as an aligned text table; with incremental saves, two more columns (what each
    save wrote and carried over) and the folder's disk use under it."""
    if not listing.incremental:
        body = [
            [
                str(r["iteration"]),
                r["name"],
                ",".join(r["components"]) or "-",
                human_bytes(r["bytes"]),
                str(r["files"]),
                r["status"],
                "<- latest" if r["latest"] else "",
            ]
            for r in listing.rows
        ]
        return table(body, ["iteration", "checkpoint", "components", "size", "files", "status", ""], right=(0, 3, 4))
    body = [
        [
            str(r["iteration"]),
            r["name"],
            ",".join(r["components"]) or "-",
            human_bytes(r["bytes"]),
            human_bytes(r["written"]),
            human_bytes(r["reused"]),
            str(r["files"]),
            r["status"],
            "<- latest" if r["latest"] else "",
        ]
        for r in listing.rows
    ]
    header = ["iteration", "checkpoint", "components", "size", "written", "reused", "files", "status", ""]
    lines = table(body, header, right=(0, 3, 4, 5, 6))
    if listing.disk_bytes is not None:
        total = sum(r["bytes"] for r in listing.rows)
        lines.append(
            f"disk use: {human_bytes(listing.disk_bytes)} for {human_bytes(total)} of checkpoints "
            "(files shared between checkpoints counted once)"
        )
    return lines


def _committed(save_dir: str) -> list[tuple[int, str, str | None]]:
    """``(iteration, folder, note)`` of every committed checkpoint, oldest first. A checkpoint whose
    re-save crashed between its two renames sits in its ``.replaced`` folder until the next engine
    start moves it back: it is listed from there, with a note."""
    found: list[tuple[int, str, str | None]] = [(i, p, None) for i, p in list_checkpoints(save_dir)]
    present = {i for i, _, _ in found}
    for lo in find_leftovers(save_dir):
        iteration = parse_iteration(lo.checkpoint)
        if lo.kind == "replaced" and iteration is not None and iteration not in present:
            present.add(iteration)
            found.append(
                (
                    iteration,
                    lo.path,
                    f"in {os.path.basename(lo.path)}: a re-save of it was interrupted between its two renames; "
                    "the next engine started on this folder moves it back (loads see it then)",
                )
            )
    return sorted(found)
