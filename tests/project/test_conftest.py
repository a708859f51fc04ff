"""tests/conftest.py: the two tiers of the suite, the fast tier (``-m "not full"``) and the full tier CI runs.

Every ``dist`` test is in the full tier only, and a torchrun launch from a test that does not
carry ``dist`` fails, so the fast tier never starts ranks (tests/conftest.py)."""

from __future__ import annotations

import _forked
import pytest
from _paths import ROOT
from _torchrun import run_torchrun


def test_a_torchrun_launch_without_the_dist_marker_fails() -> None:
    with pytest.raises(AssertionError, match=r"core_strict\.py: a torchrun launch from a test without"):
        run_torchrun("core_strict.py")


@pytest.mark.full  # collects the whole suite in a subprocess: the full tier (CI)
def test_the_fast_tier_leaves_out_dist_and_full_tests_and_keeps_the_rest() -> None:
    def collected(*args: str) -> set[str]:
        # a forked ``python -m pytest`` (tests/_forked.py): torch is imported once, not per collection
        out = _forked.run(_forked.Module("pytest"), "--collect-only", "-q", "-p", "no:cacheprovider", *args, cwd=ROOT)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return {line.split("::", 1)[1] for line in out.stdout.splitlines() if "::" in line}

    files = ["tests/engine/test_rng.py", "tests/engine/test_incremental.py"]
    every = collected(*files)
    fast = collected("-m", "not full", *files)
    left_out = every - fast
    # The torchrun tests (dist implies full) and a benchmark run (full) are left out.
    assert "test_two_ranks_restore_their_own_state_and_a_one_rank_checkpoint_grows_to_two" in left_out
    assert {t for t in left_out if t.startswith("test_two_rank_fsdp2_with_a_frozen_part")} == {
        "test_two_rank_fsdp2_with_a_frozen_part[sync]",
        "test_two_rank_fsdp2_with_a_frozen_part[pinned_staging]",
    }
    assert "test_the_benchmark_runs_in_its_smoke_mode" in left_out
    # Tests marked full for their time alone (writer processes, the S3 server) are left out too.
    slow = {
        "test_async_saves_carry_over_the_same_way[overlap]",
        "test_async_saves_carry_over_the_same_way[pinned_staging]",
        "test_s3_unchanged_files_are_copied_inside_the_store",
        "test_s3_async_saves_copy_inside_the_store_too",
        "test_two_tier_a_remote_object_changed_after_its_upload_is_uploaded_again",
    }
    assert len(left_out) == 4 + len(slow) and slow <= left_out, sorted(left_out)
    assert "test_rng_is_on_by_default_and_its_name_is_reserved" in fast
