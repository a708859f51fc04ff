"""Bounded collectives: every rank's checkpoint phase in the job's store, and barriers with a deadline.

A :class:`CollectiveWatch` belongs to one engine on one rank of a job with several ranks. It

* publishes this rank's phase (``prepare``, ``stage``, ``plan``, ``write``, ``commit``,
  ``read``, ...) with a wall-clock timestamp under one key per rank in the default process
  group's c10d store (:meth:`CollectiveWatch.phase`);
* runs a barrier on that store before each collective (:meth:`CollectiveWatch.barrier`): it
  waits at most ``timeout_s`` for every rank, and on expiry raises
  :class:`~ckpt_engine.errors.CollectiveTimeoutError` naming the ranks that did not arrive
  and their last phase, e.g. ``rank 1 did not reach 'write' within 10 s (last phase: stage,
  12.3 s ago)``. Whether a barrier passed or was given up is decided once, atomically
  (``compare_set``), so a rank that arrives late raises too instead of walking into a collective
  nobody else will join. A rank that comes to a barrier for another collective than the ranks
  before it (the ranks are out of step) gives it up for all: no rank runs a collective its peers
  are not running;
* lets a rank whose save or load failed on its own, outside a collective, give up the barrier
  the others wait at (:meth:`CollectiveWatch.leave`): they raise at once instead of after
  ``timeout_s``;
* owns a gloo process group created with the same timeout, on which the collectives themselves
  run (object collectives: no device needed, and a rank that dies between the barrier and the
  collective is caught by gloo's timeout).

The collectives consult the watch that is active in the calling thread (:func:`activate`,
:func:`active_watch`); without one (one process, or code outside a save or a load) they run
unbounded, as before. Per barrier a rank makes five small store requests; the coordinator's
store sees O(ranks) requests per barrier.

Every :func:`phase` call is also noted, with or without a watch, in this process's
:data:`PHASE_LOG` (name, ``time.perf_counter()``, thread id; the last 1,024): one append per
phase, which is what ``benchmarks/coord_bench.py`` reads to time the phases of a save or a load.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections import deque
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ..errors import CollectiveError, CollectiveTimeoutError, ProcessGroupError, RankFailedError, clip, described
from .torch_private import default_store

__all__ = ["PHASE_LOG", "CollectiveWatch", "activate", "active_watch", "c10d_failure", "phase"]

_ids = itertools.count()
_local = threading.local()
#: At most this many late ranks are described one by one in an error message.
_SHOWN = 8
#: How a barrier's verdict starts when a rank gave its slot up (:meth:`CollectiveWatch.leave`).
_LEFT = "left:"
#: How a barrier's verdict starts when ranks came to it for different collectives.
_ASTRAY = "astray:"
#: At most this many characters of that rank's error travel with it.
_ERROR_CHARS = 600
#: This process's recent phases, oldest first: ``(name, time.perf_counter(), threading.get_ident())``.
PHASE_LOG: deque[tuple[str, float, int]] = deque(maxlen=1024)


def _fmt(seconds: float) -> str:
    return f"{seconds:.0f}" if seconds >= 10 or float(seconds).is_integer() else f"{seconds:.1f}"


class CollectiveWatch:
    """Phase keys, bounded barriers and a gloo group of their own, for one engine on one rank."""

    def __init__(
        self,
        timeout_s: float,
        *,
        store: Any,
        group: Any,
        rank: int,
        world: int,
        namespace: str,
        who: str = "rank",
        monitored: bool = False,
    ) -> None:
        self.timeout_s = float(timeout_s)
        #: How messages name a process: ``rank``, or ``writer rank`` for a write provider's processes.
        self.who = who
        #: Wait at gloo's ``monitored_barrier`` instead of in the store: a peer process that died
        #: fails the barrier at once (its connections close) instead of after ``timeout_s``.
        #: For a provider's processes, whose supervisor replaces a dead one and retries.
        self.monitored = monitored
        self.store = store
        self.group = group
        self.rank = rank
        self.world = world
        self.ns = namespace
        self._seq = 0
        self._phase = "idle"
        self._phase_t = time.time()
        #: ``time.monotonic()`` by which the next barrier gives up, if sooner than ``timeout_s``.
        self._deadline: float | None = None
        #: The engine call (a save or a load; every rank makes them in the same order) under way:
        #: its number and name (:meth:`begin`).
        self._call = 0
        self._what = "save or load"
        #: The call a peer left (its note), once this rank raised RankFailedError for it: every
        #: later barrier of that call fails at once, without a slot (the peer is out of the call).
        self._left: tuple[int, dict[str, Any]] | None = None

    @classmethod
    def create(cls, timeout_s: float, *, who: str = "rank", monitored: bool = False) -> CollectiveWatch | None:
        """A watch for the default process group; ``None`` without one or with one rank.

        Collective (it creates a process group): every rank calls it at the same point."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return None
        try:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        except Exception as err:
            if not c10d_failure(err):
                raise
            raise ProcessGroupError(
                f"rank {dist.get_rank()}: could not create the process group that bounds this engine's "
                f"collectives ({type(err).__name__}: {clip(str(err), 200)}): a rank of this job died or is "
                "stopped, so the job's process group is broken. Restart the job (torchrun --max-restarts)",
                step="new_group",
            ) from err
        # Ranks create process groups in the same order, so they count watches alike.
        namespace = f"ckpt_engine/watch/{next(_ids)}/"
        return cls(
            timeout_s,
            store=default_store(),
            group=group,
            rank=dist.get_rank(),
            world=dist.get_world_size(),
            namespace=namespace,
            who=who,
            monitored=monitored,
        )

    def close(self) -> None:
        """Destroy the watch's process group (idempotent)."""
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group(group)

    # -- phases -------------------------------------------------------------------------------

    def _key(self, rank: int) -> str:
        return f"{self.ns}phase/{rank}"

    def phase(self, name: str) -> None:
        """Publish that this rank is now in phase ``name``."""
        self._phase, self._phase_t = name, time.time()
        self._publish()

    def _publish(self) -> None:
        doc = {"phase": self._phase, "t": self._phase_t, "seq": self._seq}
        self.store.set(self._key(self.rank), json.dumps(doc))

    def _read_phase(self, rank: int) -> dict[str, Any] | None:
        try:
            if not self.store.check([self._key(rank)]):
                return None
            doc: dict[str, Any] = json.loads(self.store.get(self._key(rank)))
            return doc
        except Exception:
            return None

    # -- barriers -----------------------------------------------------------------------------

    def begin(self, what: str) -> None:
        """A new engine call (``save``, ``load``) starts on this rank: every rank counts them alike."""
        self._call += 1
        self._what = what
        self._phase, self._phase_t = "start", time.time()  # not published: the call's first phase will be

    def leave(self, err: BaseException) -> None:
        """This rank's call failed here on its own, outside a collective (``err``), so it will not
        reach the barrier the others wait at or come to next: give that barrier's slot up with a
        note of the failure. The ranks waiting there wake at once and raise
        :class:`~ckpt_engine.errors.RankFailedError` (:meth:`_barrier`) instead of waiting
        ``timeout_s``; every rank has then used the slot, so the next call's barriers line up.

        Called on every rank where a failure every rank shares (one they agreed on) ends the call:
        the first note wins, and every rank skips the same slot. A rank that finished the call
        before this one failed meets the note at its next call's first barrier: a note of an
        earlier call only moves that barrier to the next slot, as this rank's next barrier does
        (and this rank's note goes past such a note to the next slot too). A rank told that a
        peer left this call (its :class:`~ckpt_engine.errors.RankFailedError`, perhaps wrapped)
        has nothing to tell: the others were told too."""
        if self.group is None or (self._left is not None and self._left[0] == self._call):
            return
        error = described(err)
        error = error[:_ERROR_CHARS] + ("..." if len(error) > _ERROR_CHARS else "")
        note = _LEFT + json.dumps({"rank": self.rank, "call": self._call, "phase": self._phase, "error": error})
        try:
            while True:
                self._seq += 1
                base = f"{self.ns}b/{self._seq}/"
                verdict = self.store.compare_set(base + "state", "", note)
                verdict = verdict.decode() if isinstance(verdict, bytes) else str(verdict)
                if verdict == note:
                    self.store.set(base + "all", "1")  # wake the ranks waiting there
                    return
                call = _note_call(_note(verdict))
                if not (verdict.startswith(_LEFT) and (call is None or call < self._call)):
                    break
                # A note a peer left after an earlier call (or one unreadable): the peers' barriers
                # skip that slot, so does this one.
        except Exception:  # the store is gone: nothing more runs on this watch
            self.group_failed()
            return
        if call is not None and call > self._call:
            # The peers finished this call and decided the slot in a later one (a peer left it, or
            # they gave it up): leave it to this rank's next call, whose first barrier reads it.
            self._seq -= 1
        elif not verdict.startswith(_LEFT):
            # The others gave this call's slot up first (a timeout, ranks out of step) and closed
            # their group: so does this rank. (A peer that left this call at this slot: nothing
            # more to do, every rank skips it.)
            self.group_failed()

    def expect_by(self, deadline: float) -> None:
        """Give up the next barrier at ``deadline`` (``time.monotonic()``) if that comes before
        ``timeout_s``: a rank whose own collective with a peer failed after waiting part of
        ``timeout_s`` (a broadcast of shared reads, bounded by half of it) spends only the rest
        calling the roll, so the lost peer is named within ``timeout_s`` of that collective's
        start, not ``timeout_s`` after its failure. Ranks that arrived at the barrier earlier
        keep their own deadline, which ends sooner still."""
        self._deadline = deadline if self._deadline is None else min(self._deadline, deadline)

    def _wait_s(self) -> float:
        deadline, self._deadline = self._deadline, None
        if deadline is None:
            return self.timeout_s
        # A last look even when the deadline has passed: the others may all be there already.
        return max(0.05, min(self.timeout_s, deadline - time.monotonic()))

    def barrier(self, step: str) -> None:
        """Wait until every rank reached collective ``step``; at most ``timeout_s``."""
        try:
            self._barrier(step)
        except CollectiveError:
            raise
        except Exception as err:
            if not c10d_failure(err):
                raise
            raise self.broken(step, err) from err

    def broken(self, step: str, err: BaseException) -> ProcessGroupError:
        """The error for collective ``step`` failing inside torch.distributed (``err``): a peer
        died or was stopped. The watch's group is closed: nothing runs on it again."""
        self.group_failed()
        return ProcessGroupError(
            f"{self.who} {self.rank}: the collective '{step}' failed in torch.distributed during phase "
            f"'{self._phase}' ({type(err).__name__}: {clip(str(err), 200)}): a peer {self.who} died or was "
            f"stopped (its connection closed, or it did not answer within {_fmt(self.timeout_s)} s). The job's "
            "process group is broken: restart the job (torchrun --max-restarts)",
            step=step,
        )

    def _barrier(self, step: str) -> None:
        if self.group is None:
            raise CollectiveTimeoutError(
                f"{self.who} {self.rank}: an earlier collective of this engine timed out; its process group is closed",
                step=step,
            )
        if self._left is not None and self._left[0] == self._call:
            raise self._left_error(step, self._left[1])
        wait_s = self._wait_s()
        deadline = time.monotonic() + wait_s  # one bound across the slots a barrier skips
        while True:
            self._seq += 1
            seq = self._seq
            base = f"{self.ns}b/{seq}/"
            self._publish()  # "seq": this rank arrived at barrier seq
            t0 = time.monotonic()
            failure = self._wait_monitored(wait_s) if self.monitored else self._wait_in_store(base, step, wait_s)
            # The rank that gives up calls the roll then, and its verdict carries it: a rank that
            # reads the verdict later (one that arrived after it, perhaps after the lost rank woke
            # up and arrived too) names the same ranks instead of the ones still missing by then.
            mine = (
                "ok" if failure is None else "timeout:" + json.dumps({"call": self._call, "roll": self._roll_call(seq)})
            )
            verdict = self.store.compare_set(base + "state", "", mine)
            verdict = verdict.decode() if isinstance(verdict, bytes) else str(verdict)
            if not verdict.startswith(_LEFT):
                break
            self._check_left(step, _note(verdict))
            # A rank gave this slot up after an earlier call the others had finished: it moved on
            # to the next slot, and so does this barrier, in the time left.
            wait_s = max(0.05, deadline - time.monotonic())
        if verdict.startswith(_ASTRAY):
            self.group_failed()
            raise self._astray_error(step, verdict)
        if verdict != "ok":
            self.group_failed()
            if self.monitored and failure is not None and verdict == mine and time.monotonic() - t0 < 0.9 * wait_s:
                # Not a timeout: a peer's connection closed (it died before the barrier).
                raise self.broken(step, failure) from failure
            # With ``monitored``, a rank whose barrier failed because another had already given
            # up is the late one: it names nobody else.
            late = _verdict_roll(verdict) if verdict == mine or not self.monitored else []
            raise self._timeout_error(step, late, came_late=verdict != mine)
        if seq > 1 and self.rank == 0:
            # Every rank passed barrier seq, so none still reads the keys of barrier seq - 1.
            old = f"{self.ns}b/{seq - 1}/"
            for name in ("step", "count", "all", "state"):
                with contextlib.suppress(Exception):
                    self.store.delete_key(old + name)

    def _wait_in_store(self, base: str, step: str, wait_s: float) -> BaseException | None:
        token = f"{self._call}:{step}"
        first = self.store.compare_set(base + "step", "", token)
        first = first.decode() if isinstance(first, bytes) else str(first)
        if first != token:
            # Ranks came to this barrier for different collectives, or for one of different
            # engine calls: they are out of step, and none may run either collective. This rank
            # does not count itself in: it gives the barrier up for every rank, the ones waiting
            # and the ones still to come.
            first_call, _, first_step = first.partition(":")
            note = json.dumps(
                {
                    "rank": self.rank,
                    "call": self._call,
                    "step": step[:_ERROR_CHARS],
                    "first_call": first_call[:20],
                    "first": first_step[:_ERROR_CHARS],
                }
            )
            self.store.compare_set(base + "state", "", _ASTRAY + note)
            self.store.set(base + "all", "1")
            return None
        if self.store.add(base + "count", 1) == self.world:
            self.store.set(base + "all", "1")
        try:
            self.store.wait([base + "all"], timedelta(seconds=wait_s))
        except Exception as err:  # DistStoreError: the deadline passed
            return err
        return None

    def _wait_monitored(self, wait_s: float) -> BaseException | None:
        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=wait_s), wait_all_ranks=True)
        except Exception as err:  # a rank did not answer in time, or its connection closed
            return err
        return None

    def _roll_call(self, seq: int) -> list[tuple[int, str]]:
        """The ranks that have not reached barrier ``seq``, each with its last published phase."""
        now = time.time()
        late: list[tuple[int, str]] = []
        for r in range(self.world):
            if r == self.rank:
                continue
            doc = self._read_phase(r)
            if doc is not None and int(doc.get("seq", 0)) >= seq:
                continue
            if doc is None:
                late.append((r, "last phase: none published"))
            else:
                ago = max(0.0, now - float(doc.get("t", now)))
                late.append((r, f"last phase: {doc.get('phase')}, {ago:.1f} s ago"))
        return late

    def _check_left(self, step: str, left: dict[str, Any]) -> None:
        """A barrier's slot holds ``left``, a note a rank left (:meth:`leave`): raise where it left
        this call (and fail every later barrier of the call at once) or a later one (the ranks are
        out of step); return where it left an earlier one (the barrier moves on to the next slot)."""
        call = _note_call(left)
        if call == self._call:
            self._left = (self._call, left)
            raise self._left_error(step, left)
        if call is not None and call > self._call:
            self.group_failed()
            raise CollectiveError(
                f"the ranks are out of step: {self.who} {left.get('rank')} left its engine call {call} at the "
                f"collective {self.who} {self.rank} reached in its call {self._call} ('{step}'). Every rank fails "
                f"this {self._what}; this is a bug: report it with every rank's log",
                step=step,
            )

    def _left_error(self, step: str, left: dict[str, Any]) -> RankFailedError:
        """The error for a barrier whose slot rank ``left["rank"]`` gave up in this call."""
        rank = left["rank"] if type(left.get("rank")) is int else -1
        error = str(left.get("error"))[: _ERROR_CHARS + 3]
        return RankFailedError(
            f"{self.who} {rank} failed this {self._what} on its own in phase '{left.get('phase')}', so it will not "
            f"reach '{step}': {error}; seen from {self.who} {self.rank}. Every rank fails this "
            f"{self._what}; fix the cause on {self.who} {rank} (the ranks are still in step: the next save or "
            "load proceeds)",
            step=step,
            failed_rank=rank,
        )

    def _astray_error(self, step: str, verdict: str) -> CollectiveError:
        """The error for a barrier the ranks came to for different collectives."""
        note = _note(verdict)
        rank = note["rank"] if type(note.get("rank")) is int else -1
        theirs, first = str(note.get("step", "?")), str(note.get("first", "?"))
        call, first_call = _note_call(note), str(note.get("first_call"))
        calls = "" if str(call) == first_call else f" (its engine call {call}, theirs {first_call})"
        return CollectiveError(
            f"the ranks are out of step: {self.who} {rank} came to collective '{theirs}' where the {self.who}s before "
            f"it came to '{first}'{calls} (one of them skipped or added a collective or a save or load), so none runs "
            f"it; seen from "
            f"{self.who} {self.rank} at '{step}'. Every rank fails this {self._what}; this is a bug: report it with "
            "every rank's log",
            step=step,
        )

    def _timeout_error(self, step: str, late: list[tuple[int, str]], *, came_late: bool) -> CollectiveTimeoutError:
        """The error for a barrier given up on: ``late`` is the roll call of the rank that gave up
        (``came_late``: not this one, which arrived after it had). This rank is left out of it."""
        late = [(r, what) for r, what in late if r != self.rank]
        if not late:
            return CollectiveTimeoutError(
                f"{self.who} {self.rank} reached '{step}' after the other ranks stopped waiting for it "
                f"(collective_timeout_s={_fmt(self.timeout_s)} s; last phase: {self._phase})",
                step=step,
            )
        within = f"within {_fmt(self.timeout_s)} s"
        if len(late) == 1:
            r, what = late[0]
            message = f"{self.who} {r} did not reach '{step}' {within} ({what})"
        else:
            ranks = ", ".join(str(r) for r, _ in late[:_SHOWN]) + (" ..." if len(late) > _SHOWN else "")
            detail = "; ".join(f"{self.who} {r}: {what}" for r, what in late[:_SHOWN])
            more = f"; and {len(late) - _SHOWN} more" if len(late) > _SHOWN else ""
            message = f"{len(late)} {self.who}s ({ranks}) did not reach '{step}' {within} ({detail}{more})"
        seen = f"{self.who} {self.rank}" + (", which arrived after another rank stopped waiting" if came_late else "")
        message += (
            f"; seen from {seen}. A rank is stuck or died: see its log; raise collective_timeout_s "
            "if that phase legitimately takes longer"
        )
        return CollectiveTimeoutError(message, step=step, missing=[r for r, _ in late])

    def group_failed(self) -> None:
        """After a failed barrier the ranks no longer agree on where they are: stop using the group."""
        self.close()


def c10d_failure(err: BaseException) -> bool:
    """Whether ``err`` was raised by torch.distributed's communication (a gloo or NCCL error, a
    store error), not by the code that called it: a ``DistError``, or an error raised from
    ``distributed_c10d`` itself (gloo reports a closed peer as a plain ``RuntimeError`` there)."""
    if isinstance(err, dist.DistError):
        return True
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith(
        "torch/distributed/distributed_c10d.py"
    )


def c10d_cause(err: BaseException, depth: int = 8) -> BaseException | None:
    """The :func:`c10d_failure` behind ``err``, if any: ``err`` itself, an error it was raised
    from or during (``__cause__`` / ``__context__``), or a failed rank's error inside DCP's
    ``CheckpointException``; ``depth`` links at most. A save that wrapped a peer's death in its
    own error (``CheckpointSaveError`` around gloo's "Connection closed by peer") is still a
    broken process group."""
    from ..errors import first_failure

    seen: set[int] = set()
    todo = [err]
    while todo and len(seen) < depth:
        e = todo.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        inner, _ = first_failure(e)
        if c10d_failure(inner):
            return inner
        todo += [x for x in (inner, e.__cause__, e.__context__) if x is not None and x is not e]
    return None


def _note(verdict: str) -> dict[str, Any]:
    """The JSON object a verdict carries after its ``kind:`` prefix (a ``left:`` note, a
    ``timeout:`` roll call, an ``astray:`` report; written by this module on another rank of the
    job): ``{}`` where there is none it can read."""
    try:
        doc = json.loads(verdict.partition(":")[2])
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def _note_call(note: dict[str, Any]) -> int | None:
    """The engine call a note names (``None`` where it names none it can read)."""
    call = note.get("call")
    return call if type(call) is int else None


def _verdict_roll(verdict: str) -> list[tuple[int, str]]:
    """The roll call a ``timeout:`` verdict carries (written by :meth:`CollectiveWatch._barrier`
    of this engine on another rank of the job; anything unreadable names nobody)."""
    try:
        return [(int(r), str(what)) for r, what in _note(verdict).get("roll", [])]
    except (ValueError, TypeError, OverflowError):
        return []


@contextlib.contextmanager
def activate(watch: CollectiveWatch | None) -> Iterator[None]:
    """Make ``watch`` bound the collectives run by this thread inside the ``with`` block."""
    previous = getattr(_local, "watch", None)
    _local.watch = watch
    try:
        yield
    finally:
        _local.watch = previous


def active_watch() -> CollectiveWatch | None:
    """The watch active in this thread, if any."""
    watch: CollectiveWatch | None = getattr(_local, "watch", None)
    return watch


def phase(name: str) -> None:
    """Note this rank's phase in :data:`PHASE_LOG` and publish it through the active watch."""
    PHASE_LOG.append((name, time.perf_counter(), threading.get_ident()))
    watch = active_watch()
    if watch is not None:
        with contextlib.suppress(Exception):  # a report, never a reason to fail a save
            watch.phase(name)
