"""``ckpt-engine verify``: completeness and the manifest's sizes and checksums."""

from __future__ import annotations

import argparse
import os

from ..errors import UsageError
from ._command import Command
from ._output import EXIT_OK, EXIT_PROBLEM, JSON_HELP, Progress, print_json, print_lines


def cmd_verify(args: argparse.Namespace) -> int:
    from .._engine.load_guard import fail_unverified
    from .._format.layout import component_dirs
    from .._format.manifest import verify_checkpoint
    from .._format.names import LATEST_FILE
    from .._format.pointer import list_checkpoints, read_latest
    from .._inspect.reader import exists, human_bytes, is_component_dir, is_save_dir, isdir, normalize
    from .._storage.store import open_store
    from ..errors import CheckpointNotFoundError

    path = normalize(args.checkpoint)
    if not exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not isdir(path):
        raise CheckpointNotFoundError(f"{path} is a file, not a checkpoint folder")
    if is_component_dir(path):
        raise UsageError(f"{path} is one component; verify its checkpoint: ckpt-engine verify {os.path.dirname(path)}")
    extra_problems: list[str] = []
    if is_save_dir(path):
        paths = [p for _, p in list_checkpoints(path)]
        latest = read_latest(path)
        if latest is not None and not isdir(os.path.join(path, latest)):
            extra_problems.append(f"{os.path.join(path, LATEST_FILE)} names {latest!r}, which does not exist")
    else:
        if not open_store(path).list_dir(path):
            raise CheckpointNotFoundError(f"{path} is empty: not a checkpoint")
        if not component_dirs(path):
            raise CheckpointNotFoundError(
                f"{path} is not a checkpoint: it has no component folders (model/, optim/, ...) "
                "and no iter_* checkpoints"
            )
        paths = [path]
    results = []
    for p in paths:
        bar = Progress(f"verifying {os.path.basename(p)}", 0)
        try:
            results.append(verify_checkpoint(p, level=args.level, progress=bar.update))
        finally:
            bar.close()
    results = [fail_unverified(r, args.allow_unverified) for r in results]  # checksums fail closed
    ok = all(r.ok for r in results) and not extra_problems
    if args.json:
        print_json(
            {
                "ok": ok,
                "checkpoints": [
                    {
                        "path": r.path,
                        "ok": r.ok,
                        "complete": r.complete,
                        "verified": r.verified,
                        "unverified_reason": r.unverified_reason,
                        "problems": r.problems,
                        "files": r.files,
                        "bytes": r.bytes,
                    }
                    for r in results
                ],
                "problems": extra_problems,
            }
        )
        return EXIT_OK if ok else EXIT_PROBLEM
    for r in results:
        if not r.ok:
            print_lines(f"FAILED  {r.path}", *(f"  {p}" for p in r.problems or [r.unverified_reason or "incomplete"]))
        elif r.verified:
            what = "checksums" if args.level == "checksums" else "sizes"
            print_lines(
                f"ok      {r.path}: complete, {what} match the manifest ({r.files} files, {human_bytes(r.bytes)})"
            )
        else:
            why = r.unverified_reason or "no manifest"
            print_lines(f"ok      {r.path}: complete (not verified against a manifest: {why})")
    print_lines(*(f"FAILED  {p}" for p in extra_problems))
    if not results:
        print_lines(f"no checkpoints in {path}")
    elif len(results) > 1:
        bad = sum(not r.ok for r in results)
        print_lines(f"{len(results) - bad} of {len(results)} checkpoints ok" + (f", {bad} failed" if bad else ""))
    return EXIT_OK if ok else EXIT_PROBLEM


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument(
        "--level",
        choices=("sizes", "checksums"),
        default="checksums",
        help="how far to check the manifest (default: checksums, which reads every byte)",
    )
    parser.add_argument(
        "--allow-unverified",
        action="store_true",
        help="at --level checksums, pass a complete checkpoint whose checksums cannot be checked (no manifest, "
        "a sizes-only or newer one); by default that fails",
    )
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


COMMAND = Command(
    name="verify",
    summary="check that checkpoints are complete and match their manifest",
    example="ckpt-engine verify runs/exp1/checkpoints/iter_000000020\n"
    "  ckpt-engine verify runs/exp1/checkpoints      # every checkpoint in the folder",
    description="Checks completeness (every component's .metadata and every byte range it names) and, "
    "where the engine's manifest exists, file sizes and checksums. Exit code 0 only when everything "
    "checks. CHECKPOINT may be a save folder: then every checkpoint in it is verified.",
    add_arguments=add_arguments,
    run=cmd_verify,
)
