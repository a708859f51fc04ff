"""``ckpt-engine convert``: one consolidated torch or safetensors file, or a Hugging Face folder, from
a component of any format the command line reads."""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from .._inspect.files import shown
from ..errors import UsageError
from ._command import Command
from ._output import EXIT_OK, Progress, parse_size, print_lines

_SUFFIXES = {".safetensors": "safetensors", ".pt": "torch", ".pth": "torch", ".bin": "torch"}


def cmd_convert(args: argparse.Namespace) -> int:
    import torch

    from .._inspect.convert import ConvertError, check_output, convert_component, require_safetensors
    from .._inspect.files import human_bytes

    fmt = args.to or _SUFFIXES.get(os.path.splitext(args.out)[1].lower())
    if fmt == "hf":
        return _convert_hf(args)
    fmt = _check_file_options(args, fmt)
    if fmt == "safetensors":
        require_safetensors()
    cast = None
    if args.dtype:
        cast = getattr(torch, args.dtype, None)
        if not isinstance(cast, torch.dtype) or not cast.is_floating_point:
            raise UsageError(f"--dtype {args.dtype!r} is not a floating-point torch dtype (e.g. bfloat16, float16)")
    out = args.out
    target, reader, keys = _component_keys(args)
    check_output(out, target)  # before "exists": --force must not be suggested for the input itself
    if os.path.isdir(out):
        name = "model.safetensors" if fmt == "safetensors" else "model.pt"
        raise UsageError(f"{out} is a folder; --to {fmt} writes one file: name a file, e.g. {os.path.join(out, name)}")
    if os.path.lexists(out) and not args.force:
        raise UsageError(f"{out} exists; pass --force to overwrite it")
    total = sum(reader.keys[k].nbytes for k in keys)
    bar = Progress(f"converting {args.component}", total, items=len(keys), noun="tensor")
    t0 = time.perf_counter()
    try:
        written, left_out = convert_component(
            reader, keys, out, fmt, cast, bar.advance, budget=args.budget, nested=args.nested
        )
    except ConvertError as err:
        raise UsageError(str(err)) from err
    finally:
        bar.close()
    size = os.path.getsize(out)
    how = f", floating-point tensors cast to {args.dtype}" if cast is not None else ""
    print_lines(
        f"wrote {out} ({fmt}): {written} values of component {args.component!r} from {target.describe()}, "
        f"{human_bytes(size)}{how}, in {time.perf_counter() - t0:.1f}s"
    )
    if left_out:
        why = "safetensors holds only tensors" if fmt == "safetensors" else "not readable with weights_only=True"
        print_lines(
            f"left out {len(left_out)} non-tensor value(s) ({why}): {', '.join(map(shown, left_out[:10]))}"
            + (" ..." if len(left_out) > 10 else "")
        )
    hint = (
        "load it with: safetensors.torch.load_file(path)"
        if fmt == "safetensors"
        else "load it with: optimizer.load_state_dict(torch.load(path, weights_only=True))"
        if args.nested
        else "load it with: torch.load(path, weights_only=True)"
    )
    print_lines(hint)
    return EXIT_OK


def _check_file_options(args: argparse.Namespace, fmt: str | None) -> str:
    """``fmt``, once options that a single torch or safetensors file cannot honour are refused."""
    if args.hf_config is not None:
        raise UsageError("--hf-config is for --to hf (a Hugging Face folder); a single file holds no config.json")
    if fmt is None:
        raise UsageError(f"cannot tell the format from {args.out!r}; give --to torch or --to safetensors")
    if fmt == "safetensors" and args.nested:
        raise UsageError("--nested writes a torch file; safetensors holds only flat tensors")
    return fmt


def _check_hf_out(out: str, force: bool) -> None:
    """Refuse an ``OUT`` that ``--to hf`` cannot replace (after :func:`check_output`)."""
    if os.path.islink(os.path.normpath(out)) and not os.path.isdir(out):
        raise UsageError(
            f"{out} is a symbolic link to {os.path.realpath(out)}, which is not a folder; point the link "
            "at a folder (or remove the link) and convert again"
        )
    if os.path.lexists(out) and not force:
        raise UsageError(f"{out} exists; pass --force to replace it")
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(f"{out} is a file; --to hf writes a folder")


def _convert_hf(args: argparse.Namespace) -> int:
    """``--to hf``: a Hugging Face folder (``_inspect.hf_export``)."""
    import torch

    from .._format.safetensors import INDEX_FILE, SINGLE_FILE
    from .._inspect.convert import check_output
    from .._inspect.files import human_bytes
    from .._inspect.hf_export import DTYPE_ALIASES, export_hf, read_hf_config

    if args.hf_config is not None and args.component in _NOT_A_MODEL:
        raise UsageError(
            f"--hf-config describes a model, but component {args.component!r} is {_NOT_A_MODEL[args.component]}; "
            "convert --component model (the default) with --hf-config, or leave --hf-config out"
        )
    hf_config = read_hf_config(args.hf_config) if args.hf_config is not None else None
    cast = None
    if args.dtype:
        cast = getattr(torch, DTYPE_ALIASES.get(args.dtype.lower(), args.dtype), None)
        if not isinstance(cast, torch.dtype) or not cast.is_floating_point:
            raise UsageError(f"--dtype {args.dtype!r} is not a floating-point dtype (e.g. bf16, bfloat16, float16)")
    out = args.out
    target, reader, keys = _component_keys(args)
    check_output(out, target)  # before "exists": --force must not be suggested for the input itself
    _check_hf_out(out, args.force)
    bar = Progress(
        f"converting {args.component}", sum(reader.keys[k].nbytes for k in keys), items=len(keys), noun="tensor"
    )
    t0 = time.perf_counter()
    try:
        result = export_hf(
            reader,
            keys,
            out,
            max_shard_size=args.max_shard_size or parse_shard_size_arg("5GB"),
            cast=cast,
            progress=bar.advance,
            budget=args.budget,
            replace=args.force,
            hf_config=hf_config,
        )
    except UsageError:
        raise
    except (ValueError, FileExistsError) as err:
        raise UsageError(str(err)) from err
    finally:
        bar.close()
    how = f", floating-point tensors cast to {str(cast).removeprefix('torch.')}" if cast is not None else ""
    shards = f"{len(result.files)} shards + {INDEX_FILE}" if len(result.files) > 1 else SINGLE_FILE
    shards += "".join(f" + {name}" for name in result.config_files)
    print_lines(
        f"wrote {out} (Hugging Face safetensors, {shards}): {result.written} tensors of component "
        f"{args.component!r} from {target.describe()}, {human_bytes(result.total_size)}{how}, "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    _print_hf_notes(result, args.component, out, hf_config)
    return EXIT_OK


def _print_hf_notes(result: Any, component: str, out: str, hf_config: Any) -> None:
    """What ``--to hf`` left out, the ties it wrote once, and how to load the folder."""
    if result.left_out:
        print_lines(
            f"left out {len(result.left_out)} non-tensor value(s) (safetensors holds only tensors): "
            + ", ".join(map(shown, result.left_out[:10]))
            + (" ..." if len(result.left_out) > 10 else "")
        )
    if result.tied:
        print_lines(
            "tied weights written once, as save_pretrained does (config.json ties word embeddings): "
            + ", ".join(f"{shown(k)} left out, it is {shown(v)}" for k, v in sorted(result.tied.items()))
        )
    print_lines(_hf_hint(component, out, hf_config))


#: Components of an engine checkpoint that are not a model, and what they hold.
_NOT_A_MODEL = {"optim": "optimizer state", "scheduler": "LR scheduler state", "trainer": "the trainer's state"}


def _hf_hint(component: str, out: str, hf_config: Any) -> str:
    """How to load what was written: only what works. ``from_pretrained`` needs ``config.json``;
    ``load_path`` loads a model."""
    if component in _NOT_A_MODEL:
        return f"load it with: safetensors.torch.load_file on {out}'s .safetensors file(s)"
    if hf_config is None:
        return (
            f"load it with: load_path: {out} (ckpt-engine), or safetensors.torch.load_file per file; "
            "for transformers' from_pretrained, convert again with --hf-config DIR (the model's Hugging Face "
            "folder, for its config.json)"
        )
    model_class = hf_config.architecture or "AutoModel"
    return f"load it with: transformers.{model_class}.from_pretrained({out!r}), or load_path: {out} (ckpt-engine)"


def parse_shard_size_arg(text: str) -> int:
    from .._inspect.hf_export import parse_shard_size

    return parse_shard_size(text)


def _component_keys(args: argparse.Namespace) -> tuple[Any, Any, list[str]]:
    """The checkpoint ``args`` names (checked complete), a reader of ``--component`` and the keys
    ``--keys`` selects; a usage error when none matches. Any format the command line reads: an
    engine checkpoint, a DCP folder, a safetensors file, a Hugging Face folder, a ``torch.save`` file."""
    from .._format.layout import check_complete
    from .._inspect.reader import ComponentReader, match_keys, resolve
    from .._inspect.sources import BatchedSource, SafetensorsSource, TorchFileSource

    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise UsageError(f"the folder of {args.out} does not exist: {parent}")
    target = resolve(args.checkpoint, [args.component])
    path = target.components[args.component]
    reader: Any
    if target.kind in ("safetensors", "hf"):
        reader = BatchedSource(SafetensorsSource(path))
    elif target.kind == "torch":
        reader = BatchedSource(TorchFileSource(path))
    else:  # a DCP folder is checked complete by its reader: every byte range its .metadata names
        if target.kind == "engine":
            check_complete(target.checkpoint)
        reader = ComponentReader(path)
    keys = match_keys(reader.keys, args.keys or ())
    if not keys:
        raise UsageError(f"no key of component {args.component!r} matches {', '.join(args.keys or ())}")
    # One rank's part (a rank-local checkpoint) converts only where it holds every element asked
    # for; otherwise a typed error names the key and what it lacks, before anything is written.
    reader.require_whole(keys)
    unsure = reader.require_the_jobs() if isinstance(reader, ComponentReader) else None
    if reader.part is not None:
        print_lines(f"note: {target.checkpoint} is {reader.part.describe()}" + (f"; {unsure}" if unsure else ""))
    return target, reader, keys


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", metavar="CHECKPOINT")
    parser.add_argument("out", metavar="OUT")
    parser.add_argument(
        "--to", choices=("torch", "safetensors", "hf"), help="output format (default: from OUT's suffix)"
    )
    parser.add_argument(
        "--max-shard-size",
        type=parse_shard_size_arg,
        metavar="SIZE",
        help="--to hf: largest shard file, e.g. 5GB (the default), 500MB, 2GiB",
    )
    parser.add_argument(
        "--hf-config",
        metavar="DIR",
        help="--to hf: copy config.json (and generation_config.json) from this Hugging Face folder of the "
        "model, so from_pretrained loads the export; tied word embeddings are then written once",
    )
    parser.add_argument("--component", default="model", help="component to convert (default: model)")
    parser.add_argument("--dtype", help="cast floating-point tensors, e.g. bfloat16")
    parser.add_argument("--keys", action="append", metavar="GLOB", help="only keys matching this glob (repeatable)")
    parser.add_argument(
        "--nested",
        action="store_true",
        help="for an optimizer: write the nested state dict optimizer.load_state_dict takes (default: flat keys)",
    )
    parser.add_argument("--force", action="store_true", help="overwrite OUT")
    parser.add_argument("--budget", type=parse_size, default="64M", help=argparse.SUPPRESS)


COMMAND = Command(
    name="convert",
    summary="write one consolidated torch or safetensors file, or a Hugging Face folder",
    example="ckpt-engine convert runs/exp1/checkpoints model.safetensors --to safetensors --dtype bfloat16\n"
    "ckpt-engine convert runs/exp1/checkpoints/iter_000000020 model.pt --to torch\n"
    "ckpt-engine convert runs/exp1/checkpoints hf_model/ --to hf --hf-config base_model/ --dtype bf16",
    description="One consolidated file of a component for inference or sharing, assembled from all "
    "shards. CHECKPOINT may also be a DCP folder, a safetensors file, a Hugging Face folder or a "
    "torch.save file (one state dict: component model). Streamed: memory stays bounded by the largest "
    "tensor. torch files load with "
    "torch.load(path, weights_only=True); safetensors files with safetensors.torch.load_file(path). "
    "--to hf writes a Hugging Face folder (model.safetensors, or shards plus model.safetensors.index.json) "
    "that load_path reads; with --hf-config DIR it also holds the model's config.json, for transformers' "
    "from_pretrained.",
    add_arguments=add_arguments,
    run=cmd_convert,
)
