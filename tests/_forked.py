"""Run a script as ``__main__`` in a child forked from a server that has already imported torch.

A test that needs a separate process (to SIGKILL it mid-save, to send it SIGTERM, to hold a lock
from another pid) used to start ``python script.py``, and each child paid 2-4 CPU-seconds of
``import torch`` and DCP before its first line. Here one server process per test process imports
torch, ``torch.distributed.checkpoint`` and ``ckpt_engine`` once (``PRELOAD``, plus what a call
names in ``preload=``) and forks a child per call, which then runs the script exactly as
``python`` would: a fresh ``__main__`` module, ``sys.argv``, ``sys.path[0]`` the script's folder,
the environment, working folder and stdin/stdout/stderr of the call (on file descriptors 0-2, so
C-level writes, ``os._exit`` and child processes keep working), and the interpreter's own exit:
non-daemon threads joined, ``atexit`` hooks run, the exit status of ``sys.exit`` or 1 with the
traceback of an uncaught exception. The child is a real OS process (real signals, real files, its
own pid); ``ForkedProcess`` is used like ``subprocess.Popen`` (``pid``, ``poll``, ``wait``,
``communicate``, ``send_signal``, ``kill``) and ``returncode`` is what ``subprocess`` gives:
``-9`` for a SIGKILL. ``run`` is ``subprocess.run(..., capture_output=True, text=True)``.

Every child has a hang guard (``timeout``, 300 s unless given): past it the server kills the child
(its process group when it leads one), its pipes close, and ``wait``/``run`` raise
``ForkedTimeout`` naming the script. It bounds a hang, never a duration a test checks. The child
is also killed as soon as whoever asked for it is gone (its status socket closed), as a direct
child dies with a job that is killed.

Besides a script, a call runs ``Code`` (``python -c``) or a ``Module`` (``python -m``), can pass
file descriptors at their numbers (``pass_fds``) and share the caller's stdout and stderr. The
server also listens on an abstract unix socket (``server_address()``, ``ADDRESS_VAR``), so that
processes the test did not start ask it too: every child it forked, which starts its
``pinned_staging`` writers with ``forked_writer`` unless ``CKPT_ENGINE_TEST_WRITERS=fresh`` is in
its environment, and the ``python`` stand-in (``python_stand_in()``, tests/_forked_python.py): a
child given it as ``sys.executable`` (``python=``) has what it starts as Python forked as well
(torchrun's ranks, a benchmark's workers).

Cost: the server's start, once per test process (about 3.5 CPU-s: what a fresh child paid each
time); then 0.3-0.4 CPU-s a child, mostly its exit tearing down the interpreter it inherited
(``gc.freeze()`` before each fork keeps that from copying the server's objects), against 4-5
CPU-s for a fresh child that imports torch and DCP. The server waits for its waiters, and they for
their children, so a child's CPU time counts in the test process's (``ForkedProcess.cpu_s`` is the
child's own).

Use this for a child that imports torch and only needs to be a separate process. Keep
``subprocess`` with ``sys.executable`` for a child that imports nothing heavy (a bare interpreter
is cheaper than a fork's exit), and where the test is about a fresh interpreter: the import cost or
which modules an import pulls in, ``python -c``/``-m`` entry points, the console script and
packaging, the demo command as users run it, a main guard, or anything fixed at interpreter start.
What a fork cannot give, because the server fixed it when it started:

- ``PYTHONHASHSEED`` and the other interpreter options (``-X``, ``-W``, ``PYTHONDONTWRITEBYTECODE``);
- the modules the server imported, imported once, from the server's ``PYTHONPATH``: a call's
  ``PYTHONPATH`` adds folders to ``sys.path`` but re-imports nothing;
- ``OMP_NUM_THREADS``: the server runs with 1 (``torch.set_num_threads(1)``, no thread started
  before a fork); a child's own ``OMP_NUM_THREADS`` above 1 is applied with ``torch.set_num_threads``,
  and without it the child keeps 1 where a fresh interpreter would use every core;
- stdin: ``/dev/null`` unless ``stdin=PIPE``, never the test process's.

``PYTHONUNBUFFERED`` in a call's environment makes the child's stdout write through, as it would.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import fcntl
import gc
import importlib
import importlib.machinery
import json
import os
import runpy
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

PIPE = subprocess.PIPE
DEVNULL = subprocess.DEVNULL
STDOUT = subprocess.STDOUT
#: What the server imports before its first fork: what nearly every child imports.
PRELOAD = ("torch", "torch.distributed.checkpoint", "ckpt_engine", "ckpt_engine.testing")
#: The hang guard of a child when the call gives none.
DEFAULT_TIMEOUT_S = 300.0
#: The largest request (its environment, mostly) and status message.
MAX_MESSAGE = 1 << 20
#: The most file descriptors a call passes on besides stdin, stdout and stderr (``pass_fds``).
MAX_PASS_FDS = 8
#: The interpreter running this module (a forked child's ``sys.executable`` may be the stand-in).
REAL_PYTHON = sys.executable


@dataclass(frozen=True)
class Code:
    """Source to run as ``python -c CODE`` runs it (``sys.argv[0] == "-c"``, ``sys.path[0] == ""``)."""

    source: str


@dataclass(frozen=True)
class Module:
    """A module to run as ``python -m NAME`` runs it (``sys.argv[0]`` its file, ``sys.path[0]`` the
    working folder)."""

    name: str


class ForkedTimeout(AssertionError):
    """A forked child ran past its hang guard and was killed."""


# -- the test process's side -----------------------------------------------------------------------


class _Server:
    """The server process and the socket requests reach it on."""

    def __init__(self) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # Read at import, so set before the server starts: one intra-op thread, and no background
        # thread from the jemalloc in pyarrow (transformers imports it), which would make forking unsafe.
        env = {**os.environ, "OMP_NUM_THREADS": "1", "JE_ARROW_MALLOC_CONF": "background_thread:false"}
        self.proc = subprocess.Popen(
            [REAL_PYTHON, str(Path(__file__).resolve()), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C of the test run is not the server's
        )
        theirs.close()
        self.owner = os.getpid()
        self.control = mine
        self.lock = threading.Lock()
        ready = _recv(mine)  # bounded by the server's progress: it answers or its socket closes
        if ready is None or ready.get("error"):
            problem = "it exited" if ready is None else ready["error"]
            raise RuntimeError(f"the fork server (tests/_forked.py) did not start: {problem}")
        #: Where processes this one did not start (tests/_forked_python.py) reach
        #: it: an abstract unix socket name, without its leading NUL.
        self.address: str = ready["address"]

    def alive(self) -> bool:
        return self.owner == os.getpid() and self.proc.poll() is None

    def request(self, request: dict[str, Any], stdio: list[int]) -> socket.socket:
        """Send one request with the child's stdin/stdout/stderr (and ``pass_fds``); the socket its
        status comes on."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self.lock:
                socket.send_fds(self.control, [json.dumps(request).encode()], [theirs.fileno(), *stdio])
        finally:
            theirs.close()
        return mine

    def close(self) -> None:
        self.control.close()  # the server sees EOF and exits
        if self.owner == os.getpid():
            self.proc.wait()


_server: _Server | Remote | None = None
_server_lock = threading.Lock()
#: The environment variable that gives tests/_forked_python.py the server's address.
ADDRESS_VAR = "CKPT_TEST_FORK_SERVER"
#: ... and the modules (comma-separated) the server imports before forking its run.
PRELOAD_VAR = "CKPT_TEST_FORK_PRELOAD"


class Remote:
    """The server as a process it did not start reaches it (a process it forked, torchrun's rank
    stand-in): a connection to its listening socket per request, which is then that request's
    status socket."""

    def __init__(self, address: str) -> None:
        self.address = address

    def alive(self) -> bool:
        return True

    def request(self, request: dict[str, Any], stdio: list[int]) -> socket.socket:
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            connection.connect("\0" + self.address)
            socket.send_fds(connection, [json.dumps(request).encode()], stdio)
        except BaseException:
            connection.close()
            raise
        return connection


def _the_server() -> _Server | Remote:
    global _server
    with _server_lock:
        if _server is None or not _server.alive():
            _server = _Server()
            atexit.register(_server.close)
        return _server


#: Set to "fresh" to start ``pinned_staging``'s writers in new interpreters, as users' jobs do.
WRITERS_VAR = "CKPT_ENGINE_TEST_WRITERS"


def forked_writer(args: list[str], pass_fds: tuple[int, int], env: dict[str, str]) -> ForkedProcess:
    """``pinned_staging``'s writer (the plugin's ``start_writer``), forked from the server: the same
    module, pipes, environment and exit statuses as the new interpreter a user's job starts, at a
    tenth of the CPU. The tests start writers by the hundred."""
    from ckpt_engine_plugins.pinned_staging.process import WRITER_MODULE

    return popen(
        Module(WRITER_MODULE),
        *args,
        env=env,
        inherit_env=False,
        pass_fds=pass_fds,
        stdout=1,
        stderr=2,
        timeout=None,  # the writer exits when its training process's pipe end closes
        preload=("ckpt_engine_plugins.pinned_staging.ipc",),
    )


def forks_writers(env: Mapping[str, str]) -> bool:
    """Whether a process with ``env`` forks its writers (the default) or starts new interpreters."""
    return env.get(WRITERS_VAR, "forked") == "forked"


_stand_in: list[str] = []
#: Set to "fresh" for a ``python_stand_in()`` that is the real interpreter: new interpreters, as users' jobs start.
PYTHON_VAR = "CKPT_ENGINE_TEST_PYTHON"


def python_stand_in() -> str:
    """An executable that runs ``python ARGS`` as a child forked from this test process's server
    (tests/_forked_python.py), and ``exec``s the real interpreter where it cannot: a child given it
    as ``sys.executable`` (``popen(..., python=python_stand_in())``) forks what it starts too.
    ``CKPT_ENGINE_TEST_PYTHON=fresh``: the real interpreter instead."""
    if os.environ.get(PYTHON_VAR) == "fresh":
        return REAL_PYTHON
    with _server_lock:
        if not _stand_in:
            folder = tempfile.mkdtemp(prefix="ckpt-forked-python-")
            atexit.register(shutil.rmtree, folder, True)
            path = os.path.join(folder, "python")
            tests = os.path.dirname(os.path.abspath(__file__))
            code = f"import sys; sys.path.insert(0, {tests!r}); import _forked_python as m; m.main(sys.argv[1:])"
            with open(path, "w") as f:  # a shell script: no limit on the interpreter's path, spaces allowed
                # -S: no site; the stand-in needs only the standard library
                f.write(f'#!/bin/sh\nexec {shlex.quote(REAL_PYTHON)} -S -c {shlex.quote(code)} "$0" "$@"\n')
            os.chmod(path, 0o755)
            _stand_in.append(path)
        return _stand_in[0]


def server_address() -> str:
    """The address of this test process's server (started if need be), for ``ADDRESS_VAR``."""
    return _the_server().address


def _capture_fd() -> int:
    """An unlinked temporary file opened for appending: a child's output, read back with pread."""
    fd, path = tempfile.mkstemp(prefix="ckpt-forked-")
    os.unlink(path)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_APPEND)
    return fd


def _read_capture(fd: int) -> str:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 1 << 20, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks).decode(errors="replace")


class _Stream:
    """One of the child's stdin/stdout/stderr as the test process holds it."""

    def __init__(self, spec: int | None, reading: bool) -> None:
        #: What the child gets (sent to the server, closed here once sent).
        self.child_fd: int
        self.file: IO[str] | None = None  # PIPE: the test's end
        self.capture: int | None = None  # the default for stdout/stderr: a file read back
        if spec == PIPE:
            r, w = os.pipe()
            self.child_fd, mine = (w, r) if reading else (r, w)
            self.file = open(mine, "r" if reading else "w", encoding="utf-8", errors="replace")  # noqa: SIM115
        elif spec == DEVNULL or (spec is None and not reading):
            self.child_fd = os.open(os.devnull, os.O_RDWR)
        elif spec is None:
            self.capture = _capture_fd()
            self.child_fd = os.dup(self.capture)
        elif spec >= 0:
            self.child_fd = os.dup(spec)  # the caller's own file descriptor, shared as Popen shares it
        else:
            raise ValueError(f"stream {spec!r}: use None (captured, /dev/null for stdin), PIPE, DEVNULL or a fd")

    def same(self) -> _Stream:
        """Another stream that writes where this one does (``stderr=STDOUT``)."""
        twin = _Stream(DEVNULL, reading=True)
        os.close(twin.child_fd)
        twin.child_fd = os.dup(self.child_fd)
        return twin

    def text(self) -> str | None:
        return None if self.capture is None else _read_capture(self.capture)

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.capture is not None:
            os.close(self.capture)
            self.capture = None


class ForkedProcess:
    """A child forked by the server, used like ``subprocess.Popen`` in text mode.

    ``stdout``/``stderr`` are files to read where the call asked for ``PIPE``; otherwise they are
    captured to files and ``communicate()`` returns them once the child has exited. Leaving the
    ``with`` block kills a child still running and waits for it."""

    def __init__(self, args: list[str], status: socket.socket, streams: tuple[_Stream, _Stream, _Stream]) -> None:
        self.args = args
        self.returncode: int | None = None
        self.timed_out = False
        self._status = status
        self._status_lock = threading.Lock()  # poll/wait from several threads, as Popen allows
        self._streams = streams
        self.stdin, self.stdout, self.stderr = (s.file for s in streams)
        self._readers: dict[int, tuple[threading.Thread, list[str]]] = {}
        first = _recv(status)  # the child says so once its streams, folder and environment are set
        if first is None or "returncode" in first or "error" in first:
            try:
                self._finish(first)
            finally:
                status.close()
            raise RuntimeError(self.describe(f"failed before running its script (rc={self.returncode})"))
        self.pid: int = first["pid"]

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Kill the child if it still runs, wait for it, and release its status and captures."""
        if self.poll() is None:
            self.kill()
            self._collect(None)
        self._status.close()
        for stream in self._streams:
            stream.close()

    def poll(self) -> int | None:
        """The exit status, or None while the child runs (never raises ``ForkedTimeout``)."""
        self._collect(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit status (``-N`` after signal N); ``subprocess.TimeoutExpired`` past ``timeout``;
        ``ForkedTimeout`` when the hang guard killed the child."""
        if not self._collect(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        if self.timed_out:
            raise ForkedTimeout(self.describe(f"ran past its hang guard and was killed (rc={self.returncode})"))
        assert self.returncode is not None
        return self.returncode

    def _collect(self, timeout: float | None) -> bool:
        """Whether the child has exited, its status read within ``timeout``. The status socket
        stays open until ``__exit__`` (readable at its end), so threads may wait at once."""
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                return False
            with self._status_lock:
                if self.returncode is None:
                    self._finish(_recv(self._status))
        return True

    def _finish(self, message: dict[str, Any] | None) -> None:
        if message is None or "error" in message:
            problem = "its waiter is gone" if message is None else message["error"]
            raise RuntimeError(f"{self.args}: the fork server could not run it: {problem}")
        self.returncode = int(message["returncode"])
        self.timed_out = bool(message.get("timed_out"))
        #: The child's CPU seconds (user and system; its own children not counted).
        self.cpu_s = float(message.get("cpu_s", 0.0))

    def communicate(self, input: str | None = None, timeout: float | None = None) -> tuple[str, str]:
        """Write ``input`` (then close stdin), read the piped streams to their end, wait for the
        exit; returns stdout and stderr (piped or captured, ``""`` for ``DEVNULL``)."""
        if self.stdin is not None and not self.stdin.closed:
            if input:
                self.stdin.write(input)
            self.stdin.close()
        for file in (self.stdout, self.stderr):
            if file is not None and id(file) not in self._readers:
                chunks: list[str] = []
                reader = threading.Thread(target=lambda f=file, c=chunks: c.append(f.read()), daemon=True)
                reader.start()
                self._readers[id(file)] = (reader, chunks)
        for reader, _ in self._readers.values():
            reader.join(timeout)
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
        self.wait(timeout)
        return self._text(1), self._text(2)

    def _text(self, index: int) -> str:
        stream = self._streams[index]
        if stream.file is not None:
            return "".join(self._readers[id(stream.file)][1]) if id(stream.file) in self._readers else ""
        return stream.text() or ""

    def output(self) -> tuple[str, str]:
        """What the child wrote so far to its captured stdout and stderr (``""`` where piped)."""
        return self._streams[1].text() or "", self._streams[2].text() or ""

    def describe(self, what: str) -> str:
        out, err = self.output()
        return f"{self.args} {what}\n--- stdout ---\n{out[-4000:]}\n--- stderr ---\n{err[-6000:]}"

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


Target = str | os.PathLike[str] | Code | Module


def popen(
    target: Target,
    *args: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    stdin: int | None = None,
    stdout: int | None = None,
    stderr: int | None = None,
    start_new_session: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    preload: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    inherit_env: bool = True,
    python: str | None = None,
) -> ForkedProcess:
    """Start ``python target *args`` (``Code``: ``python -c``, ``Module``: ``python -m``) as a
    forked child.

    ``env`` is added to this process's environment (is the whole environment where
    ``inherit_env=False``); ``stdin`` is ``/dev/null`` unless ``PIPE``; ``stdout``/``stderr`` are
    captured to files unless ``PIPE``, ``DEVNULL`` or a file descriptor of this process to share;
    ``pass_fds`` are file descriptors the child gets at the same numbers (``Popen``'s
    ``pass_fds``); ``stderr=STDOUT`` sends both to one place; ``preload`` names modules the server
    imports before forking (once per server: ``lightning``, ``s3fs``, transformers); ``timeout`` is the hang guard
    (``None``: none); ``python`` is the child's ``sys.executable`` (``python_stand_in()``: what it
    starts with it is forked too)."""
    full_env = {**(os.environ if inherit_env else {}), **(env or {})}
    if python is not None:
        full_env[ADDRESS_VAR] = server_address()
    request = make_request(target, args, full_env, cwd, start_new_session, timeout, preload, pass_fds, python)
    argv = request["argv"]
    out = _Stream(stdout, reading=True)
    streams = (_Stream(stdin, reading=False), out, out.same() if stderr == STDOUT else _Stream(stderr, reading=True))
    try:
        status = _the_server().request(request, [*(s.child_fd for s in streams), *pass_fds])
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    finally:
        for stream in streams:
            os.close(stream.child_fd)
    return ForkedProcess(argv, status, streams)


def make_request(
    target: Target,
    args: Sequence[str | os.PathLike[str]],
    env: Mapping[str, str],
    cwd: str | os.PathLike[str] | None = None,
    new_session: bool = False,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    preload: Sequence[str] = (),
    pass_fds: Sequence[int] = (),
    python: str | None = None,
) -> dict[str, Any]:
    """What the server is sent to start ``python target *args`` with exactly ``env``."""
    if len(pass_fds) > MAX_PASS_FDS or any(fd <= 2 for fd in pass_fds):
        raise ValueError(f"pass_fds {list(pass_fds)}: at most {MAX_PASS_FDS}, none of them 0-2")
    if isinstance(target, Code):
        argv = ["-c", *(os.fspath(a) for a in args)]
    elif isinstance(target, Module):
        argv = ["-m", target.name, *(os.fspath(a) for a in args)]
    else:
        argv = [os.fspath(target), *(os.fspath(a) for a in args)]
    return {
        "script": argv[0] if isinstance(target, str | os.PathLike) else None,
        "code": target.source if isinstance(target, Code) else None,
        "module": target.name if isinstance(target, Module) else None,
        "argv": argv,
        "env": dict(env),
        "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
        "new_session": new_session,
        "timeout": timeout,
        "preload": list(preload),
        "pass_fds": list(pass_fds),
        "fork_writers": forks_writers(env),
        "python": python,
    }


def run(
    target: Target,
    *args: str | os.PathLike[str],
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    input: str | None = None,
    timeout: float | None = DEFAULT_TIMEOUT_S,
    preload: Sequence[str] = (),
    inherit_env: bool = True,
    python: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run([python, target, *args], capture_output=True, text=True)`` in a forked
    child; ``ForkedTimeout`` when it runs past ``timeout``."""
    stdin = PIPE if input is not None else None
    options: dict[str, Any] = {"env": env, "cwd": cwd, "stdin": stdin, "timeout": timeout, "preload": preload}
    options["python"] = python
    with popen(target, *args, inherit_env=inherit_env, **options) as proc:
        out, err = proc.communicate(input)
        return subprocess.CompletedProcess(proc.args, proc.wait(), out, err)


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.send(json.dumps(message).encode())


def _recv(sock: socket.socket) -> dict[str, Any] | None:
    """One message, or None at EOF (the other end exited)."""
    try:
        data = sock.recv(MAX_MESSAGE)
    except ConnectionResetError:
        return None
    return json.loads(data) if data else None


# -- the server's side -------------------------------------------------------------------------------

#: ``sys.path`` past its first entry and the server's ``PYTHONPATH``: the interpreter's own folders.
_BASE_PATH: list[str] = []
#: The server's own address, in the server and every process it forks.
_ADDRESS: list[str] = []
#: Set when an import left a thread running in the server: no fork from it is safe any more.
_broken: str | None = None


@dataclass
class _Child:
    """What a forked child runs, and the streams and status socket it was given."""

    request: dict[str, Any]
    status: socket.socket
    #: The child's stdin, stdout and stderr, then what it gets at the numbers of ``pass_fds``.
    fds: list[int]


def _pythonpath(env: Mapping[str, str]) -> list[str]:
    return [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]


def _preload(modules: Sequence[str]) -> str | None:
    """Import ``modules`` here, before any fork; why not, or None. An import that leaves a thread
    running breaks the server: a fork copies only the forking thread, not the locks it holds."""
    global _broken
    for name in modules:
        if _broken is None and name not in sys.modules:
            try:
                importlib.import_module(name)
            except BaseException:
                return f"importing {name} failed in the fork server:\n{traceback.format_exc()}"
            if len(os.listdir("/proc/self/task")) > 1:
                _broken = f"importing {name} started a thread in the fork server: forking from it is unsafe"
    return _broken


def _server_main(fd: int) -> _Child | None:
    """The server: import, say so, serve; returns in a forked child only (None: the client left)."""
    control = socket.socket(fileno=fd)
    base = sys.path[1:]
    pythonpath = _pythonpath(os.environ)
    _BASE_PATH[:] = base[len(pythonpath) :] if base[: len(pythonpath)] == pythonpath else base
    problem = _preload(PRELOAD)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    address = f"ckpt-forked-{os.getpid()}-{os.urandom(4).hex()}"
    listener.bind("\0" + address)  # Linux's abstract names: no file to clean up
    _ADDRESS.append(address)
    listener.listen(64)
    _send(control, {"ready": os.getpid(), "error": problem, "address": address})
    return None if problem else _serve(control, listener)


def _serve(control: socket.socket, listener: socket.socket) -> _Child | None:
    """One forked waiter per request, which forks the child and reports its exit status. Requests
    come from the test process (``control``: a status socket, then the descriptors) and from
    processes it did not start (a connection to ``listener``: the connection is the status socket)."""
    while True:
        _reap()
        readable = select.select([control, listener], [], [])[0]
        if listener in readable:
            connection = listener.accept()[0]
            connection.settimeout(60.0)  # a rank's stand-in sends its request as it connects
            try:
                data, fds, _, _ = socket.recv_fds(connection, MAX_MESSAGE, 3 + MAX_PASS_FDS)
            except OSError:
                data, fds = b"", []
            connection.settimeout(None)
            child = _start(control, listener, data, connection, fds) if data else None
            if child is not None:
                return child
        if control in readable:
            try:
                data, fds, _, _ = socket.recv_fds(control, MAX_MESSAGE, 4 + MAX_PASS_FDS)
            except ConnectionResetError:
                data = b""
            if not data:
                _reap()
                return None
            child = _start(control, listener, data, socket.socket(fileno=fds[0]), fds[1:])
            if child is not None:
                return child


def _start(
    control: socket.socket, listener: socket.socket, data: bytes, status: socket.socket, passed: list[int]
) -> _Child | None:
    """Fork the waiter of one request; returns in the child only."""
    request = json.loads(data)
    problem = _preload(request["preload"])
    if problem is not None:
        _send(status, {"error": problem})
    else:
        gc.freeze()  # no collection in a child walks (and so copies) the server's objects
        if os.fork() == 0:
            control.close()
            listener.close()
            return _waiter(_Child(request, status, passed))
    status.close()
    for fd in passed:
        os.close(fd)
    return None


def _reap() -> None:
    """Collect the waiters that have exited: waited for, their CPU time (and their child's) counts
    in the server's, and so in the test process's once it waits for the server."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def _waiter(child: _Child) -> _Child:
    """In the waiter: fork the child and return in it; here, report its exit status and exit."""
    try:
        pid = os.fork()
    except OSError as err:
        _send(child.status, {"error": f"fork: {err}"})
        os._exit(1)
    if pid == 0:
        return child
    for fd in child.fds:
        os.close(fd)
    os._exit(_report(child.status, pid, child.request["timeout"]))


def _kill(pid: int) -> None:
    """SIGKILL the child, and the process group it leads (its own children too) if it leads one."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)


def _report(status: socket.socket, pid: int, timeout: float | None) -> int:
    """Wait for the child and send its exit status. The child is killed at ``timeout`` (the hang
    guard), and as soon as whoever asked for it is gone (its status socket closed: a test process
    that died, or a torchrun rank's stand-in that torchrun killed), as a direct child would be."""
    exited = os.pidfd_open(pid)
    ready = select.select([exited, status.fileno()], [], [], timeout)[0]  # retried after a signal (PEP 475)
    timed_out = not ready
    if exited not in ready:
        _kill(pid)
    _, code, usage = os.wait4(pid, 0)
    cpu_s = usage.ru_utime + usage.ru_stime
    message = {"pid": pid, "returncode": os.waitstatus_to_exitcode(code), "timed_out": timed_out, "cpu_s": cpu_s}
    with contextlib.suppress(OSError):
        _send(status, message)
    return 0


def _enter(child: _Child) -> None:
    """Become the process ``python`` would have started: session, streams, folder, environment,
    ``sys.argv`` and ``sys.path``; then tell the test process the child's pid."""
    request = child.request
    if request["new_session"]:
        os.setsid()
    _place_fds(child)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    script = request["script"]
    if request["module"] is not None:
        first = os.getcwd()
    else:
        first = "" if script is None else os.path.dirname(os.path.realpath(script))
    sys.path[:] = [first, *_pythonpath(request["env"]), *_BASE_PATH]
    encoding = sys.__stdout__.encoding if sys.__stdout__ is not None else "utf-8"
    sys.stdin = open(0, encoding=encoding, closefd=False)  # noqa: SIM115
    sys.stdout = open(1, "w", encoding=encoding, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding=encoding, errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr  # type: ignore[misc]
    sys.stderr.reconfigure(line_buffering=True)
    if request["env"].get("PYTHONUNBUFFERED"):
        sys.stdout.reconfigure(write_through=True)
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # as in a fresh interpreter, a random seed, not the server's (``random`` reseeds itself)
        threads = request["env"].get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 1:
            torch.set_num_threads(int(threads))
    if request["python"] is not None:
        sys.executable = request["python"]
    global _server
    _server = Remote(_ADDRESS[0])  # what this process forks, it asks the same server for
    if request["fork_writers"]:
        _fork_writers()
    _send(child.status, {"pid": os.getpid()})
    child.status.close()


def _fork_writers() -> None:
    """In a child that will start ``pinned_staging`` writers: fork them from the server too."""
    try:
        from ckpt_engine_plugins.pinned_staging import process
    except ImportError:
        return
    process.start_writer = forked_writer


def _place_fds(child: _Child) -> None:
    """Put the child's stdio on 0-2 and each passed descriptor on its number in the test process.
    Everything received moves above the numbers first, so no move closes a descriptor still needed."""
    high = 3 + max([*child.request["pass_fds"], *child.fds, child.status.fileno()])
    status = fcntl.fcntl(child.status.fileno(), fcntl.F_DUPFD_CLOEXEC, high)
    child.status.close()
    child.status = socket.socket(fileno=status)
    moved = []
    for fd in child.fds:
        moved.append(fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, high))
        os.close(fd)
    for target, fd in zip([0, 1, 2, *child.request["pass_fds"]], moved, strict=True):
        os.dup2(fd, target)  # inheritable, as Popen leaves them
        os.close(fd)
    child.fds = []


def _run_as_main(request: dict[str, Any]) -> None:
    """Execute the script (or ``-c`` code) in a fresh ``__main__`` module, as ``python`` does: an
    uncaught exception prints its traceback (from the script's frame) and exits with 1."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __package__=None, __spec__=None)
    script = request["script"]
    if script is not None:
        main.__file__ = os.path.abspath(script)
        main.__loader__ = importlib.machinery.SourceFileLoader("__main__", main.__file__)
        main.__cached__ = None  # type: ignore[attr-defined]
    try:
        if request["module"] is not None:
            sys.argv = sys.argv[1:]  # runpy puts the module's file in place of its name
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            return
        sys.modules["__main__"] = main
        if script is not None:
            with open(script, "rb") as f:
                source: str | bytes = f.read()
        else:
            source = request["code"]
        exec(compile(source, script or "<string>", "exec", dont_inherit=True), main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)  # from the script's own frame
        raise SystemExit(1) from None


def _child_main(child: _Child) -> None:
    try:
        _enter(child)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(70)
    _run_as_main(child.request)


if __name__ == "__main__":  # the server: started by _Server, never by hand
    _CHILD = _server_main(int(sys.argv[1]))
    if _CHILD is not None:  # a forked child: the script runs, then this interpreter's usual exit
        _child_main(_CHILD)
