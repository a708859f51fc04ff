"""The measured methods: limits, baselines and ours. Each runs inside a child process.

A method prepares once (untimed: write the checkpoint it loads, allocate destinations), then
runs ``reps`` timed repetitions. ``run`` returns the timings of one repetition: ``time`` for a
plain operation, ``blocking`` and ``total`` for an asynchronous save.
"""

from __future__ import annotations

import contextlib
import gc
import os
import shutil
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from _bench_state import StateModule, make_tensors

warnings.filterwarnings("ignore", message="torch.distributed is disabled")
warnings.filterwarnings("ignore", message="Detected an existing checkpoint")
warnings.filterwarnings("ignore", category=FutureWarning)


class Skip(Exception):
    """The method cannot run here; the message says why (it lands in the table and the JSON)."""


@dataclass
class Ctx:
    """What a method sees: the state, where to write, and knobs from the command line."""

    shapes: list[tuple[str, tuple[int, ...], torch.dtype]]
    state: dict[str, torch.Tensor]
    nbytes: int
    workdir: str
    dir_kind: str  # "repo" or "shm"
    threads: int
    scratch: dict[str, Any] = field(default_factory=dict)

    def path(self, name: str) -> str:
        return os.path.join(self.workdir, name)

    def zeros(self) -> dict[str, torch.Tensor]:
        return make_tensors(self.shapes, fill=False)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _byte_view(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def drop_caches() -> str | None:
    """Drop the page cache; ``None`` if done, else why not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return None
    except OSError as err:
        return f"cannot drop the page cache ({err.strerror or err}): cold reads not measured"


def _rm(path: str) -> None:
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.exists(path):
        os.remove(path)


@contextlib.contextmanager
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


class Method:
    name = ""
    group = ""  # "limit", "baseline", "ours"
    op = ""  # "save", "load", "copy", "async"
    cold = False
    reference = ""  # the limit this row is compared with

    def prepare(self, ctx: Ctx) -> None:
        pass

    def before_rep(self, ctx: Ctx, rep: int) -> None:
        if self.cold:
            why = drop_caches()
            if why:
                raise Skip(why)

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        raise NotImplementedError

    def after_rep(self, ctx: Ctx, rep: int) -> None:
        pass

    def close(self, ctx: Ctx) -> None:
        pass


def _timed(fn: Callable[[], Any]) -> dict[str, float]:
    t0 = time.perf_counter()
    fn()
    return {"time": time.perf_counter() - t0}


# -- limits ------------------------------------------------------------------------------------


def _raw_write(ctx: Ctx, path: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in ctx.state.values():
            view = _byte_view(t)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        os.close(fd)


class RawWrite(Method):
    name, group, op = "raw_write", "limit", "save"
    reference = "raw_write"

    def before_rep(self, ctx: Ctx, rep: int) -> None:
        _rm(ctx.path("raw.bin"))

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        return _timed(lambda: _raw_write(ctx, ctx.path("raw.bin")))


class RawRead(Method):
    name, group, op = "raw_read", "limit", "load"
    reference = "raw_read"

    def prepare(self, ctx: Ctx) -> None:
        _raw_write(ctx, ctx.path("raw.bin"))
        ctx.scratch["dest"] = ctx.zeros()
        self.run(ctx, -1)  # warm the page cache

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        def read() -> None:
            fd = os.open(ctx.path("raw.bin"), os.O_RDONLY)
            try:
                offset = 0
                for t in ctx.scratch["dest"].values():
                    view = _byte_view(t)
                    done = 0
                    while done < len(view):
                        n = os.preadv(fd, [view[done:]], offset + done)
                        if n <= 0:
                            raise OSError("short read")
                        done += n
                    offset += len(view)
            finally:
                os.close(fd)

        return _timed(read)


class RawReadCold(RawRead):
    name, cold = "raw_read_cold", True
    reference = "raw_read_cold"


class Memcpy(Method):
    name, group, op = "memcpy", "limit", "copy"
    reference = "memcpy"

    def prepare(self, ctx: Ctx) -> None:
        ctx.scratch["dest"] = ctx.zeros()  # allocated and touched once

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        dest = ctx.scratch["dest"]

        def copy() -> None:
            for k, t in ctx.state.items():
                dest[k].copy_(t)

        return _timed(copy)


# -- baselines ---------------------------------------------------------------------------------


class TorchSave(Method):
    name, group, op, reference = "torch_save", "baseline", "save", "raw_write"

    def before_rep(self, ctx: Ctx, rep: int) -> None:
        _rm(ctx.path("state.pt"))

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        def save() -> None:
            with open(ctx.path("state.pt"), "wb") as f:
                torch.save(ctx.state, f)
                f.flush()
                os.fsync(f.fileno())

        return _timed(save)


class TorchLoad(Method):
    name, group, op, reference = "torch_load", "baseline", "load", "raw_read"

    def prepare(self, ctx: Ctx) -> None:
        torch.save(ctx.state, ctx.path("state.pt"))

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        def load() -> None:
            ctx.scratch["out"] = None
            ctx.scratch["out"] = torch.load(ctx.path("state.pt"), map_location="cpu", weights_only=True)

        return _timed(load)

    def after_rep(self, ctx: Ctx, rep: int) -> None:
        ctx.scratch["out"] = None


def _safetensors() -> Any:
    try:
        import safetensors.torch as st
    except ImportError as err:
        raise Skip("safetensors is not installed (pip install safetensors)") from err
    return st


class SafetensorsSave(Method):
    name, group, op, reference = "safetensors_save", "baseline", "save", "raw_write"

    def prepare(self, ctx: Ctx) -> None:
        self.st = _safetensors()

    def before_rep(self, ctx: Ctx, rep: int) -> None:
        _rm(ctx.path("state.safetensors"))

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        def save() -> None:
            self.st.save_file(ctx.state, ctx.path("state.safetensors"))
            _fsync_path(ctx.path("state.safetensors"))

        return _timed(save)


class SafetensorsLoad(Method):
    """``safetensors.torch.load_file``: maps the file; tensor pages are read on first touch."""

    name, group, op, reference = "safetensors_load", "baseline", "load", "raw_read"

    def prepare(self, ctx: Ctx) -> None:
        self.st = _safetensors()
        self.st.save_file(ctx.state, ctx.path("state.safetensors"))

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        def load() -> None:
            ctx.scratch["out"] = None
            ctx.scratch["out"] = self.st.load_file(ctx.path("state.safetensors"), device="cpu")

        return _timed(load)

    def after_rep(self, ctx: Ctx, rep: int) -> None:
        ctx.scratch["out"] = None


class SafetensorsLoadInto(SafetensorsLoad):
    """``load_file`` maps the file and returns tensors over the mapping without reading them;
    this row also copies them into preallocated destinations, as loading a model does."""

    name = "safetensors_load_into"

    def prepare(self, ctx: Ctx) -> None:
        super().prepare(ctx)
        ctx.scratch["dest"] = ctx.zeros()

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        dest = ctx.scratch["dest"]

        def load() -> None:
            for k, t in self.st.load_file(ctx.path("state.safetensors"), device="cpu").items():
                dest[k].copy_(t)

        return _timed(load)


class DcpSave(Method):
    name, group, op, reference = "dcp_save", "baseline", "save", "raw_write"
    tuned = False

    def before_rep(self, ctx: Ctx, rep: int) -> None:
        _rm(ctx.path("dcp"))

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        threads = ctx.threads if self.tuned else 1
        writer = dcp.FileSystemWriter(ctx.path("dcp"), thread_count=threads)
        with _quiet():
            return _timed(lambda: dcp.save(ctx.state, storage_writer=writer))


class DcpSaveTuned(DcpSave):
    name, tuned = "dcp_save_tuned", True


class DcpLoad(Method):
    name, group, op, reference = "dcp_load", "baseline", "load", "raw_read"

    def prepare(self, ctx: Ctx) -> None:
        import torch.distributed.checkpoint as dcp

        with _quiet():
            dcp.save(ctx.state, storage_writer=dcp.FileSystemWriter(ctx.path("dcp")))
        ctx.scratch["dest"] = ctx.zeros()

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp

        with _quiet():
            return _timed(lambda: dcp.load(ctx.scratch["dest"], storage_reader=dcp.FileSystemReader(ctx.path("dcp"))))


class DcpLoadCold(DcpLoad):
    name, cold, reference = "dcp_load_cold", True, "raw_read_cold"


class DcpAsync(Method):
    """``dcp.async_save``: blocking = until it returns, total = until its future is done."""

    name, group, op, reference = "dcp_async_thread", "baseline", "async", "memcpy"
    process = False

    def prepare(self, ctx: Ctx) -> None:
        if self.process:
            import torch.distributed as dist

            if not dist.is_initialized():
                os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
                os.environ.setdefault("MASTER_PORT", str(29600 + os.getpid() % 1000))
                dist.init_process_group("gloo", rank=0, world_size=1)
        self.executor_warm = False

    def before_rep(self, ctx: Ctx, rep: int) -> None:
        _rm(ctx.path("dcp_async"))

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        kind = AsyncCheckpointerType.PROCESS if self.process else AsyncCheckpointerType.THREAD
        writer = dcp.FileSystemWriter(ctx.path("dcp_async"))
        with _quiet():
            t0 = time.perf_counter()
            fut: Any = dcp.async_save(ctx.state, storage_writer=writer, async_checkpointer_type=kind)
            blocking = time.perf_counter() - t0
            fut.result()
            total = time.perf_counter() - t0
        return {"blocking": blocking, "total": total}

    def close(self, ctx: Ctx) -> None:
        if self.process:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


class DcpAsyncProcess(DcpAsync):
    name, process = "dcp_async_process", True


# -- ours --------------------------------------------------------------------------------------


def _engine(ctx: Ctx, save_dir: str, **config: Any) -> Any:
    from ckpt_engine import CheckpointEngine, EngineConfig

    # Rounds save the same iteration into one folder on purpose: replacing it is the measured path.
    config.setdefault("allow_overwrite", True)
    return CheckpointEngine(EngineConfig(save_dir=save_dir, **config))


class OursSave(Method):
    name, group, op, reference = "ours_save", "ours", "save", "raw_write"
    config: dict[str, Any] = {}

    def prepare(self, ctx: Ctx) -> None:
        self.module = StateModule(ctx.state)
        self.engine = _engine(ctx, ctx.path("ours_" + self.name), **self.config)

    def before_rep(self, ctx: Ctx, rep: int) -> None:
        _rm(ctx.path("ours_" + self.name))

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        return _timed(lambda: self.engine.save(rep + 10, model=self.module))

    def close(self, ctx: Ctx) -> None:
        self.engine.close()


class OursSaveTuned(OursSave):
    name = "ours_save_tuned"

    def prepare(self, ctx: Ctx) -> None:
        self.config = {"thread_count": ctx.threads}
        super().prepare(ctx)


class OursSaveNoChecksums(OursSave):
    name = "ours_save_nochecksums"
    config = {"save_checksums": False}


class OursLoad(Method):
    """``engine.load`` from ``latest_checkpoint.txt``: the model and the (tiny) trainer state."""

    name, group, op, reference = "ours_load", "ours", "load", "raw_read"
    model_only = False
    direct = True

    def prepare(self, ctx: Ctx) -> None:
        with _engine(ctx, ctx.path("ours_load")) as engine:
            engine.save(1, model=StateModule(ctx.state))
        self.dest = StateModule(ctx.zeros())
        if self.model_only:
            self.engine = _engine(
                ctx, ctx.path("ours_load_unused"), load_path=os.path.join(ctx.path("ours_load"), "iter_000000001")
            )
        else:
            self.engine = _engine(ctx, ctx.path("ours_load"))
        if not self.direct:
            os.environ["CKPT_ENGINE_DIRECT_READ"] = "0"

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        return _timed(lambda: self.engine.load(model=self.dest))

    def close(self, ctx: Ctx) -> None:
        self.engine.close()
        os.environ.pop("CKPT_ENGINE_DIRECT_READ", None)


class OursLoadCold(OursLoad):
    name, cold, reference = "ours_load_cold", True, "raw_read_cold"


class OursLoadModelOnly(OursLoad):
    name, model_only = "ours_load_model_only", True


class OursLoadDcpPath(OursLoad):
    """The engine's load with the direct read switched off: DCP's torch.load path."""

    name, direct = "ours_load_dcp_path", False


class OursAsync(Method):
    """The ``pinned_staging`` plugin: blocking = ``save()`` returning, total = the commit."""

    name, group, op, reference = "ours_async", "ours", "async", "memcpy"

    def prepare(self, ctx: Ctx) -> None:
        from importlib.metadata import entry_points

        if "pinned_staging" not in {ep.name for ep in entry_points(group="ckpt_engine")}:
            raise Skip("the pinned_staging plugin is not installed")
        self.module = StateModule(ctx.state)
        t0 = time.perf_counter()
        self.engine = _engine(ctx, ctx.path("ours_async"), plugins=["pinned_staging"], keep_last=1)
        ctx.scratch["engine_start_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        handle = self.engine.save(1000, model=self.module)  # first save: buffers allocated here
        ctx.scratch["first_blocking_s"] = time.perf_counter() - t0
        handle.result()
        ctx.scratch["first_total_s"] = time.perf_counter() - t0

    def run(self, ctx: Ctx, rep: int) -> dict[str, float]:
        t0 = time.perf_counter()
        handle = self.engine.save(rep + 10, model=self.module)
        blocking = time.perf_counter() - t0
        handle.result()
        return {"blocking": blocking, "total": time.perf_counter() - t0}

    def close(self, ctx: Ctx) -> None:
        self.engine.close()


# -- many small tensors ------------------------------------------------------------------------


class _Counting:
    """Counts DCP planner calls (``create_local_plan`` / ``create_global_plan``)."""

    def __init__(self) -> None:
        from torch.distributed.checkpoint import DefaultSavePlanner

        self.counts = {"local": 0, "global": 0}
        self._cls = DefaultSavePlanner
        self._orig = (DefaultSavePlanner.create_local_plan, DefaultSavePlanner.create_global_plan)
        counts = self.counts
        orig_local, orig_global = self._orig

        def local(planner: Any) -> Any:
            counts["local"] += 1
            return orig_local(planner)

        def global_(planner: Any, plans: Any) -> Any:
            counts["global"] += 1
            return orig_global(planner, plans)

        DefaultSavePlanner.create_local_plan = local  # type: ignore[method-assign]
        DefaultSavePlanner.create_global_plan = global_  # type: ignore[method-assign]

    def restore(self) -> None:
        self._cls.create_local_plan, self._cls.create_global_plan = self._orig  # type: ignore[method-assign]


class SmallDcpSave(DcpSave):
    name, group, reference = "small_dcp_save", "baseline", ""


class SmallDcpLoad(DcpLoad):
    name, group, reference = "small_dcp_load", "baseline", ""


class SmallOursSave(OursSave):
    name, group, reference = "small_ours_save", "ours", ""

    def prepare(self, ctx: Ctx) -> None:
        super().prepare(ctx)
        self.counter = _Counting()
        ctx.scratch["plans"] = []

    def before_rep(self, ctx: Ctx, rep: int) -> None:
        # keep earlier checkpoints: the engine saves a new iteration each repetition, as a
        # training run does; a repeated save of the unchanged structure is what is measured
        self.counter.counts["local"] = self.counter.counts["global"] = 0

    def after_rep(self, ctx: Ctx, rep: int) -> None:
        ctx.scratch["plans"].append(dict(self.counter.counts))

    def close(self, ctx: Ctx) -> None:
        self.counter.restore()
        super().close(ctx)


class SmallOursLoad(OursLoad):
    name, group, reference = "small_ours_load", "ours", ""


METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (
        RawWrite,
        RawRead,
        RawReadCold,
        Memcpy,
        TorchSave,
        TorchLoad,
        SafetensorsSave,
        SafetensorsLoad,
        SafetensorsLoadInto,
        DcpSave,
        DcpSaveTuned,
        DcpLoad,
        DcpLoadCold,
        DcpAsync,
        DcpAsyncProcess,
        OursSave,
        OursSaveTuned,
        OursSaveNoChecksums,
        OursLoad,
        OursLoadCold,
        OursLoadModelOnly,
        OursLoadDcpPath,
        OursAsync,
        SmallDcpSave,
        SmallDcpLoad,
        SmallOursSave,
        SmallOursLoad,
    )
}

BIG_METHODS = [n for n in METHODS if not n.startswith("small_")]
SMALL_METHODS = [n for n in METHODS if n.startswith("small_")]


def collect() -> None:
    gc.collect()
