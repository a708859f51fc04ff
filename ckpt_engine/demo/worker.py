"""The demo's worker process: trains the job, saves checkpoints, and reports ``DEMO {json}`` events on stdout."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from .._markers import hookimpl
from .job import Job
from .settings import ASYNC_PLUGIN, Settings

EVENT_PREFIX = "DEMO "
_emit_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    line = EVENT_PREFIX + json.dumps({"event": event, **fields}) + "\n"
    with _emit_lock:
        sys.stdout.write(line)
        sys.stdout.flush()


class DemoObserver:
    """Reports every save's timings (``on_save_done``) to the demo."""

    name = "demo_observer"

    def __init__(self, rank: int) -> None:
        self.rank = rank

    @hookimpl
    def on_save_done(self, result: Any) -> None:
        if self.rank == 0:
            emit(
                "saved",
                iteration=result.iteration,
                succeeded=result.succeeded,
                error=None if result.error is None else f"{type(result.error).__name__}: {result.error}",
                bytes=result.bytes_written,
                blocked=result.blocked_seconds,
                staging=result.staging_seconds,
                write=result.write_seconds,
                total=result.total_seconds,
            )


class KillPointWatcher(threading.Thread):
    """Pauses this process (SIGSTOP) once the save of ``iteration`` has started writing files.

    The demo then kills the paused process group with SIGKILL, so the kill lands in the middle of
    the save on every run, however fast the disk. If the save commits before the watcher sees
    it, the watcher reports a miss and the demo tries the next save.
    """

    def __init__(self, save_dir: str, iteration: int) -> None:
        super().__init__(daemon=True, name="demo-kill-point")
        from .._format.names import iter_dirname, partial_dirname

        self.partial = os.path.join(save_dir, partial_dirname(iteration))
        self.final = os.path.join(save_dir, iter_dirname(iteration))
        self.iteration = iteration
        self.missed = threading.Event()

    def run(self) -> None:
        while True:
            written = _written_files(self.partial)
            if written:
                done = sorted(
                    c for c in os.listdir(self.partial) if os.path.isfile(os.path.join(self.partial, c, ".metadata"))
                )
                started = sorted(c for c in os.listdir(self.partial) if os.path.isdir(os.path.join(self.partial, c)))
                emit("kill-point", iteration=self.iteration, written=done, started=started, files=written)
                os.kill(os.getpid(), signal.SIGSTOP)
                return
            if os.path.isdir(self.final):
                emit("kill-missed", iteration=self.iteration)
                self.missed.set()
                return
            time.sleep(0.0002)


def _written_files(path: str) -> int:
    n = 0
    try:
        for _, _, names in os.walk(path):
            n += sum(1 for name in names if name.endswith(".distcp"))
    except OSError:
        return 0
    return n


def worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ckpt_engine.demo worker")
    parser.add_argument("--worker", choices=("train", "resume"), required=True)
    parser.add_argument("--settings", required=True)
    parser.add_argument("--save-dir", required=True)
    parser.add_argument("--async-saves", action="store_true")
    opts = parser.parse_args(argv)
    s = Settings(**json.loads(opts.settings))

    import logging

    import torch

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    rank, world = 0, int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
    try:
        run_worker(opts.worker, s, opts.save_dir, opts.async_saves, rank, world)
    finally:
        sys.stdout.flush()
        if world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return 0


def run_worker(role: str, s: Settings, save_dir: str, async_saves: bool, rank: int, world: int) -> None:
    if role == "train":
        reference_run(s, rank, world)
    checkpointed_run(role, s, save_dir, async_saves, rank, world)
    if rank == 0:
        emit("done")


def reference_run(s: Settings, rank: int, world: int) -> None:
    """The uninterrupted reference run: the same job, fresh objects, no checkpoints."""
    t0 = time.perf_counter()
    ref = Job.create(s, rank, world)
    for step in range(1, s.steps + 1):
        loss = ref.step(step)
        if rank == 0:
            emit("reference-step", step=step, loss=loss)
    del ref
    if rank == 0:
        emit("reference-done", seconds=time.perf_counter() - t0)


def checkpointed_run(role: str, s: Settings, save_dir: str, async_saves: bool, rank: int, world: int) -> None:
    """Load the latest checkpoint (or start from scratch), then train to the end with a save
    every ``save_every`` steps; the train role arms the kill point from ``kill_at`` on."""
    from .._engine.engine import CheckpointEngine

    job = Job.create(s, rank, world)
    objects: list[Any] = [DemoObserver(rank)]
    # One buffer set, pinned_staging's default: a save waits for the previous one, so at most one
    # save is in flight.
    config = {"save_dir": save_dir, "plugins": [ASYNC_PLUGIN] if async_saves else []}
    with CheckpointEngine(config, plugins=objects) as engine:
        t0 = time.perf_counter()
        result = engine.load(**job.objects())
        if rank == 0:
            emit(
                "loaded",
                iteration=result.iteration,
                path=result.checkpoint_path,
                source=result.source,
                summary=result.report.summary(),
                seconds=time.perf_counter() - t0,
                plugins=list(engine.plugin_names),
            )
        if async_saves:
            # The writer process starts with the engine, alongside the load; a real job trains
            # for a while before its first save, so let it finish starting before the clock runs.
            startup = engine.wait_ready()
            if rank == 0:
                emit("writer-ready", seconds=startup)
        watcher: KillPointWatcher | None = None
        for step in range(result.iteration + 1, s.steps + 1):
            loss = job.step(step)
            if rank == 0:
                emit("step", step=step, loss=loss)
            if step % s.save_every:
                continue
            if role == "train" and rank == 0 and step >= s.kill_at and (watcher is None or watcher.missed.is_set()):
                watcher = KillPointWatcher(save_dir, step)
                watcher.start()
            t_save = time.perf_counter()
            engine.save(step, **job.objects())
            if rank == 0:
                emit("save-returned", iteration=step, blocked=time.perf_counter() - t_save)
