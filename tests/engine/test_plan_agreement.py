"""The plan digests the ranks of a load compare (``_dcpio/coordination.py``); the collective
that compares them runs on 2 gloo ranks in ``distributed/test_distributed.py`` (``diverge``)."""

from __future__ import annotations

from ckpt_engine._dcpio.coordination import _by_key, _differences, _split, plan_digest
from ckpt_engine._format.names import per_rank_key
from ckpt_engine.types import Decision, PlanEntry, ValueSpec

SPEC = ValueSpec(is_tensor=True, shape=(2,), dtype=None)


def _plan(
    keys: dict[str, str], how: dict[str, str] | None = None, mapped: dict[str, str] | None = None
) -> tuple[bytes, list[str]]:
    """The digest and rows of a plan reading ``keys`` (destination -> stored key, this rank's
    copy for a per-rank key), each loaded unless ``how`` says skip or overlap."""
    entries = []
    for dest, storage in keys.items():
        e = PlanEntry(dest_key=dest, storage_key=storage, target=SPEC, stored=SPEC, decision=Decision.LOAD)
        decision = (how or {}).get(dest)
        entries.append(e.skip("kept") if decision == "skip" else e.overlap("grew") if decision == "overlap" else e)
    return plan_digest(entries, mapped if mapped is not None else dict(keys), keys)


def test_ranks_with_the_same_plan_agree_in_any_order() -> None:
    a, _ = _plan({"w": "w", "b": "b"})
    b, _ = _plan({"b": "b", "w": "w"})
    assert a == b and _split([a, b]) is None


def test_a_stored_key_loaded_on_one_rank_and_skipped_on_another_is_named() -> None:
    base, rows0 = _plan({"w": "w", "b": "b"})
    skipped, rows1 = _plan({"w": "w", "b": "b"}, how={"b": "skip"})
    assert skipped[:8] == base[:8] and skipped[8:] != base[8:]  # the same stored keys, planned otherwise
    assert _split([base, skipped]) == ([0], [1])
    assert _split([base, base, skipped, base]) == ([0, 1, 3], [2])
    plans = [(f"rank {r}", _by_key(rows)) for r, rows in ((0, rows0), (1, rows1))]
    assert _differences(plans) == ["'b': rank 0 load into 'b'; rank 1 skip into 'b'"]


def test_per_rank_copies_are_not_compared_their_shapes_may_differ_by_rank() -> None:
    mapped = {"w": "w", "expert": "expert"}
    rank0, _ = _plan({"w": "w", "expert": per_rank_key("expert", 0)}, mapped=mapped)
    rank1, _ = _plan({"w": "w", "expert": per_rank_key("expert", 1)}, how={"expert": "overlap"}, mapped=mapped)
    assert rank0 == rank1


def test_ranks_reading_other_stored_keys_are_not_compared() -> None:
    # Pipeline stages, or experts a rank-aware remap gives each rank: other stored keys.
    stage0, _ = _plan({"layers.0.w": "layers.0.w"})
    stage1, _ = _plan({"layers.1.w": "layers.1.w"}, how={"layers.1.w": "skip"})
    assert _split([stage0, stage1, stage0, stage1]) is None
    experts0, _ = _plan({"experts.0.w": "experts.0.w", "experts.1.w": "experts.1.w"})
    experts1, _ = _plan({"experts.0.w": "experts.2.w", "experts.1.w": "experts.3.w"})
    assert _split([experts0, experts1]) is None
    # ...but the replicas of one stage are.
    stage1_other, _ = _plan({"layers.1.w": "layers.1.w"})
    assert _split([stage0, stage1, stage0, stage1_other]) == ([1], [3])
    assert _split([None, None]) is None  # planners that send no digest


def test_keys_with_any_character_are_named_and_a_long_plan_stops_at_the_first_differences() -> None:
    odd = "a\x00b{0}"  # a NUL and a format field: the rows are JSON, the message never formats keys
    keys = {odd: odd, **{f"k{i}": f"k{i}" for i in range(20_000)}}
    _, rows0 = _plan(keys)
    _, rows1 = _plan(keys, how={odd: "skip", **{f"k{i}": "skip" for i in range(10)}})
    differ = _differences([("rank 0", _by_key(rows0)), ("rank 1", _by_key(rows1))])
    assert len(differ) == 5
    assert differ[0] == "'a\\x00b{0}': rank 0 load into 'a\\x00b{0}'; rank 1 skip into 'a\\x00b{0}'"
