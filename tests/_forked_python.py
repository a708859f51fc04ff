"""A ``python`` whose runs are forked: what the executable of ``_forked.python_stand_in()`` runs.

A child forked with ``python=_forked.python_stand_in()`` sees that executable as ``sys.executable``,
so the processes it starts the way Python code starts Python (``[sys.executable, script, ...]``,
``-c``, ``-m``; torchrun's ranks, a benchmark's worker, ``check_exact_resume``'s runs) come from
the fork server of the test process too (tests/_forked.py, address in ``CKPT_TEST_FORK_SERVER``):
0.3-0.4 CPU-s each instead of 4-5 for a new interpreter that imports torch.

``STAND_IN [-u] SCRIPT ARGS`` (or ``-c CODE ARGS``, ``-m MODULE ARGS``) has the server fork the
run with this process's environment, folder, stdin, stdout and stderr, and is then that run as far
as its parent can tell: it passes on the signals a parent sends (SIGTERM from torchrun when another
rank failed) and ends as the run ended, with the same exit code or killed by the same signal. If the
stand-in is SIGKILLed, the server kills the run (its status socket closed), so no run outlives it.
The stand-in imports nothing heavy (it starts without ``site``). What it does not know (another
interpreter option, ``-`` or no script, no server address in the environment) runs the real
interpreter in its place, so a caller sees no difference but the cost.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

from _forked import ADDRESS_VAR, PRELOAD_VAR, Code, Module, Remote, Target, _recv, make_request

#: What a parent sends a run it stops (torchrun's agent: SIGTERM); each is passed on to the run.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
#: The interpreter options the stand-in takes, and what each sets in the run's environment
#: (torchrun starts its ranks with ``-u``).
OPTIONS = {"-u": ("PYTHONUNBUFFERED", "1")}


def parse(argv: list[str]) -> tuple[Target, list[str], dict[str, str]] | None:
    """``python``'s arguments as a target, its arguments and the run's environment; None for a
    command line the stand-in leaves to the real interpreter."""
    env = dict(os.environ)
    while argv and argv[0] in OPTIONS:
        key, value = OPTIONS[argv[0]]
        env[key] = value
        argv = argv[1:]
    if len(argv) >= 2 and argv[0] == "-c":
        return Code(argv[1]), argv[2:], env
    if len(argv) >= 2 and argv[0] == "-m":
        return Module(argv[1]), argv[2:], env
    if not argv or argv[0].startswith("-"):
        return None
    return argv[0], argv[1:], env


def main(argv: list[str]) -> None:
    """``argv``: the stand-in's path, then ``python``'s arguments (the stand-in's shell script runs
    ``python -S -c 'main(sys.argv[1:])' "$0" "$@"``)."""
    parsed = parse(argv[1:])
    address = os.environ.get(ADDRESS_VAR)
    if parsed is None or not address:
        os.execv(sys.executable, [sys.executable, *argv[1:]])
    target, args, env = parsed
    preload = [name for name in env.get(PRELOAD_VAR, "").split(",") if name]
    python = os.path.abspath(argv[0])
    request = make_request(target, args, env, timeout=None, preload=preload, python=python)
    connection = Remote(address).request(request, [0, 1, 2])
    started = _receive(connection, python)
    if "pid" not in started or "returncode" in started:
        sys.exit(f"{python}: the fork server could not start {request['argv']}: {started}")
    pid = started["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    returncode = int(_receive(connection, python)["returncode"])
    if returncode < 0:  # end as the run did: killed by the same signal
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    os._exit(returncode)


def _receive(connection: socket.socket, python: str) -> dict[str, Any]:
    message = _recv(connection)
    if message is None:  # named as the stand-in: under ``-c``, ``sys.argv[0]`` is "-c"
        sys.exit(f"{python}: the fork server closed the connection (it exited)")
    return message
