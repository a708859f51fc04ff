"""A rank whose save or load fails on its own, outside a collective, tells the ranks waiting for it.

The watches of several "ranks" share one real c10d ``HashStore``, each rank a thread. The
barriers are given a timeout far longer than any of these steps takes: a rank told of the
failure raises at once, so the tests end by what the ranks do, not by a clock. A missing note
shows as that wait, then a ``CollectiveTimeoutError`` where the test expects another outcome (a
wait inside the store cannot be interrupted by the suite's hang guard).
"""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from _threads import in_threads

from ckpt_engine import CollectiveTimeoutError, RankFailedError
from ckpt_engine._dcpio.watch import CollectiveWatch

#: No barrier here may end by timing out: a rank that waits is woken by the others long before.
LONG_S = 120.0


class _Store:
    """A real ``HashStore`` that counts the barriers' waits, so a test can act once a rank waits."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self.waiting = threading.Semaphore(0)

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.waiting.release()
        self._store.wait(keys, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _watches(world: int, timeout_s: float = LONG_S) -> list[CollectiveWatch]:
    store = _Store()
    return [
        CollectiveWatch(timeout_s, store=store, group=object(), rank=r, world=world, namespace="left/")
        for r in range(world)
    ]


def _begin(watches: list[CollectiveWatch], what: str) -> None:
    for w in watches:
        w.begin(what)


def _all_pass(watches: list[CollectiveWatch], step: str) -> None:
    assert in_threads(*[lambda w=w: w.barrier(step) for w in watches]) == [None] * len(watches)


def _rank_1_meets_rank_0s_note_and_both_go_on(watches: list[CollectiveWatch]) -> None:
    """Rank 1's next barrier raises rank 0's failure at once; the ranks are then at one slot, and
    the next call runs its collectives together."""
    w0, w1 = watches
    with pytest.raises(RankFailedError, match="rank 0 failed this save on its own"):
        w1.barrier("prepare")
    assert w0._seq == w1._seq
    _begin(watches, "save")
    _all_pass(watches, "prepare")


def test_the_ranks_waiting_for_a_rank_that_failed_on_its_own_raise_at_once_naming_it() -> None:
    w0, w1, w2 = watches = _watches(3)
    _begin(watches, "save")
    _all_pass(watches, "prepare")
    w1.phase("write")

    def failing_rank() -> None:
        for _ in range(2):  # ranks 0 and 2 wait for it
            assert w1.store.waiting.acquire(timeout=LONG_S)
        w1.leave(OSError(28, "No space left on device"))

    r0, _, r2 = in_threads(lambda: w0.barrier("plan_check"), failing_rank, lambda: w2.barrier("plan_check"))
    for rank, got in ((0, r0), (2, r2)):
        assert isinstance(got, RankFailedError), (rank, got)
        assert got.failed_rank == 1 and got.missing == (1,) and got.step == "plan_check"
        assert "rank 1 failed this save on its own in phase 'write', so it will not reach 'plan_check'" in str(got)
        assert "OSError: [Errno 28] No space left on device" in str(got)
        assert f"seen from rank {rank}" in str(got)
    # Nobody's group was closed, and the ranks are still in step: the next call's barriers pass.
    assert all(w.group is not None for w in watches)
    _begin(watches, "save")
    _all_pass(watches, "prepare")
    _all_pass(watches, "commit")


def test_a_rank_that_failed_after_the_others_finished_the_call_does_not_fail_their_next_one() -> None:
    w0, w1 = watches = _watches(2)
    _begin(watches, "load")
    _all_pass(watches, "read")
    w1.leave(RuntimeError("a Stateful's load_state_dict raised on rank 1"))  # after the call's last barrier
    # Rank 0 finished that load; its next save's first barrier is the slot rank 1 gave up. It
    # moves on to the next slot, where rank 1's next barrier is.
    _begin(watches, "save")
    _all_pass(watches, "prepare")
    _all_pass(watches, "write")
    assert w0._seq == w1._seq


def test_ranks_that_all_fail_together_give_up_the_same_slot_and_stay_in_step() -> None:
    watches = _watches(3)
    _begin(watches, "save")
    _all_pass(watches, "prepare")
    for w in watches:  # a failure the ranks agreed on: each leaves, the first note wins
        w.leave(ValueError("replicated state differs"))
    _begin(watches, "save")
    _all_pass(watches, "prepare")
    assert len({w._seq for w in watches}) == 1


def test_a_rank_leaving_a_slot_the_others_gave_up_on_by_timeout_closes_its_group_as_they_did() -> None:
    w0, w1 = _watches(2, timeout_s=0.2)
    _begin([w0, w1], "save")
    with pytest.raises(CollectiveTimeoutError):
        w0.barrier("write")  # rank 1 never comes: rank 0 gives up and closes its group
    assert w0.group is None
    w1.leave(OSError("late failure"))
    # Every rank's next call makes a new group (the engine's rule after a timeout).
    assert w1.group is None


def test_ranks_that_come_to_a_barrier_for_different_collectives_all_refuse_it() -> None:
    w0, w1, w2 = watches = _watches(3)
    _begin(watches, "save")
    _all_pass(watches, "prepare")
    # Rank 1 skipped a collective the others run: without the check the three would pass this
    # barrier together and run two different collectives against each other.
    got = in_threads(lambda: w0.barrier("plan_check"), lambda: w1.barrier("commit"), lambda: w2.barrier("plan_check"))
    for rank, err in enumerate(got):
        assert type(err).__name__ == "CollectiveError", (rank, err)
        assert "the ranks are out of step" in str(err) and "'commit'" in str(err) and "'plan_check'" in str(err)
        assert f"seen from rank {rank}" in str(err)
    assert all(w.group is None for w in watches)  # every rank's next call makes a new group


def test_a_later_barrier_of_the_call_a_peer_left_fails_at_once_without_a_slot() -> None:
    # Code that catches the error and goes on to another collective in the same call (a resume's
    # fallback) must not wait for the rank that left, nor use a slot the others do not.
    w0, w1 = watches = _watches(2)
    _begin(watches, "load")
    w1.leave(TypeError("bad argument on rank 1"))  # before its first collective
    for step in ("sync", "sync", "metadata"):
        with pytest.raises(RankFailedError, match="rank 1 failed this load on its own"):
            w0.barrier(step)
    w0.leave(RankFailedError("wrapped"))  # told already: nothing more to tell
    _begin(watches, "save")
    _all_pass(watches, "prepare")
    assert w0._seq == w1._seq


def test_a_note_left_at_the_start_of_a_call_goes_past_a_peers_note_of_the_previous_call() -> None:
    w0, w1 = watches = _watches(2)
    _begin(watches, "save")
    _all_pass(watches, "commit")
    w1.leave(RuntimeError("failed on rank 1 after the last collective"))  # end of call 1
    _begin(watches, "save")
    w0.leave(ValueError("bad argument on rank 0"))  # start of call 2: must not be lost
    _rank_1_meets_rank_0s_note_and_both_go_on(watches)


def test_a_note_left_after_the_others_timed_out_in_their_next_call_closes_the_group_in_that_call() -> None:
    # Rank 1 fails after the last collective of call 1, but only after rank 0 gave up the first
    # barrier of call 2 (and closed its group there). Rank 1 must close its group in its call 2,
    # as rank 0 did, or the ranks would make their new groups in different calls.
    w0, w1 = watches = _watches(2, timeout_s=0.2)
    _begin(watches, "save")
    _all_pass(watches, "commit")
    w0.begin("save")
    with pytest.raises(CollectiveTimeoutError):
        w0.barrier("prepare")
    assert w0.group is None
    w1.leave(RuntimeError("failed on rank 1 after the last collective"))  # still its call 1
    assert w1.group is not None
    w1.begin("save")
    with pytest.raises(CollectiveTimeoutError, match="after the other ranks stopped waiting"):
        w1.barrier("prepare")
    assert w1.group is None


def test_ranks_in_different_engine_calls_at_one_barrier_refuse_it() -> None:
    w0, w1 = watches = _watches(2)
    _begin(watches, "save")
    w1.begin("save")  # rank 1 is one call ahead: the same step names no longer hide it
    got = in_threads(lambda: w0.barrier("prepare"), lambda: w1.barrier("prepare"))
    for err in got:
        assert type(err).__name__ == "CollectiveError" and "the ranks are out of step" in str(err), err
        assert "engine call" in str(err)


def test_a_rank_leaving_after_a_peer_already_left_the_next_call_takes_no_slot() -> None:
    # Rank 1 fails after the last collective of call 1, but rank 0 has already started call 2
    # and failed there on its own first, at the slot rank 1 would take: rank 1's next call must
    # meet rank 0's note there, not one slot further on (the ranks would then be a call apart).
    w0, w1 = watches = _watches(2)
    _begin(watches, "save")
    _all_pass(watches, "commit")
    w0.begin("save")
    w0.leave(ValueError("bad argument on rank 0"))  # call 2
    w1.leave(RuntimeError("failed on rank 1 after the last collective"))  # still call 1
    w1.begin("save")
    _rank_1_meets_rank_0s_note_and_both_go_on(watches)


def test_an_unreadable_note_is_passed_over_alike_by_a_leaving_rank_and_by_a_barrier() -> None:
    w0, w1 = watches = _watches(2)
    _begin(watches, "save")
    _all_pass(watches, "prepare")
    # The next slot holds a note no rank of this engine wrote (a number JSON reads as infinity).
    w0.store.compare_set(f"left/b/{w0._seq + 1}/state", "", 'left:{"rank": "x", "call": 1e400}')
    w0.store.set(f"left/b/{w0._seq + 1}/all", "1")
    w1.leave(RuntimeError("failed on rank 1"))  # goes past it to the next slot
    with pytest.raises(RankFailedError, match="rank 1 failed this save on its own"):
        w0.barrier("write")  # passes it over too, and meets rank 1's note
    assert w0._seq == w1._seq
