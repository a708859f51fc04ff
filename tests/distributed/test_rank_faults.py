"""A rank SIGKILLed or SIGSTOPped in the middle of a 2-rank save (``collective_timeout_s: 3``).

The ranks are plain processes, not torchrun workers: torchrun's agent kills the survivors as soon
as one rank dies, and these tests are about what the survivors see. Every error is a typed
``CkptEngineError`` naming the rank and the collective; the error says truthfully whether the
checkpoint was committed (``latest_checkpoint.txt`` is the judge); the save after a lost rank
fails at once with ``ProcessGroupError`` (restart the job) instead of a raw ``DistStoreError``
from ``new_group``; a stopped rank that wakes up late raises typed errors too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _torchrun import run_ranks

pytestmark = pytest.mark.dist


@pytest.mark.parametrize(
    ("sig", "step", "committed"),
    [("KILL", "commit", False), ("KILL", "committed", True), ("STOP", "committed", True)],
    ids=["kill-before-commit", "kill-after-commit", "stop-after-commit"],
)
def test_a_lost_rank_gives_typed_errors_and_a_truthful_commit_outcome(
    tmp_path: Path, sig: str, step: str, committed: bool
) -> None:
    result = run_ranks("rank_fault.py", str(tmp_path), sig, step, timeout=180)
    results = result.results()
    assert 0 in results, result.describe()
    rank0 = results[0][0]
    third, fourth = rank0["third"], rank0["fourth"]
    assert third["typed"], third
    assert third["type"] == "CollectiveTimeoutError", third
    assert f"rank 1 did not reach '{step}'" in third["message"]
    assert third["committed"] is committed
    assert rank0["latest"] == ("iter_000000003" if committed else "iter_000000002")
    assert ("was committed" if committed else "was not committed") in third["message"]
    assert fourth["type"] == "ProcessGroupError" and fourth["typed"], fourth
    assert "restart" in fourth["message"].lower() and "rank 0" in fourth["message"]
    if sig == "STOP":  # the stopped rank, woken after rank 0 gave up on it
        assert 1 in results, result.describe()
        late = results[1][0]
        assert late["third"]["typed"] and late["fourth"]["typed"], late
        assert late["third"]["committed"] is None or late["third"]["committed"] is False, late
