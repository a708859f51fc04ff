"""``ckpt-engine``: look at, check, compare, convert and dry-run-load checkpoints; run the demo.

Every command parses metadata without pickle, a ``torch.save`` file's ``data.pkl`` with the
engine's closed-vocabulary interpreter, and other values with ``weights_only=True``: looking at
an untrusted checkpoint never runs code from it. ``ls``, ``inspect`` and ``verify --level sizes``
import no torch; commands that read values import it when they run. Errors are one readable line and a
non-zero exit code; ``--debug`` shows the traceback.

Exit codes: 0 success; 1 the command ran and found a problem (``verify`` failed, ``diff`` found
differences, ``plan`` would fail, the demo's losses differ); 2 an error (bad input, a checkpoint
that cannot be read, a usage error); 3 ``verify`` found nothing damaged but content it cannot check
(no checksums to check against); 130 interrupted.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

from ..errors import UsageError
from . import convert, demo, diff, docs_config, inspect, ls, plan, plugins, verify
from ._command import Command
from ._output import EXIT_ERROR, EXIT_INTERRUPTED

__all__ = ["COMMANDS", "CliError", "build_parser", "main"]

#: Every command, in the order ``--help`` lists them. A new command is a module with a ``COMMAND``.
COMMANDS: tuple[Command, ...] = tuple(
    m.COMMAND for m in (ls, inspect, verify, diff, convert, plan, plugins, demo, docs_config)
)

CliError = UsageError  # the name this module used before UsageError joined the error family


# -- parser -----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}{did_you_mean(message)}\n")


def did_you_mean(message: str) -> str:
    """``"; did you mean 'ls'?"`` for argparse's "invalid choice" of a command (or any choice), when
    one of the choices is close to what was typed; else ``""``."""
    import difflib
    import re

    m = re.search(r"invalid choice: '?(.*?)'? \(choose from (.*)\)$", message)
    if m is None:
        return ""
    typed, listed = m.group(1), [c.strip().strip("'") for c in m.group(2).split(",")]
    if message.startswith("argument COMMAND:"):
        listed = [c.name for c in COMMANDS if not c.hidden]
    close = difflib.get_close_matches(typed, listed, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _add(sub: Any, command: Command, common: argparse.ArgumentParser) -> None:
    shown: dict[str, Any] = {} if command.hidden else {"help": command.summary}
    parser: argparse.ArgumentParser = sub.add_parser(
        command.name,
        description=command.description or command.summary,
        epilog="example:\n" + _example_lines(command.example),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
        **shown,
    )
    command.add_arguments(parser)
    parser.set_defaults(func=command.run)


def _example_lines(example: str) -> str:
    """A command's examples, one a line, each indented by two spaces, as ``ckpt-engine --help``
    shows its own: however the ``example`` string indents its lines."""
    return "\n".join("  " + line.strip() for line in example.splitlines() if line.strip())


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    common.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=argparse.SUPPRESS,
        help="no progress bars (they show on a terminal only, on stderr)",
    )
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

            exit codes: 0 ok; 1 a problem was found (verify, diff, plan, demo); 2 an error;
            3 verify: complete, but holds no checksums to check its content against.
            Documentation: docs/cli.md"""
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        parents=[common],
    )
    parser.add_argument("--version", action="version", version=f"ckpt-engine {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command in COMMANDS:
        _add(sub, command, common)
    return parser


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
    from . import _output

    _output.QUIET = bool(getattr(args, "quiet", False))
    import logging

    logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly with the status of a SIGPIPE death, as
        # other Unix tools do; stdout goes to /dev/null so the exit-time flush cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13
    except Exception as err:
        if debug:  # the traceback, and the same exit code as without --debug
            import traceback

            traceback.print_exc()
            return EXIT_ERROR
        from .._inspect.files import shown

        print(f"ckpt-engine {args.command}: error: {shown(_error_text(err), lines=True)}", file=sys.stderr)
        return EXIT_ERROR


def _error_text(err: BaseException) -> str:
    import pluggy

    from ..errors import CkptEngineError

    message = str(err).strip() or type(err).__name__
    # pydantic appends a documentation URL to every validation error: noise on a terminal.
    message = "\n".join(line for line in message.splitlines() if "For further information visit" not in line)
    if isinstance(err, (CkptEngineError, pluggy.PluginValidationError)):  # UsageError is one
        kind = "" if isinstance(err, UsageError) else f"{type(err).__name__}: "
        return kind + message
    if isinstance(err, OSError):
        return f"{type(err).__name__}: {message}"
    return f"{type(err).__name__}: {message} (an unexpected error; run with --debug for the traceback)"


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
