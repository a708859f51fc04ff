"""The lineage of the node-local tier's steps (DESIGN section 12): the planner's rule on its own
(which copies a resume may take, one save of a step on every rank), and in one process with real
checkpoints: a new run, a rolled-back or replaced ``save_dir`` and another job's folders never
resume the tier's step (the multi-rank cases are tests/distributed/test_tier_lineage.py's)."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch.distributed.checkpoint as dcp

from ckpt_engine import CheckpointEngine, CheckpointExistsError, CheckpointSaveError, hookimpl
from ckpt_engine._format.manifest import Lineage, Place, lookup_manifest, parse_manifest
from ckpt_engine._tier.lineage import (
    COMMITTED_FILE,
    Announced,
    Committed,
    Durable,
    abandoned,
    admissible,
    place_of,
    saved_elsewhere,
)
from ckpt_engine._tier.recovery import _plan
from ckpt_engine._tier.topology import Topology
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal

RUN, OTHER = "aa11", "bb22"


def _lin(save: str, parent: str | None = None, parent_it: int | None = None, run: str = RUN) -> Lineage:
    return Lineage(run, save, parent, parent_it)


def _copy(iteration: int, lineage: Lineage | None, owner: int = 0, holder: int | None = None) -> Announced:
    return Announced(owner if holder is None else holder, owner, iteration, lineage)


def _kept(durable: Durable | None, copies: list[Announced]) -> list[int]:
    return sorted(c.iteration for c in admissible(durable, copies)[0])


# -- the rule -------------------------------------------------------------------------------------


def test_an_empty_save_dir_takes_nothing_from_the_tier() -> None:
    copies = [_copy(7, _lin("e1-7", "e1-6", 6))]
    kept, aside = admissible(None, copies)
    assert kept == [] and list(aside.values()) == [copies]


def test_only_descendants_of_save_dirs_latest_in_its_run_are_taken() -> None:
    durable = Durable(6, _lin("e1-6", "e1-3", 3))
    copies = [
        _copy(6, _lin("e1-6", "e1-3", 3)),  # the durable step's own save
        _copy(7, _lin("e1-7", "e1-6", 6)),  # descends from it
        _copy(8, _lin("f1-2", "e9-6", 6)),  # another save of step 6 is its parent
        _copy(9, _lin("e1-9", "e1-6", 6, run=OTHER)),  # another run
        _copy(5, _lin("e1-5", "e1-3", 3)),  # older than save_dir's: not wanted, not set aside
    ]
    kept, aside = admissible(durable, copies)
    assert sorted(c.iteration for c in kept) == [6, 7]
    assert {r: [c.iteration for c in cs] for r, cs in aside.items()} == {
        "it does not descend from save_dir's latest": [8],
        "another run": [9],
    }


def test_a_later_save_of_the_engine_that_made_save_dirs_latest_descends_from_it() -> None:
    """An asynchronous save with two staging buffers begins step 4 while the durable commit of 3
    still runs: step 4 records the durable step before 3 (none here) as its parent, and was set
    aside once 3 was save_dir's latest, though the job closed cleanly. A later save of the same
    engine descends from 3 whatever parent it recorded; another engine's does not."""
    durable = Durable(3, _lin("e1-3"))
    copies = [_copy(4, _lin("e1-4")), _copy(5, _lin("e1-5", "e1-3", 3)), _copy(6, _lin("e2-1"))]
    kept, aside = admissible(durable, copies)
    assert sorted(c.iteration for c in kept) == [4, 5]
    assert aside == {"it does not descend from save_dir's latest": [copies[2]]}
    assert _kept(Durable(3, _lin("e1-7")), [_copy(4, _lin("e1-4"))]) == []  # an earlier save: not after it


def test_a_tie_takes_the_durable_steps_own_save_only() -> None:
    durable = Durable(6, _lin("e1-6", "e1-3", 3))
    assert _kept(durable, [_copy(6, _lin("e1-6", "e1-3", 3))]) == [6]
    assert _kept(durable, [_copy(6, _lin("e2-1", "e1-3", 3))]) == []


def test_a_rolled_back_save_dir_sets_aside_every_save_of_the_engine_that_went_past_it() -> None:
    """save_dir rolled back from 6 to 3: step 7 descends from the deleted 6, and step 5, made by
    the same engine before it, is set aside with it; a later engine's saves after 3 are taken."""
    durable = Durable(3, _lin("e1-3"))
    old = [_copy(5, _lin("e1-5", "e1-3", 3)), _copy(7, _lin("e1-7", "e1-6", 6))]
    assert _kept(durable, old) == []
    later = [*old, _copy(4, _lin("e2-1", "e1-3", 3))]
    assert _kept(durable, later) == [4]


def test_a_recorded_commit_past_save_dirs_latest_sets_aside_the_engines_saves() -> None:
    """save_dir rolled back from 9 to 6, where 9 was the engine's last save and durable: its copy
    and the local steps 7 and 8 descend from 6, so only the rank's record of 9's commit tells the
    rollback from a crash while 9 was written (where the tier's 9 is the step to resume)."""
    durable = Durable(6, _lin("e1-6", "e1-3", 3))
    copies = [_copy(it, _lin(f"e1-{it}", "e1-6", 6)) for it in (7, 8, 9)]
    assert _kept(durable, copies) == [7, 8, 9]  # no record: the commit of 9 may not have finished
    kept, aside = admissible(durable, copies, [Committed(RUN, "e1", 9)])
    assert kept == [] and aside == {"save_dir was rolled back past its saves": copies}
    for record in (Committed(OTHER, "e1", 9), Committed(RUN, "e1", 6), Committed(RUN, "e2", 9)):
        assert sorted(c.iteration for c in admissible(durable, copies, [record])[0]) == [7, 8, 9], record


def test_before_its_first_durable_step_a_run_known_by_its_run_file_takes_its_own_steps() -> None:
    durable = Durable(None, None, RUN)
    copies = [
        _copy(4, _lin("e1-4")),
        _copy(5, _lin("e2-5", run=OTHER)),
        _copy(6, _lin("e3-6", "e3-3", 3)),  # its durable step 3 is gone from save_dir
        _copy(2, _lin("e3-2")),  # made by the same engine as 6: set aside with it
    ]
    assert _kept(durable, copies) == [4]


def test_copies_without_a_lineage_follow_the_old_rule_only_beside_a_save_dir_without_one() -> None:
    assert _kept(Durable(3, None), [_copy(5, None)]) == [5]
    assert _kept(Durable(3, None), [_copy(5, _lin("e1-5"))]) == []
    assert _kept(Durable(3, _lin("e1-3")), [_copy(5, None)]) == []


def test_the_plan_never_mixes_two_saves_of_one_step() -> None:
    """Ranks 0-1 hold a new save of step 7, ranks 2-3 the old one (with its replicas of ranks 0-1
    on their node): only the old save is complete, and every part comes from it."""
    topology = Topology(world=4, ranks_per_node=2, replicas=1)
    new, old = _lin("e2-1", "e1-6", 6), _lin("e1-7", "e1-6", 6)
    kept = [
        _copy(7, new, owner=0),
        _copy(7, new, owner=1),
        _copy(7, old, owner=2),
        _copy(7, old, owner=3),
        _copy(7, old, owner=0, holder=2),
        _copy(7, old, owner=1, holder=3),
    ]
    plan = _plan(kept, set(), topology)
    assert plan is not None and (plan.iteration, plan.save_id) == (7, "e1-7")
    assert plan.source == {0: 2, 1: 3, 2: 2, 3: 3}
    assert _plan(kept[:4], set(), topology) is None  # neither save complete: nothing from the tier


# -- the manifest -----------------------------------------------------------------------------------


def test_copies_saved_for_another_save_dir_location_are_set_aside() -> None:
    """A job started from a copy of another job's save_dir has its run: only the place tells the
    other job's later steps from its own. Copies that record no place are judged by run alone."""
    here, there = Place("/ckpt/b", "/nvme/tier"), Place("/ckpt/a", "/nvme/tier")
    moved = Place("/ckpt/a", "/nvme/old_tier")  # a tier copied or moved along with its save_dir
    durable = Durable(6, Lineage(RUN, "e1-6", "e1-3", 3, there), place=here)
    copies = [
        _copy(7, Lineage(RUN, "e1-7", "e1-6", 6, there)),  # the original job's step past the copy
        _copy(8, Lineage(RUN, "f1-1", "e1-6", 6, here)),  # this job's own first save
        _copy(9, Lineage(RUN, "f1-2", "e1-6", 6)),  # no place recorded
        _copy(10, Lineage(RUN, "e1-8", "e1-6", 6, moved)),
    ]
    kept, aside = admissible(durable, copies)
    assert sorted(c.iteration for c in kept) == [8, 9, 10]
    assert {r: [c.iteration for c in cs] for r, cs in aside.items()} == {
        "saved for another save_dir, '/ckpt/a' (a copy or a move of this one)": [7]
    }
    # Where save_dir's place is not known (a caller that passes none), the run decides alone.
    assert _kept(dataclasses.replace(durable, place=None), copies) == [7, 8, 9, 10]
    # Before the run's first durable step as well.
    first = [_copy(1, Lineage(RUN, "e1-1", place=there)), _copy(2, Lineage(RUN, "f1-1", place=here))]
    assert _kept(Durable(None, None, RUN, here), first) == [2]


def test_a_folder_is_one_place_under_another_spelling_or_on_a_host_whose_links_differ(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    here = place_of(str(tmp_path / "real"), "s3://bucket/tier/")
    for spelling in (str(tmp_path / "link"), f"file://{tmp_path}/real", f"{tmp_path}/./real/"):
        assert here.same_save_dir(place_of(spelling, "s3://bucket/tier"))
    assert here.local_dir == "s3://bucket/tier" and here.same_local_dir(place_of("/x", "s3://bucket/tier"))
    # The same spelling where links resolve elsewhere (another host's mount layout): the same place.
    other_host = dataclasses.replace(here, real_save_dir="/mnt/elsewhere")
    assert here.same_save_dir(other_host) and not saved_elsewhere(other_host, here)
    copied = place_of(str(tmp_path / "copy"), "s3://bucket/tier")
    assert not here.same_save_dir(copied) and saved_elsewhere(copied, here)


def test_a_lineage_round_trips_through_the_manifest_and_a_bad_one_is_refused(tmp_path: Path) -> None:
    config = {"save_dir": str(tmp_path / "durable"), "local_dir": str(tmp_path / "local"), "persist_every": 2}
    _save(config, range(1, 4))
    durable = lookup_manifest(tmp_path / "durable/iter_000000002").manifest
    local = lookup_manifest(tmp_path / "local/rank_00000/iter_000000003").manifest
    assert durable is not None and local is not None and durable.lineage is not None and local.lineage is not None
    assert local.lineage.run_id == durable.lineage.run_id
    assert (local.lineage.parent_save_id, local.lineage.parent_iteration) == (durable.lineage.save_id, 2)
    assert parse_manifest(local.to_json().encode(), "test").lineage == local.lineage
    assert local.lineage.place == durable.lineage.place == place_of(str(tmp_path / "durable"), str(tmp_path / "local"))
    assert local.lineage.place.real_save_dir == os.path.realpath(tmp_path / "durable")
    doc = json.loads(local.to_json())
    doc["lineage"]["run_id"] = "../x"
    with pytest.raises(Exception, match="run_id"):
        parse_manifest(json.dumps(doc).encode(), "test")
    for bad in (
        "/x",
        {"save_dir": "/x"},
        {"save_dir": "", "local_dir": "/y"},
        {"save_dir": 7, "local_dir": "/y"},
        {"save_dir": "/x", "local_dir": "/y", "real": ["/x"]},
    ):
        doc = json.loads(local.to_json())
        doc["lineage"]["place"] = bad
        with pytest.raises(Exception, match="place"):
            parse_manifest(json.dumps(doc).encode(), "test")
    # Plain DCP still loads the engine's checkpoint (the lineage is the manifest's only).
    state = TinyTrainingState.create(seed=5)
    sd = state.model.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path / "durable/iter_000000002/model"))


# -- in one process, real checkpoints -----------------------------------------------------------


def _snapshot(state: TinyTrainingState) -> dict[str, Any]:
    return {"model": {k: v.clone() for k, v in state.model.state_dict().items()}}


def _save(config: dict[str, Any], steps: range, seed: int = 1) -> dict[int, dict[str, Any]]:
    state = TinyTrainingState.create(seed=seed)
    out = {}
    with CheckpointEngine(config) as engine:
        for it in steps:
            state.train(1, seed=it * seed)
            assert engine.save(it, **state.objects()).result().succeeded
            out[it] = _snapshot(state)
    return out


def _resume(config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    state = TinyTrainingState.create(seed=99)
    with CheckpointEngine(config) as engine:
        result = engine.load(**state.objects())
    return result, _snapshot(state)


def _config(save_dir: Path, local_dir: Path) -> dict[str, Any]:
    return {"save_dir": str(save_dir), "local_dir": str(local_dir), "persist_every": 3, "local_keep_last": 3}


def test_a_new_run_with_an_empty_save_dir_starts_fresh_beside_an_old_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(_config(tmp_path / "old", tmp_path / "local"), range(1, 8))
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        result, _ = _resume(_config(tmp_path / "new", tmp_path / "local"))
    assert (result.iteration, result.source) == (0, "scratch")
    lines = [r.getMessage() for r in caplog.records if "set aside" in r.getMessage()]
    assert len(lines) == 1 and "save_dir holds no checkpoint" in lines[0] and "iteration(s) 5, 6, 7" in lines[0]
    # The new run saves the old run's iterations again (not refused as re-saves) and resumes its own.
    new = _save(_config(tmp_path / "new", tmp_path / "local"), range(1, 8), seed=3)
    result, got = _resume(_config(tmp_path / "new", tmp_path / "local"))
    assert (result.iteration, set(result.bytes_by_source)) == (7, {"local"})
    assert_state_dicts_equal(got, new[7])


def test_a_run_with_no_durable_step_yet_resumes_its_tier(tmp_path: Path) -> None:
    config = {**_config(tmp_path / "durable", tmp_path / "local"), "persist_every": 10}
    saved = _save(config, range(1, 6))
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (5, {"local"})
    assert_state_dicts_equal(got, saved[5])


def test_a_rolled_back_save_dir_resumes_its_latest(tmp_path: Path) -> None:
    config = _config(tmp_path / "durable", tmp_path / "local")
    saved = _save(config, range(1, 8))
    shutil.rmtree(tmp_path / "durable/iter_000000006")
    (tmp_path / "durable/latest_checkpoint.txt").write_text("iter_000000003\n")
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (3, {"durable"})
    assert_state_dicts_equal(got, saved[3])


def test_a_save_dir_rolled_back_past_its_last_durable_step_resumes_its_latest(tmp_path: Path) -> None:
    """Steps 7 and 8 local, 9 durable and the job's last; save_dir then rolled back to 6. Every
    local step descends from 6, and the tier's 9 is the deleted durable save itself: it was
    resumed. The rank's record of 9's commit sets them aside; without the record (a crash before
    the commit finished, the same files otherwise) the tier's 9 is what a resume takes."""
    config = _config(tmp_path / "durable", tmp_path / "local")
    saved = _save(config, range(1, 10))
    record = tmp_path / "local/rank_00000" / COMMITTED_FILE
    assert json.loads(record.read_text())["committed"][-1]["iteration"] == 9
    shutil.rmtree(tmp_path / "durable/iter_000000009")
    (tmp_path / "durable/latest_checkpoint.txt").write_text("iter_000000006\n")
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (6, {"durable"})
    assert_state_dicts_equal(got, saved[6])
    record.unlink()
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (9, {"local"})
    assert_state_dicts_equal(got, saved[9])


def test_a_save_dir_replaced_by_another_runs_steps_resumes_them(tmp_path: Path) -> None:
    config = _config(tmp_path / "durable", tmp_path / "local")
    _save(config, range(1, 7))
    other = _save(_config(tmp_path / "other", tmp_path / "other_local"), range(1, 7), seed=3)
    shutil.rmtree(tmp_path / "durable")
    shutil.copytree(tmp_path / "other", tmp_path / "durable")
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (6, {"durable"})
    assert_state_dicts_equal(got, other[6])


def test_another_jobs_folders_copied_into_local_dir_are_not_resumed(tmp_path: Path) -> None:
    config = _config(tmp_path / "durable", tmp_path / "local")
    saved = _save(config, range(1, 6))
    _save(_config(tmp_path / "other", tmp_path / "other_local"), range(1, 10), seed=3)
    for it in (8, 9):
        name = f"rank_00000/iter_00000000{it}"
        shutil.copytree(tmp_path / "other_local" / name, tmp_path / "local" / name)
    (tmp_path / "local/rank_00000/latest_checkpoint.txt").write_text("iter_000000009\n")
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (5, {"local"})
    assert_state_dicts_equal(got, copy.deepcopy(saved[5]))


def test_a_copy_of_save_dir_resumes_its_own_steps_not_the_originals(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Job B starts from a copy of job A's save_dir (A's run id included) with the local_dir A
    used: A's tier steps past the copy are A's training, not B's. B resumes the copy's latest,
    its saves of the same iterations replace A's copies, and each job resumes its own steps."""
    a_config, b_config = _config(tmp_path / "a", tmp_path / "local"), _config(tmp_path / "b", tmp_path / "local")
    saved_a = _save(a_config, range(1, 4))  # durable 3
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    saved_a.update(_save(a_config, range(4, 6)))  # A goes on: 4 and 5 in the tier only
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        result, got = _resume(b_config)
    assert (result.iteration, set(result.bytes_by_source)) == (3, {"durable"})
    assert_state_dicts_equal(got, saved_a[3])
    assert any(
        "saved for another save_dir" in r.getMessage() and "iteration(s) 3, 4, 5" in r.getMessage()
        for r in caplog.records
    )
    saved_b = _save(b_config, range(4, 6), seed=7)  # B's own 4 and 5 replace A's (not refused as re-saves)
    result, got = _resume(b_config)
    assert (result.iteration, set(result.bytes_by_source)) == (5, {"local"})
    assert_state_dicts_equal(got, saved_b[5])
    result, got = _resume(a_config)  # A's 4 and 5 are gone: A resumes its 3 (its own tier copy), never B's 5
    assert (result.iteration, set(result.bytes_by_source)) == (3, {"local"})
    assert_state_dicts_equal(got, saved_a[3])


def test_a_step_received_into_a_folder_of_newer_steps_is_kept(tmp_path: Path) -> None:
    """A recovery that passes over newer steps takes an older one from a peer's replica into a
    rank folder that still holds the newer ones: retention (keep the newest ``local_keep_last``)
    deleted the step just received, and the resume failed on a folder that did not exist."""
    from ckpt_engine._tier.folders import commit_copy, start_copy

    config = _config(tmp_path / "durable", tmp_path / "local")
    _save(config, range(1, 8))  # local_keep_last 3: the tier holds 5, 6 and 7
    folder = tmp_path / "local/rank_00000"
    aside = tmp_path / "aside"
    shutil.copytree(tmp_path / "durable/iter_000000006", aside)  # a committed step 6 of rank 0, as a replica
    shutil.rmtree(folder / "iter_000000006")
    manifest = lookup_manifest(str(aside)).manifest
    assert manifest is not None
    partial = start_copy(str(tmp_path / "local"), 0, 6)
    shutil.rmtree(partial)
    shutil.copytree(aside, partial)
    final = commit_copy(str(tmp_path / "local"), dataclasses.replace(manifest, rank=0), partial, keep_last=1)
    assert final == str(folder / "iter_000000006") and (folder / "iter_000000006").is_dir()


# -- forks: a later job that went on from an older step -----------------------------------------------


def test_a_step_an_earlier_instance_saved_past_a_later_fork_is_abandoned() -> None:
    """e1 saved 4 to 6; e2 went on from 3 (resumed there) and saved 4; e3 went on from 4. Only
    e2's 4 is still training's history; e1's 5 and 6 are a future abandoned at e2's fork."""
    durable = Durable(3, _lin("e1-3"), forks=(("e1", 0), ("e2", 3), ("e3", 4)))
    copies = [_copy(4, _lin("e2-1", "e1-3", 3)), _copy(5, _lin("e1-5", "e1-3", 3)), _copy(6, _lin("e1-6", "e1-3", 3))]
    kept, aside = admissible(durable, copies)
    assert [c.iteration for c in kept] == [4]
    assert [
        c.iteration
        for c in aside["a later job of the run went on from an older step (this step's future was abandoned)"]
    ] == [5, 6]
    assert not abandoned((("e1", 0), ("e2", 6)), "e1", 6)  # e2 went on from e1's last step
    # An instance no fork records (its record could not be written; saved before forks were
    # recorded) is judged by the other rules alone, and a fork of a job that committed nothing
    # (it stopped in its first save) abandons nothing: the steps before it are training's history.
    assert not abandoned((("e2", 3),), "e0", 4)
    forks = (("e1", 0), ("e2", 3))
    assert abandoned(forks, "e1", 5, live={"e1", "e2"}) and not abandoned(forks, "e1", 5, live={"e1"})
    kept, _ = admissible(Durable(3, _lin("e1-3"), forks=forks), [_copy(5, _lin("e1-5", "e1-3", 3))])
    assert [c.iteration for c in kept] == [5]


def test_a_job_that_resumed_an_older_step_is_not_undone_by_the_next_resume(tmp_path: Path) -> None:
    """Job A saved 1 to 6 (3 durable, the others local only). Job B's resume passed A's tier over
    (step 6 damaged) and went on from save_dir's 3; B saved 4 (A's own 4 is replaced, not refused:
    B abandoned it) and stopped. A copy of A's 5 kept elsewhere was resumed (the newest step): the
    future B abandoned, discarding B's training. It must take B's 4."""
    config = {**_config(tmp_path / "durable", tmp_path / "local"), "persist_every": 100}
    state = TinyTrainingState.create(seed=1)
    with CheckpointEngine(config) as engine:
        for it in range(1, 7):
            state.train(1, seed=it)
            assert engine.save(it, **state.objects(), durable=it == 3).result().succeeded
    folder = tmp_path / "local/rank_00000"
    data = next((folder / "iter_000000006/model").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    data.write_bytes(bytes(raw))
    shutil.copytree(folder / "iter_000000005", tmp_path / "kept_elsewhere")  # as a peer's replica would
    b = TinyTrainingState.create(seed=99)
    with CheckpointEngine(config) as engine:
        assert engine.load(**b.objects()).iteration == 3
        b.train(1, seed=40)  # another batch than A's step 4
        assert engine.save(4, **b.objects()).result().succeeded
    # B's commit removed A's 5 and 6 from its folder (a future it abandoned); a copy of 5 kept
    # elsewhere must still not be resumed.
    assert sorted(p.name for p in folder.glob("iter_*")) == ["iter_000000004"]
    shutil.copytree(tmp_path / "kept_elsewhere", folder / "iter_000000005")
    forks = json.loads((tmp_path / "durable/.ckpt_engine_run.json").read_text())["forks"]
    assert [start for _, start in forks] == [0, 3]
    result, got = _resume(config)
    assert (result.iteration, result.checkpoint_path) == (4, str(folder / "iter_000000004"))
    assert_state_dicts_equal(got, _snapshot(b))


def test_a_job_whose_fork_could_not_be_recorded_keeps_its_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """save_dir's run file could not be rewritten when job A started (a full quota, a read-only
    object): A's own fork is missing, and an older fork made A's steps 4 and 5 look abandoned; the
    resume took save_dir's 3. An instance the forks do not record abandons and is abandoned by
    nothing."""
    config = {**_config(tmp_path / "durable", tmp_path / "local"), "persist_every": 100}
    _save({**config, "persist_every": 3}, range(1, 4))
    import ckpt_engine._engine.local_tier as local_tier

    def unwritable(*args: Any, **kwargs: Any) -> None:
        raise PermissionError("read-only")

    monkeypatch.setattr(local_tier, "write_run", unwritable)
    a = TinyTrainingState.create(seed=5)
    with CheckpointEngine(config) as engine:
        assert engine.load(**a.objects()).iteration == 3
        for it in (4, 5):
            a.train(1, seed=it)
            assert engine.save(it, **a.objects()).result().succeeded
    monkeypatch.undo()
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (5, {"local"})
    assert_state_dicts_equal(got, _snapshot(a))


def test_a_job_that_stopped_in_its_first_save_abandons_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Job B (on another node: its own local_dir) resumed save_dir's 3 and its first save failed
    after its fork was recorded. B committed nothing, so job A's tier steps 4 and 5 on A's node are
    still the run's newest training; the next resume there takes 5."""
    config = _config(tmp_path / "durable", tmp_path / "local")
    saved = _save(config, range(1, 6))
    import ckpt_engine._engine.local_tier as local_tier

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    other = {**config, "local_dir": str(tmp_path / "other_node")}
    b = TinyTrainingState.create(seed=7)
    with CheckpointEngine(other) as engine:
        assert engine.load(**b.objects()).iteration == 3
        monkeypatch.setattr(local_tier.LocalTier, "write", fail)
        with pytest.raises(Exception):  # noqa: B017 - whatever the failed write raises
            engine.save(4, **b.objects()).result()
        monkeypatch.undo()
    forks = json.loads((tmp_path / "durable/.ckpt_engine_run.json").read_text())["forks"]
    assert [start for _, start in forks][-1] == 3  # B's fork was recorded
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (5, {"local"})
    assert_state_dicts_equal(got, saved[5])


def test_the_tier_keeps_the_steps_of_a_job_that_went_on_from_an_older_step(tmp_path: Path) -> None:
    """save_dir rolled back to step 2 (a user's rollback) while the tier held the first job's 4 and
    5. The next job resumed 2 and saved 3 to the tier: ``local_keep_last`` (2) counted 4 and 5 as
    the newest and removed 3 right after its commit, so the third job resumed save_dir's 2 and lost
    3. The abandoned 4 and 5 are removed instead, and the tier's latest names 3."""
    config = {**_config(tmp_path / "durable", tmp_path / "local"), "persist_every": 2, "local_keep_last": 2}
    _save(config, range(1, 6))
    shutil.rmtree(tmp_path / "durable/iter_000000004")
    (tmp_path / "durable/latest_checkpoint.txt").write_text("iter_000000002\n")
    b = TinyTrainingState.create(seed=9)
    with CheckpointEngine(config) as engine:
        assert engine.load(**b.objects()).iteration == 2
        b.train(1, seed=30)
        assert engine.save(3, **b.objects()).result().tier == "local"
    folder = tmp_path / "local/rank_00000"
    assert sorted(p.name for p in folder.glob("iter_*")) == ["iter_000000003"]  # 4 and 5 removed, not 3
    assert (folder / "latest_checkpoint.txt").read_text().strip() == "iter_000000003"
    result, got = _resume(config)
    assert (result.iteration, result.checkpoint_path) == (3, str(folder / "iter_000000003"))
    assert_state_dicts_equal(got, _snapshot(b))


def test_resumed_from_tells_an_engine_that_did_not_load_where_training_went_on(tmp_path: Path) -> None:
    """The integrations read a checkpoint through a reader engine; the engine that saves never
    called load(). Told the step with resumed_from, its save of an iteration the tier holds past
    that step replaces the abandoned copy (it was refused: CheckpointExistsError mid-run)."""
    config = {**_config(tmp_path / "durable", tmp_path / "local"), "persist_every": 3}
    _save(config, range(1, 6))
    b = TinyTrainingState.create(seed=11)
    with CheckpointEngine(config) as engine, pytest.raises(CheckpointExistsError):
        engine.save(4, **b.objects())
    with CheckpointEngine(config) as engine:
        engine.resumed_from(3)
        b.train(1, seed=44)
        assert engine.save(4, **b.objects()).result().succeeded
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (4, {"local"})
    assert_state_dicts_equal(got, _snapshot(b))


def test_a_job_that_went_back_with_allow_overwrite_and_saved_to_the_tier_is_resumed_not_the_left_history(
    tmp_path: Path,
) -> None:
    """Job A saved 1 to 6 (2, 4 and 6 durable). Job B loaded the older durable 2 by name, with
    ``allow_overwrite``, and saved 3 (not a multiple of ``persist_every``) and 5. Saved to the
    tier only, ``latest`` kept naming A's 6, the history B left, and the next resume took it:
    training B had discarded. B's first save also goes to ``save_dir``, which rewinds ``latest``
    there, and the tier's 5 descends from it."""
    config = {**_config(tmp_path / "durable", tmp_path / "local"), "persist_every": 2, "allow_overwrite": True}
    _save(config, range(1, 7))
    assert (tmp_path / "durable/latest_checkpoint.txt").read_text().strip() == "iter_000000006"
    b = TinyTrainingState.create(seed=99)
    older = {**config, "load_dir": str(tmp_path / "durable/iter_000000002")}
    with CheckpointEngine(older) as engine:
        assert engine.load(**b.objects()).iteration == 2
        for it in (3, 5):
            b.train(1, seed=40 + it)  # other batches than A's
            assert engine.save(it, **b.objects()).result().succeeded
    assert (tmp_path / "durable/latest_checkpoint.txt").read_text().strip() == "iter_000000003"
    result, got = _resume(config)
    assert (result.iteration, result.checkpoint_path) == (5, str(tmp_path / "local/rank_00000/iter_000000005"))
    assert_state_dicts_equal(got, _snapshot(b))


def test_a_job_that_went_back_keeps_saving_durably_while_its_rewinding_save_failed(tmp_path: Path) -> None:
    """As above, but job B's first save (6, the iteration save_dir's latest names) failed. The
    tier stack counted it as B's own save there and placed B's 7 in the tier only: latest kept
    naming A's 6, which the next resume took. A save counts once it is committed."""
    from ckpt_engine import WriteContext, WriteResult
    from ckpt_engine.defaults import DefaultIO

    class FailOnce:
        name = "fail_once"

        def __init__(self) -> None:
            self.failed, self.io = False, DefaultIO()

        def writes_rank_local(self) -> bool:  # the default write's, which it calls
            return True

        @hookimpl
        def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> WriteResult:
            if ctx.iteration == 6 and not self.failed:
                self.failed = True
                raise OSError(28, "No space left on device")
            return self.io.write(ctx, state_dict)

    config = {**_config(tmp_path / "durable", tmp_path / "local"), "persist_every": 2, "allow_overwrite": True}
    _save(config, range(1, 7))
    b = TinyTrainingState.create(seed=99)
    with CheckpointEngine(
        {**config, "load_dir": str(tmp_path / "durable/iter_000000002")}, plugins=[FailOnce()]
    ) as engine:
        assert engine.load(**b.objects()).iteration == 2
        b.train(1, seed=46)
        with pytest.raises(CheckpointSaveError):
            engine.save(6, **b.objects())
        b.train(1, seed=47)
        assert engine.save(7, **b.objects()).result().succeeded
    assert (tmp_path / "durable/latest_checkpoint.txt").read_text().strip() == "iter_000000007"
    result, got = _resume(config)
    assert result.iteration == 7
    assert_state_dicts_equal(got, _snapshot(b))
