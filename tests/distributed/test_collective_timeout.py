"""``collective_timeout_s``: bounded barriers that name the ranks that did not arrive.

The barrier protocol runs here on a real c10d ``HashStore`` shared by threads playing the ranks;
the torchrun test runs a real 2-rank job in which one rank sleeps inside a hook."""

from __future__ import annotations

import re
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist
from _threads import in_threads
from _torchrun import run_torchrun

from ckpt_engine import CollectiveTimeoutError, EngineConfig
from ckpt_engine._dcpio.watch import CollectiveWatch, activate, active_watch, phase

pytestmark = pytest.mark.full  # waits out collective timeouts


class _RecordingStore:
    """A real c10d ``HashStore`` that also records how long each ``wait`` was allowed to take:
    the tests check the bound a barrier asked for, not how long a loaded machine took."""

    def __init__(self) -> None:
        self._store = dist.HashStore()
        self.waits: list[float] = []

    def wait(self, keys: list[str], timeout: timedelta) -> None:
        self.waits.append(timeout.total_seconds())
        self._store.wait(keys, timeout)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)


def _watches(world: int, timeout_s: float) -> list[CollectiveWatch]:
    store = _RecordingStore()
    return [
        CollectiveWatch(timeout_s, store=store, group=object(), rank=r, world=world, namespace="test/")
        for r in range(world)
    ]


def _first(w: CollectiveWatch, step: str) -> tuple[Any, threading.Event]:
    """``w``'s barrier at ``step`` as a thread's function, and the event it sets once that
    barrier returned or raised: a late rank waits for it, so ``w`` cannot have waited for that rank."""
    returned = threading.Event()

    def first() -> None:
        try:
            w.barrier(step)
        finally:
            returned.set()

    return first, returned


def test_default_timeout_is_600_s() -> None:
    assert EngineConfig(save_dir="x").collective_timeout_s == 600


def test_barriers_pass_when_every_rank_arrives() -> None:
    watches = _watches(3, 5.0)

    def rank(w: CollectiveWatch) -> int:
        for step in ("prepare", "plan", "write", "commit"):
            w.phase(step)
            w.barrier(step)
        return w.rank

    assert in_threads(*[lambda w=w: rank(w) for w in watches]) == [0, 1, 2]
    # Rank 0 deleted the keys of the barriers everybody passed: only the last one's remain.
    store = watches[0].store
    assert not store.check(["test/b/1/count"]) and store.check(["test/b/4/count"])


def test_a_rank_that_does_not_arrive_is_named_with_its_last_phase() -> None:
    w0, w1, w2 = _watches(3, 0.5)
    w1.phase("stage")
    w2.phase("write")
    first, gave_up = _first(w0, "write")

    def late() -> None:
        # Rank 2 arrives only once rank 0 has given up: rank 0 cannot have waited for it.
        assert gave_up.wait(60), "rank 0 never gave up"
        w2.barrier("write")

    r0, r2 = in_threads(first, late)
    assert w0.store.waits[0] == 0.5  # rank 0 waited its timeout, not longer
    assert isinstance(r0, CollectiveTimeoutError)
    assert r0.step == "write" and r0.missing == (1, 2)
    assert re.search(r"rank 1: last phase: stage, \d+\.\d s ago", str(r0)), r0
    assert "2 ranks (1, 2) did not reach 'write' within 0.5 s" in str(r0)
    # Rank 2 came late, but rank 1 never did: rank 2 times out too, naming only rank 1.
    assert isinstance(r2, CollectiveTimeoutError) and r2.missing == (1,), r2
    assert w0.group is None and w2.group is None  # the group is not used again


def test_a_rank_arriving_after_the_others_gave_up_raises_instead_of_entering_the_collective() -> None:
    w0, w1 = _watches(2, 0.5)
    first, gave_up = _first(w0, "write")

    def late() -> None:
        assert gave_up.wait(60), "rank 0 never gave up"
        w1.phase("stage")
        w1.barrier("write")

    r0, r1 = in_threads(first, late)
    assert isinstance(r0, CollectiveTimeoutError) and r0.missing == (1,)
    assert isinstance(r1, CollectiveTimeoutError) and r1.missing == ()
    assert "rank 1 reached 'write' after the other ranks stopped waiting for it" in str(r1)
    assert "last phase: stage" in str(r1)


def test_a_survivor_arriving_after_the_lost_rank_woke_names_it() -> None:
    # Rank 2 stops; rank 0 gives up on it. Rank 2 then wakes and arrives, and rank 1 comes last:
    # every rank is there by then, so rank 1's own wait passes, but the barrier was given up.
    # Rank 1 names the rank rank 0 found missing, not nobody (this was a CI flake of the
    # shared-read fault test, where rank 0 wakes the stopped rank once it has given up).
    w0, w1, w2 = _watches(3, 0.3)
    w2.phase("read (shared 2/3, broadcast)")
    with pytest.raises(CollectiveTimeoutError) as given_up:
        w0.barrier("read")
    assert given_up.value.missing == (1, 2)
    woke = in_threads(lambda: w2.barrier("read"))[0]
    assert isinstance(woke, CollectiveTimeoutError) and woke.missing == (1,)  # rank 1 was missing too
    with pytest.raises(CollectiveTimeoutError) as last:
        w1.barrier("read")
    assert last.value.missing == (2,), last.value
    expected = r"rank 2 did not reach 'read' within 0\.3 s \(last phase: read \(shared 2/3, broadcast\)"
    assert re.match(expected, str(last.value)), last.value
    assert "seen from rank 1, which arrived after another rank stopped waiting" in str(last.value)


def test_a_rank_whose_collective_already_waited_calls_the_roll_only_for_the_rest() -> None:
    # After a broadcast of shared reads failed, having waited part of the timeout, the rank
    # names the lost peer by the original deadline, not a whole timeout later; the deadline is
    # for one barrier only.
    w0, _ = _watches(2, timeout_s=60)
    w0.expect_by(time.monotonic() + 0.2)
    with pytest.raises(CollectiveTimeoutError, match=r"rank 1 did not reach 'read'") as info:
        w0.barrier("read")
    (waited,) = w0.store.waits
    assert 0.05 <= waited <= 0.2  # the rest of the deadline (60 s without it)
    assert info.value.missing == (1,)
    assert w0._wait_s() == 60  # spent: the next barrier waits the whole timeout again


def test_message_for_one_missing_rank_matches_the_documented_form() -> None:
    w0, w1 = _watches(2, 0.3)
    w1.phase("stage")
    with pytest.raises(CollectiveTimeoutError) as info:
        w0.barrier("write")
    assert re.match(r"rank 1 did not reach 'write' within 0\.3 s \(last phase: stage, \d+\.\d s ago\)", str(info.value))
    w0b, _w1b = _watches(2, 0.3)
    with pytest.raises(CollectiveTimeoutError, match=r"rank 1 did not reach 'plan' .*last phase: none published"):
        w0b.barrier("plan")


def test_phase_reports_only_through_the_active_watch() -> None:
    (w,) = _watches(1, 1.0)
    phase("ignored")  # no active watch: nothing, no error
    assert active_watch() is None
    with activate(w):
        assert active_watch() is w
        phase("read")
    assert active_watch() is None
    assert b'"phase": "read"' in w.store.get("test/phase/0")


@pytest.mark.dist
def test_a_rank_stuck_in_a_hook_is_named_by_the_other_within_the_timeout(tmp_path: Any) -> None:
    run = run_torchrun("collective_timeout.py", str(tmp_path), nproc=2, timeout=120)
    assert run.returncode == 0, run.describe()
    res = run.results()
    steps = {(rank, r["step"]): r for rank, rows in res.items() for r in rows}
    # Save: rank 1 is held in remap_keys until rank 0's save has returned; timeout 3 s. Rank 0
    # returned by itself (the order shows it: rank 1 was released by it, not by the hang guard),
    # after waiting out the timeout.
    waited = steps[0, "save_remap"]
    assert waited["raised"] == "CollectiveTimeoutError", waited
    assert re.match(
        r"rank 1 did not reach 'prepare' within 3 s \(last phase: remap_keys, \d+\.\d s ago\)", waited["message"]
    )
    assert waited["missing"] == [1] and waited["seconds"] >= 2.9
    late = steps[1, "save_remap"]
    assert late["released"] is True, late
    assert late["raised"] == "CollectiveTimeoutError" and "after the other ranks stopped waiting" in late["message"]
    # The engine is usable again afterwards.
    assert steps[0, "save_again"]["raised"] is None and steps[1, "save_again"]["raised"] is None
    # Load: rank 1 is held in pre_load_plan.
    waited = steps[0, "load_plan"]
    assert waited["raised"] == "CollectiveTimeoutError", waited
    assert re.match(r"rank 1 did not reach 'plan' within 3 s \(last phase: plan, \d+\.\d s ago\)", waited["message"])
    assert waited["missing"] == [1] and waited["seconds"] >= 2.9
    assert steps[1, "load_plan"]["released"] is True
    assert steps[1, "load_plan"]["raised"] == "CollectiveTimeoutError"
    # close() on rank 0 returned while rank 1 waited outside the engine for it: no other rank needed.
    assert steps[1, "closed"]["waited_for_rank_0"] is True
    for rank in (0, 1):
        assert steps[rank, "closed"]["raised"] is None


@pytest.mark.dist
def test_a_stopped_writer_process_is_named_by_the_other_writer_within_the_timeout(tmp_path: Any) -> None:
    """``pinned_staging``'s writer processes bound their collectives by ``collective_timeout_s``
    too, and say which writer did not arrive and what it last did."""
    run = run_torchrun("collective_timeout_writer.py", str(tmp_path), nproc=2, timeout=180)
    assert run.returncode == 0, run.describe()
    steps = {(rank, r["step"]): r for rank, rows in run.results().items() for r in rows}
    waited = steps[0, "save_stopped"]
    assert waited["raised"] == "CheckpointSaveError", waited
    assert re.search(
        r"writer rank 1 did not reach 'agree' within 3 s \(last phase: [\w:]+, \d+\.\d s ago\)", waited["message"]
    ), waited
    # Rank 1's writer stays stopped until rank 0's result() has returned: rank 0's writer gave
    # up by itself (the order shows it), after waiting out the timeout.
    assert waited["seconds"] >= 2.9, waited
    late = steps[1, "save_stopped"]
    assert late["raised"] == "CheckpointSaveError", late
    assert "writer rank 1 reached 'agree' after the other ranks stopped waiting" in late["message"], late
    for rank in (0, 1):
        assert steps[rank, "save_again"]["raised"] is None, steps[rank, "save_again"]
    # close() on rank 0 returned while rank 1 waited outside the engine for it.
    assert steps[1, "closed"]["waited_for_rank_0"] is True
    for rank in (0, 1):
        assert steps[rank, "closed"]["raised"] is None, steps[rank, "closed"]


def test_a_peer_failure_wrapped_in_another_engine_error_is_found() -> None:
    """gloo's "Connection closed by peer" inside a CheckpointSaveError (or inside DCP's
    CheckpointException) is still a broken process group: ``bounded`` raises ProcessGroupError
    for it, as the docs promise, instead of the wrapper around a raw RuntimeError."""
    from torch.distributed.checkpoint.api import CheckpointException

    from ckpt_engine import CheckpointSaveError
    from ckpt_engine._dcpio.watch import c10d_cause

    peer = dist.DistError("Connection closed by peer [127.0.0.1]:29500")
    try:
        try:
            raise peer
        except dist.DistError as err:
            raise CheckpointSaveError("saving iteration 3 failed: Connection closed by peer") from err
    except CheckpointSaveError as wrapped:
        assert c10d_cause(wrapped) is peer
    dcp_failure = CheckpointException("save", {1: peer})
    assert c10d_cause(CheckpointSaveError("failed")) is None
    wrapped_dcp = CheckpointSaveError("failed")
    wrapped_dcp.__cause__ = dcp_failure
    assert c10d_cause(wrapped_dcp) is peer
    looped = ValueError("a")
    looped.__context__ = ValueError("b")
    looped.__context__.__context__ = looped  # a cycle ends the walk
    assert c10d_cause(looped) is None
