"""What peers_bench.py measures around a checkpointer: the training loop, memory, fsync, page cache.

* The loop: forward, backward, the checkpointer's own wait (``Peer.guard``), ``optimizer.step()``.
  One save after a step; the loop goes on until the save is durable (at least ``min_after`` more
  steps), and the time it added is its length minus as many steps of a loop without saves run
  right before it.
* Durable: the checkpointer reports completion, then every file and folder it wrote is fsynced
  (nearly free where it fsynced them itself), in a thread, while the loop runs.
* Memory: the training process's peak RSS (``clear_refs`` + ``VmHWM``, bench.py's ``PeakRss``)
  and the private memory (USS) of its helper processes, sampled every 20 ms.
* Cold reads: each file is dropped from the page cache with ``posix_fadvise(DONTNEED)`` after an
  fsync, and ``mincore`` says how much of it was still resident afterwards.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _peers_methods import Peer, Work
from bench import PeakRss
from torch import nn

MIB = 1 << 20
_libc = ctypes.CDLL(None, use_errno=True)


# -- the states --------------------------------------------------------------------------------


class SmallModel(nn.Module):
    """``count`` parameters of 16 fp32 elements; the loss reads all of them in one ``cat``."""

    def __init__(self, count: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.p = nn.ParameterList([nn.Parameter(torch.randn(16, generator=gen)) for _ in range(count)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.cat(list(self.p)) * x).square().sum()


class SmallLM(nn.Module):
    """A model shaped like a small language model: an embedding and 20 blocks of ten parameters
    (two layer norms, a fused ``qkv`` projection with bias, an output projection, an MLP), 201
    parameters in all, sized so that parameters and AdamW's two moments add up to about ``mib``
    MiB; with AdamW its flattened state dict holds about 3,000 items (a ``step`` and eleven
    hyper-parameters per parameter), the shape whose load is mostly per-item work."""

    VOCAB, BLOCKS = 8000, 20

    def __init__(self, mib: int) -> None:
        super().__init__()
        d = 256 if mib <= 384 else 512
        per_block = (mib * MIB // 4 // 3 - self.VOCAB * d) // self.BLOCKS
        hidden = max(64, (per_block - 4 * d * d) // (2 * d))
        self.d = d
        self.embed = nn.Embedding(self.VOCAB, d)
        self.blocks = nn.ModuleList(
            nn.ModuleDict(
                {
                    "ln1": nn.LayerNorm(d),
                    "qkv": nn.Linear(d, 3 * d),
                    "o": nn.Linear(d, d, bias=False),
                    "ln2": nn.LayerNorm(d),
                    "up": nn.Linear(d, hidden),
                    "down": nn.Linear(hidden, d, bias=False),
                }
            )
            for _ in range(self.BLOCKS)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for b in self.blocks:
            h = h + b["o"](b["qkv"](b["ln1"](h))[..., : self.d])
            h = h + b["down"](torch.relu(b["up"](b["ln2"](h))))
        return h


class WideEmbedding(nn.Module):
    """A model whose state is mostly one tensor: an embedding table (a large vocabulary, 1024
    wide) and one 1024-wide layer, sized so that parameters and AdamW's two moments add up to
    about ``mib`` MiB. Its three largest tensors (the table and its moments) are each about a
    third of the state: the shape of a large vocabulary's embedding and output tables."""

    D = 1024

    def __init__(self, mib: int) -> None:
        super().__init__()
        self.vocab = max(1024, (mib * MIB // 4 // 3 - self.D * self.D) // self.D)
        self.embed = nn.Embedding(self.vocab, self.D)
        self.proj = nn.Linear(self.D, self.D)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.proj(self.embed(tokens))
        return out


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else 1


def parse_state(state: str, small_count: int = 50_000) -> tuple[str, int]:
    """A state's name (``N``: the MLP, ``lmN``, ``embN``, ``small[N]``) as :func:`build`'s ``kind``
    and ``size`` (``small`` alone: ``small_count`` tensors)."""
    kind = next((k for k in ("small", "lm", "emb") if state.startswith(k)), "big")
    size = state[len(kind) :] if kind != "big" else state
    return kind, int(size or small_count) if kind == "small" else int(size)


def build(kind: str, size: int, batch: int) -> tuple[Work, Callable[[], torch.Tensor], str]:
    """``kind`` "big": an MLP of 1024-wide layers whose parameters and AdamW moments add up to
    about ``size`` MiB; "lm": :class:`SmallLM` of about ``size`` MiB with AdamW; "emb":
    :class:`WideEmbedding` of about ``size`` MiB with AdamW; "small":
    ``size`` tiny parameters, a stateless SGD, saved model only.
    With more than one rank, FSDP2 (``fully_shard``) shards every layer (and the small model)
    over them before the optimizer is built, as a training script does."""
    from async_bench import _overlap_model

    torch.manual_seed(0)
    ranks = world_size()
    if kind == "small":
        model: nn.Module = SmallModel(size)
        x = torch.randn(size * 16)
        label = f"{size:,} tensors of 16 fp32"
    elif kind == "lm":
        model = SmallLM(size)
        x = torch.randint(0, SmallLM.VOCAB, (batch, 16))
        label = f"{size} MiB small-LM model+AdamW (201 parameters)"
    elif kind == "emb":
        wide = WideEmbedding(size)
        model, x = wide, torch.randint(0, wide.vocab, (batch, 16))
        label = f"{size} MiB embedding-table model+AdamW ({wide.vocab:,} x {wide.D})"
    else:
        model = _overlap_model(size)
        x = torch.randn(batch, 1024)
        label = f"{size} MiB model+AdamW"
    if ranks > 1:
        from torch.distributed.fsdp import fully_shard

        for layer in model.children() if kind != "small" else ():
            fully_shard(layer)
        fully_shard(model)
        label += f", {ranks} ranks (FSDP2)"
    if kind == "small":
        optim: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    else:
        optim = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def loss() -> torch.Tensor:
        out: torch.Tensor = model(x).square().mean() if kind != "small" else model(x)
        return out

    work = Work(model=model, optim=optim, with_optim=kind != "small", root="")
    return work, loss, label


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard; a plain tensor itself)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def state_tensors(w: Work) -> list[torch.Tensor]:
    """This rank's share of the state (its local shards)."""
    out = [_local(p.detach()) for p in w.model.parameters()]
    if w.with_optim:
        out += [_local(t) for st in w.optim.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    return out


def fingerprint(w: Work) -> list[torch.Tensor]:
    """Copies of three parameters and one optimizer moment (this rank's shards): a load must
    bring these back."""
    params = [_local(p.detach()) for p in w.model.parameters()]
    picks = [params[0], params[len(params) // 2], params[-1]]
    if w.with_optim:
        picks.append(_local(w.optim.state[next(iter(w.model.parameters()))]["exp_avg"]))
    return [t.clone() for t in picks]


def matches(w: Work, saved: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(fingerprint(w), saved, strict=True))


# -- files -------------------------------------------------------------------------------------


def files_of(paths: list[str]) -> Iterator[str]:
    for path in paths:
        if os.path.isdir(path):
            for folder, _dirs, names in os.walk(path):
                for name in names:
                    yield os.path.join(folder, name)
        elif os.path.isfile(path):
            yield path


def fsync_all(paths: list[str]) -> None:
    """fsync every file under ``paths``, then every folder (so the names are durable too)."""
    folders = {os.path.dirname(os.path.abspath(p)) for p in paths}
    for f in files_of(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        folders.add(os.path.dirname(f))
    folders.update(p for p in paths if os.path.isdir(p))
    for d in sorted(folders):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def disk_bytes(paths: list[str]) -> tuple[int, int]:
    """Bytes and number of the files under ``paths`` (each inode once)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for f in files_of(paths):
        st = os.stat(f)
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
    return total, len(seen)


def _resident(path: str) -> tuple[int, int]:
    """(resident pages, pages) of a file, by ``mincore`` over a private read-only mapping."""
    size = os.path.getsize(path)
    if size == 0:
        return 0, 0
    page = mmap.PAGESIZE
    pages = (size + page - 1) // page
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        vec = (ctypes.c_ubyte * pages)()
        rc = _libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec)
        del addr
        if rc != 0:
            raise OSError(ctypes.get_errno(), "mincore failed")
        return sum(b & 1 for b in vec), pages


def drop_page_cache(paths: list[str]) -> float:
    """Drop the files' pages from the page cache; the fraction still resident afterwards."""
    resident = pages = 0
    for f in files_of(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        r, n = _resident(f)
        resident, pages = resident + r, pages + n
    return resident / pages if pages else 0.0


# -- memory ------------------------------------------------------------------------------------


def descendants(pid: int | None = None) -> set[int]:
    pid = os.getpid() if pid is None else pid
    out: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids = [int(x) for x in f.read().split()]
        except OSError:
            continue
        for kid in kids:
            out.add(kid)
            out |= descendants(kid)
    return out


def uss_bytes(pid: int) -> int:
    """Private (unshared) memory of a process: what it costs beyond pages shared with others."""
    total = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += int(line.split()[1]) * 1024
    except OSError:
        return 0
    return total


class Meter:
    """Peak RSS of this process over one operation, and the peak USS of the helpers counted."""

    def __init__(self) -> None:
        self.rss = PeakRss()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.helper_peak = 0

    def start(self, helpers: Callable[[], set[int]]) -> None:
        self.helper_peak = 0
        self._stop.clear()
        self._thread = threading.Thread(target=self._sample, args=(helpers,), daemon=True)
        self._thread.start()
        self.rss.start()

    def _sample(self, helpers: Callable[[], set[int]]) -> None:
        while True:
            self.helper_peak = max(self.helper_peak, sum(uss_bytes(p) for p in helpers()))
            if self._stop.wait(0.02):
                return

    def stop(self) -> tuple[int, int]:
        """(peak RSS growth of this process, peak USS of the helpers)."""
        grown = self.rss.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        return grown, self.helper_peak


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


FREEZE_AFTER_TRIM = False  # the smoke run: see trim()


def trim() -> None:
    """Return freed heap memory to the system (glibc), so one method's leftovers do not pad the next.
    With ``FREEZE_AFTER_TRIM`` (the smoke run) the objects alive after the collection are frozen
    (``gc.freeze``), so the next trim scans only what was made since: a full collection over
    torch's and DCP's imports costs most of a second on a loaded machine, many times per state."""
    import gc

    gc.collect()
    if FREEZE_AFTER_TRIM:
        gc.freeze()
    with contextlib.suppress(AttributeError):
        _libc.malloc_trim(0)


# -- the loop ----------------------------------------------------------------------------------


class Waiter(threading.Thread):
    """Waits for the checkpointer's completion, then fsyncs what it wrote; stamps both."""

    def __init__(self, pending: Any, paths: list[str], t0: float) -> None:
        super().__init__(daemon=True)
        self.pending, self.paths, self.t0 = pending, paths, t0
        self.done_s = self.durable_s = 0.0
        self.error: BaseException | None = None
        self.finished = threading.Event()

    def run(self) -> None:
        try:
            if self.pending is not None:
                self.pending.result()
            self.done_s = time.perf_counter() - self.t0
            fsync_all(self.paths)
            self.durable_s = time.perf_counter() - self.t0
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            self.error = err
        finally:
            self.finished.set()


def train_step(w: Work, loss: Callable[[], torch.Tensor], peer: Peer | None) -> None:
    loss().backward()  # type: ignore[no-untyped-call]
    with peer.guard() if peer is not None else contextlib.nullcontext():
        w.optim.step()
    w.optim.zero_grad()


def _any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank: with sharded layers every rank must run the same
    number of steps (their forward and backward are collectives), so they agree on each step."""
    if world_size() == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([int(flag)])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def loop(
    w: Work,
    loss: Callable[[], torch.Tensor],
    steps: int,
    peer: Peer | None = None,
    step_id: int = 0,
    max_s: float = 300.0,
) -> dict[str, Any]:
    """``steps`` steps without a save; with ``peer``: one step, the save, then steps until the
    save is durable and at least ``steps - 1`` more have run (``max_s`` bounds the wait)."""
    t0 = time.perf_counter()
    if peer is None:
        for _ in range(steps):
            train_step(w, loss, None)
        return {"loop_s": time.perf_counter() - t0, "steps": steps}
    train_step(w, loss, peer)
    saved = fingerprint(w)
    ts = time.perf_counter()
    pending = peer.save(step_id)
    blocking = time.perf_counter() - ts
    waiter = Waiter(pending, peer.paths(step_id), ts)
    waiter.start()
    n = 1
    while _any_rank(n < steps or not waiter.finished.is_set()):
        train_step(w, loss, peer)
        n += 1
        if _any_rank(time.perf_counter() - t0 > max_s):
            break
    loop_s = time.perf_counter() - t0
    waiter.finished.wait(max_s)
    if waiter.error is not None:
        raise waiter.error
    if not waiter.finished.is_set():
        raise TimeoutError(f"{peer.name}: the save was not durable {max_s:.0f} s after it started")
    return {
        "loop_s": loop_s,
        "steps": n,
        "blocking_s": blocking,
        "done_s": waiter.done_s,
        "durable_s": waiter.durable_s,
        "saved": saved,
    }
