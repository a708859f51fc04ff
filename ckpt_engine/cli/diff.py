"""``ckpt-engine diff``: two checkpoints compared key by key, streamed."""

from __future__ import annotations

import argparse
import math
from typing import TYPE_CHECKING

from ._command import Command
from ._output import EXIT_OK, EXIT_PROBLEM, JSON_HELP, TRUST_HELP, Progress, parse_size, print_json, print_lines

if TYPE_CHECKING:
    from .._inspect.compare import ComponentDiff


def cmd_diff(args: argparse.Namespace) -> int:
    from .._inspect.compare import compare_checkpoints
    from .._inspect.target import resolve

    a, b = resolve(args.a), resolve(args.b)
    result = compare_checkpoints(
        a,
        b,
        args.component or (),
        args.keys or (),
        atol=args.atol,
        budget=args.budget,
        trust=args.trust,
        meter=lambda name, total: Progress(f"comparing {name}", total, noun="tensor"),
    )
    if args.json:
        print_json(result.to_json())
    else:
        lines = [f"a: {a.describe()}", f"b: {b.describe()}"]
        for comp in result.components:
            lines += ["", *_component_text(comp, args.limit)]
        skipped = [c.name for c in result.components if c.not_compared]
        same = "the checkpoints are identical"
        if skipped:
            same = f"the checkpoints are identical in what both hold (not compared: {', '.join(skipped)})"
        differ = "the checkpoints differ"
        partial = sum(len(c.partial) for c in result.components)
        if partial:
            held = f"{partial} tensor(s) not compared: a side holds only part of them (one rank's part)"
            others = any(not c.not_compared and _differences(c) > len(c.partial) for c in result.components)
            differ = f"the checkpoints differ; {held}" if others else f"the checkpoints are not identical: {held}"
        print_lines(*lines, "", same if result.identical else differ)
    return EXIT_OK if result.identical else EXIT_PROBLEM


def _differences(comp: ComponentDiff) -> int:
    """How many differences ``comp`` lists, tensors held only in part among them."""
    return (
        len(comp.only_a)
        + len(comp.only_b)
        + len(comp.changed)
        + len(comp.diffs)
        + len(comp.value_changes)
        + len(comp.partial)
        + (comp.only_in is not None)
    )


def _component_text(comp: ComponentDiff, limit: int) -> list[str]:
    from .._inspect.files import shown

    if comp.only_in is not None:
        why = f"; not compared ({comp.not_compared})" if comp.not_compared else ""
        return [f"{comp.name}: only in {comp.only_in}{why}"]
    ndiff = len(comp.diffs) + len(comp.value_changes)
    counts = [
        (len(comp.only_a), "only in a"),
        (len(comp.only_b), "only in b"),
        (len(comp.changed), "shape/dtype changed"),
        (ndiff, "keys differ" if ndiff > 1 else "key differs"),
        (len(comp.partial), "held only in part"),
    ]
    found = ", ".join(f"{n} {what}" for n, what in counts if n)
    lines = [f"{comp.name}: {found or 'identical'} ({comp.equal} of {comp.common} common keys equal)"]
    lines += [f"  {side} is {part.describe()}" for side, part in comp.parts.items()]
    # Stored names, escaped: what a terminal would act on (ESC, BEL, CR) is printed as repr writes it.
    lines += _limited([f"  not compared: {shown(k)}: a side holds only part of it" for k in comp.partial], limit)
    lines += _limited([f"  only in a: {shown(k)}" for k in comp.only_a], limit)
    lines += _limited([f"  only in b: {shown(k)}" for k in comp.only_b], limit)
    lines += _limited(
        [
            f"  tied: {shown(k)} (only in {side}) equals {shown(twin)} there, compared as one tensor "
            "(tied weights are stored once)"
            for k, twin, side in comp.tied
        ],
        limit,
    )
    lines += _limited([f"  changed: {shown(k)}: {x} -> {y}" for k, x, y in comp.changed], limit)
    ranked = sorted(comp.diffs.items(), key=lambda kv: (-kv[1], kv[0]))
    lines += _limited([f"  differs: {shown(k)}: max |a-b| = {d:.6g}" for k, d in ranked], limit)
    lines += _limited([f"  differs: {shown(k)}: {x} -> {y}" for k, (x, y) in comp.value_changes.items()], limit)
    return lines


def _limited(lines: list[str], limit: int) -> list[str]:
    if limit <= 0 or len(lines) <= limit:
        return lines
    return [*lines[:limit], f"  ... and {len(lines) - limit} more (--limit 0 lists all)"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A")
    parser.add_argument("b", metavar="B")
    parser.add_argument("--component", action="append", metavar="C", help="only this component (repeatable)")
    parser.add_argument("--keys", action="append", metavar="GLOB", help="only keys matching this glob (repeatable)")
    parser.add_argument(
        "--atol", type=_tolerance, default=0.0, help="differences up to this count as equal (default 0)"
    )
    parser.add_argument("--limit", type=int, default=20, help="list at most this many keys per kind (0: all)")
    parser.add_argument("--trust", action="store_true", help=TRUST_HELP)
    parser.add_argument("--budget", type=parse_size, default="64M", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


COMMAND = Command(
    name="diff",
    summary="compare two checkpoints key by key (streamed), of any format inspect reads",
    example="ckpt-engine diff runs/exp1/checkpoints/iter_000000010 runs/exp1/checkpoints/iter_000000020\n"
    "ckpt-engine diff runs/exp1/checkpoints hf_model/     # a checkpoint against its Hugging Face export",
    description="Per component: keys only in A, only in B, shape or dtype changed, and for common keys "
    "the largest absolute difference; other values compare by their stored bytes, then by value. "
    "Reads one batch of tensors at a time from A, then the same from B: memory is bounded "
    "by the largest tensor, never a whole checkpoint. A or B may be of any format inspect reads; one that "
    "holds one state dict (a file, a Hugging Face or DCP folder) is compared with the other's model "
    "component (--component names another), and the other's other components are listed as not "
    "compared. Exit code 0 when identical, 1 when they differ.",
    add_arguments=add_arguments,
    run=cmd_diff,
)


def _tolerance(text: str) -> float:
    """``--atol``: a finite number at least 0 (a negative or NaN one made a checkpoint differ from itself)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}: the tolerance must be a finite number >= 0")
    return value
