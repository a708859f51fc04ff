"""Replication rounds are bounded (``replication_max_in_flight``): behind a slow link
(``peer_bandwidth_mb_s``), saves either skip replicating their step (``skip``, the default) or
wait for a round to finish (``wait``), and the local tier holds at most ``local_keep_last`` +
that many steps per rank, instead of every step whose replication is still queued.

One torchrun launch of 2 gloo ranks as 2 nodes (``tests/dist_scripts/replication_bound.py``)
runs both behaviours.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _torchrun import run_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.full]

STEPS = 8
KEEP_LAST, MAX_IN_FLIGHT = 2, 2  # the defaults


def test_slow_replication_bounds_rounds_in_flight_and_steps_held(tmp_path: Path) -> None:
    run = run_torchrun("replication_bound.py", str(tmp_path), "skip,wait", str(STEPS), nproc=2, timeout=400)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == [0, 1], run.describe()
    for rank, reports in results.items():
        by_mode = {r["mode"]: r for r in reports}
        for mode, got in by_mode.items():
            saves = got["saves"]
            assert len(saves) == STEPS
            assert max(s["in_flight"] for s in saves) <= MAX_IN_FLIGHT, (rank, mode, saves)
            assert max(s["held"] for s in saves) <= KEEP_LAST + MAX_IN_FLIGHT, (rank, mode, saves)
            # Every round done: still within the bound (the steps they pinned go at the next save).
            assert len(got["held_after"]) <= KEEP_LAST + MAX_IN_FLIGHT, (rank, mode, got)
        # The link is far slower than the saves: skipping is what kept the bound, with a warning each...
        assert by_mode["skip"]["skipped"] >= 1, by_mode["skip"]
        # ... and waiting kept it without skipping any step.
        assert by_mode["wait"]["skipped"] == 0, by_mode["wait"]
