"""Collectives of a save or a load: DCP's error semantics, one place to bound and observe them.

:class:`Comm` offers the three shapes DCP's save uses (an all-gather, gather-reduce-scatter and
gather-finish-broadcast) over ``torch.distributed`` object collectives, and :meth:`Comm.settle`,
the fixed-size agreement on a step's outcome that the engine's load uses instead of DCP's
gather and scatter of plans. Each runs the local part
on every rank, catches its error, and raises DCP's ``CheckpointException`` (every failed rank's
error, by rank) on every rank, so that no rank walks into a collective the others left. In one
process without a process group it calls the functions directly.

Inside a save or a load of the engine (an active :class:`~ckpt_engine._dcpio.watch.CollectiveWatch`)
every collective is preceded by the watch's bounded barrier and runs on the watch's gloo group:
a rank that does not arrive within ``collective_timeout_s`` is named in a
``CollectiveTimeoutError`` instead of hanging the others.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from .fast_read import gc_paused
from .watch import active_watch

__all__ = ["RANK_LOCAL", "Comm"]

_T = TypeVar("_T")
_R = TypeVar("_R")


class _Failed:
    """An error crossing ranks: the exception if it pickles, else its text."""

    def __init__(self, err: BaseException) -> None:
        self.err = err

    def __reduce__(self) -> Any:
        import pickle

        try:
            pickle.dumps(self.err)
        except Exception:
            return (_Failed, (RuntimeError(f"{type(self.err).__name__}: {self.err}"),))
        return (_Failed, (self.err,))


def checkpoint_error(step: str, failures: Mapping[int, BaseException]) -> CheckpointException:
    """DCP's ``CheckpointException`` for ``step`` failed on the ranks of ``failures``, each error
    with its traceback's summary, as DCP's own are built (its ``str`` formats those pairs: a bare
    exception there made ``str`` raise ``TypeError``)."""
    wrapped = {r: (err, traceback.extract_tb(err.__traceback__)) for r, err in failures.items()}
    return CheckpointException(step, wrapped)


def _run(fn: Callable[[], _T]) -> _T | _Failed:
    try:
        return fn()
    except (Exception, CheckpointException) as err:
        return _Failed(err)


def _raise_failures(step: str, values: list[Any]) -> None:
    failures = {r: v.err for r, v in enumerate(values) if isinstance(v, _Failed)}
    if failures:
        raise checkpoint_error(step, failures)


class _RankLocal:
    """The type of :data:`RANK_LOCAL` (one object, pickled by name)."""

    def __repr__(self) -> str:
        return "RANK_LOCAL"

    def __reduce__(self) -> str:
        return "RANK_LOCAL"


#: A ``process_group`` value: this rank saves (or loads) alone, with no collective at all, as one
#: process without a process group does, also where the job has one. Its checkpoint holds this
#: rank's state only (every item it holds, replicated or not) with a ``.metadata`` of its own:
#: the node-local tier's rank-local checkpoints (``EngineConfig.local_dir``).
RANK_LOCAL: Any = _RankLocal()


class Comm:
    """The collectives of one DCP save or load over ``group`` (default: the default group;
    :data:`RANK_LOCAL`: none, this rank alone)."""

    def __init__(self, group: Any = None) -> None:
        self._held: _Failed | None = None
        alone = group is RANK_LOCAL
        watch = None if alone else active_watch()
        if watch is not None and group is not None and group is not watch.group:
            watch = None  # a group of the caller's own: not the watch's to bound
        self.watch = watch
        if watch is not None:
            group = watch.group
        self.group = None if alone else group
        self.dist = not alone and dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank(self.group) if self.dist else 0
        self.world = dist.get_world_size(self.group) if self.dist else 1

    def _bound(self, name: str) -> None:
        """The watch's bounded barrier before collective ``name`` (nothing without a watch)."""
        if self.watch is not None:
            self.watch.barrier(name)

    def _global(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def step(self, name: str, fn: Callable[[], _T]) -> _T:
        """Run a local step; its error is held back until the next collective (see
        :meth:`all_gather`) on several ranks, raised at once in one process."""
        out = _run(fn)
        if isinstance(out, _Failed):
            if self.world == 1:
                raise checkpoint_error(name, {0: out.err})
            self._held = out
            return None  # type: ignore[return-value]
        return out

    def _take_held(self, value: Any) -> Any:
        held = self._held
        if held is not None:
            self._held = None
            return held
        return value

    def all_gather(self, name: str, value: _T) -> list[_T]:
        """Every rank's ``value``; raises on every rank if a step of any rank failed."""
        value = self._take_held(value)
        out: list[Any] = [value]
        if self.world > 1:
            out = [None] * self.world
            self._bound(name)
            dist.all_gather_object(out, value, group=self.group)
        _raise_failures(name, out)
        return out

    def settle(self, name: str, value: _T) -> _T:
        """``value``, or the error of a step of any rank raised on every rank, in messages of a
        fixed size: each rank sends one small int (failed or not) in an all-gather, so rank 0
        handles O(ranks) bytes whatever the plans hold. Only when some rank failed does the
        lowest failing rank broadcast its error; every rank then raises DCP's
        ``CheckpointException`` with that error for each failed rank (what
        :func:`~ckpt_engine.errors.first_failure` reads: the same error, the same ranks, as a
        gather of every rank's outcome gives)."""
        value = self._take_held(value)
        if self.world == 1:
            _raise_failures(name, [value])
            return value
        flags: list[Any] = [None] * self.world
        self._bound(name)
        dist.all_gather_object(flags, int(isinstance(value, _Failed)), group=self.group)
        failed = [r for r, flag in enumerate(flags) if flag]
        if not failed:
            return value
        box: list[Any] = [value if self.rank == failed[0] else None]
        self._bound(name + " (error)")
        dist.broadcast_object_list(box, src=self._global(failed[0]), group=self.group)
        err = box[0].err if isinstance(box[0], _Failed) else RuntimeError(f"rank {failed[0]} failed in {name!r}")
        raise checkpoint_error(name, dict.fromkeys(failed, err))

    @gc_paused()
    def gather_scatter(self, name: str, value: _T, reduce: Callable[[list[_T]], list[_R]]) -> _R:
        """Gather ``value`` on rank 0, which runs ``reduce`` over all of them and hands each rank
        its element of the result. No cyclic garbage collection meanwhile: rank 0 unpickles every
        rank's plan (at 1,024 ranks x 200 tensors, 200k DCP objects, few cycles) and full
        collections took most of it (benchmarks/coord_sim_bench.py)."""
        value = self._take_held(value)
        if self.world == 1:
            _raise_failures(name, [value])
            result = _run(lambda: reduce([value]))
            _raise_failures(name, [result])
            return result[0]  # type: ignore[index]
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._bound(name)
        dist.gather_object(value, gathered, dst=self._global(0), group=self.group)
        scatter: list[Any] | None = None
        if self.rank == 0:
            assert gathered is not None
            failures = {r: v.err for r, v in enumerate(gathered) if isinstance(v, _Failed)}
            if failures:
                scatter = [checkpoint_error(name, failures)] * self.world
            else:
                result = _run(lambda: reduce(gathered))
                if isinstance(result, _Failed):
                    scatter = [checkpoint_error(name, {0: result.err})] * self.world
                else:
                    scatter = list(result)
        box: list[Any] = [None]
        self._bound(name + " (result)")
        dist.scatter_object_list(box, scatter, src=self._global(0), group=self.group)
        if isinstance(box[0], CheckpointException):
            raise box[0]
        return box[0]  # type: ignore[no-any-return]

    def gather_finish(self, name: str, local: Callable[[], _T], finish: Callable[[list[_T]], _R]) -> _R:
        """Every rank runs ``local``; rank 0 runs ``finish`` over all results (no cyclic garbage
        collection while it gathers them and runs it); every rank gets its return value (or
        raises every failure)."""
        value = _run(local)
        with gc_paused():
            return self._finish(name, value, finish)

    def _finish(self, name: str, value: Any, finish: Callable[[list[_T]], _R]) -> _R:
        if self.world == 1:
            _raise_failures(name, [value])
            out = _run(lambda: finish([value]))
            _raise_failures(name, [out])
            return out  # type: ignore[return-value]
        gathered: list[Any] | None = [None] * self.world if self.rank == 0 else None
        self._bound(name)
        dist.gather_object(value, gathered, dst=self._global(0), group=self.group)
        box: list[Any] = [None]
        if self.rank == 0:
            assert gathered is not None
            failures = {r: v.err for r, v in enumerate(gathered) if isinstance(v, _Failed)}
            if failures:
                box[0] = checkpoint_error(name, failures)
            else:
                out = _run(lambda: finish(gathered))
                box[0] = checkpoint_error(name, {0: out.err}) if isinstance(out, _Failed) else out
        self._bound(name + " (result)")
        dist.broadcast_object_list(box, src=self._global(0), group=self.group)
        if isinstance(box[0], CheckpointException):
            raise box[0]
        return box[0]  # type: ignore[no-any-return]
