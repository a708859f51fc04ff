"""The plan digests the ranks of a load compare (``_dcpio/coordination.py``); the collective
that compares them runs on 2 gloo ranks in ``distributed/test_distributed.py`` (``diverge``)."""

from __future__ import annotations

from ckpt_engine._dcpio.coordination import _split, plan_digest
from ckpt_engine._format.names import per_rank_key
from ckpt_engine.types import Decision, PlanEntry, ValueSpec

SPEC = ValueSpec(is_tensor=True, shape=(2,), dtype=None)


def _entries(keys: dict[str, str], skip: tuple[str, ...] = ()) -> list[PlanEntry]:
    out = []
    for dest, storage in keys.items():
        e = PlanEntry(dest_key=dest, storage_key=storage, target=SPEC, stored=SPEC, decision=Decision.LOAD)
        out.append(e.skip("kept") if dest in skip else e)
    return out


def _digest(keys: dict[str, str], skip: tuple[str, ...] = (), mapped: dict[str, str] | None = None) -> bytes:
    mapped = mapped if mapped is not None else dict(keys)
    return plan_digest(_entries(keys, skip), mapped, keys)[0]


def test_ranks_with_the_same_plan_agree_in_any_order() -> None:
    a = _digest({"w": "w", "b": "b"})
    b = _digest({"b": "b", "w": "w"})
    assert a == b and _split([a, b]) is None


def test_a_per_rank_key_counts_by_the_key_it_was_saved_under_not_by_the_ranks_copy() -> None:
    mapped = {"w": "w", "pos": "pos"}
    rank0 = _digest({"w": "w", "pos": per_rank_key("pos", 0)}, mapped=mapped)
    rank1 = _digest({"w": "w", "pos": per_rank_key("pos", 1)}, mapped=mapped)
    assert rank0 == rank1


def test_a_key_read_from_another_stored_key_or_skipped_on_one_rank_is_a_different_plan() -> None:
    base = _digest({"w": "w", "b": "b"})
    remapped = _digest({"w": "ema.w", "b": "b"})
    skipped = _digest({"w": "w", "b": "b"}, skip=("b",))
    for other in (remapped, skipped):
        assert other[:8] == base[:8] and other[8:] != base[8:]  # the same keys, planned otherwise
        assert _split([base, other]) == ([0], [1])
    assert _split([base, base, skipped, base]) == ([0, 1, 3], [2])


def test_ranks_holding_other_keys_pipeline_stages_are_not_compared() -> None:
    stage0 = _digest({"layers.0.w": "layers.0.w"})
    stage1 = _digest({"layers.1.w": "layers.1.w"}, skip=("layers.1.w",))
    assert _split([stage0, stage1, stage0, stage1]) is None
    # ...but the replicas of one stage are.
    stage1_other = _digest({"layers.1.w": "layers.1.w"})
    assert _split([stage0, stage1, stage0, stage1_other]) == ([1], [3])
    assert _split([None, None]) is None  # planners that send no digest
