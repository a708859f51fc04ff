"""The save plan of an unchanged structure is reused at 2 gloo ranks, not only in one process.

Every rank's structure signature holds its rank, so the ranks' digests differ; a cache that
compared them all with its own digest never hit at several ranks (every save planned and
gathered the plans again). tests/distributed/test_scale.py covers the one-process cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from _torchrun import run_torchrun

pytestmark = pytest.mark.dist


def test_unchanged_structure_reuses_the_plan_on_every_rank(tmp_path: Path) -> None:
    run = run_torchrun("plan_cache_ranks.py", str(tmp_path / "ckpt"), nproc=2, timeout=120)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == [0, 1], run.describe()
    for rank in (0, 1):
        (out,) = results[rank]
        assert out["after_1"] == [1, 0], rank  # the first save plans
        assert out["after_2"] == [1, 1], rank  # new values, same structure: the cached plan
        assert out["after_3"] == [2, 1], rank  # other shapes: planned again
        assert out["loaded"] == out["saved"], rank  # what the cached plan wrote is what was saved
