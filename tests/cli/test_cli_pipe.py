"""``ckpt-engine ... | head``: a reader that goes away ends the command quietly, as with other
Unix tools (exit status 141, the shell's code for SIGPIPE), with no traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.full  # over 2 s on 2 cores: a CLI process
def test_closed_stdout_is_a_quiet_sigpipe_exit() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ckpt_engine", "plugins"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err and "error" not in err.lower()
