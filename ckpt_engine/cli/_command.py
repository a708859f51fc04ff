"""The shape of a command: its name, its help texts, the arguments it adds and the function it runs.

Each module of this package defines one ``COMMAND``; :func:`ckpt_engine.cli.build_parser` loops
over them. A command's ``run`` computes and prints; it returns the exit code.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class Command:
    name: str
    #: One line, shown in ``ckpt-engine --help``.
    summary: str
    #: Shown under ``example:`` in the command's ``--help``.
    example: str
    #: The paragraph of the command's ``--help``; the summary when empty.
    description: str = ""
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]
    #: Left out of ``ckpt-engine --help`` (tools for the project itself).
    hidden: bool = False
