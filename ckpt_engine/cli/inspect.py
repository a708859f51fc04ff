"""``ckpt-engine inspect``: every key of a checkpoint with dtype, shape, shards and bytes."""

from __future__ import annotations

import argparse
from typing import Any

from ._command import Command
from ._output import EXIT_OK, JSON_HELP, TRUST_HELP, plural, print_json, print_lines


def cmd_inspect(args: argparse.Namespace) -> int:
    from .._format.manifest import verify_checkpoint
    from .._inspect.reader import (
        ComponentReader,
        Unreadable,
        human_bytes,
        match_keys,
        prefix_of,
        resolve,
        summarize_value,
    )
    from .._inspect.reader import table as make_table

    target = resolve(args.checkpoint, args.component or ())
    report = verify_checkpoint(target.checkpoint, level="sizes")
    out: dict[str, Any] = {"checkpoint": target.checkpoint, "complete": report.complete, "components": {}}
    lines = [f"checkpoint {target.describe()}"]
    if not report.complete or report.problems:
        lines.append(f"warning: {report.problems[0] if report.problems else 'incomplete'}")
    for name, cdir in target.components.items():
        reader = ComponentReader(cdir, args.trust)
        keys = match_keys(reader.keys, args.keys or ())
        values: dict[str, Any] = {}
        small = [k for k in keys if not reader.keys[k].is_tensor and reader.keys[k].stored_bytes <= 65536]
        if small and not args.no_values:
            try:
                values = reader.read(small)
            except Exception as err:  # a damaged data file: still show the metadata
                values = dict.fromkeys(small, Unreadable(_first_line(err), needs_trust=False))
        infos = [reader.keys[k] for k in keys]
        tensors = [i for i in infos if i.is_tensor]
        total = sum(i.stored_bytes for i in infos)
        prefixes: dict[str, list[int]] = {}
        for i in infos:
            agg = prefixes.setdefault(prefix_of(i.key), [0, 0, 0])
            agg[0] += 1
            agg[1] += i.numel if i.is_tensor else 0
            agg[2] += i.stored_bytes
        out["components"][name] = {
            "path": cdir,
            "keys": [
                {
                    "key": i.key,
                    "kind": "tensor" if i.is_tensor else "value",
                    "dtype": i.dtype_name if i.is_tensor else None,
                    "shape": list(i.shape) if i.is_tensor else None,
                    "shards": i.shards,
                    "bytes": i.stored_bytes,
                    **({"value": summarize_value(values[i.key], 200)} if i.key in values else {}),
                }
                for i in infos
            ],
            "tensors": len(tensors),
            "values": len(infos) - len(tensors),
            "numel": sum(i.numel for i in tensors),
            "bytes": total,
            "prefixes": {p: {"keys": a[0], "numel": a[1], "bytes": a[2]} for p, a in prefixes.items()},
        }
        filt = f" matching {', '.join(args.keys)}" if args.keys else ""
        lines += [
            "",
            f"{name}: {plural(len(tensors), 'tensor')} ({sum(i.numel for i in tensors):,} elements), "
            f"{plural(len(infos) - len(tensors), 'other value')}{filt}, {human_bytes(total)}",
        ]
        if args.summary:
            pass
        elif infos:
            rows = [
                [
                    i.key,
                    i.dtype_name if i.is_tensor else "value",
                    str(list(i.shape)) if i.is_tensor else summarize_value(values[i.key]) if i.key in values else "",
                    str(i.shards) if i.is_tensor else "",
                    human_bytes(i.stored_bytes),
                ]
                for i in infos
            ]
            lines += [
                "  " + row
                for row in make_table(rows, ["key", "dtype", "shape / value", "shards", "bytes"], right=(3, 4))
            ]
        grouped = {p: a for p, a in prefixes.items() if any(i.key.startswith(p + ".") for i in infos)}
        if len(prefixes) > 1 and grouped:
            parts = [
                f"{p}.* {a[0]} keys {human_bytes(a[2])}" if p in grouped else f"{p} {human_bytes(a[2])}"
                for p, a in sorted(prefixes.items())
            ]
            lines.append("  by prefix: " + ", ".join(parts))
    if args.json:
        print_json(out)
    else:
        print_lines(*lines)
    return EXIT_OK


def _first_line(err: BaseException) -> str:
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    return text if len(text) <= 120 else text[:117] + "..."


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
    summary="every key of a checkpoint: dtype, shape, shards, bytes",
    example="ckpt-engine inspect runs/exp1/checkpoints/iter_000000020 --component model --keys '*.weight'",
    description="Every key with dtype, global shape, number of stored shards and bytes; small non-tensor "
    "values shown (a value weights_only refuses as a short placeholder; --trust reads it); totals "
    "per component and per top-level prefix. CHECKPOINT may be a checkpoint folder, "
    "one component folder, or a save folder (its latest checkpoint).",
    add_arguments=add_arguments,
    run=cmd_inspect,
)
