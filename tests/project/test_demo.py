"""``ckpt-engine demo`` in its fast form: train, SIGKILL mid-save, resume, identical losses."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _paths import ROOT

from ckpt_engine.cli import main
from ckpt_engine.demo import add_demo_arguments, check_settings, settings_from_args
from ckpt_engine.plugin_manager import installed_plugins

pytestmark = pytest.mark.full  # the demo: train, SIGKILL, resume

ASYNC = "pinned_staging" in installed_plugins()


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd:
            found.append(f"{pid}: {cmd}")
    return found


def _run_demo(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(["demo", *argv])
    out, err = capsys.readouterr()
    return code, out + err


def test_fast_demo_kills_mid_save_and_resumes_bit_identically(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "demo"
    code, out = _run_demo(capsys, "--fast", "--out", str(out_dir))
    assert code == 0, out
    save_dir = out_dir / "checkpoints"
    # Async when the plugin is installed, else synchronous, and it says which.
    if ASYNC:
        assert "saves: async (pinned_staging" in out
    else:
        assert "saves: synchronous (pinned_staging, the async plugin, is not installed)" in out
    # The kill lands in the first save from step 9 (iteration 9), or, in the rare run where that
    # save commits before the worker sees it writing, in the next one (12); it never commits.
    m = re.search(r"step +(\d+): save of iter_(\d+) in progress \(\d+ data file\(s\) on disk\) -> SIGKILL", out)
    assert m and m.group(1) == str(int(m.group(2))), out
    killed = int(m.group(1))
    assert killed == 9 or (killed == 12 and "(the save committed before the worker could pause" in out)
    resumed = killed - 3
    assert "worker killed: exit code -9 (SIGKILL)" in out
    assert re.search(rf"\.iter_{killed:09}\.partial .*uncommitted", out)
    assert re.search(rf"{resumed}\s+iter_{resumed:09} .*<- latest", out)  # latest at the kill: the last commit
    # The resume loads the last committed checkpoint in a fresh process and reports what it loaded.
    assert f"loaded {save_dir / f'iter_{resumed:09}'} (iteration {resumed}, rule: latest)" in out
    assert "model: 12 loaded, 0 overlap, 0 skipped, 0 missing, 0 unexpected" in out
    # Losses after the resume equal the reference, step for step.
    rows = re.findall(r"^ +(\d+) +([\d.]+) +([\d.]+) +(same|DIFFERENT)$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(resumed + 1, 13))
    assert all(r[1] == r[2] and r[3] == "same" for r in rows)
    assert f"OK: all {12 - resumed} steps after the resume are bit-identical to the uninterrupted run." in out
    assert re.search(r"Saves: 4 committed, [\d.]+ (KiB|MiB) each\. Median: save\(\) blocked training \d+ ms", out)
    # One checkpoint, one size, one unit: its save line and its row of the `ckpt-engine ls` table.
    saved_as = re.search(rf"committed iter_{resumed:09}  ([\d.]+ \w+), ", out)
    listed_as = re.search(rf"^ +{resumed} +iter_{resumed:09} +\S+ +([\d.]+ \w+) ", out, re.M)
    assert saved_as and listed_as and saved_as.group(1) == listed_as.group(1), out
    # On disk: the resumed run re-saved what was lost; nothing is left uncommitted.
    assert (save_dir / "latest_checkpoint.txt").read_text() == "iter_000000012\n"
    assert sorted(p.name for p in save_dir.iterdir() if p.name.startswith((".iter", "iter"))) == [
        f"iter_{i:09}" for i in (3, 6, 9, 12)
    ]
    assert _processes_mentioning(str(save_dir)) == []
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "Plot: skipped (matplotlib is not installed" in out
    else:
        assert (out_dir / "demo.png").stat().st_size > 10_000
    # The workers' event stream is kept for debugging; every save reported its timings.
    assert (out_dir / "worker-train.log").exists() and (out_dir / "worker-resume.log").exists()


def test_demo_sync_flag_and_a_rerun_into_its_own_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_dir = tmp_path / "demo"
    out_dir.mkdir()
    (out_dir / "mine.txt").write_text("keep me")
    code, out = _run_demo(capsys, "--fast", "--out", str(out_dir))
    assert code == 2 and "exists and was not made by the demo" in out
    assert (out_dir / "mine.txt").read_text() == "keep me"

    code, out = _run_demo(
        capsys,
        "--fast",
        "--sync",
        "--no-plot",
        "--steps",
        "8",
        "--save-every",
        "2",
        "--kill-at",
        "5",
        "--out",
        str(tmp_path / "d2"),
    )
    assert code == 0, out
    assert "saves: synchronous" in out
    assert "save of iter_000000006 in progress" in out and "iteration 4, rule: latest" in out
    assert "(synchronous: all of it blocks)" in out
    assert not (tmp_path / "d2" / "demo.png").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--kill-at", "40"], "no save at or after --kill-at 40 within --steps 12"),
        (["--kill-at", "2"], "--kill-at 2 must come after the first save (step 3)"),
        (["--batch", "31", "--ranks", "2"], "--batch 31 must be divisible by --ranks 2"),
        (["--steps", "0"], "must be positive"),
    ],
)
def test_demo_rejects_impossible_settings(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = _run_demo(capsys, "--fast", "--out", str(tmp_path / "d"), *argv)
    assert code == 2 and message in out
    assert not (tmp_path / "d").exists()


def test_default_settings_kill_in_the_middle_and_leave_a_checkpoint_to_resume() -> None:
    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    for argv in ([], ["--fast"], ["--steps", "100"], ["--fast", "--steps", "30", "--save-every", "5"]):
        s = settings_from_args(parser.parse_args(argv))
        assert check_settings(s, 1) is None and check_settings(s, 2) is None, argv
        kill_save = -(-s.kill_at // s.save_every) * s.save_every
        assert s.save_every < kill_save < s.steps, argv


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("CKPT_ENGINE_SLOW_TESTS"), reason="about 45 s on 2 CPU cores: set CKPT_ENGINE_SLOW_TESTS=1"
)
def test_two_rank_demo(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run_demo(capsys, "--fast", "--ranks", "2", "--no-plot", "--out", str(tmp_path / "demo"))
    assert code == 0, out
    assert "2 gloo ranks under torchrun, FSDP2-sharded" in out
    assert "(torchrun agent, ranks, writers)" in out
    assert "OK: all 6 steps after the resume are bit-identical" in out
    assert _processes_mentioning(str(tmp_path / "demo")) == []


#: Import names of the ``test`` extra's distributions where they differ from the distribution name.
_IMPORT_NAMES = {"pytest-timeout": "pytest_timeout", "pytest-xdist": "xdist", "types-PyYAML": None, "moto": "moto"}


def _test_only_modules() -> list[str]:
    """The top-level modules of pyproject's ``test`` extra that the engine's own dependencies lack."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {re.split(r"[\s<>=!;\[]", d, maxsplit=1)[0].lower() for d in project["dependencies"]}
    out = []
    for dist in project["optional-dependencies"]["test"]:
        name = re.split(r"[\s<>=!;\[]", dist, maxsplit=1)[0]
        module = _IMPORT_NAMES.get(name, name.replace("-", "_"))
        if module and name.lower() not in core:
            out.append(module)
    return out


def test_demo_sh_installs_the_demo_extra_and_ci_the_test_extra() -> None:
    demo = (ROOT / "scripts" / "demo.sh").read_text()
    assert '-e ".[demo]"' in demo and "[test" not in demo.split("pip install", 1)[1].split("\n", 1)[0]
    assert '".[test]"' in (ROOT / ".ci" / "run").read_text()
    assert {"pytest", "moto", "lightning", "transformers", "mypy", "safetensors"} <= set(_test_only_modules())


@pytest.mark.parametrize(
    "ranks",
    [
        "1",
        pytest.param(
            "2",
            marks=[
                pytest.mark.dist,
                pytest.mark.slow,
                pytest.mark.skipif(
                    not os.environ.get("CKPT_ENGINE_SLOW_TESTS"),
                    reason="about 45 s on 2 CPU cores: set CKPT_ENGINE_SLOW_TESTS=1",
                ),
            ],
        ),
    ],
)
def test_the_demo_needs_nothing_from_the_test_extra(tmp_path: Path, ranks: str) -> None:
    """scripts/demo.sh installs only the ``demo`` extra: the demo, its worker processes and (with
    ``--ranks 2``) torchrun's ranks run with every ``test``-extra module hidden, as if not installed."""
    hidden = _test_only_modules()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "from importlib.machinery import PathFinder\n"
        f"HIDDEN = {set(hidden)!r}\n"
        "class _Hiding:\n"  # the path finder, blind to the hidden packages: find_spec says None, as uninstalled
        "    @staticmethod\n"
        "    def find_spec(name, path=None, target=None):\n"
        "        return None if name.split('.')[0] in HIDDEN else PathFinder.find_spec(name, path, target)\n"
        "    @staticmethod\n"
        "    def invalidate_caches():\n"
        "        PathFinder.invalidate_caches()\n"
        "    find_distributions = PathFinder.find_distributions\n"  # entry points: the built-in plugins
        "sys.meta_path[:] = [_Hiding if f is PathFinder else f for f in sys.meta_path]\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "ckpt_engine", "demo", "--fast", "--no-plot", "--ranks", ranks]
    proc = subprocess.run(
        [*argv, "--out", str(tmp_path / "demo")], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "bit-identical to the uninterrupted run" in proc.stdout
    probe = subprocess.run(
        [sys.executable, "-c", "import pytest"], env=env, capture_output=True, text=True, timeout=120
    )
    assert probe.returncode != 0 and "No module named 'pytest'" in probe.stderr  # the hiding works
