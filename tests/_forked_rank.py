"""What torchrun starts as each rank of a test launch: a stand-in that has the fork server of the
test process (tests/_forked.py, address in ``CKPT_TEST_FORK_SERVER``) fork the real script, and
then is that rank as far as torchrun can tell.

``torchrun ... tests/_forked_rank.py SCRIPT ARGS`` runs ``SCRIPT ARGS`` with the environment
torchrun gave this process (``RANK``, ``LOCAL_RANK``, ``MASTER_PORT``, ``TORCHELASTIC_*``), its
folder and its stdin, stdout and stderr, in a child forked from a process that has imported torch:
0.3-0.4 CPU-s a rank instead of 4-5 for a new interpreter. The rank is a real process (its own pid,
a real gloo group, real signals); this stand-in imports nothing heavy, passes on the signals torchrun
sends (SIGTERM when another rank failed), and ends as the rank ended: the same exit code, or killed
by the same signal. If torchrun SIGKILLs the stand-in, the server kills the rank (its status socket
closed), so no rank outlives its launch.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from typing import Any

from _forked import ADDRESS_VAR, PRELOAD_VAR, Remote, _recv, make_request

#: What torchrun's agent sends a rank it stops; each is passed on to the real rank.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> None:
    script, *args = argv[1:]
    preload = [name for name in os.environ.get(PRELOAD_VAR, "").split(",") if name]
    request = make_request(script, args, os.environ, timeout=None, preload=preload)
    connection = Remote(os.environ[ADDRESS_VAR]).request(request, [0, 1, 2])
    started = _receive(connection)
    if "pid" not in started or "returncode" in started:
        sys.exit(f"_forked_rank.py: the fork server could not start {script}: {started}")
    pid = started["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, frame: os.kill(pid, signum))
    returncode = int(_receive(connection)["returncode"])
    if returncode < 0:  # end as the rank did: killed by the same signal
        if -returncode not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-returncode, signal.SIG_DFL)
        os.kill(os.getpid(), -returncode)
    os._exit(returncode)


def _receive(connection: socket.socket) -> dict[str, Any]:
    message = _recv(connection)
    if message is None:
        sys.exit("_forked_rank.py: the fork server closed the connection (it exited)")
    return message


if __name__ == "__main__":
    main(sys.argv)
