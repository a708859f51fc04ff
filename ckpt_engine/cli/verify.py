"""``ckpt-engine verify``: completeness and the manifest's sizes and checksums."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

from ._command import Command
from ._output import EXIT_OK, EXIT_PROBLEM, EXIT_UNVERIFIED, JSON_HELP, Progress, plural, print_json, print_lines

if TYPE_CHECKING:
    from .._format.verify import VerifyReport
    from .._inspect.verification import PathVerification


def cmd_verify(args: argparse.Namespace) -> int:
    from .._inspect.files import normalize
    from .._inspect.verification import verify_path

    path = normalize(args.checkpoint)
    result = verify_path(
        path,
        args.level,
        allow_unverified=args.allow_unverified,
        meter=_meter,
    )
    if args.json:
        print_json(_json(result))
    else:
        print_lines(*_text(result, args.level))
    return exit_code(result)


def _meter(path: str, number: int, count: int) -> Progress:
    """The bar of one checkpoint: its bytes hashed, with which checkpoint of how many it is."""
    of = f" (checkpoint {number} of {count})" if count > 1 else ""
    return Progress(f"verifying {os.path.basename(path)}{of}", 0)


def exit_code(result: PathVerification) -> int:
    """0 when everything checks (or is unverified, with ``--allow-unverified``); 3 when the worst is
    a complete checkpoint whose content cannot be checked; 1 when anything is damaged."""
    if result.ok:
        return EXIT_OK
    return EXIT_UNVERIFIED if result.verdict == "unverified" else EXIT_PROBLEM


def _json(result: PathVerification) -> dict[str, Any]:
    from .._inspect.verification import verdict_of

    return {
        "ok": result.ok,
        "verdict": result.verdict,
        "checkpoints": [
            {
                "path": r.path,
                "format": result.kinds.get(r.path, "engine"),
                "verdict": verdict_of(r),
                "ok": r.ok and (verdict_of(r) == "ok" or result.allow_unverified),
                "complete": r.complete,
                "verified": r.verified,
                "unverified_reason": r.unverified_reason,
                "problems": r.problems,
                "files": r.files,
                "bytes": r.bytes,
                **({"rank_local": _parts_json(result, r.path)} if r.path in result.parts else {}),
            }
            for r in result.reports
        ],
        "problems": result.problems,
    }


def _parts_json(result: PathVerification, path: str) -> dict[str, Any]:
    return {name: part.to_json() for name, part in result.parts[path].items()}


def _text(result: PathVerification, level: str) -> list[str]:
    from .._inspect.verification import verdict_of

    lines: list[str] = []
    for r in result.reports:
        if r.ok and r.path in result.parts:
            lines += _part_text(result, r, level)
        elif not r.ok:
            lines += [f"FAILED  {r.path}", *(f"  {p}" for p in r.problems or [r.unverified_reason or "incomplete"])]
        elif verdict_of(r) == "unverified" and not result.allow_unverified:
            lines.append(f"UNVERIFIED {r.path}: {_unverified(r)}")
        elif r.verified:
            lines.append(f"ok      {r.path}: complete, {_verified(result.kinds.get(r.path, 'engine'), level, r)}")
        elif result.kinds.get(r.path, "engine") == "engine":
            lines.append(
                f"ok      {r.path}: complete (not verified against a manifest: {r.unverified_reason or 'no manifest'})"
            )
        else:
            lines.append(f"ok      {r.path}: complete (checksums not checked: {r.unverified_reason})")
    lines += [f"FAILED  {p}" for p in result.problems]
    return lines + _summary(result)


def _summary(result: PathVerification) -> list[str]:
    from .._inspect.verification import verdict_of

    reports = result.reports
    if not reports:
        return [f"no checkpoints in {result.path}"]
    if len(reports) == 1:
        return []
    verdicts = [verdict_of(r) for r in reports]
    bad, unverified = verdicts.count("damaged"), verdicts.count("unverified")
    good = len(reports) - bad - (0 if result.allow_unverified else unverified)
    tail = (f", {unverified} unverified" if unverified and not result.allow_unverified else "") + (
        f", {bad} failed" if bad else ""
    )
    folder = f"; the folder itself has {len(result.problems)} problem(s) (FAILED above)" if result.problems else ""
    return [f"{good} of {len(reports)} checkpoints ok{tail}{folder}"]


def _unverified(r: VerifyReport) -> str:
    """Why a complete checkpoint's content could not be checked, and what to do about it."""
    from .._inspect.files import human_bytes

    return (
        f"complete, sizes and structure check ({plural(r.files, 'file')}, {human_bytes(r.bytes)}); no checksums "
        f"to check its content against ({r.unverified_reason or 'no manifest'}); --allow-unverified accepts that"
    )


def _part_text(result: PathVerification, r: VerifyReport, level: str) -> list[str]:
    """A checkpoint that is one rank's part: ok as that part, never called the whole checkpoint."""
    parts = result.parts[r.path]
    kind = result.kinds.get(r.path, "engine")
    checked = _verified(kind, level, r) if r.verified else f"not verified against a manifest: {r.unverified_reason}"
    first = next(iter(parts.values()))
    whole = all(p.whole for p in parts.values())
    what = "holds every element of its tensors" if whole else "not the whole checkpoint"
    lines = [f"ok      {r.path}: {first.who} of a rank-local checkpoint (the node-local tier), {what}; {checked}"]
    return lines + [f"  {name}: {part.describe()}" for name, part in parts.items() if not part.whole]


def _verified(kind: str, level: str, r: VerifyReport) -> str:
    """What a verified report checked, by format."""
    from .._inspect.files import human_bytes

    size = human_bytes(r.bytes)
    if kind == "torch":
        if level == "checksums":
            return f"every record matches the CRC-32 of its zip directory ({plural(r.files, 'record')}, {size})"
        return f"every tensor's storage record is there, as large as it needs ({plural(r.files, 'record')}, {size})"
    if kind in ("safetensors", "hf"):
        return f"the headers describe every byte of the files ({plural(r.files, 'file')}, {size})"
    what = "checksums" if level == "checksums" else "sizes"
    return f"{what} match the manifest ({r.files} files, {size})"


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
        help="at --level checksums, pass (exit code 0) a complete checkpoint whose checksums cannot be checked "
        "(no manifest, a sizes-only or newer one, a format without checksums); by default it is UNVERIFIED, "
        "exit code 3",
    )
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


COMMAND = Command(
    name="verify",
    summary="check that checkpoints are complete and match their manifest",
    example="ckpt-engine verify runs/exp1/checkpoints/iter_000000020\n"
    "ckpt-engine verify runs/exp1/checkpoints      # every checkpoint in the folder",
    description="Checks completeness (every component's .metadata and every byte range it names) and, "
    "where the engine's manifest exists, file sizes and checksums. Exit code 0 when everything "
    "checks, 1 when anything is damaged, 3 when nothing is damaged but some checkpoint's content holds "
    "no checksums to check it against (UNVERIFIED). CHECKPOINT may be a save folder: then every "
    "checkpoint in it is verified. It may also be a "
    "DCP folder, a safetensors file, a Hugging Face folder or a torch.save file (.pt, .pth, .bin): headers "
    "and records are checked against the file's size, and a torch.save file's CRC-32 checksums at --level "
    "checksums (safetensors and DCP folders hold none: UNVERIFIED; --level sizes, or --allow-unverified).",
    add_arguments=add_arguments,
    run=cmd_verify,
)
