"""``ckpt-engine diff``: two checkpoints compared key by key, streamed."""

from __future__ import annotations

import argparse
from typing import Any

from ..errors import UsageError
from ._command import Command
from ._output import EXIT_OK, EXIT_PROBLEM, JSON_HELP, TRUST_HELP, Progress, parse_size, print_json, print_lines


def _max_abs_diff(a: Any, b: Any) -> float:
    import torch

    if torch.equal(a, b):
        return 0.0
    if a.dtype == torch.bool or b.dtype == torch.bool:
        return float((a.to(torch.int8) != b.to(torch.int8)).any())
    wide = torch.complex128 if a.is_complex() or b.is_complex() else torch.float64
    x, y = a.to(wide), b.to(wide)
    d = (x - y).abs()
    if d.is_complex():
        d = d.real
    both_nan = torch.isnan(x) & torch.isnan(y) if not x.is_complex() else torch.zeros_like(d, dtype=torch.bool)
    d = torch.where(both_nan, torch.zeros_like(d), d)
    d = torch.nan_to_num(d, nan=float("inf"))
    return float(d.max()) if d.numel() else 0.0


def cmd_diff(args: argparse.Namespace) -> int:
    from .._inspect.reader import ComponentReader, batches, match_keys, resolve, summarize_value

    a, b = resolve(args.a), resolve(args.b)
    wanted = args.component or sorted(set(a.components) | set(b.components))
    result: dict[str, Any] = {"a": a.checkpoint, "b": b.checkpoint, "components": {}}
    lines = [f"a: {a.describe()}", f"b: {b.describe()}"]
    differs = False
    for name in wanted:
        if name not in a.components or name not in b.components:
            side = "a" if name in a.components else "b" if name in b.components else None
            if side is None:
                raise UsageError(f"neither checkpoint has component {name!r}")
            lines += ["", f"{name}: only in {side}"]
            result["components"][name] = {"only_in": side}
            differs = True
            continue
        ra, rb = ComponentReader(a.components[name], args.trust), ComponentReader(b.components[name], args.trust)
        keys_a = match_keys(ra.keys, args.keys or ())
        keys_b = match_keys(rb.keys, args.keys or ())
        only_a = [k for k in keys_a if k not in rb.keys]
        only_b = [k for k in keys_b if k not in ra.keys]
        common = [k for k in keys_a if k in rb.keys]
        changed_spec: list[tuple[str, str, str]] = []
        comparable: list[str] = []
        for k in common:
            ia, ib = ra.keys[k], rb.keys[k]
            if ia.is_tensor != ib.is_tensor or ia.shape != ib.shape:
                changed_spec.append((k, ia.spec(), ib.spec()))
            else:
                if ia.dtype != ib.dtype:
                    changed_spec.append((k, ia.spec(), ib.spec()))
                comparable.append(k)
        diffs: dict[str, float] = {}
        value_changes: dict[str, tuple[str, str]] = {}
        total = sum(ra.keys[k].nbytes for k in comparable)
        bar = Progress(f"comparing {name}", total)
        try:
            # Streamed: one batch of a, then the same keys of b; never both checkpoints at once.
            merged = {k: ra.keys[k] if ra.keys[k].nbytes >= rb.keys[k].nbytes else rb.keys[k] for k in comparable}
            for batch in batches(comparable, merged, args.budget):
                va = ra.read(batch)
                vb = rb.read(batch)
                for k in batch:
                    x, y = va.pop(k), vb.pop(k)
                    if ra.keys[k].is_tensor:
                        d = _max_abs_diff(x, y)
                        if d > args.atol:
                            diffs[k] = d
                        bar.advance(ra.keys[k].nbytes)
                    elif not _same_value(x, y, ra.stored.get(k), rb.stored.get(k)):
                        value_changes[k] = (summarize_value(x), summarize_value(y))
        finally:
            bar.close()
        equal = len(comparable) - len(diffs) - len(value_changes)
        comp_differs = bool(only_a or only_b or changed_spec or diffs or value_changes)
        differs |= comp_differs
        result["components"][name] = {
            "only_in_a": only_a,
            "only_in_b": only_b,
            "changed": [{"key": k, "a": x, "b": y} for k, x, y in changed_spec],
            "max_abs_diff": diffs,
            "values_changed": {k: {"a": x, "b": y} for k, (x, y) in value_changes.items()},
            "equal": equal,
        }
        counts = [
            (len(only_a), "only in a"),
            (len(only_b), "only in b"),
            (len(changed_spec), "shape/dtype changed"),
            (len(diffs) + len(value_changes), "keys differ" if len(diffs) + len(value_changes) > 1 else "key differs"),
        ]
        found = ", ".join(f"{n} {what}" for n, what in counts if n)
        head = f"{name}: {found or 'identical'} ({equal} of {len(common)} common keys equal)"
        lines += ["", head]
        limit = args.limit
        lines += _limited([f"  only in a: {k}" for k in only_a], limit)
        lines += _limited([f"  only in b: {k}" for k in only_b], limit)
        lines += _limited([f"  changed: {k}: {x} -> {y}" for k, x, y in changed_spec], limit)
        ranked = sorted(diffs.items(), key=lambda kv: (-kv[1], kv[0]))
        lines += _limited([f"  differs: {k}: max |a-b| = {d:.6g}" for k, d in ranked], limit)
        lines += _limited([f"  differs: {k}: {x} -> {y}" for k, (x, y) in value_changes.items()], limit)
    result["identical"] = not differs
    if args.json:
        print_json(result)
    else:
        print_lines(*lines, "", "the checkpoints differ" if differs else "the checkpoints are identical")
    return EXIT_PROBLEM if differs else EXIT_OK


def _same_value(x: Any, y: Any, stored_x: bytes | None, stored_y: bytes | None) -> bool:
    """Equal stored bytes are equal values, read or not (a value ``weights_only`` refuses, such
    as the original checkpointer's ``_extra_state``, compares by them); else the read values."""
    from .._inspect.reader import Unreadable

    if stored_x is not None and stored_x == stored_y:
        return True
    if isinstance(x, Unreadable) or isinstance(y, Unreadable):
        return False
    return _values_equal(x, y)


def _values_equal(x: Any, y: Any) -> bool:
    import torch

    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
    try:
        return bool(x == y)
    except Exception:
        return False


def _limited(lines: list[str], limit: int) -> list[str]:
    if limit <= 0 or len(lines) <= limit:
        return lines
    return [*lines[:limit], f"  ... and {len(lines) - limit} more (--limit 0 lists all)"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("a", metavar="A")
    parser.add_argument("b", metavar="B")
    parser.add_argument("--component", action="append", metavar="C", help="only this component (repeatable)")
    parser.add_argument("--keys", action="append", metavar="GLOB", help="only keys matching this glob (repeatable)")
    parser.add_argument("--atol", type=float, default=0.0, help="differences up to this count as equal (default 0)")
    parser.add_argument("--limit", type=int, default=20, help="list at most this many keys per kind (0: all)")
    parser.add_argument("--trust", action="store_true", help=TRUST_HELP)
    parser.add_argument("--budget", type=parse_size, default="64M", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true", help=JSON_HELP)


COMMAND = Command(
    name="diff",
    summary="compare two checkpoints key by key (streamed)",
    example="ckpt-engine diff runs/exp1/checkpoints/iter_000000010 runs/exp1/checkpoints/iter_000000020",
    description="Per component: keys only in A, only in B, shape or dtype changed, and for common keys "
    "the largest absolute difference; other values compare by their stored bytes, then by value. "
    "Reads one batch of tensors at a time from A, then the same from B: memory is bounded "
    "by the largest tensor, never a whole checkpoint. Exit code 0 when identical, "
    "1 when they differ.",
    add_arguments=add_arguments,
    run=cmd_diff,
)
