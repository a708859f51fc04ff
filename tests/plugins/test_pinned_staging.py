"""``pinned_staging``: async saves through reused shared buffers and a writer process (one process).

Real writer processes, real DCP checkpoints, real signals: the writer is paused with SIGSTOP to
hold a save "in flight" deterministically, and killed with SIGKILL. Each test checks what a user
would: the content of the checkpoint, what ``latest_checkpoint.txt`` names, what raises.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _paths import ROOT
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin, PinnedWriterError
from ckpt_engine_plugins.pinned_staging.shm import FILE_PREFIX, default_shm_dir
from torch import nn

from ckpt_engine import CheckpointEngine, CheckpointSaveError, CkptEngineError, SaveResult, hookimpl
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal

SCRIPTS = ROOT / "tests" / "dist_scripts"
#: A hang guard only (pytest-timeout ends a test at 420 s): the writer process and the subprocesses
#: took over 60 s on the shared 2-core machine (load average near 20), which failed a test.
TIMEOUT = 300.0


class Recorder:
    """An ``on_save_done`` observer."""

    name = "recorder"

    def __init__(self) -> None:
        self.results: list[SaveResult] = []

    @hookimpl
    def on_save_done(self, result: SaveResult) -> None:
        self.results.append(result)


class Extra:
    """An ``extra=`` component with a CPU tensor, a mutable list and a plain value."""

    def __init__(self) -> None:
        self.tensor = torch.arange(6, dtype=torch.float64)
        self.history = [1, 2, 3]
        self.value: Any = "a"

    def state_dict(self) -> dict[str, Any]:
        return {"tensor": self.tensor, "history": self.history, "value": self.value}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.tensor, self.history, self.value = sd["tensor"], sd["history"], sd["value"]


def make(save_dir: str | Path, **options: Any) -> tuple[CheckpointEngine, PinnedStagingPlugin, Recorder]:
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(**options))
    recorder = Recorder()
    engine = CheckpointEngine({"save_dir": str(save_dir)}, plugins=[plugin, recorder])
    return engine, plugin, recorder


def snapshot(state: TinyTrainingState, extra: Extra | None = None) -> dict[str, Any]:
    snap = {
        "model": copy.deepcopy(state.model.state_dict()),
        "optim": copy.deepcopy(state.optimizer.state_dict()),
        "scheduler": copy.deepcopy(state.scheduler.state_dict()),
        "scaler": copy.deepcopy(state.grad_scaler.state_dict()),
    }
    if extra is not None:
        snap["extra"] = copy.deepcopy(extra.state_dict())
    return snap


def mutate(state: TinyTrainingState, extra: Extra | None = None) -> None:
    """Change every saved value in place, as the next optimizer step would."""
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(100.0)
            for v in state.optimizer.state[p].values():
                v.mul_(3.0)
    state.scheduler.step()
    scaler_sd = state.grad_scaler.state_dict()
    state.grad_scaler.load_state_dict({**scaler_sd, "scale": scaler_sd["scale"] * 2})
    if extra is not None:
        extra.tensor.add_(1000)
        extra.history.append(99)


def load(path: str, tmp_path: Path, hidden: int = 16) -> tuple[TinyTrainingState, Extra, int]:
    """A fresh state filled from the checkpoint folder ``path`` (through the engine, bit-exact)."""
    fresh, extra = TinyTrainingState.create(seed=999, hidden=hidden, steps=1), Extra()
    extra.tensor.zero_()
    config = {"save_dir": str(tmp_path / "loader"), "load_path": path, "load_training_state": True}
    with CheckpointEngine(config) as engine:
        has_extra = os.path.isdir(os.path.join(path, "extra"))
        result = engine.load(**fresh.objects(), extra={"extra": extra} if has_extra else None)
    return fresh, extra, result.iteration


def latest(save_dir: str | Path) -> str | None:
    p = Path(save_dir) / "latest_checkpoint.txt"
    return p.read_text().strip() if p.exists() else None


def shm_files(pid: int | None = None) -> list[str]:
    prefix = f"{FILE_PREFIX}{pid or os.getpid()}."
    return [n for n in os.listdir(default_shm_dir()) if n.startswith(prefix)]


def gone(pid: int, timeout: float = 10.0) -> bool:
    """True once ``pid`` no longer runs (reaped, or a zombie nobody waits for)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


# -- one engine shared by the tests that leave it healthy ---------------------------------------


Shared = tuple[CheckpointEngine, PinnedStagingPlugin, Recorder, Path]


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Shared]:
    save_dir = tmp_path_factory.mktemp("pinned_shared") / "checkpoints"
    engine, plugin, recorder = make(save_dir)
    yield engine, plugin, recorder, save_dir
    engine.close()


@pytest.mark.full  # over 2 s on 2 cores: starts writer processes
def test_save_returns_a_point_in_time_copy(shared: Shared, tmp_path: Path) -> None:
    engine, _, _, save_dir = shared
    state, extra = TinyTrainingState.create(seed=1, steps=2), Extra()
    before = snapshot(state, extra)
    handle = engine.save(5, **state.objects(), extra={"extra": extra})
    mutate(state, extra)  # right after save() returned: must not reach the checkpoint
    after = snapshot(state, extra)
    assert handle.result().succeeded

    loaded, loaded_extra, iteration = load(str(save_dir / "iter_000000005"), tmp_path)
    assert iteration == 5
    assert_state_dicts_equal(snapshot(loaded, loaded_extra), before)
    assert not torch.equal(loaded.model.state_dict()["0.weight"], after["model"]["0.weight"])
    assert loaded_extra.history == [1, 2, 3]  # non-tensor values were deep-copied at save()
    # The live objects kept the mutation; the staged copy never aliased them.
    assert_state_dicts_equal(snapshot(state, extra), after)


def test_back_to_back_saves_are_not_torn(shared: Shared, tmp_path: Path) -> None:
    engine, _, _, save_dir = shared
    state = TinyTrainingState.create(seed=2, steps=1)
    expected = {}
    for iteration in (20, 21, 22):  # no wait in between: each save re-stages into the same buffers
        engine.save(iteration, **state.objects())
        expected[iteration] = snapshot(state)
        mutate(state)
        state.train(1, seed=iteration)
    engine.wait()
    for iteration, snap in expected.items():
        loaded, _, it = load(str(save_dir / f"iter_{iteration:09}"), tmp_path / str(iteration))
        assert it == iteration
        assert_state_dicts_equal(snapshot(loaded), snap)
    assert latest(save_dir) == "iter_000000022"


def test_buffers_are_reused_and_reallocated_when_shapes_change(shared: Shared, tmp_path: Path) -> None:
    engine, plugin, _, save_dir = shared
    state = TinyTrainingState.create(seed=3, steps=1)
    engine.save(30, **state.objects()).result()
    first = plugin.buffer_sets()
    rng = 3 + torch.cuda.device_count()  # the rng component's generators: Python, NumPy, torch CPU, each CUDA device
    assert len(first) == 1 and first[0].tensors == 4 + 4 * 3 + rng and not first[0].busy
    state.train(1, seed=5)
    engine.save(31, **state.objects()).result()
    assert plugin.buffer_sets() == first  # same set, same memory (set id and data pointer)
    assert shm_files() == [], "a buffer file stayed in /dev/shm after the writer mapped it"

    wider = TinyTrainingState.create(seed=4, hidden=24, steps=1)  # new shapes: a new set
    before = snapshot(wider)
    engine.save(32, **wider.objects()).result()
    (second,) = plugin.buffer_sets()
    assert second.set_id != first[0].set_id and second.nbytes > first[0].nbytes
    loaded, _, _ = load(str(save_dir / "iter_000000032"), tmp_path, hidden=24)
    assert_state_dicts_equal(snapshot(loaded), before)


def test_on_save_done_reports_sane_timings_once_per_save(shared: Shared) -> None:
    engine, _, recorder, save_dir = shared
    state = TinyTrainingState.create(seed=5, steps=1)
    recorder.results.clear()
    engine.save(40, **state.objects()).result()
    engine.save(41, **state.objects()).result()
    assert [r.iteration for r in recorder.results] == [40, 41]
    for r in recorder.results:
        assert r.succeeded and r.error is None
        assert r.path == str(save_dir / f"iter_{r.iteration:09}")
        assert r.components == ("model", "optim", "scheduler", "trainer", "rng")
        assert r.bytes_written > 0
        assert 0 < r.staging_seconds <= r.blocked_seconds < r.total_seconds
        assert 0 < r.write_seconds < r.total_seconds


def test_values_the_writer_cannot_import_fail_clearly(shared: Shared, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, plugin, _, save_dir = shared
    before = latest(save_dir)
    pid = plugin.writer_pid

    class ScriptOnly:  # as if defined in a training script run as __main__
        def __init__(self) -> None:
            self.x = 1

    ScriptOnly.__module__, ScriptOnly.__qualname__ = "__main__", "PinnedTestScriptOnly"
    monkeypatch.setattr(sys.modules["__main__"], "PinnedTestScriptOnly", ScriptOnly, raising=False)
    holder = Extra()
    holder.value = ScriptOnly()
    state = TinyTrainingState.create(seed=6, steps=1)
    handle = engine.save(50, **state.objects(), extra={"extra": holder})
    with pytest.raises(CheckpointSaveError, match=r"PinnedTestScriptOnly.*__main__.*importable module"):
        handle.result()
    with pytest.raises(CheckpointSaveError):
        engine.wait()  # the failure is also reported to the next wait()
    assert latest(save_dir) == before and not (save_dir / "iter_000000050").exists()
    assert plugin.writer_pid == pid  # one process: a failed write does not cost the writer

    holder.value = threading.Lock()  # not picklable: refused while staging, in save() itself
    with pytest.raises(CheckpointSaveError, match="picklable"):
        engine.save(51, **state.objects(), extra={"extra": holder})
    engine.save(52, **state.objects()).result()
    assert latest(save_dir) == "iter_000000052"


# -- lifecycle: each test owns its writer ---------------------------------------------------------


@pytest.mark.full  # over 2 s on 2 cores: starts writer processes
def test_writer_killed_mid_save_fails_clearly_and_a_new_writer_takes_over(
    save_dir: str, tmp_path: Path, fresh_writers: None
) -> None:
    """On the writers users' jobs start (the other tests fork theirs, tests/conftest.py)."""
    engine, plugin, recorder = make(save_dir)
    state = TinyTrainingState.create(seed=7, steps=1)
    engine.save(1, **state.objects()).result()
    pid = plugin.writer_pid
    assert pid is not None
    # A new interpreter, a child of this process, that sees no GPU and runs one intra-op thread.
    cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]
    assert [c.decode() for c in cmdline[:3]] == [sys.executable, "-m", "ckpt_engine_plugins.pinned_staging.writer"]
    assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) == os.getpid()
    environ = dict(e.decode().split("=", 1) for e in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0") if e)
    assert (environ["CUDA_VISIBLE_DEVICES"], environ["OMP_NUM_THREADS"]) == ("", "1")
    os.kill(pid, signal.SIGSTOP)  # hold the next save in flight
    handle = engine.save(2, **state.objects())
    assert not handle.done()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(CheckpointSaveError) as info:
        handle.result()
    message = str(info.value)
    assert f"pid {pid}" in message and "SIGKILL" in message and "exit code -9" in message, message
    assert "iteration 2" in message and "not committed" in message, message
    assert isinstance(info.value.__cause__, PinnedWriterError)
    assert latest(save_dir) == "iter_000000001"
    leftovers = [n for n in os.listdir(save_dir) if "iter_000000002" in n]
    assert leftovers == [], f"the failed save left {leftovers}"
    assert [r.succeeded for r in recorder.results] == [True, False]

    # The caller saw that failure through its handle: the next save() proceeds.
    state.train(1, seed=3)
    expected = snapshot(state)
    engine.save(3, **state.objects()).result()  # a new writer took over
    assert plugin.writer_pid not in (None, pid)
    assert latest(save_dir) == "iter_000000003"
    loaded, _, _ = load(os.path.join(save_dir, "iter_000000003"), tmp_path)
    assert_state_dicts_equal(snapshot(loaded), expected)
    engine.close()
    assert shm_files() == []


@pytest.mark.full  # over 2 s on 2 cores: starts writer processes
def test_one_save_in_flight_and_close_drains_it(save_dir: str, tmp_path: Path) -> None:
    engine, plugin, _ = make(save_dir)
    plugin.wait_ready()
    pid = plugin.writer_pid
    assert pid is not None
    state = TinyTrainingState.create(seed=8, steps=1)
    os.kill(pid, signal.SIGSTOP)
    try:
        first = engine.save(1, **state.objects())
        expected1 = snapshot(state)
        mutate(state)
        second = threading.Thread(target=engine.save, args=(2,), kwargs=state.objects())
        second.start()
        second.join(1.0)
        assert second.is_alive(), "with buffers=1 a save must wait while the previous write is pending"
        assert not first.done()
    finally:
        os.kill(pid, signal.SIGCONT)
    second.join(TIMEOUT)
    expected2 = snapshot(state)

    os.kill(pid, signal.SIGSTOP)  # close() must wait for the pending save 2, then stop the writer
    threading.Timer(1.0, os.kill, (pid, signal.SIGCONT)).start()
    t0 = time.monotonic()
    engine.close()
    assert time.monotonic() - t0 > 0.8
    assert latest(save_dir) == "iter_000000002"
    assert first.result().succeeded
    for iteration, expected in ((1, expected1), (2, expected2)):
        loaded, _, _ = load(os.path.join(save_dir, f"iter_{iteration:09}"), tmp_path / str(iteration))
        assert_state_dicts_equal(snapshot(loaded), expected)
    assert gone(pid) and plugin.writer_pid is None
    assert plugin.buffer_sets() == () and shm_files() == []
    with pytest.raises(CkptEngineError, match="closed"):
        engine.save(3, **state.objects())


@pytest.mark.full  # over 2 s on 2 cores: starts writer processes
def test_close_gives_up_after_close_timeout(save_dir: str) -> None:
    engine, plugin, recorder = make(save_dir, close_timeout_s=1.0)
    plugin.wait_ready()
    pid = plugin.writer_pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    engine.save(1, **TinyTrainingState.create(seed=9, steps=1).objects())
    t0 = time.monotonic()
    with pytest.raises(CkptEngineError, match=r"close_timeout_s=1"):
        engine.close()
    # The stopped writer never finishes: close() returning at all shows it gave up, and not
    # before the 1 s it was given.
    assert time.monotonic() - t0 >= 0.9
    assert gone(pid)
    assert latest(save_dir) is None and not os.path.exists(os.path.join(save_dir, "iter_000000001"))
    assert [r.succeeded for r in recorder.results] == [False]


@pytest.mark.full  # over 2 s on 2 cores: starts writer processes
def test_two_buffer_sets_let_a_save_stage_while_the_previous_is_written(save_dir: str, tmp_path: Path) -> None:
    engine, plugin, _ = make(save_dir, buffers=2)
    assert plugin.max_saves_in_flight == 2
    plugin.wait_ready()
    pid = plugin.writer_pid
    assert pid is not None
    state = TinyTrainingState.create(seed=10, steps=1)
    expected = {}
    os.kill(pid, signal.SIGSTOP)
    try:
        first = engine.save(1, **state.objects())
        expected[1] = snapshot(state)
        mutate(state)
        second = engine.save(2, **state.objects())  # does not wait for the stopped writer
        expected[2] = snapshot(state)
        assert not first.done() and not second.done()
        sets = plugin.buffer_sets()
        assert len(sets) == 2 and all(s.busy for s in sets)
        mutate(state)
        third = threading.Thread(target=engine.save, args=(3,), kwargs=state.objects())
        third.start()
        third.join(1.0)
        assert third.is_alive(), "a third save must wait: both buffer sets are being written"
    finally:
        os.kill(pid, signal.SIGCONT)
    third.join(TIMEOUT)
    expected[3] = snapshot(state)
    engine.close()
    assert latest(save_dir) == "iter_000000003"
    for iteration, snap in expected.items():
        loaded, _, _ = load(os.path.join(save_dir, f"iter_{iteration:09}"), tmp_path / str(iteration))
        assert_state_dicts_equal(snapshot(loaded), snap)


@pytest.mark.full  # over 2 s on 2 cores: starts writer processes
def test_exit_without_close_commits_and_needs_no_main_guard(tmp_path: Path) -> None:
    """The script has no ``if __name__ == "__main__":`` guard, never closes its engine and exits
    while its last save is still being written (its writer is paused until after exit began)."""
    save_dir = tmp_path / "checkpoints"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "async_exit_no_guard.py"), str(save_dir)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        env=env,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    lines = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, proc.stdout  # the script body ran once: the writer never re-ran it
    report = lines[0]
    assert report["pending_at_exit"] is True
    assert latest(save_dir) == "iter_000000002"
    model = nn.Linear(32, 32)
    loaded = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    import torch.distributed.checkpoint as dcp

    dcp.load(loaded, checkpoint_id=str(save_dir / "iter_000000002" / "model"))
    assert loaded["weight"].sum().item() == pytest.approx(report["weight_sum"])
    assert loaded["weight"].sum().item() != pytest.approx(report["weight_sum_after"])
    assert gone(report["writer_pid"])
    assert shm_files(report["pid"]) == []


def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="buffer"):
        PinnedStagingPlugin.Options(buffers=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Extra inputs"):
        PinnedStagingPlugin.Options(close_timout_s=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError):
        PinnedStagingPlugin.Options(write_timeout_s=0)


@pytest.mark.full  # the benchmark end to end
def test_benchmark_smoke(tmp_path: Path) -> None:
    """``benchmarks/async_bench.py --smoke`` runs end to end and reports every measure."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("async_bench", ROOT / "benchmarks" / "async_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    threads = torch.get_num_threads()
    try:
        args = [
            "--smoke",
            "--out",
            str(tmp_path / "r.json"),
            "--dir",
            str(tmp_path),
            "--overlap-optimizers",
            "adamw,sgd",
        ]
        results = bench.main(args)
    finally:
        torch.set_num_threads(threads)
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(results))
    (size,) = results["sizes"]
    assert size["tensors"] == 200 and size["bytes_written"] >= size["state_bytes"]
    for key in ("ratio_blocked_over_floor", "ratio_async_total_over_sync", "rss_growth"):
        assert isinstance(size[key], float), key
    assert size["buffer_sets"] == 1
    training = results["training"]
    assert training["no_save_steps_per_s"] > 0 and training["async_steps_per_s"] > 0
    adamw, sgd = results["overlap"]  # (e) with both optimizers: SGD's state is the parameters alone
    assert (adamw["optimizer"], sgd["optimizer"]) == ("adamw", "sgd") and adamw["tensors"] > 0 and sgd["tensors"] > 0
    assert all(o["overlap"]["blocked_over_floor"] > 0 for o in (adamw, sgd))
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]  # its checkpoints were cleaned up


def test_the_skeleton_reads_each_device_mesh_once(one_rank_mesh: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``DeviceMesh.mesh`` is rebuilt on every access; every DTensor of a model shares its mesh,
    so the collector works the mesh out once, with the same result for each tensor."""
    from ckpt_engine_plugins.pinned_staging.collect import collect
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Replicate

    reads: list[int] = []
    real = DeviceMesh.mesh

    def counted(self: DeviceMesh) -> torch.Tensor:
        reads.append(1)
        return real.fget(self)  # type: ignore[attr-defined, no-any-return]

    monkeypatch.setattr(DeviceMesh, "mesh", property(counted))
    state = {"model": {f"w{i}": DTensor.from_local(torch.randn(3), one_rank_mesh, [Replicate()]) for i in range(20)}}
    collector, skeletons = collect(state, share_across_components=True)
    assert len(collector.sources) == 20 and len(collector.meshes) == 1 and "model" in skeletons
    assert collector.meshes[0].ranks == (0,) and len(reads) == 1
