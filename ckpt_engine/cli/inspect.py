"""``ckpt-engine inspect``: every key of a checkpoint with dtype, shape, shards and bytes."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._command import Command
from ._output import EXIT_OK, JSON_HELP, TRUST_HELP, plural, print_json, print_lines

if TYPE_CHECKING:
    from .._inspect.contents import CheckpointContents, ComponentContents
    from .._inspect.keys import KeyInfo


def cmd_inspect(args: argparse.Namespace) -> int:
    from .._inspect.contents import read_contents
    from .._inspect.target import resolve

    target = resolve(args.checkpoint, args.component or ())
    contents = read_contents(target, args.keys or (), read_values=not args.no_values, trust=args.trust)
    if args.json:
        print_json(contents.to_json())
    else:
        print_lines(*_text(contents, args.keys or (), summary=args.summary))
    return EXIT_OK


def _text(contents: CheckpointContents, patterns: Sequence[str], *, summary: bool) -> list[str]:
    from .._inspect.files import human_bytes

    lines = [f"checkpoint {contents.target.describe()}"]
    if contents.reused_bytes:
        lines.append(
            f"incremental save: wrote {human_bytes(contents.total_bytes - contents.reused_bytes)}, carried "
            f"{human_bytes(contents.reused_bytes)} in {plural(contents.reused_files, 'unchanged file')} over from "
            "the previous checkpoint"
        )
    if not contents.complete or contents.problems:
        lines.append(f"warning: {contents.problems[0] if contents.problems else 'incomplete'}")
    filt = f" matching {', '.join(patterns)}" if patterns else ""
    for comp in contents.components:
        tensors = comp.tensors
        lines += [
            "",
            f"{comp.name}: {plural(len(tensors), 'tensor')} ({comp.numel:,} elements), "
            f"{plural(len(comp.infos) - len(tensors), 'other value')}{filt}, {human_bytes(comp.bytes)}",
        ]
        if comp.part is not None:
            lines.append(f"  {comp.part.describe()}")
        if not summary and comp.infos:
            lines += _key_table(comp)
        lines += _prefix_line(comp)
    return lines


def _key_table(comp: ComponentContents) -> list[str]:
    from .._inspect.files import human_bytes, shown, table
    from .._inspect.keys import summarize_value

    held = comp.part is not None and not comp.part.whole  # a column of the elements held, for one rank's part
    rows = [
        [
            shown(i.key),  # a stored name: what a terminal would act on, escaped
            i.dtype_name if i.is_tensor else "value",
            str(list(i.shape)) if i.is_tensor else summarize_value(comp.values[i.key]) if i.key in comp.values else "",
            str(i.shards) if i.is_tensor else "",
            *([_held(i)] if held else []),
            human_bytes(i.stored_bytes),
        ]
        for i in comp.infos
    ]
    head = ["key", "dtype", "shape / value", "shards", *(["held"] if held else []), "bytes"]
    return ["  " + row for row in table(rows, head, right=tuple(range(3, len(head))))]


def _held(i: KeyInfo) -> str:
    """The elements of a tensor one rank's part holds: ``all``, or ``64 of 128``."""
    if not i.is_tensor:
        return ""
    return "all" if i.held is None else f"{i.held:,} of {i.numel:,}"


def _prefix_line(comp: ComponentContents) -> list[str]:
    """``by prefix:`` totals, when there is more than one prefix and one of them groups keys."""
    from .._inspect.files import human_bytes, shown

    prefixes = comp.prefixes
    grouped = {p for p in prefixes if any(i.key.startswith(p + ".") for i in comp.infos)}
    if len(prefixes) <= 1 or not grouped:
        return []
    parts = [
        f"{shown(p)}.* {a.keys} keys {human_bytes(a.bytes)}" if p in grouped else f"{shown(p)} {human_bytes(a.bytes)}"
        for p, a in sorted(prefixes.items(), key=lambda pa: pa[0])
    ]
    return ["  by prefix: " + ", ".join(parts)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument("--component", action="append", metavar="C", help="only this component (repeatable)")
    parser.add_argument("--keys", action="append", metavar="GLOB", help="only keys matching this glob (repeatable)")
    parser.add_argument("--summary", action="store_true", help="totals only, no per-key table")
    parser.add_argument("--no-values", action="store_true", help="do not read non-tensor values")
    parser.add_argument("--trust", action="store_true", help=TRUST_HELP)
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


COMMAND = Command(
    name="inspect",
    summary="every key of a checkpoint, safetensors, Hugging Face or torch.save file: dtype, shape, bytes",
    example="ckpt-engine inspect runs/exp1/checkpoints/iter_000000020 --component model --keys '*.weight'\n"
    "ckpt-engine inspect model.safetensors      # also a Hugging Face folder, a .pt file, a DCP folder",
    description="Every key with dtype, global shape, number of stored shards and bytes; small non-tensor "
    "values shown (a value weights_only refuses as a short placeholder; --trust reads it); totals "
    "per component and per top-level prefix. CHECKPOINT may be a checkpoint folder, "
    "one component folder, or a save folder (its latest checkpoint); or a DCP folder the engine did not "
    "write, a safetensors file, a Hugging Face folder (one file, or shards and their index) or a torch.save "
    "file (.pt, .pth, .bin), read without torch and without unpickling.",
    add_arguments=add_arguments,
    run=cmd_inspect,
)
