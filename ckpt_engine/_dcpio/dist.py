"""torch.distributed helpers: everything also works with no process group (one process)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..errors import ProcessGroupError, clip
from .watch import active_watch, c10d_failure


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def new_gloo_group(timeout_s: float) -> Any:
    """A gloo group of every rank whose operations time out after ``timeout_s`` (collective: every
    rank creates it at the same point); a failure because a rank is gone is a typed error."""
    try:
        return dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    except Exception as err:
        if not c10d_failure(err):
            raise
        raise ProcessGroupError(
            f"rank {dist.get_rank()}: could not create a process group ({type(err).__name__}: {clip(str(err), 200)}): "
            "a rank of this job died or is stopped. Restart the job",
            step="new_group",
        ) from err


def barrier() -> None:
    if initialized():
        dist.barrier()


def _bounded_group(step: str) -> Any:
    """Inside an engine save or load: the watch's barrier for ``step``, then its group."""
    watch = active_watch()
    if watch is None:
        return None
    watch.barrier(step)
    return watch.group


@contextlib.contextmanager
def _typed(step: str) -> Iterator[None]:
    """Inside an engine save or load, a collective that fails in torch.distributed (a peer died
    or was stopped) raises :class:`~ckpt_engine.errors.ProcessGroupError` naming ``step``."""
    try:
        yield
    except Exception as err:
        watch = active_watch()
        if watch is None or not c10d_failure(err):
            raise
        raise watch.broken(step, err) from err


def all_gather_object(obj: Any, step: str = "sync") -> list[Any]:
    """Every rank's ``obj``, in rank order; ``[obj]`` without a process group. Inside a save or a
    load, bounded by ``collective_timeout_s`` (``step`` names it in the error)."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    group = _bounded_group(step)
    with _typed(step):
        dist.all_gather_object(out, obj, group=group)
    return out


def any_rank(flag: bool, step: str = "sync") -> bool | None:
    """Whether ``flag`` is set on any rank, in one all-reduce of a one-element CPU tensor on the
    active watch's gloo group (bounded like :func:`all_gather_object`). ``None`` outside an engine
    save or load (no watch: the default group may be NCCL, which takes no CPU tensor), and the
    caller exchanges objects instead. An object all-gather pickles, sends the sizes, then the
    bytes: on two gloo ranks here it took 3.4 ms against 0.13 ms for this, on every agreement of
    a save or a load that went well."""
    watch = active_watch()
    if not initialized() or watch is None:
        return None
    box = torch.tensor([int(flag)], dtype=torch.int64)
    group = _bounded_group(step)
    with _typed(step):
        dist.all_reduce(box, op=dist.ReduceOp.SUM, group=group)
    return bool(box.item())


def broadcast_object(obj: Any, src: int = 0, step: str = "sync") -> Any:
    """``obj`` from rank ``src`` on every rank (bounded like :func:`all_gather_object`)."""
    if not initialized():
        return obj
    box = [obj]
    group = _bounded_group(step)
    with _typed(step):
        dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """Silence DCP warnings that say nothing to an engine user.

    * "torch.distributed is disabled ..." is issued on every single-process save/load;
    * "Detected an existing checkpoint ..." is issued when the engine rewrites its own
      uncommitted folder, which it does on purpose.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint in")
        yield
