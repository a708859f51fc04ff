"""``ckpt-engine demo``: train, get killed with SIGKILL in the middle of a save, resume, compare.

1. A worker process trains the model for ``--steps`` steps without interruption: the reference.
2. The same worker then trains the same model from scratch with a checkpoint every
   ``--save-every`` steps (async with the ``pinned_staging`` plugin when it is installed, else
   synchronous). From step ``--kill-at`` on, it watches its next save; as soon as the save has
   started writing files, it pauses itself (SIGSTOP) and the demo kills it, and every process
   under it, with SIGKILL: the save is never committed.
3. A fresh worker process resumes from ``latest_checkpoint.txt`` and trains to the end.
4. The resumed losses must equal the reference losses, bit for bit, step for step.

``--ranks 2`` runs every worker under ``torchrun`` with 2 gloo ranks and an FSDP2-sharded model.
Workers talk to the demo through ``DEMO {json}`` lines on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .._markers import hookimpl
from ..errors import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["Settings", "add_demo_arguments", "run_demo"]

MARKER = ".ckpt-engine-demo"
ASYNC_PLUGIN = "pinned_staging"


@dataclass(frozen=True)
class Settings:
    steps: int = 60
    save_every: int = 10
    kill_at: int = 43  # default_kill_at(Settings()): what the demo uses unless --kill-at is given
    hidden: int = 512
    layers: int = 6
    batch: int = 128
    in_dim: int = 32
    seed: int = 0
    lr: float = 1e-3


FAST = Settings(steps=12, save_every=3, kill_at=9, hidden=64, layers=2, batch=32)


def add_demo_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument("--steps", type=int, help=f"training steps (default {d.steps}; --fast: {FAST.steps})")
    p.add_argument("--save-every", type=int, help=f"checkpoint every N steps (default {d.save_every})")
    p.add_argument(
        "--kill-at",
        type=int,
        help="kill during the first save at or after this step (default: just past 70%% of --steps, "
        f"{default_kill_at(d)} for the defaults; --fast: {default_kill_at(FAST)})",
    )
    p.add_argument("--hidden", type=int, help=f"model width (default {d.hidden})")
    p.add_argument("--layers", type=int, help=f"residual blocks (default {d.layers})")
    p.add_argument("--batch", type=int, help=f"global batch size (default {d.batch})")
    p.add_argument("--out", default=os.path.join("runs", "demo"), help="output folder (default runs/demo)")
    p.add_argument("--ranks", type=int, choices=(1, 2), default=1, help="1 process, or 2 gloo ranks under torchrun")
    p.add_argument("--fast", action="store_true", help="a tiny model and few steps (a few seconds; what CI runs)")
    p.add_argument("--sync", action="store_true", help=f"synchronous saves even if {ASYNC_PLUGIN} is installed")
    p.add_argument("--no-plot", action="store_true", help="do not save the loss plot")
    p.add_argument("--timeout", type=float, default=600.0, help="give up on a worker after this many seconds")


def settings_from_args(args: argparse.Namespace) -> Settings:
    base = FAST if args.fast else Settings()
    changes = {
        name: getattr(args, name)
        for name in ("steps", "save_every", "kill_at", "hidden", "layers", "batch")
        if getattr(args, name, None) is not None
    }
    s = dataclasses.replace(base, **changes)
    if "kill_at" not in changes:
        s = dataclasses.replace(s, kill_at=default_kill_at(s))
    return s


def default_kill_at(s: Settings) -> int:
    """The default kill point keeps its place relative to the run: just past 70% of it."""
    return max(s.save_every + 1, int(s.steps * 0.7) + 1)


def check_settings(s: Settings, ranks: int) -> str | None:
    if min(s.steps, s.save_every, s.hidden, s.layers, s.batch) < 1:
        return "--steps, --save-every, --hidden, --layers and --batch must be positive"
    if s.batch % ranks:
        return f"--batch {s.batch} must be divisible by --ranks {ranks}"
    first_save = s.save_every
    kill_save = -(-s.kill_at // s.save_every) * s.save_every
    if s.kill_at <= first_save:
        return f"--kill-at {s.kill_at} must come after the first save (step {first_save}), so there is one to resume"
    if kill_save > s.steps:
        return f"no save at or after --kill-at {s.kill_at} within --steps {s.steps} (saves every {s.save_every})"
    return None


# -- the training job (shared by the reference run and the workers) -----------------------------


def build_model(s: Settings) -> nn.Module:
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(width)
            self.fc = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = x + nn.functional.gelu(self.fc(self.norm(x)))
            return out

    class DemoNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.stem = nn.Linear(s.in_dim, s.hidden)
            self.blocks = nn.ModuleList(Block(s.hidden) for _ in range(s.layers))
            self.head = nn.Linear(s.hidden, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.stem(x)
            for block in self.blocks:
                h = block(h)
            out: torch.Tensor = self.head(h)
            return out

    torch.manual_seed(s.seed)
    return DemoNet()


def teacher_targets(s: Settings, x: torch.Tensor) -> torch.Tensor:
    """A fixed smooth function of the inputs for the model to learn."""
    import torch

    g = torch.Generator().manual_seed(s.seed + 4242)
    w = torch.randn(s.in_dim, 8, generator=g) / s.in_dim**0.5
    return torch.sin(x @ w).sum(dim=1, keepdim=True)


def batch_for(s: Settings, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The data of one step is a function of the step: a resumed run sees the same batches."""
    import torch

    g = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
    x = torch.randn(s.batch, s.in_dim, generator=g)
    y = teacher_targets(s, x)
    return x[rank::world], y[rank::world]


@dataclass
class Job:
    settings: Settings
    model: Any
    optimizer: Any
    scheduler: Any
    scaler: Any
    rank: int = 0
    world: int = 1

    @classmethod
    def create(cls, s: Settings, rank: int = 0, world: int = 1) -> Job:
        import torch

        model = build_model(s)
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:  # type: ignore[union-attr]
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.01)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=s.steps, eta_min=s.lr * 0.05)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=5)
        return cls(s, model, optimizer, scheduler, scaler, rank, world)

    def objects(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "optimizer": self.optimizer,
            "scheduler": self.scheduler,
            "grad_scaler": self.scaler,
        }

    def step(self, step: int) -> float:
        import torch
        from torch import nn

        x, y = batch_for(self.settings, step, self.rank, self.world)
        loss = nn.functional.mse_loss(self.model(x), y)
        self.optimizer.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        value = loss.detach().clone()
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(value)
            value /= self.world
        return float(value.to(torch.float64))


def parameter_count(s: Settings) -> int:
    return sum(p.numel() for p in build_model(s).parameters())


# -- worker -----------------------------------------------------------------------------------

_emit_lock = threading.Lock()


def emit(event: str, **fields: Any) -> None:
    line = "DEMO " + json.dumps({"event": event, **fields}) + "\n"
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
    from .._engine.engine import CheckpointEngine

    if role == "train":
        # The uninterrupted reference run: the same job, fresh objects, no checkpoints.
        t0 = time.perf_counter()
        ref = Job.create(s, rank, world)
        for step in range(1, s.steps + 1):
            loss = ref.step(step)
            if rank == 0:
                emit("reference-step", step=step, loss=loss)
        del ref
        if rank == 0:
            emit("reference-done", seconds=time.perf_counter() - t0)
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
    if rank == 0:
        emit("done")


# -- the demo (parent) ------------------------------------------------------------------------


@dataclass
class RunLog:
    """What the demo learned from one worker's events."""

    losses: dict[int, float] = field(default_factory=dict)
    reference: dict[int, float] = field(default_factory=dict)
    saves: dict[int, dict[str, Any]] = field(default_factory=dict)
    loaded: dict[str, Any] | None = None
    kill: dict[str, Any] | None = None
    returncode: int | None = None
    seconds: float = 0.0


def _worker_cmd(role: str, s: Settings, save_dir: str, async_saves: bool, ranks: int) -> list[str]:
    args = ["--worker", role, "--settings", json.dumps(dataclasses.asdict(s)), "--save-dir", save_dir]
    if async_saves:
        args.append("--async-saves")
    if ranks == 1:
        return [sys.executable, "-m", "ckpt_engine.demo", *args]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "--max-restarts=0",
        "-m",
        "ckpt_engine.demo",
        *args,
    ]


def _events(stream: Any) -> Iterator[dict[str, Any]]:
    for line in stream:
        if line.startswith("DEMO "):
            try:
                yield json.loads(line[5:])
            except json.JSONDecodeError:
                continue


class DemoFailure(Exception):
    pass


def _run_worker_process(
    role: str,
    s: Settings,
    out: str,
    save_dir: str,
    async_saves: bool,
    ranks: int,
    timeout: float,
    on_event: Any,
) -> RunLog:
    log = RunLog()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", CUDA_VISIBLE_DEVICES="")
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # holds ckpt_engine/
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    err_path = os.path.join(out, f"worker-{role}.log")
    t0 = time.perf_counter()
    with open(err_path, "w") as err_file:
        proc = subprocess.Popen(
            _worker_cmd(role, s, save_dir, async_saves, ranks),
            stdout=subprocess.PIPE,
            stderr=err_file,
            text=True,
            start_new_session=True,
            env=env,
        )
        timer = threading.Timer(timeout, lambda: _kill_group(proc))
        timer.start()
        try:
            assert proc.stdout is not None
            for ev in _events(proc.stdout):
                kind = ev["event"]
                if kind == "step":
                    log.losses[int(ev["step"])] = float(ev["loss"])
                elif kind == "reference-step":
                    log.reference[int(ev["step"])] = float(ev["loss"])
                elif kind in ("saved", "save-returned"):
                    # Merged per iteration: "call" is how long save() blocked the training loop,
                    # measured around the call (a sync save commits inside it, an async one after).
                    entry = log.saves.setdefault(int(ev["iteration"]), {})
                    if kind == "saved":
                        entry.update(ev)
                    else:
                        entry["call"] = ev["blocked"]
                    if "call" in entry and "event" in entry:
                        on_event({**entry, "event": "save-complete"})
                elif kind == "loaded":
                    log.loaded = ev
                elif kind == "kill-point":
                    _kill_group(proc)
                    log.kill = ev
                on_event(ev)
                if log.kill is not None:
                    break
            proc.wait(timeout=60)
            proc.stdout.close()
        finally:
            timer.cancel()
            if proc.poll() is None:
                _kill_group(proc)
                proc.wait()
    log.returncode = proc.returncode
    log.seconds = time.perf_counter() - t0
    if log.kill is None and proc.returncode != 0:
        with open(err_path) as f:
            tail = f.read()[-3000:]
        raise DemoFailure(
            f"the {role} worker failed (exit code {proc.returncode}); its log, {err_path}, ends with:\n{tail}"
        )
    return log


def _children() -> dict[int, list[int]]:
    """ppid -> child pids of every process (``/proc`` on Linux, ``ps`` elsewhere)."""
    tree: dict[int, list[int]] = {}
    pairs: list[tuple[int, int]] = []
    if os.path.isdir("/proc/self"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            fields = stat[stat.rfind(")") + 2 :].split()
            pairs.append((int(name), int(fields[1])))
    else:  # pragma: no cover - macOS and other POSIX systems
        text = subprocess.run(["ps", "-A", "-o", "pid=", "-o", "ppid="], capture_output=True, text=True).stdout
        pairs = [(int(a), int(b)) for a, b in (line.split() for line in text.splitlines() if line.strip())]
    for pid, ppid in pairs:
        tree.setdefault(ppid, []).append(pid)
    return tree


def _descendants(root: int) -> list[int]:
    tree, out, todo = _children(), [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += tree.get(pid, [])
    return out


def _kill_group(proc: subprocess.Popen[str]) -> None:
    """SIGKILL the worker and every process under it: torchrun puts each rank in a session of its
    own, so killing the worker's process group alone would leave the ranks (and their writer
    processes) running. Everything is frozen first, so nothing can start new processes."""
    seen: set[int] = set()
    for _ in range(3):
        new = [p for p in _descendants(proc.pid) if p not in seen]
        if not new:
            break
        for pid in new:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        seen.update(new)
    for pid in seen:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _prepare_out(out: str) -> str:
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise UsageError(f"--out {out} is a file")
        if os.listdir(out) and not os.path.exists(os.path.join(out, MARKER)):
            raise UsageError(f"--out {out} exists and was not made by the demo; choose another folder or empty it")
        shutil.rmtree(out)
    os.makedirs(out)
    with open(os.path.join(out, MARKER), "w") as f:
        f.write("made by `ckpt-engine demo`; the demo deletes and recreates this folder\n")
    return os.path.join(out, "checkpoints")


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def run_demo(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    problem = check_settings(s, args.ranks)
    if problem:
        raise UsageError(problem)
    from ..plugin_manager import installed_plugins

    has_async = ASYNC_PLUGIN in installed_plugins()
    async_saves = has_async and not args.sync
    out = args.out
    save_dir = _prepare_out(out)
    p = print
    t_start = time.perf_counter()

    p("ckpt-engine demo: train, SIGKILL in the middle of a save, resume, compare")
    p(
        f"  model: residual MLP, {s.layers} blocks of width {s.hidden} ({parameter_count(s):,} parameters), "
        "AdamW, cosine LR, grad scaler"
    )
    where = "1 process" if args.ranks == 1 else f"{args.ranks} gloo ranks under torchrun, FSDP2-sharded"
    p(f"  run: {s.steps} steps, batch {s.batch}, a checkpoint every {s.save_every} steps, {where}")
    p(f"  checkpoints: {save_dir}")
    if async_saves:
        p(f"  saves: async ({ASYNC_PLUGIN}: training continues while a background process writes)")
    elif has_async:
        p(f"  saves: synchronous (--sync; {ASYNC_PLUGIN} is installed but not used)")
    else:
        p(f"  saves: synchronous ({ASYNC_PLUGIN}, the async plugin, is not installed)")

    # 2. Train with checkpoints; killed mid-save.
    p("")
    p(f"1. Reference: {s.steps} steps without interruption (in the worker, before its checkpointed run)")
    reference: dict[int, float] = {}

    def show(ev: dict[str, Any]) -> None:
        kind = ev["event"]
        if kind == "reference-step":
            reference[int(ev["step"])] = float(ev["loss"])
        elif kind == "reference-done":
            p(
                f"   loss {reference[1]:.6f} at step 1 -> {reference[s.steps]:.6f} at step {s.steps} "
                f"({ev['seconds']:.1f}s)"
            )
            p("")
            p(
                f"2. The same training with a checkpoint every {s.save_every} steps; SIGKILL during the first save "
                f"from step {s.kill_at}"
            )
        elif kind == "loaded" and ev["source"] == "scratch":
            p(f"   no checkpoint yet: starting from scratch (plugins: {', '.join(ev['plugins'])})")
        elif kind == "writer-ready":
            p(f"   {ASYNC_PLUGIN}'s writer process started in {ev['seconds']:.1f}s (with the engine, before training)")
        elif kind == "save-complete":
            if ev["succeeded"]:
                p(
                    f"   step {ev['iteration']:>4}: committed iter_{ev['iteration']:09}  {_mb(ev['bytes'])}, "
                    f"save() blocked training {_ms(ev['call'])}, committed after {_ms(ev['total'])}"
                )
            else:
                p(f"   step {ev['iteration']:>4}: save FAILED: {ev['error']}")
        elif kind == "kill-missed":
            p(f"   step {ev['iteration']:>4}: (the save committed before the worker could pause; trying the next one)")
        elif kind == "kill-point":
            p(
                f"   step {ev['iteration']:>4}: save of iter_{ev['iteration']:09} in progress "
                f"({ev['files']} data file(s) on disk) -> SIGKILL"
            )

    train = _run_worker_process("train", s, out, save_dir, async_saves, args.ranks, args.timeout, show)
    if len(train.reference) != s.steps:
        raise DemoFailure("the worker did not finish the reference run")
    if train.kill is None:
        raise DemoFailure("the training worker finished without reaching the kill point; lower --kill-at")
    killed_at = int(train.kill["iteration"])
    p(
        f"   worker killed: exit code {train.returncode} (SIGKILL), with every process under it"
        + (" (torchrun agent, ranks, writers)" if args.ranks > 1 else "")
    )
    p("   (the worker paused itself with SIGSTOP once the save was writing, so the kill lands mid-save every run)")
    p("")
    p("   on disk after the kill (`ckpt-engine ls`):")
    _show_ls(save_dir)

    # 3. Resume.
    p("")
    p("3. Resume in a fresh process from latest_checkpoint.txt")

    def show_resume(ev: dict[str, Any]) -> None:
        kind = ev["event"]
        if kind == "loaded":
            p(f"   loaded {ev['path']} (iteration {ev['iteration']}, rule: {ev['source']}) in {_ms(ev['seconds'])}:")
            for line in str(ev["summary"]).splitlines():
                p(f"     {line}")
        else:
            show(ev)

    resume = _run_worker_process("resume", s, out, save_dir, async_saves, args.ranks, args.timeout, show_resume)
    if resume.loaded is None:
        raise DemoFailure("the resumed worker reported no load")
    resumed_from = int(resume.loaded["iteration"])

    # 4. Compare.
    p("")
    first = resumed_from + 1
    p(f"4. Resumed run vs uninterrupted run, steps {first}..{s.steps}")
    same = [step for step in range(first, s.steps + 1) if resume.losses.get(step) == reference[step]]
    prefix_ok = all(train.losses[k] == reference[k] for k in train.losses)
    rows = list(range(first, s.steps + 1))
    shown = rows if len(rows) <= 10 else [*rows[:4], -1, *rows[-4:]]
    p(f"   {'step':>6}  {'uninterrupted':>16}  {'resumed':>16}")
    for step in shown:
        if step == -1:
            p(f"   {'...':>6}")
            continue
        got = resume.losses.get(step)
        mark = "same" if got == reference[step] else "DIFFERENT"
        p(f"   {step:>6}  {reference[step]:>16.10f}  {(got if got is not None else float('nan')):>16.10f}  {mark}")
    ok = len(same) == len(rows) and prefix_ok and len(resume.losses) == len(rows)

    # Saves.
    committed = {**train.saves, **resume.saves}
    good = [ev for ev in committed.values() if ev.get("succeeded") and "call" in ev]
    p("")
    if good:
        calls = sorted(ev["call"] for ev in good)
        totals = sorted(ev["total"] for ev in good)
        median_call, median_total = calls[len(calls) // 2], totals[len(totals) // 2]
        p(
            f"Saves: {len(good)} committed, {_mb(int(sum(ev['bytes'] for ev in good) / len(good)))} each. "
            f"Median: save() blocked training {_ms(median_call)}, committed {_ms(median_total)} after the call"
            + (" (the rest ran in the background writer)." if async_saves else " (synchronous: all of it blocks).")
        )
        if len(calls) > 2:
            p(f"   slowest save() call: {_ms(calls[-1])}; slowest commit: {_ms(totals[-1])}")
    p(
        f"The kill: SIGKILL during the save of iter_{killed_at:09}; it was never committed, "
        f"so the resume loaded iter_{resumed_from:09}."
    )

    if not args.no_plot:
        plot = _plot(os.path.join(out, "demo.png"), s, reference, train, resume, killed_at, resumed_from)
        if plot:
            p(f"Plot: {plot}")
    p(f"Logs: {out}/worker-*.log    total time {time.perf_counter() - t_start:.1f}s")
    p("")
    if ok:
        p(f"OK: all {len(rows)} steps after the resume are bit-identical to the uninterrupted run.")
        p(f"Next: ckpt-engine ls {save_dir}   |   ckpt-engine inspect {save_dir} --component model")
        return 0
    if not prefix_ok:
        p("FAILED: the checkpointed run diverged from the reference before the kill")
    p("FAILED: the resumed run does not match the uninterrupted run")
    return 1


def _show_ls(save_dir: str) -> None:
    """What ``ckpt-engine ls`` shows of the save folder, from the same library code."""
    from .._inspect.listing import list_save_dir, listing_table

    for line in listing_table(list_save_dir(save_dir)):
        print(f"     {line}")


def _plot(
    path: str,
    s: Settings,
    reference: dict[int, float],
    train: RunLog,
    resume: RunLog,
    killed_at: int,
    resumed_from: int,
) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("Plot: skipped (matplotlib is not installed: pip install matplotlib)")
        return None
    fig, ax = plt.subplots(figsize=(9, 4.5))
    steps = sorted(reference)
    ax.plot(steps, [reference[k] for k in steps], color="0.6", linewidth=4, label="uninterrupted run")
    ks = sorted(train.losses)
    ax.plot(ks, [train.losses[k] for k in ks], color="tab:blue", linewidth=1.5, label="run killed mid-save")
    rs = sorted(resume.losses)
    ax.plot(
        rs,
        [resume.losses[k] for k in rs],
        color="tab:orange",
        linestyle="--",
        linewidth=1.5,
        label=f"resumed from iter {resumed_from}",
    )
    saves = sorted(k for k, ev in {**train.saves, **resume.saves}.items() if ev.get("succeeded"))
    for i, k in enumerate(saves):
        ax.axvline(k, color="tab:green", alpha=0.25, linewidth=1, label="checkpoint committed" if i == 0 else None)
    ax.axvline(killed_at, color="tab:red", linewidth=1.5, label=f"SIGKILL during save {killed_at}")
    ax.plot(
        [resumed_from], [reference[resumed_from]], marker="o", color="tab:orange", markersize=8, label="resume point"
    )
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("ckpt-engine demo: killed mid-save, resumed, losses identical")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run_demo_safely(args: argparse.Namespace) -> int:
    try:
        return run_demo(args)
    except DemoFailure as err:
        print(f"FAILED: {err}")
        return 1
