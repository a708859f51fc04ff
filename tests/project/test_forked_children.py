"""``tests/_forked.py``: children forked from a server that imported torch behave like ``python
script.py`` children where the tests rely on it: their own pid and exit status (``-9`` after a
SIGKILL), their streams on file descriptors 1 and 2, the call's environment, folder and argv, the
interpreter's exit, and a hang guard that kills a stuck child and says so."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _forked import PIPE, Code, ForkedTimeout, Module, popen, python_stand_in, run

pytestmark = pytest.mark.full  # over 2 s on 2 cores: the fork server's start (as for its users)

SCRIPT = """
import atexit, os, sys, threading, time
print("argv", sys.argv[1:], "main", __name__, "file", __file__ == os.path.abspath(sys.argv[0]))
print("path0", sys.path[0], "cwd", os.getcwd(), "var", os.environ.get("FORKED_VAR"))
print("helper", __import__("forked_helper").VALUE, "torch", "torch" in sys.modules)
os.write(2, b"written by fd 2\\n")
atexit.register(lambda: print("atexit hook", flush=True))
threading.Thread(target=lambda: (time.sleep(0.05), print("thread joined"))).start()
sys.exit(int(sys.argv[1]))
"""


def test_a_script_runs_as_main_with_the_calls_argv_env_folder_and_streams(tmp_path: Path) -> None:
    script = tmp_path / "scripts" / "child.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "forked_helper.py").write_text("VALUE = 42\n")
    env = {"FORKED_VAR": "set", "PYTHONPATH": f"{extra}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = run(script, "7", env=env, cwd=tmp_path)
    assert done.returncode == 7, done.stderr
    assert done.stdout.splitlines() == [
        "argv ['7'] main __main__ file True",
        f"path0 {script.parent} cwd {tmp_path} var set",
        "helper 42 torch True",  # the server's import, not the child's
        "thread joined",  # the interpreter's exit: threads joined, then atexit hooks
        "atexit hook",
    ]
    assert done.stderr == "written by fd 2\n"
    assert "FORKED_VAR" not in os.environ  # the call's environment only

    failed = run(Code("import os, sys\nprint('before', flush=True)\n1 / 0"))
    assert failed.returncode == 1 and failed.stdout == "before\n"
    assert failed.stderr.startswith('Traceback (most recent call last):\n  File "<string>", line 3')
    assert failed.stderr.endswith("ZeroDivisionError: division by zero\n")
    assert run(Code("import os; os.write(1, b'raw'); os._exit(5)")).stdout == "raw"
    assert run(Code("import sys; print(sys.stdin.read().upper())"), input="piped").stdout == "PIPED\n"
    seeds = {run(Code("import torch; print(torch.initial_seed(), torch.rand(1).item())")).stdout for _ in range(2)}
    assert len(seeds) == 2  # each child's generator seeded afresh, as each fresh interpreter's is
    as_c = run(Code("import sys; print(sys.argv, repr(sys.path[0]), sys.executable)"), "a b")
    assert as_c.stdout == f"['-c', 'a b'] '' {sys.executable}\n"  # as ``python -c CODE 'a b'``


def test_a_module_runs_as_python_m_with_passed_descriptors_at_their_numbers(tmp_path: Path) -> None:
    """What ``pinned_staging``'s writer is started with in the tests: ``-m``, two pipe ends at the
    caller's numbers, an environment given whole, and the caller's own stdout and stderr."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "echo.py").write_text(
        "import os, sys\n"
        "fd_in, fd_out = int(sys.argv[1]), int(sys.argv[2])\n"
        "os.write(fd_out, os.read(fd_in, 100).upper())\n"
        "print(__name__, sys.argv[0] == __file__, sys.path[0], sorted(os.environ), flush=True)\n"
        "os.write(2, b'to fd 2\\n')\n"
    )
    out = tmp_path / "out.txt"
    child_in, to_child = os.pipe()
    from_child, child_out = os.pipe()
    with open(out, "w") as sink:
        proc = popen(
            Module("pkg.echo"),
            str(child_in),
            str(child_out),
            env={"PYTHONPATH": str(tmp_path), "ONLY": "this"},
            inherit_env=False,
            cwd=tmp_path,
            pass_fds=(child_in, child_out),
            stdout=sink.fileno(),
            stderr=sink.fileno(),
        )
        os.close(child_in), os.close(child_out)
        os.write(to_child, b"ping")
        assert os.read(from_child, 100) == b"PING"
        assert proc.wait() == 0
    assert out.read_text() == f"__main__ True {tmp_path} ['ONLY', 'PYTHONPATH']\nto fd 2\n"
    failed = run(Module("pkg.missing"), env={"PYTHONPATH": str(tmp_path)})
    assert failed.returncode == 1 and "No module named pkg.missing" in failed.stderr
    with pytest.raises(ValueError, match="none of them 0-2"):
        popen(Module("pkg.echo"), pass_fds=(1,))


def test_a_signalled_child_reports_the_signal_as_subprocess_does() -> None:
    ready = "import os, sys, time\nos.setpgid(0, 0)\nprint(os.getpid(), os.getppid(), flush=True)\ntime.sleep(600)"
    with popen(Code(ready), stdout=PIPE) as proc:
        assert proc.stdout is not None
        pid, parent = map(int, proc.stdout.readline().split())
        assert pid == proc.pid != os.getpid() and parent != os.getpid()  # forked by the server
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGKILL)  # the group it made: a real process, a real kill
        assert proc.wait() == -signal.SIGKILL
    with popen(Code(ready), stdout=PIPE) as proc:
        assert proc.stdout is not None and proc.stdout.readline()
        proc.terminate()
        out, err = proc.communicate()
        assert proc.returncode == -signal.SIGTERM and (out, err) == ("", "")


def test_a_child_that_hangs_is_killed_at_its_timeout_and_named() -> None:
    hang = Code("import time\nprint('stuck here', flush=True)\ntime.sleep(600)")
    with pytest.raises(ForkedTimeout, match=r"\['-c'\] ran past its hang guard and was killed \(rc=-9\)") as info:
        run(hang, timeout=0.5)
    assert "stuck here" in str(info.value)  # what it wrote before the kill
    # A session leader is killed with its group: its own child does not outlive it.
    tree = "import subprocess, sys, time\nprint(subprocess.Popen(['sleep', '600']).pid, flush=True)\ntime.sleep(600)"
    with popen(Code(tree), stdout=PIPE, start_new_session=True, timeout=0.5) as proc:
        assert proc.stdout is not None
        grandchild = int(proc.stdout.readline())
        with pytest.raises(ForkedTimeout):
            proc.wait()
    with pytest.raises(subprocess.TimeoutExpired), popen(Code("import time; time.sleep(600)")) as running:
        running.wait(0.01)  # the Popen-like wait of a running child
    while not _gone(grandchild):  # bounded by the kill's progress: SIGKILL cannot be caught
        time.sleep(0.01)


def test_a_child_whose_requester_is_gone_is_killed() -> None:
    """What keeps a run from outliving the ``python`` stand-in that asked for it (tests/_forked_python.py):
    once the status socket's other end closes (the requester died), the server kills the child."""
    proc = popen(Code("import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)"), stdout=PIPE)
    assert proc.stdout is not None
    pid = int(proc.stdout.readline())
    assert not _gone(pid)
    proc._status.close()  # as the requester's death closes it
    while not _gone(pid):  # bounded by the kill's progress
        time.sleep(0.01)
    proc.stdout.close()


def _gone(pid: int) -> bool:
    """The process is dead (a zombie waiting for its parent counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


_STAND_IN_CHECK = """
import subprocess, sys
code = "import sys; print('torch' in sys.modules, sys.argv[1:], flush=True); sys.exit(int(sys.argv[1]))"
for argv in (["-c", code, "3"], ["-u", "-c", code, "0"], ["-E", "-c", code, "5"]):
    done = subprocess.run([sys.executable, *argv], capture_output=True, text=True)
    print(done.returncode, done.stdout.strip(), flush=True)
"""


def test_a_child_given_the_python_stand_in_forks_what_it_starts() -> None:
    """``python=python_stand_in()``: the child's ``sys.executable`` runs ``-c``/``-m``/scripts as
    forked children (torch already imported), with their exit codes and arguments; an option the
    stand-in does not know (``-E``) runs the real interpreter (torch not imported)."""
    done = run(Code(_STAND_IN_CHECK), python=python_stand_in())
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["3 True ['3']", "0 True ['0']", "5 False ['5']"]


def test_the_python_stand_in_ends_as_its_run_did() -> None:
    """A signal sent to the stand-in reaches the run, and the stand-in ends killed by it (as
    torchrun's agent sees a rank it stopped)."""
    code = "import os, sys, time\nprint(os.getpid(), flush=True)\ntime.sleep(600)"
    script = "import subprocess, sys\n"
    script += f"proc = subprocess.Popen([sys.executable, '-c', {code!r}], stdout=subprocess.PIPE)\n"
    script += "pid = int(proc.stdout.readline())\nproc.terminate()\nprint(proc.wait(), pid, flush=True)\n"
    done = run(Code(script), python=python_stand_in())
    returncode, pid = done.stdout.split()
    assert done.returncode == 0 and int(returncode) == -signal.SIGTERM, done.stderr
    assert _gone(int(pid))
