"""``ckpt-engine ls``: the checkpoints of a save folder, one row each."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from ._command import Command
from ._output import EXIT_OK, EXIT_PROBLEM, JSON_HELP, Progress, print_json, print_lines

if TYPE_CHECKING:
    from .._inspect.listing import SaveDirListing


def cmd_ls(args: argparse.Namespace) -> int:
    # Listing reads every .metadata for its fields only, into the torch-free stand-in records: the
    # command never imports torch (seconds; tests/project/test_import_cost.py).
    from .._format.metadata_types import records_without_dcp
    from .._inspect.files import normalize
    from .._inspect.listing import list_save_dir

    save_dir = normalize(args.save_dir)
    check_save_dir(save_dir)
    tier = None
    with records_without_dcp():
        listing = list_save_dir(
            save_dir,
            verify=args.verify,
            meter=lambda count: Progress(f"reading {os.path.basename(save_dir)}", 0, items=count, noun="checkpoint"),
        )
        if args.local_dir is not None:
            from .._inspect.tier_listing import list_local_tier

            tier = list_local_tier(normalize(args.local_dir), listing, verify=args.verify)
    if args.json:
        doc = _json(listing)
        if tier is not None:
            doc["local_tier"] = {
                "local_dir": tier.local_dir,
                "iterations": tier.rows,
                "resume": tier.resume,
                "set_aside": tier.set_aside,
                "warnings": tier.warnings,
            }
            doc["ok"] = doc["ok"] and not tier.problem
        print_json(doc)
    else:
        lines = _text(listing, verify=args.verify)
        if tier is not None:
            from .._inspect.tier_listing import local_tier_table

            lines += ["", *local_tier_table(tier)]
        print_lines(*lines)
    return EXIT_PROBLEM if listing.problem or (tier is not None and tier.problem) else EXIT_OK


def check_save_dir(save_dir: str) -> None:
    """Refuse what is no save folder, saying which command reads it."""
    from .._format.pointer import list_checkpoints
    from .._format.safetensors_header import is_weights_folder
    from .._inspect.files import exists, is_component_dir, isdir
    from .._inspect.target import KIND_NAMES, inside_checkpoint, sniff_file
    from .._storage.urls import is_url
    from ..errors import CheckpointNotFoundError

    if not exists(save_dir):
        raise CheckpointNotFoundError(f"{save_dir} does not exist")
    inspect = f"; to look at it: ckpt-engine inspect {save_dir}"
    if not isdir(save_dir):
        kind = sniff_file(save_dir)
        what = f"is {KIND_NAMES[kind]}" if kind else "is a file"
        fix = inspect if kind else ""
        raise CheckpointNotFoundError(
            f"{save_dir} {what}, not a save folder: ls lists the iter_* checkpoints of the folder the engine "
            f"saves to (EngineConfig.save_dir){fix}"
        )
    if is_component_dir(save_dir) or (not list_checkpoints(save_dir) and _looks_like_checkpoint(save_dir)):
        what = "a checkpoint"
        if not is_url(save_dir) and is_weights_folder(save_dir):
            what = KIND_NAMES["hf"]
        elif is_component_dir(save_dir) and not inside_checkpoint(save_dir):
            what = KIND_NAMES["dcp"]
        raise UsageError(f"{save_dir} is {what}, not a save folder; try: ckpt-engine inspect {save_dir}")


def _json(listing: SaveDirListing) -> dict[str, Any]:
    return {
        "save_dir": listing.save_dir,
        "latest": listing.latest,
        "checkpoints": listing.rows,
        "disk_bytes": listing.disk_bytes,
        "warnings": listing.warnings,
        "ok": not listing.problem,
    }


def _text(listing: SaveDirListing, *, verify: bool) -> list[str]:
    from .._inspect.listing import listing_table

    rows = listing.rows
    if not rows:
        return [f"no checkpoints in {listing.save_dir}", *listing.warnings]
    lines = listing_table(listing)
    for r in rows:
        if r["note"]:
            lines.append(f"{r['name']}: {r['note']}")
        if r["status"] != "complete" and r["problems"]:
            lines.append(f"{r['name']}: {r['problems'][0]}")
    if not verify and any(r["status"] == "verified" for r in rows):
        lines.append("(verified: sizes match the manifest; `ckpt-engine ls --verify` also compares checksums)")
    if any(r["status"] == "complete" for r in rows):
        lines.append(
            "(complete: no manifest, so no sizes or checksums to compare; every file the metadata names is there)"
        )
    return [*lines, *listing.warnings]


def _looks_like_checkpoint(path: str) -> bool:
    """A checkpoint folder (component folders in it) or another format ``inspect`` reads."""
    from .._format.safetensors_header import is_weights_folder
    from .._inspect.files import is_component_dir
    from .._storage.store import open_store
    from .._storage.urls import is_url

    if not is_url(path) and is_weights_folder(path):
        return True
    try:
        return any(is_component_dir(os.path.join(path, n)) for n, d in open_store(path).list_dir(path) if d)
    except OSError:
        return False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("save_dir", metavar="SAVE_DIR", help="folder with iter_XXXXXXXXX/ checkpoints")
    parser.add_argument(
        "--verify", action="store_true", help="also check checksums against the manifest (reads all data)"
    )
    parser.add_argument(
        "--local-dir",
        metavar="LOCAL_DIR",
        help="also list this node's local tier (EngineConfig.local_dir): each iteration, the ranks whose "
        "checkpoints are here, whether save_dir holds it too (durable), which step a resume takes and from "
        "which tier, and the copies it sets aside (another run's, or not descended from save_dir's latest)",
    )
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


COMMAND = Command(
    name="ls",
    summary="list the checkpoints of a save folder",
    example="ckpt-engine ls runs/exp1/checkpoints\n  ckpt-engine ls runs/exp1/checkpoints --verify --json\n"
    "  ckpt-engine ls runs/exp1/checkpoints --local-dir /local_nvme/exp1/tier",
    description="One row per checkpoint: iteration, components, size, file count, status (complete, "
    "verified, INCOMPLETE, CORRUPT, or uncommitted for an interrupted save) and which one "
    "latest_checkpoint.txt names.",
    add_arguments=add_arguments,
    run=cmd_ls,
)
