"""FSDP2 with torchao float8 training weights on 2 gloo ranks: the DTensors' local tensors are a
subclass, and the sync save and ``pinned_staging`` both bring every shard back bit for bit into a
fresh sharded model of the same subclass (tests/dist_scripts/subclass_fsdp.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from _torchrun import run_torchrun

pytestmark = pytest.mark.dist


def test_fsdp2_float8_weights_round_trip_bit_exact(tmp_path: Path) -> None:
    run = run_torchrun("subclass_fsdp.py", str(tmp_path), nproc=2, timeout=300)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == [0, 1], run.describe()
    for rank, reports in results.items():
        assert [r["mode"] for r in reports] == ["sync", "pinned_staging"]
        for r in reports:
            assert r["saved_local_type"] == r["loaded_local_type"] == "WeightWithDynamicFloat8CastTensor", (rank, r)
            assert r["differed_before_load"] == r["keys"], (rank, r)  # the fresh model started elsewhere
            assert r["equal"] == r["keys"], (rank, r)
