"""``ckpt-engine ls``: the checkpoints of a save folder, one row each."""

from __future__ import annotations

import argparse
import os
from typing import Any, Literal

from ..errors import UsageError
from ._command import Command
from ._output import EXIT_OK, EXIT_PROBLEM, JSON_HELP, print_json, print_lines


def cmd_ls(args: argparse.Namespace) -> int:
    from .._format.layout import component_dirs
    from .._format.manifest import verify_checkpoint
    from .._format.names import LATEST_FILE, iter_dirname
    from .._format.pointer import list_checkpoints, read_latest
    from .._inspect.reader import (
        disk_usage,
        exists,
        human_bytes,
        is_component_dir,
        isdir,
        normalize,
        table,
        uncommitted_dirs,
    )
    from ..errors import CheckpointNotFoundError, CkptEngineError

    save_dir = normalize(args.save_dir)
    if not exists(save_dir):
        raise CheckpointNotFoundError(f"{save_dir} does not exist")
    if not isdir(save_dir):
        raise CheckpointNotFoundError(f"{save_dir} is a file, not a save folder")
    if is_component_dir(save_dir) or (not list_checkpoints(save_dir) and _looks_like_checkpoint(save_dir)):
        raise UsageError(f"{save_dir} is a checkpoint, not a save folder; try: ckpt-engine inspect {save_dir}")
    warnings: list[str] = []
    try:
        latest = read_latest(save_dir)
    except CkptEngineError as err:
        latest = None
        warnings.append(f"warning: {err}")
    level: Literal["sizes", "checksums"] = "checksums" if args.verify else "sizes"
    rows: list[dict[str, Any]] = []
    for iteration, path, note in _committed(save_dir):
        report = verify_checkpoint(path, level=level)
        if not report.complete:
            status = "INCOMPLETE"
        elif report.problems:
            status = "CORRUPT"
        elif report.verified:
            status = "verified"
        else:
            status = "complete"
        rows.append(
            {
                "iteration": iteration,
                "name": iter_dirname(iteration),
                "path": path,
                "components": component_dirs(path),
                # Counted as `verify` counts them: the checkpoint's data and metadata files.
                "bytes": report.bytes,
                "files": report.files,
                "status": status,
                "verified": report.verified,
                "problems": list(report.problems),
                "latest": iter_dirname(iteration) == latest,
                "note": note,
            }
        )
    for iteration, path in uncommitted_dirs(save_dir):
        size, files = disk_usage(path)
        rows.append(
            {
                "iteration": iteration,
                "name": os.path.basename(path),
                "path": path,
                "components": component_dirs(path),
                "bytes": size,
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
        )
    rows.sort(key=lambda r: (r["iteration"], r["status"] == "uncommitted"))
    if latest is not None and not any(r["latest"] for r in rows):
        warnings.append(f"warning: {LATEST_FILE} names {latest!r}, which does not exist")
    for r in rows:
        if r["latest"] and r["status"] in ("INCOMPLETE", "CORRUPT"):
            warnings.append(f"warning: {LATEST_FILE} names {r['name']}, which is {r['status'].lower()}")
    problem = bool(warnings) or any(r["status"] in ("INCOMPLETE", "CORRUPT") for r in rows)
    code = EXIT_PROBLEM if problem else EXIT_OK
    if args.json:
        print_json(
            {"save_dir": save_dir, "latest": latest, "checkpoints": rows, "warnings": warnings, "ok": not problem}
        )
        return code
    if not rows:
        print_lines(f"no checkpoints in {save_dir}", *warnings)
        return code
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
        for r in rows
    ]
    print_lines(*table(body, ["iteration", "checkpoint", "components", "size", "files", "status", ""], right=(0, 3, 4)))
    for r in rows:
        if r["note"]:
            print_lines(f"{r['name']}: {r['note']}")
        if r["status"] != "complete" and r["problems"]:
            print_lines(f"{r['name']}: {r['problems'][0]}")
    if not args.verify and any(r["status"] == "verified" for r in rows):
        print_lines("(verified: sizes match the manifest; `ckpt-engine ls --verify` also compares checksums)")
    if any(r["status"] == "complete" for r in rows):
        print_lines(
            "(complete: no manifest, so no sizes or checksums to compare; every file the metadata names is there)"
        )
    print_lines(*warnings)
    return code


def _committed(save_dir: str) -> list[tuple[int, str, str | None]]:
    """``(iteration, folder, note)`` of every committed checkpoint, oldest first. A checkpoint whose
    re-save crashed between its two renames sits in its ``.replaced`` folder until the next engine
    start moves it back: it is listed from there, with a note."""
    from .._format.layout import find_leftovers
    from .._format.names import parse_iteration
    from .._format.pointer import list_checkpoints

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


def _looks_like_checkpoint(path: str) -> bool:
    from .._inspect.reader import is_component_dir
    from .._storage.store import open_store

    try:
        return any(is_component_dir(os.path.join(path, n)) for n, d in open_store(path).list_dir(path) if d)
    except OSError:
        return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("save_dir", metavar="SAVE_DIR", help="folder with iter_XXXXXXXXX/ checkpoints")
    parser.add_argument(
        "--verify", action="store_true", help="also check checksums against the manifest (reads all data)"
    )
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


COMMAND = Command(
    name="ls",
    summary="list the checkpoints of a save folder",
    example="ckpt-engine ls runs/exp1/checkpoints\n  ckpt-engine ls runs/exp1/checkpoints --verify --json",
    description="One row per checkpoint: iteration, components, size, file count, status (complete, "
    "verified, INCOMPLETE, CORRUPT, or uncommitted for an interrupted save) and which one "
    "latest_checkpoint.txt names.",
    add_arguments=add_arguments,
    run=cmd_ls,
)
