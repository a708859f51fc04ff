"""The demo's save timings: how long ``save()`` blocked training and when the save committed are
measured from one start (the ``save()`` call), so the commit never reads as earlier than the
return of the call that made it (the demo once printed ``blocked training 117 ms, committed
after 112 ms``)."""

from __future__ import annotations

import pytest

from ckpt_engine._inspect.listing import SaveDirListing, listing_table
from ckpt_engine.demo.narration import describe_save_times, save_line, save_times


def test_a_save_that_waited_for_the_previous_one_commits_after_it_returned() -> None:
    """``save()`` waited 112 ms for the previous save before its own clock started: the engine's
    ``total`` (112 ms) is from that later start; from the call's start the commit is at 224 ms."""
    ev = {"call": 0.117, "blocked": 0.005, "total": 0.112}
    call, committed, waited = save_times(ev)
    assert (call, waited) == (0.117, pytest.approx(0.112)) and committed == pytest.approx(0.224)
    assert describe_save_times(ev) == "save() blocked training 117 ms, committed 224 ms after the call began"


def test_a_synchronous_save_commits_inside_the_call() -> None:
    """A synchronous save's ``blocked`` equals its ``total``; the call, timed outside, is a little
    longer: the commit was inside the call, never "after" it."""
    ev = {"call": 0.117, "blocked": 0.112, "total": 0.112}
    assert save_times(ev)[1] == pytest.approx(0.117)
    assert describe_save_times(ev) == "save() blocked training 117 ms, committed inside the call"


@pytest.mark.parametrize(
    "ev",
    [
        {"call": 0.024, "blocked": 0.020, "total": 0.238},
        {"call": 0.117, "blocked": 0.005, "total": 0.112},
        {"call": 0.117, "blocked": 0.112, "total": 0.112},
        {"call": 0.050, "blocked": 0.060, "total": 0.040},  # clocks that disagree: still never before
    ],
)
def test_the_commit_is_never_before_the_return(ev: dict[str, float]) -> None:
    call, committed, _ = save_times(ev)
    assert committed >= call


def test_a_save_line_and_the_ls_table_show_one_size_in_one_unit() -> None:
    """The demo printed one checkpoint as "19.8 MB" in its save line and "18.9 MiB" in the ``ls``
    table under it: both now say what ``ckpt-engine ls`` says, in binary units."""
    nbytes = 19_800_000
    ev = {"iteration": 10, "succeeded": True, "bytes": nbytes, "call": 0.048, "blocked": 0.040, "total": 0.221}
    row = {
        "iteration": 10,
        "name": "iter_000000010",
        "components": ["model"],
        "bytes": nbytes,
        "files": 2,
        "status": "verified",
        "latest": True,
        "reused": 0,
    }
    table = listing_table(SaveDirListing("runs/demo/checkpoints", "iter_000000010", [row]))
    assert save_line(ev).startswith("   step   10: committed iter_000000010  18.9 MiB, save() blocked training 48 ms")
    assert " 18.9 MiB " in table[1]
    assert "MB" not in save_line(ev).replace("MiB", "")
