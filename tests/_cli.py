"""The in-process CLI runner behind the ``cli`` fixture (tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ckpt_engine.cli import main

#: ``cli(*argv)`` -> (exit code, stdout, stderr)
Run = Callable[..., tuple[int, str, str]]


def in_process(capsys: pytest.CaptureFixture[str]) -> Run:
    """Run the CLI in this process; returns (exit code, stdout, stderr)."""

    def run(*argv: str) -> tuple[int, str, str]:
        capsys.readouterr()
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run
