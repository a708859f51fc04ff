"""``ckpt-engine``: look at, check, compare, convert and dry-run-load checkpoints; run the demo.

Every command reads metadata with a restricted unpickler and values with ``weights_only=True``:
looking at an untrusted checkpoint never runs code from it. Errors are one readable line and a
non-zero exit code; ``--debug`` shows the traceback.

Exit codes: 0 success; 1 the command ran and found a problem (``verify`` failed, ``diff`` found
differences, ``plan`` would fail, the demo's losses differ); 2 an error (bad input, a checkpoint
that cannot be read, a usage error); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any, Literal, NoReturn

__all__ = ["CliError", "main"]

EXIT_OK, EXIT_PROBLEM, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130


class CliError(Exception):
    """A command-line mistake (a bad argument, a factory that cannot be imported)."""


# -- output helpers ---------------------------------------------------------------------------


class Progress:
    """A one-line progress bar on stderr, shown only when stderr is a terminal."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = _isatty(self.stream) if enabled is None else enabled
        self.label, self.total, self.done = label, max(total, 0), 0
        self._last = 0.0

    def advance(self, n: int) -> None:
        self.update(self.done + n)

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            self._last = now
            frac = min(self.done / self.total, 1.0) if self.total else 1.0
            bar = "#" * int(frac * 30)
            from ._cli_read import human_bytes

            self.stream.write(
                f"\r{self.label} [{bar:<30}] {frac:4.0%} {human_bytes(self.done)}/{human_bytes(self.total)}"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def _print(*lines: str) -> None:
    for line in lines:
        print(line)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def _json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


# -- ls ---------------------------------------------------------------------------------------


def cmd_ls(args: argparse.Namespace) -> int:
    from ._cli_read import disk_usage, exists, human_bytes, is_component_dir, isdir, normalize, table, uncommitted_dirs
    from .errors import CheckpointNotFoundError, CkptEngineError
    from .integrity import verify_checkpoint
    from .layout import LATEST_FILE, component_dirs, iter_dirname, list_checkpoints, read_latest

    save_dir = normalize(args.save_dir)
    if not exists(save_dir):
        raise CheckpointNotFoundError(f"{save_dir} does not exist")
    if not isdir(save_dir):
        raise CheckpointNotFoundError(f"{save_dir} is a file, not a save folder")
    if is_component_dir(save_dir) or (not list_checkpoints(save_dir) and _looks_like_checkpoint(save_dir)):
        raise CliError(f"{save_dir} is a checkpoint, not a save folder; try: ckpt-engine inspect {save_dir}")
    warnings: list[str] = []
    try:
        latest = read_latest(save_dir)
    except CkptEngineError as err:
        latest = None
        warnings.append(f"warning: {err}")
    level: Literal["sizes", "checksums"] = "checksums" if args.verify else "sizes"
    rows: list[dict[str, Any]] = []
    for iteration, path in list_checkpoints(save_dir):
        report = verify_checkpoint(path, level=level)
        if not report.complete:
            status = "INCOMPLETE"
        elif report.problems:
            status = "CORRUPT"
        elif report.verified:
            status = "verified"
        else:
            status = "complete"
        size, files = disk_usage(path)
        rows.append(
            {
                "iteration": iteration,
                "name": os.path.basename(path),
                "path": path,
                "components": component_dirs(path),
                "bytes": size,
                "files": files,
                "status": status,
                "verified": report.verified,
                "problems": list(report.problems),
                "latest": os.path.basename(path) == latest,
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
            }
        )
    rows.sort(key=lambda r: (r["iteration"], r["status"] == "uncommitted"))
    if latest is not None and not any(r["latest"] for r in rows):
        warnings.append(f"warning: {LATEST_FILE} names {latest!r}, which does not exist")
    for r in rows:
        if r["latest"] and r["status"] in ("INCOMPLETE", "CORRUPT"):
            warnings.append(f"warning: {LATEST_FILE} names {r['name']}, which is {r['status'].lower()}")
    if args.json:
        _json({"save_dir": save_dir, "latest": latest, "checkpoints": rows, "warnings": warnings})
        return EXIT_OK
    if not rows:
        _print(f"no checkpoints in {save_dir}", *warnings)
        return EXIT_OK
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
    _print(*table(body, ["iteration", "checkpoint", "components", "size", "files", "status", ""], right=(0, 3, 4)))
    for r in rows:
        if r["status"] != "complete" and r["problems"]:
            _print(f"{r['name']}: {r['problems'][0]}")
    if not args.verify and any(r["status"] == "complete" for r in rows):
        _print("(sizes checked; `ckpt-engine ls --verify` or `ckpt-engine verify` also checks checksums)")
    _print(*warnings)
    return EXIT_OK


def _looks_like_checkpoint(path: str) -> bool:
    from ._cli_read import is_component_dir
    from .store import open_store

    try:
        return any(is_component_dir(os.path.join(path, n)) for n, d in open_store(path).list_dir(path) if d)
    except OSError:
        return False


# -- inspect ----------------------------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
    from ._cli_read import ComponentReader, Unreadable, human_bytes, match_keys, prefix_of, resolve, summarize_value
    from ._cli_read import table as make_table
    from .integrity import verify_checkpoint

    target = resolve(args.checkpoint, args.component or ())
    report = verify_checkpoint(target.checkpoint, level="sizes")
    out: dict[str, Any] = {"checkpoint": target.checkpoint, "complete": report.complete, "components": {}}
    lines = [f"checkpoint {target.describe()}"]
    if not report.complete or report.problems:
        lines.append(f"warning: {report.problems[0] if report.problems else 'incomplete'}")
    for name, cdir in target.components.items():
        reader = ComponentReader(cdir)
        keys = match_keys(reader.keys, args.keys or ())
        values: dict[str, Any] = {}
        small = [k for k in keys if not reader.keys[k].is_tensor and reader.keys[k].stored_bytes <= 65536]
        if small and not args.no_values:
            try:
                values = reader.read(small)
            except Exception as err:  # a damaged data file: still show the metadata
                values = dict.fromkeys(small, Unreadable(str(err).splitlines()[0][:120]))
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
            f"{name}: {_n(len(tensors), 'tensor')} ({sum(i.numel for i in tensors):,} elements), "
            f"{_n(len(infos) - len(tensors), 'other value')}{filt}, {human_bytes(total)}",
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
        _json(out)
    else:
        _print(*lines)
    return EXIT_OK


# -- verify -----------------------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
    from ._cli_read import exists, human_bytes, is_component_dir, is_save_dir, isdir, normalize
    from ._load_guard import fail_unverified
    from .errors import CheckpointNotFoundError
    from .integrity import verify_checkpoint
    from .layout import LATEST_FILE, component_dirs, list_checkpoints, read_latest
    from .store import open_store

    path = normalize(args.checkpoint)
    if not exists(path):
        raise CheckpointNotFoundError(f"{path} does not exist")
    if not isdir(path):
        raise CheckpointNotFoundError(f"{path} is a file, not a checkpoint folder")
    if is_component_dir(path):
        raise CliError(f"{path} is one component; verify its checkpoint: ckpt-engine verify {os.path.dirname(path)}")
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
        _json(
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
            _print(f"FAILED  {r.path}", *(f"  {p}" for p in r.problems or [r.unverified_reason or "incomplete"]))
        elif r.verified:
            what = "checksums" if args.level == "checksums" else "sizes"
            _print(f"ok      {r.path}: complete, {what} match the manifest ({r.files} files, {human_bytes(r.bytes)})")
        else:
            why = r.unverified_reason or "no manifest"
            _print(f"ok      {r.path}: complete (not verified against a manifest: {why})")
    _print(*(f"FAILED  {p}" for p in extra_problems))
    if not results:
        _print(f"no checkpoints in {path}")
    elif len(results) > 1:
        bad = sum(not r.ok for r in results)
        _print(f"{len(results) - bad} of {len(results)} checkpoints ok" + (f", {bad} failed" if bad else ""))
    return EXIT_OK if ok else EXIT_PROBLEM


# -- diff -------------------------------------------------------------------------------------


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
    from ._cli_read import ComponentReader, Unreadable, batches, match_keys, resolve, summarize_value

    a, b = resolve(args.a), resolve(args.b)
    wanted = args.component or sorted(set(a.components) | set(b.components))
    result: dict[str, Any] = {"a": a.checkpoint, "b": b.checkpoint, "components": {}}
    lines = [f"a: {a.describe()}", f"b: {b.describe()}"]
    differs = False
    for name in wanted:
        if name not in a.components or name not in b.components:
            side = "a" if name in a.components else "b" if name in b.components else None
            if side is None:
                raise CliError(f"neither checkpoint has component {name!r}")
            lines += ["", f"{name}: only in {side}"]
            result["components"][name] = {"only_in": side}
            differs = True
            continue
        ra, rb = ComponentReader(a.components[name]), ComponentReader(b.components[name])
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
                    elif isinstance(x, Unreadable) or isinstance(y, Unreadable) or not _values_equal(x, y):
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
        _json(result)
    else:
        _print(*lines, "", "the checkpoints differ" if differs else "the checkpoints are identical")
    return EXIT_PROBLEM if differs else EXIT_OK


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


# -- convert ----------------------------------------------------------------------------------


_SUFFIXES = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from ._cli_convert import ConvertError, convert_component, require_safetensors
    from ._cli_read import ComponentReader, human_bytes, match_keys, resolve
    from .layout import check_complete

    fmt = args.to or _SUFFIXES.get(os.path.splitext(args.out)[1].lower())
    if fmt is None:
        raise CliError(f"cannot tell the format from {args.out!r}; give --to torch or --to safetensors")
    if fmt == "safetensors":
        require_safetensors()
    cast = None
    if args.dtype:
        cast = getattr(torch, args.dtype, None)
        if not isinstance(cast, torch.dtype) or not cast.is_floating_point:
            raise CliError(f"--dtype {args.dtype!r} is not a floating-point torch dtype (e.g. bfloat16, float16)")
    out = args.out
    if os.path.exists(out) and not args.force:
        raise CliError(f"{out} exists; pass --force to overwrite it")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise CliError(f"the folder of {out} does not exist: {parent}")
    target = resolve(args.checkpoint, [args.component])
    check_complete(target.checkpoint)
    reader = ComponentReader(target.components[args.component])
    keys = match_keys(reader.keys, args.keys or ())
    if not keys:
        raise CliError(f"no key of component {args.component!r} matches {', '.join(args.keys or ())}")
    total = sum(reader.keys[k].nbytes for k in keys)
    bar = Progress(f"converting {args.component}", total)
    t0 = time.perf_counter()
    try:
        written, left_out = convert_component(reader, keys, out, fmt, cast, bar.advance, budget=args.budget)
    except ConvertError as err:
        raise CliError(str(err)) from err
    finally:
        bar.close()
    size = os.path.getsize(out)
    how = f", floating-point tensors cast to {args.dtype}" if cast is not None else ""
    _print(
        f"wrote {out} ({fmt}): {written} values of component {args.component!r} from {target.describe()}, "
        f"{human_bytes(size)}{how}, in {time.perf_counter() - t0:.1f}s"
    )
    if left_out:
        why = "safetensors holds only tensors" if fmt == "safetensors" else "not readable with weights_only=True"
        _print(
            f"left out {len(left_out)} non-tensor value(s) ({why}): {', '.join(left_out[:10])}"
            + (" ..." if len(left_out) > 10 else "")
        )
    hint = (
        "load it with: safetensors.torch.load_file(path)"
        if fmt == "safetensors"
        else "load it with: torch.load(path, weights_only=True)"
    )
    _print(hint)
    return EXIT_OK


# -- plan -------------------------------------------------------------------------------------


def import_factory(spec: str) -> Callable[[], Any]:
    """``package.module:attr`` -> the callable; the current folder is importable, as with ``python -m``."""
    import importlib

    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CliError(f"--model {spec!r} must be 'package.module:factory' (a callable that builds the model)")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as err:
        raise CliError(
            f"cannot import module {module_name!r} (from --model {spec}): {type(err).__name__}: {err}"
        ) from err
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as err:
            raise CliError(f"module {module_name!r} has no attribute {attr!r} (from --model {spec})") from err
    if not callable(obj):
        raise CliError(f"--model {spec} is a {type(obj).__name__}, not a callable that builds the model")
    factory: Callable[[], Any] = obj
    return factory


_LOAD_ARGS = ("model", "optimizer", "scheduler", "grad_scaler", "extra")


def _build_objects(spec: str) -> Any:
    from torch import nn

    from .state import TrainingObjects

    built = import_factory(spec)
    try:
        made = built()
    except Exception as err:
        raise CliError(f"--model factory {spec} raised {type(err).__name__}: {err}") from err
    if isinstance(made, Mapping):
        unknown = sorted(set(made) - set(_LOAD_ARGS))
        if unknown:
            raise CliError(f"--model factory {spec} returned unknown keys {unknown}; allowed: {', '.join(_LOAD_ARGS)}")
        kwargs = dict(made)
    elif isinstance(made, nn.Module) or (isinstance(made, (list, tuple)) and made):
        kwargs = {"model": made}
    else:
        raise CliError(
            f"--model factory {spec} returned a {type(made).__name__}; return an nn.Module, a list of modules, "
            "or a dict of engine.load() arguments (model=, optimizer=, scheduler=, grad_scaler=, extra=)"
        )
    try:
        return TrainingObjects.from_args(
            kwargs.get("model"),
            kwargs.get("optimizer"),
            kwargs.get("scheduler"),
            kwargs.get("grad_scaler"),
            kwargs.get("extra"),
        )
    except (TypeError, ValueError) as err:
        raise CliError(f"--model factory {spec}: {err}") from err


def cmd_plan(args: argparse.Namespace) -> int:
    from ._cli_plan import plan_load

    return plan_load(args, _build_objects(args.model))


# -- plugins ----------------------------------------------------------------------------------


def cmd_plugins(args: argparse.Namespace) -> int:
    from ._cli_docs import describe_plugins, hook_kind
    from ._cli_read import table

    infos = describe_plugins()
    enabled: dict[str, Any] | None = None
    if args.config:
        enabled = _describe_config(args.config)
    if args.json:
        _json({"plugins": [i.to_dict() for i in infos], "config": enabled})
        return EXIT_OK
    lines = ["installed plugins (entry points of the 'ckpt_engine' group):"]
    for info in infos:
        origin = f"{info.value}" + (f", from {info.dist} {info.version}" if info.dist else "")
        flag = "  [on by default]" if info.default_on else ""
        lines += ["", f"{info.name}  ({origin}){flag}"]
        if info.error:
            lines.append(f"  {info.error}")
            continue
        if info.summary:
            lines += textwrap.wrap(info.summary, 96, initial_indent="  ", subsequent_indent="  ")
        hooks = ", ".join(f"{h} ({hook_kind(h)})" for h in info.hooks) or "none"
        lines.append(f"  hooks: {hooks}")
        if info.options:
            lines.append("  options:")
            rows = [[o.name, o.type, o.default, o.description] for o in info.options]
            lines += ["    " + r for r in table(rows, ["name", "type", "default", "description"])]
        else:
            lines.append("  options: none")
    if not infos:
        lines.append("  (none)")
    if enabled is not None:
        lines += ["", f"with {args.config}:"]
        lines.append("  enabled, in fold order: " + (", ".join(enabled["order"]) or "(none)"))
        for hook, names in enabled["fold_order"].items():
            lines.append(f"  {hook}: {' -> '.join(names) or '(no plugin)'}")
        for hook, name in enabled["providers"].items():
            lines.append(f"  {hook}: {name}")
    _print(*lines)
    return EXIT_OK


def _describe_config(path: str) -> dict[str, Any]:
    from .config import EngineConfig
    from .defaults import DEFAULT_PLUGIN_NAME
    from .loading import build_plugin_manager
    from .pipeline import Pipeline

    config = EngineConfig.from_file(path)
    loaded = build_plugin_manager(config)
    pipeline = Pipeline(loaded)
    try:
        return {
            "order": list(loaded.order),
            "fold_order": {h: list(v) for h, v in pipeline.fold_order.items()},
            "providers": {
                h: ("the engine's default" if n == DEFAULT_PLUGIN_NAME else n) for h, n in pipeline.providers.items()
            },
        }
    finally:
        for name in reversed(loaded.order):
            closer = getattr(loaded.pm.get_plugin(name), "close", None)
            if callable(closer):
                closer()


# -- docs-config (hidden) ---------------------------------------------------------------------


def cmd_docs_config(args: argparse.Namespace) -> int:
    from ._cli_docs import config_reference

    text = config_reference()
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            same = f.read() == text
        if not same:
            _print(f"{args.check} is out of date; run: ckpt-engine docs-config -o {args.check}")
        return EXIT_OK if same else EXIT_PROBLEM
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        _print(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return EXIT_OK


# -- demo -------------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo_safely

    return run_demo_safely(args)


# -- parser -----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def _add(
    sub: Any, name: str, func: Callable[[argparse.Namespace], int], summary: str, example: str, **kw: Any
) -> argparse.ArgumentParser:
    parser: argparse.ArgumentParser = sub.add_parser(
        name,
        help=summary,
        description=kw.pop("description", summary),
        epilog="example:\n" + textwrap.indent(textwrap.dedent(example).strip("\n"), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        **kw,
    )
    parser.set_defaults(func=func)
    return parser


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    parser = _Parser(
        prog="ckpt-engine",
        description="Look at, check, compare, convert and dry-run-load ckpt-engine (DCP) checkpoints.",
        epilog=textwrap.dedent(
            """\
            examples:
              ckpt-engine demo                                  # train, SIGKILL mid-save, resume, compare
              ckpt-engine ls runs/exp1/checkpoints
              ckpt-engine inspect runs/exp1/checkpoints/iter_000000020 --component model
              ckpt-engine convert runs/exp1/checkpoints model.safetensors --to safetensors

            exit codes: 0 ok; 1 a problem was found (verify, diff, plan, demo); 2 an error.
            Documentation: docs/cli.md"""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"ckpt-engine {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    json_help = "print JSON instead of text (for scripts)"

    p = _add(
        sub,
        "ls",
        cmd_ls,
        "list the checkpoints of a save folder",
        "ckpt-engine ls runs/exp1/checkpoints\n  ckpt-engine ls runs/exp1/checkpoints --verify --json",
        description="One row per checkpoint: iteration, components, size, file count, status (complete, "
        "verified, INCOMPLETE, CORRUPT, or uncommitted for an interrupted save) and which one "
        "latest_checkpoint.txt names.",
        parents=[common],
    )
    p.add_argument("save_dir", metavar="SAVE_DIR", help="folder with iter_XXXXXXXXX/ checkpoints")
    p.add_argument("--verify", action="store_true", help="also check checksums against the manifest (reads all data)")
    p.add_argument("--json", action="store_true", help=json_help)

    p = _add(
        sub,
        "inspect",
        cmd_inspect,
        "every key of a checkpoint: dtype, shape, shards, bytes",
        "ckpt-engine inspect runs/exp1/checkpoints/iter_000000020 --component model --keys '*.weight'",
        description="Every key with dtype, global shape, number of stored shards and bytes; small non-tensor "
        "values shown; totals per component and per top-level prefix. CHECKPOINT may be a checkpoint folder, "
        "one component folder, or a save folder (its latest checkpoint).",
        parents=[common],
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--component", action="append", metavar="C", help="only this component (repeatable)")
    p.add_argument("--keys", action="append", metavar="GLOB", help="only keys matching this glob (repeatable)")
    p.add_argument("--summary", action="store_true", help="totals only, no per-key table")
    p.add_argument("--no-values", action="store_true", help="do not read non-tensor values")
    p.add_argument("--json", action="store_true", help=json_help)

    p = _add(
        sub,
        "verify",
        cmd_verify,
        "check that checkpoints are complete and match their manifest",
        "ckpt-engine verify runs/exp1/checkpoints/iter_000000020\n"
        "  ckpt-engine verify runs/exp1/checkpoints      # every checkpoint in the folder",
        description="Checks completeness (every component's .metadata and every byte range it names) and, "
        "where the engine's manifest exists, file sizes and checksums. Exit code 0 only when everything "
        "checks. CHECKPOINT may be a save folder: then every checkpoint in it is verified.",
        parents=[common],
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument(
        "--level",
        choices=("sizes", "checksums"),
        default="checksums",
        help="how far to check the manifest (default: checksums, which reads every byte)",
    )
    p.add_argument(
        "--allow-unverified",
        action="store_true",
        help="at --level checksums, pass a complete checkpoint whose checksums cannot be checked (no manifest, "
        "a sizes-only or newer one); by default that fails",
    )
    p.add_argument("--json", action="store_true", help=json_help)

    p = _add(
        sub,
        "diff",
        cmd_diff,
        "compare two checkpoints key by key (streamed)",
        "ckpt-engine diff runs/exp1/checkpoints/iter_000000010 runs/exp1/checkpoints/iter_000000020",
        description="Per component: keys only in A, only in B, shape or dtype changed, and for common keys "
        "the largest absolute difference. Reads one batch of tensors at a time from A, then the same from "
        "B: memory is bounded by the largest tensor, never a whole checkpoint. Exit code 0 when identical, "
        "1 when they differ.",
        parents=[common],
    )
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--component", action="append", metavar="C", help="only this component (repeatable)")
    p.add_argument("--keys", action="append", metavar="GLOB", help="only keys matching this glob (repeatable)")
    p.add_argument("--atol", type=float, default=0.0, help="differences up to this count as equal (default 0)")
    p.add_argument("--limit", type=int, default=20, help="list at most this many keys per kind (0: all)")
    p.add_argument("--budget", type=_size, default="64M", help=argparse.SUPPRESS)
    p.add_argument("--json", action="store_true", help=json_help)

    p = _add(
        sub,
        "convert",
        cmd_convert,
        "write one consolidated torch or safetensors file",
        "ckpt-engine convert runs/exp1/checkpoints model.safetensors --to safetensors --dtype bfloat16\n"
        "  ckpt-engine convert runs/exp1/checkpoints/iter_000000020 model.pt --to torch",
        description="One consolidated file of a component for inference or sharing, assembled from all "
        "shards. Streamed: memory stays bounded by the largest tensor. torch files load with "
        "torch.load(path, weights_only=True); safetensors files with safetensors.torch.load_file(path).",
        parents=[common],
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--to", choices=("torch", "safetensors"), help="output format (default: from OUT's suffix)")
    p.add_argument("--component", default="model", help="component to convert (default: model)")
    p.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16")
    p.add_argument("--keys", action="append", metavar="GLOB", help="only keys matching this glob (repeatable)")
    p.add_argument("--force", action="store_true", help="overwrite OUT")
    p.add_argument("--budget", type=_size, default="64M", help=argparse.SUPPRESS)

    p = _add(
        sub,
        "plan",
        cmd_plan,
        "dry-run a load into your model: what would load, skip, be missing",
        "ckpt-engine plan runs/exp1/checkpoints --model my_project.models:build --config engine.yaml",
        description="Builds the model with FACTORY (a callable taking no arguments that returns an nn.Module, "
        "a list of modules, or a dict of engine.load() arguments), then runs the engine's real load planner "
        "with the configured plugins against the checkpoint's metadata. Prints the load report: what would "
        "load, be skipped, overlap-loaded, renamed, be missing or unexpected. Reads no tensor data and "
        "writes nothing. Exit code 1 when the load would fail.",
        parents=[common],
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("--model", required=True, metavar="PACKAGE.MODULE:FACTORY")
    p.add_argument("--config", metavar="FILE", help="engine config (YAML/TOML/JSON): plugins, strictness")
    p.add_argument("--component", action="append", metavar="C", help="only this component (repeatable)")
    p.add_argument("--all", action="store_true", help="list every key, not a collapsed summary")
    p.add_argument("--json", action="store_true", help=json_help)

    p = _add(
        sub,
        "plugins",
        cmd_plugins,
        "installed plugins, their hooks and options",
        "ckpt-engine plugins\n  ckpt-engine plugins --config engine.yaml    # what this config enables",
        description="Every installed plugin (built-in and third-party entry points of the 'ckpt_engine' "
        "group), the hooks it implements, and its options with defaults. With --config, also the plugins "
        "the config enables, in fold order, and the provider of each provider hook.",
        parents=[common],
    )
    p.add_argument("--config", metavar="FILE", help="also show what this engine config enables")
    p.add_argument("--json", action="store_true", help=json_help)

    from .demo import add_demo_arguments

    p = _add(
        sub,
        "demo",
        cmd_demo,
        "train, SIGKILL mid-save, resume, check the losses match",
        "ckpt-engine demo\n  ckpt-engine demo --fast\n  ckpt-engine demo --ranks 2 --steps 40 --out runs/demo2",
        description="Trains a small model with checkpoints every few steps (async with pinned_staging when "
        "installed), kills the training process with SIGKILL in the middle of a save, resumes from "
        "latest_checkpoint.txt in a fresh process, and checks that the resumed losses equal an "
        "uninterrupted run's, step for step.",
        parents=[common],
    )
    add_demo_arguments(p)

    p = sub.add_parser("docs-config", parents=[common], description="generate docs/configuration.md")
    p.set_defaults(func=cmd_docs_config)
    p.add_argument("-o", "--output", metavar="FILE")
    p.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the generated text")
    return parser


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = units.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if t[-1:] in units else t) * mult)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M)") from err
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value


# -- main -------------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, usage errors
        return int(exc.code or 0) if isinstance(exc.code, int) or exc.code is None else EXIT_ERROR
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return EXIT_ERROR
    debug = bool(getattr(args, "debug", False))
    import logging

    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:
        if debug:
            raise
        print(f"ckpt-engine {args.command}: error: {_error_text(err)}", file=sys.stderr)
        return EXIT_ERROR


def _error_text(err: BaseException) -> str:
    import pluggy

    from .errors import CkptEngineError

    message = str(err).strip() or type(err).__name__
    # pydantic appends a documentation URL to every validation error: noise on a terminal.
    message = "\n".join(line for line in message.splitlines() if "For further information visit" not in line)
    if isinstance(err, (CkptEngineError, CliError, pluggy.PluginValidationError)):
        kind = "" if isinstance(err, CliError) else f"{type(err).__name__}: "
        return kind + message
    if isinstance(err, OSError):
        return f"{type(err).__name__}: {message}"
    return f"{type(err).__name__}: {message} (an unexpected error; run with --debug for the traceback)"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
