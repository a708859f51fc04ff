"""The digests behind the per-rank state check (``_engine/consensus``) and the load's resolution of
per-rank storage keys (``_format/names``), on plain values: no process group needed. The ranks'
exchange itself runs under torchrun in tests/distributed/test_per_rank_state.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from ckpt_engine._engine.consensus import (
    FULL_HASH_BYTES,
    PAGE_BYTES,
    SAMPLED_PAGES,
    differences,
    digests,
    page_offsets,
    per_rank_maps,
    tensor_digest,
    value_digest,
)
from ckpt_engine._format.names import per_rank_copies, per_rank_key, resolve_per_rank, split_per_rank
from ckpt_engine.errors import PerRankStateError, ReplicatedStateMismatchError

LARGE = FULL_HASH_BYTES * 8  # bytes of a tensor hashed by sampled pages


def test_a_small_tensor_is_hashed_whole_with_its_shape_and_dtype() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    assert tensor_digest(t) == tensor_digest(t.clone())
    changed = t.clone()
    changed[517] += 1
    assert tensor_digest(changed) != tensor_digest(t)
    assert tensor_digest(t.view(10, 100)) != tensor_digest(t)
    assert tensor_digest(t.view(torch.int32)) != tensor_digest(t)
    assert tensor_digest(t[::2]) == tensor_digest(t[::2].contiguous())  # strided: its values, not its storage


def test_a_large_tensor_is_hashed_by_pages_that_move_with_the_iteration() -> None:
    offsets = page_offsets(LARGE, salt=3)
    assert len(offsets) == SAMPLED_PAGES
    assert offsets[-1] == LARGE - PAGE_BYTES
    assert all(0 <= o <= LARGE - PAGE_BYTES for o in offsets)
    assert page_offsets(LARGE, salt=4) != offsets

    t = torch.zeros(LARGE, dtype=torch.uint8)
    base = tensor_digest(t, salt=3)
    in_page = t.clone()
    in_page[offsets[5] + 7] = 1
    assert tensor_digest(in_page, salt=3) != base
    # The documented limit: a byte no sampled page covers is not seen by that save...
    unsampled = offsets[5] + PAGE_BYTES + 1  # just after a sampled page
    assert not any(o <= unsampled < o + PAGE_BYTES for o in offsets)
    outside = t.clone()
    outside[unsampled] = 1
    assert tensor_digest(outside, salt=3) == base
    # ... and a later save's pages may cover it.
    salts = [s for s in range(1, 200) if any(o <= unsampled < o + PAGE_BYTES for o in page_offsets(LARGE, s))]
    assert salts
    assert tensor_digest(outside, salt=salts[0]) != tensor_digest(t, salt=salts[0])


def test_values_hash_by_their_pickle_sets_in_any_order() -> None:
    assert value_digest({"epoch": 2, "index": 100}) == value_digest({"epoch": 2, "index": 100})
    assert value_digest(100) != value_digest(101)
    assert value_digest({"b", "a", "c"}) == value_digest({"c", "a", "b"})
    assert isinstance(value_digest(lambda: 0), int)  # unpicklable: hashed by its repr, no error


def rank_state(rank: int, expert: float | None = None) -> dict[str, dict[str, Any]]:
    return {
        "model": {"weight": torch.ones(4), "expert": torch.full((3,), float(rank if expert is None else expert))},
        "trainer": {"iteration": 5},
        "loader": {"epoch": 2, "index": 100 + rank},
    }


def maps(state: dict[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    return {name: {k: k for k in sd} for name, sd in state.items()}


def exchange(states: list[dict[str, dict[str, Any]]], patterns: tuple[str, ...] = ()) -> list[Any]:
    local = [digests(s, maps(s), 1, patterns) for s in states]
    gathered = [d.sent for d in local]
    return [(d, differences(d, gathered)) for d in local]


def test_a_differing_plain_tensor_is_named_with_its_ranks_and_raises() -> None:
    (local, found), _ = exchange([rank_state(0), rank_state(1)])
    by_key = {(d.component, d.key): d for d in found}
    assert set(by_key) == {("model", "expert"), ("loader", "index")}
    assert by_key["model", "expert"].tensor and by_key["model", "expert"].groups == ((0,), (1,))
    with pytest.raises(ReplicatedStateMismatchError, match=r"component 'model' key 'expert': rank\(s\) \[0\]"):
        per_rank_maps(local, found, maps(rank_state(0)), 0)


def test_differing_values_and_extras_get_rank_keys_and_configured_keys_always() -> None:
    states = [rank_state(0), rank_state(1)]
    for rank, (local, found) in enumerate(exchange(states, ("model.expert",))):
        assert all(d.component == "loader" for d in found)
        renamed = per_rank_maps(local, found, maps(states[rank]), rank)
        assert renamed["model"] == {"weight": "weight", "expert": f"expert@rank{rank}"}
        assert renamed["loader"] == {"epoch": f"epoch@rank{rank}", "index": f"index@rank{rank}"}  # the whole extra
        assert renamed["trainer"] == {"iteration": "iteration"}


def test_identical_state_changes_no_key() -> None:
    states = [rank_state(0, expert=1.0), rank_state(0, expert=1.0)]
    for rank, (local, found) in enumerate(exchange(states)):
        assert found == []
        assert per_rank_maps(local, found, maps(states[rank]), rank) == maps(states[rank])


def test_ranks_holding_different_keys_compare_the_keys_they_share() -> None:
    a, b = rank_state(0, expert=1.0), rank_state(0, expert=2.0)
    b["model"]["only_rank1"] = torch.zeros(2)  # not replicated: nothing to compare
    a["trainer"]["rank0.seed"] = 1
    b["trainer"]["rank1.seed"] = 2
    (_, found), (_, found1) = exchange([a, b])
    assert [(d.component, d.key, d.groups) for d in found] == [("model", "expert", ((0,), (1,)))]
    assert found1 == found


@dataclass
class Planner:
    component: str = "loader"
    checkpoint_dir: str = "/ck/iter_000000001/loader"
    rank: int = 0
    world_size: int = 2
    repartitions: bool = False


SAVED = frozenset({"epoch@rank0", "epoch@rank1", "index@rank0", "index@rank1", "plain"})


def test_names_of_per_rank_keys() -> None:
    assert per_rank_key("a.b", 3) == "a.b@rank3"
    assert split_per_rank("a.b@rank3") == ("a.b", 3)
    assert split_per_rank("a@rankx") is None and split_per_rank("@rank1") is None
    assert per_rank_copies(SAVED) == {"epoch": {0, 1}, "index": {0, 1}}


def test_a_load_reads_its_own_rank_copy_and_claims_the_others() -> None:
    key_map = {"epoch": "epoch", "index": "index", "plain": "plain"}
    resolved, claimed = resolve_per_rank(key_map, SAVED, Planner(rank=1))
    assert resolved == {"epoch": "epoch@rank1", "index": "index@rank1", "plain": "plain"}
    assert claimed == SAVED - {"plain"}
    untouched, none = resolve_per_rank(key_map, frozenset(key_map), Planner())
    assert untouched == key_map and none == set()


def test_another_world_size_is_refused_unless_the_object_repartitions() -> None:
    key_map = {"epoch": "epoch"}
    with pytest.raises(PerRankStateError, match=r"component 'loader' holds key 'epoch' saved per rank by 2 rank"):
        resolve_per_rank(key_map, SAVED, Planner(world_size=1))
    with pytest.raises(PerRankStateError, match="this job has 4"):
        resolve_per_rank(key_map, SAVED, Planner(world_size=4, rank=3))
    resolved, _ = resolve_per_rank(key_map, SAVED, Planner(world_size=4, rank=3, repartitions=True))
    assert resolved == {"epoch": "epoch@rank1"}
