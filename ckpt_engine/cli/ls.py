"""``ckpt-engine ls``: the checkpoints of a save folder, one row each."""

from __future__ import annotations

import argparse
import os

from ..errors import UsageError
from ._command import Command
from ._output import EXIT_OK, EXIT_PROBLEM, JSON_HELP, print_json, print_lines


def cmd_ls(args: argparse.Namespace) -> int:
    # Listing reads every .metadata for its fields only: into the stand-in records, so that the
    # command never imports torch.distributed.checkpoint (about a second; tests/project/test_import_cost.py).
    from .._format.metadata_types import records_without_dcp
    from .._format.pointer import list_checkpoints
    from .._inspect.files import exists, is_component_dir, isdir, normalize
    from .._inspect.listing import list_save_dir, listing_table
    from ..errors import CheckpointNotFoundError

    save_dir = normalize(args.save_dir)
    if not exists(save_dir):
        raise CheckpointNotFoundError(f"{save_dir} does not exist")
    if not isdir(save_dir):
        raise CheckpointNotFoundError(f"{save_dir} is a file, not a save folder")
    if is_component_dir(save_dir) or (not list_checkpoints(save_dir) and _looks_like_checkpoint(save_dir)):
        raise UsageError(f"{save_dir} is a checkpoint, not a save folder; try: ckpt-engine inspect {save_dir}")
    with records_without_dcp():
        listing = list_save_dir(save_dir, verify=args.verify)
    rows, warnings = listing.rows, listing.warnings
    code = EXIT_PROBLEM if listing.problem else EXIT_OK
    if args.json:
        print_json(
            {
                "save_dir": save_dir,
                "latest": listing.latest,
                "checkpoints": rows,
                "disk_bytes": listing.disk_bytes,
                "warnings": warnings,
                "ok": not listing.problem,
            }
        )
        return code
    if not rows:
        print_lines(f"no checkpoints in {save_dir}", *warnings)
        return code
    print_lines(*listing_table(listing))
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


def _looks_like_checkpoint(path: str) -> bool:
    from .._inspect.files import is_component_dir
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
