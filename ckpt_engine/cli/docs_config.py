"""``ckpt-engine docs-config`` (hidden): generate or check docs/configuration.md from the code."""

from __future__ import annotations

import argparse
import sys

from ._command import Command
from ._output import EXIT_OK, EXIT_PROBLEM, print_lines


def cmd_docs_config(args: argparse.Namespace) -> int:
    from .._inspect.describe import config_reference

    text = config_reference()
    if args.check:
        with open(args.check, encoding="utf-8") as f:
            same = f.read() == text
        if not same:
            print_lines(f"{args.check} is out of date; run: ckpt-engine docs-config -o {args.check}")
        return EXIT_OK if same else EXIT_PROBLEM
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            f.write(text)
        print_lines(f"wrote {args.output}")
    else:
        sys.stdout.write(text)
    return EXIT_OK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", metavar="FILE")
    parser.add_argument("--check", metavar="FILE", help="exit 1 if FILE differs from the generated text")


COMMAND = Command(
    name="docs-config",
    summary="generate docs/configuration.md",
    example="ckpt-engine docs-config -o docs/configuration.md",
    add_arguments=add_arguments,
    run=cmd_docs_config,
    hidden=True,
)
