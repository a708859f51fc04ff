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

The load's settle of the plan also carries each rank's plan digest (:func:`plan_digest`,
:func:`check_plans_agree`): whether the ranks that read the same stored keys of a component
planned them alike. Each rank plans its load alone, running ``remap_keys`` and ``pre_load_plan``
itself; a hook that depends on the rank (or a plugin enabled on some ranks only) would have one
rank load a replicated parameter and another keep its own value, and nothing would say so. Ranks
that plan the same set of stored keys (every rank of a DDP or FSDP job; each pipeline stage's
replicas) must send the same digest; ranks that read other stored keys are not compared, nor are
per-rank copies (``per_rank_keys``) and rank-local parts, whose decisions may differ by rank.
Only where two digests differ do the lowest ranks of the two plans broadcast their rows, so that
every rank raises the same :class:`~ckpt_engine.errors.CheckpointDisagreementError` naming the
keys.
"""

from __future__ import annotations

import hashlib
import json
import traceback
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import CheckpointDisagreementError, clip
from ..types import PlanEntry
from .fast_read import gc_paused
from .watch import active_watch

__all__ = ["RANK_LOCAL", "Comm", "PlanDigest", "check_plans_agree", "plan_digest"]

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

    def broadcast(self, name: str, value: Any, src: int) -> Any:
        """Rank ``src``'s ``value`` on every rank (this group's rank numbers)."""
        if self.world == 1:
            return value
        box: list[Any] = [value]
        self._bound(name)
        dist.broadcast_object_list(box, src=self._global(src), group=self.group)
        return box[0]

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
        return self.settle_with(name, value, None)[0]

    def settle_with(self, name: str, value: _T, digest: Any) -> tuple[_T, list[Any]]:
        """:meth:`settle`, and every rank's ``digest`` (a small value, ``[digest]`` in one process),
        which travels in the same all-gather as the int."""
        value = self._take_held(value)
        if self.world == 1:
            _raise_failures(name, [value])
            return value, [digest]
        flags: list[Any] = [None] * self.world
        flag = int(isinstance(value, _Failed))
        self._bound(name)
        dist.all_gather_object(flags, flag if digest is None else (flag, digest), group=self.group)
        pairs = [f if isinstance(f, tuple) else (f, None) for f in flags]
        failed = [r for r, (flag, _) in enumerate(pairs) if flag]
        if not failed:
            return value, [d for _, d in pairs]
        sent = self.broadcast(name + " (error)", value if self.rank == failed[0] else None, failed[0])
        err = sent.err if isinstance(sent, _Failed) else RuntimeError(f"rank {failed[0]} failed in {name!r}")
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
        result: Any = None
        if self.rank == 0:
            assert gathered is not None
            failures = {r: v.err for r, v in enumerate(gathered) if isinstance(v, _Failed)}
            if failures:
                result = checkpoint_error(name, failures)
            else:
                out = _run(lambda: finish(gathered))
                result = checkpoint_error(name, {0: out.err}) if isinstance(out, _Failed) else out
        result = self.broadcast(name + " (result)", result, 0)
        if isinstance(result, CheckpointException):
            raise result
        return result  # type: ignore[no-any-return]


# -- whether the ranks planned alike ----------------------------------------------------------

#: A rank's plan of one component: 8 bytes of digest of the stored keys it plans, then 8 of how.
PlanDigest = bytes
#: At most this many differing keys, and ranks of a side, are named.
_SHOWN = 5


def _plan_rows(entries: Sequence[PlanEntry]) -> list[str]:
    """One row per entry (the stored key, the destination key and the decision), sorted."""
    return sorted(json.dumps([e.storage_key, e.dest_key, e.decision.value]) for e in entries)


def _digest(lines: Sequence[str]) -> bytes:
    h = hashlib.blake2b(digest_size=8)
    for line in lines:
        h.update(line.encode("utf-8", "surrogatepass"))
        h.update(b"\x01")
    return h.digest()


def plan_digest(
    entries: Sequence[PlanEntry], mapped: Mapping[str, str], resolved: Mapping[str, str]
) -> tuple[PlanDigest, list[str]]:
    """This rank's :data:`PlanDigest` of ``entries`` (``mapped``: each destination key's stored key
    after ``remap_keys``; ``resolved``: the same with per-rank keys replaced by this rank's copy),
    and the rows it digests (sent only where plans differ). Ranks that plan the same set of stored
    keys must plan them alike; ranks that read other stored keys (other pipeline stages, experts
    a remap gives each rank) are not compared."""
    # A key resolved to this rank's own per-rank copy is left out: its value, shape and so its
    # decision may differ by rank.
    shared = [e for e in entries if resolved.get(e.dest_key, e.storage_key) == mapped.get(e.dest_key, e.storage_key)]
    rows = _plan_rows(shared)
    stored = sorted({e.storage_key for e in shared})
    return _digest(stored) + _digest(rows), rows


def _split(digests: Sequence[PlanDigest | None]) -> tuple[list[int], list[int]] | None:
    """The ranks of the first two different plans among ranks with the same stored keys, or ``None``."""
    first_plan: dict[bytes, bytes] = {}
    for d in digests:
        if d is None:
            continue
        keys, plan = d[:8], d[8:]
        seen = first_plan.setdefault(keys, plan)
        if seen != plan:
            a = [r for r, x in enumerate(digests) if x == keys + seen]
            b = [r for r, x in enumerate(digests) if x == d]
            return a, b
    return None


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:_SHOWN])) + (f" and {len(ranks) - _SHOWN} more" if len(ranks) > _SHOWN else "")


def _by_key(rows: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
    """A plan's rows as ``stored key -> sorted [(destination key, decision)]``."""
    out: dict[str, list[tuple[str, str]]] = {}
    for row in rows:
        storage, dest, decision = json.loads(row)
        out.setdefault(storage, []).append((dest, decision))
    for got in out.values():
        got.sort()
    return out


def _differences(plans: Sequence[tuple[str, Mapping[str, list[tuple[str, str]]]]]) -> list[str]:
    """The first :data:`_SHOWN` stored keys two plans (each with its rank's label, grouped by
    :func:`_by_key`) plan differently, each as the message shows it (``key: rank A ...; rank B ...``)."""

    def how(got: list[tuple[str, str]]) -> str:
        return ", ".join(f"{decision} into {clip(dest)}" for dest, decision in got) or "nothing"

    (label_a, plan_a), (label_b, plan_b) = plans
    out = []
    for key in sorted(plan_a.keys() | plan_b.keys()):
        got_a, got_b = plan_a.get(key, []), plan_b.get(key, [])
        if got_a != got_b:
            out.append(f"{clip(key)}: {label_a} {how(got_a)}; {label_b} {how(got_b)}")
            if len(out) == _SHOWN:
                break
    return out


def check_plans_agree(
    comm: Comm, component: str, where: str, digests: Sequence[PlanDigest | None], rows: Sequence[str]
) -> None:
    """Raise :class:`CheckpointDisagreementError` on every rank where ranks that plan the same
    stored keys of ``component`` (in ``where``) planned them differently (``digests``: every
    rank's, as the settle gathered them; ``rows``: this rank's plan). Collective only where they
    differ (every rank sees the same ``digests``): the lowest rank of each of the two plans
    broadcasts its rows."""
    split = _split(digests)
    if split is None:
        return
    a, b = split
    plans = [
        (f"rank {r}", _by_key(comm.broadcast("plan agreement", list(rows) if comm.rank == r else None, r)))
        for r in (a[0], b[0])
    ]
    differ = _differences(plans)
    raise CheckpointDisagreementError(
        f"component {component!r} of {where}: the ranks planned this load differently, so ranks that read the same "
        f"stored keys would load different values: rank(s) {_ranks(a)} and rank(s) {_ranks(b)} differ at "
        f"{' | '.join(differ)}. A pre_load_plan or remap_keys hook that depends on the rank, or a plugin enabled on "
        "some ranks only, does this: ranks that read a stored key must plan it alike (state that differs by rank "
        f"belongs in per_rank_keys). Nothing of component {component!r} was read"
    )
