"""Save and load through the engine with real DCP checkpoints on disk (single process)."""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

from ckpt_engine import (
    CheckpointEngine,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    ConfigError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    IntegrityError,
    LoadStrictnessError,
    UnsafeCheckpointError,
)
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal


class Counter:
    """An ``extra=`` Stateful component (e.g. a data-loader position)."""

    def __init__(self, position: int = 0, seed: int = 0) -> None:
        self.position, self.seed = position, seed

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "seed": self.seed, "history": torch.full((4,), self.position)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position, self.seed = sd["position"], sd["seed"]
        assert torch.equal(sd["history"], torch.full((4,), self.position))


def _fresh(seed: int = 123) -> TinyTrainingState:
    return TinyTrainingState.create(seed=seed, steps=1)


def _snapshot(state: TinyTrainingState) -> dict[str, Any]:
    return {
        "model": copy.deepcopy(state.model.state_dict()),
        "optim": copy.deepcopy(state.optimizer.state_dict()),
        "scheduler": copy.deepcopy(state.scheduler.state_dict()),
        "scaler": copy.deepcopy(state.grad_scaler.state_dict()),
    }


def test_round_trip_restores_everything_bit_exact(save_dir: str) -> None:
    state = TinyTrainingState.create(steps=3)
    before = _snapshot(state)
    counter = Counter(position=17, seed=5)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        result = engine.save(3, **state.objects(), extra={"dataloader": counter}).result()
    assert result.succeeded and result.bytes_written > 0
    assert result.components == ("model", "optim", "scheduler", "trainer", "dataloader", "rng")  # rng: on by default

    fresh, fresh_counter = _fresh(), Counter()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        loaded = engine.load(**fresh.objects(), extra={"dataloader": fresh_counter})
    assert loaded.iteration == 3 and loaded.source == "latest"
    assert loaded.checkpoint_path == os.path.join(save_dir, "iter_000000003")
    assert_state_dicts_equal(_snapshot(fresh), before)
    assert (fresh_counter.position, fresh_counter.seed) == (17, 5)
    assert set(loaded.report) == {"model", "optim", "scheduler", "trainer", "dataloader", "rng"}
    for rep in loaded.report.values():
        assert not rep.missing and not rep.unexpected and not rep.skipped


def test_resumed_training_matches_uninterrupted_run(save_dir: str) -> None:
    reference = TinyTrainingState.create(seed=7, steps=4)
    reference_losses = reference.train(4, seed=100)

    run = TinyTrainingState.create(seed=7, steps=4)
    CheckpointEngine({"save_dir": save_dir}).save(4, **run.objects())
    run.train(2, seed=999)  # training goes on (and diverges) after the save...

    resumed = _fresh(seed=42)  # ...then the job dies; a new process resumes
    assert CheckpointEngine({"save_dir": save_dir}).load(**resumed.objects()).iteration == 4
    assert resumed.train(4, seed=100) == reference_losses


def test_layout_matches_the_original_checkpointer(save_dir: str) -> None:
    state = TinyTrainingState.create()
    engine = CheckpointEngine({"save_dir": save_dir})
    engine.save(5, **state.objects())
    engine.save(12, **state.objects())
    assert sorted(os.listdir(save_dir)) == ["iter_000000005", "iter_000000012", "latest_checkpoint.txt"]
    assert Path(save_dir, "latest_checkpoint.txt").read_text() == "iter_000000012\n"
    ckpt = Path(save_dir, "iter_000000012")
    # The original layout, plus the engine's manifest at the checkpoint level, the random state
    # (rng: on by default, a component like any other) and in each component folder the compact
    # index of its .metadata, which DCP ignores: every component stays a plain DCP checkpoint.
    assert sorted(os.listdir(ckpt)) == ["ckpt_engine_manifest.json", "model", "optim", "rng", "scheduler", "trainer"]
    for component in ("model", "optim", "scheduler", "trainer"):
        assert sorted(os.listdir(ckpt / component)) == [".metadata", ".metadata_index", "__0_0.distcp"]

    # Every component loads with plain dcp.load, in the original's component dicts.
    sd = get_model_state_dict(_fresh().model)
    dcp.load(sd, checkpoint_id=str(ckpt / "model"))
    assert_state_dicts_equal(sd, dict(state.model.state_dict()))
    trainer = {"grad_scaler": _fresh().grad_scaler.state_dict(), "iteration": 0}
    dcp.load(trainer, checkpoint_id=str(ckpt / "trainer"))
    assert trainer["iteration"] == 12
    assert trainer["grad_scaler"] == state.grad_scaler.state_dict()
    fresh = _fresh()
    osd = get_optimizer_state_dict(
        fresh.model, fresh.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    dcp.load(osd, checkpoint_id=str(ckpt / "optim"))
    ref = get_optimizer_state_dict(
        state.model, state.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
    )
    assert_state_dicts_equal(osd, ref)


def test_plain_dcp_checkpoint_in_original_layout_loads(save_dir: str) -> None:
    """What the original checkpointer wrote: four plain DCP saves and a pointer file."""
    state = TinyTrainingState.create(steps=2)
    ckpt = Path(save_dir, "iter_000000009")
    planner = dcp.DefaultSavePlanner(dedup_save_to_lowest_rank=True)
    parts = {
        "model": get_model_state_dict(state.model),
        "optim": get_optimizer_state_dict(
            state.model, state.optimizer, options=StateDictOptions(flatten_optimizer_state_dict=True)
        ),
        "scheduler": state.scheduler.state_dict(),
        "trainer": {"grad_scaler": state.grad_scaler.state_dict(), "iteration": 9},
    }
    for name, sd in parts.items():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(ckpt / name)), planner=planner)
    Path(save_dir, "latest_checkpoint.txt").write_text("iter_000000009\n")

    fresh = _fresh()
    loaded = CheckpointEngine({"save_dir": save_dir}).load(**fresh.objects())
    assert loaded.iteration == 9
    assert_state_dicts_equal(_snapshot(fresh), _snapshot(state))


@pytest.mark.parametrize("iteration", ["twenty", None, [9], 9.5, -3])
def test_an_iteration_that_is_no_count_is_a_typed_error_naming_the_component(save_dir: str, iteration: Any) -> None:
    """A checkpoint of the original checkpointer's kind (no manifest) whose ``trainer`` holds no
    step count: a typed error naming the component. It was a bare ValueError or TypeError (9.5 was
    taken as 9). As with a damaged byte found while reading, components read before it may hold
    loaded values; with ``fallback_to_last_complete`` the older checkpoint's read replaces them."""
    state = TinyTrainingState.create(steps=2)
    CheckpointEngine({"save_dir": save_dir}).save(5, model=state.model)
    ckpt = Path(save_dir, "iter_000000009")
    for name, sd in {"model": get_model_state_dict(_fresh().model), "trainer": {"iteration": iteration}}.items():
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(ckpt / name)))
    Path(save_dir, "latest_checkpoint.txt").write_text("iter_000000009\n")
    with pytest.raises(CorruptCheckpointError, match=r"iter_000000009/trainer: the iteration is"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_fresh().model)
    fresh = _fresh()
    result = CheckpointEngine({"save_dir": save_dir, "fallback_to_last_complete": True}).load(model=fresh.model)
    assert (result.iteration, result.fell_back_from) == (5, str(ckpt))
    assert_state_dicts_equal(dict(fresh.model.state_dict()), dict(state.model.state_dict()))


def test_save_content_is_fixed_when_save_returns(save_dir: str) -> None:
    state = TinyTrainingState.create()
    expected = copy.deepcopy(state.model.state_dict())
    engine = CheckpointEngine({"save_dir": save_dir})
    engine.save(1, model=state.model)
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(1.0)
    fresh = _fresh()
    engine.load(model=fresh.model)
    assert_state_dicts_equal(dict(fresh.model.state_dict()), dict(expected))


def test_model_and_optimizer_lists(save_dir: str) -> None:
    a, b = TinyTrainingState.create(seed=1), TinyTrainingState.create(seed=2)
    models = [nn.ModuleDict({"enc": a.model}), nn.ModuleDict({"dec": b.model})]
    CheckpointEngine({"save_dir": save_dir}).save(2, model=models, optimizer=[a.optimizer, b.optimizer])
    fa, fb = _fresh(5), _fresh(6)
    fresh_models = [nn.ModuleDict({"enc": fa.model}), nn.ModuleDict({"dec": fb.model})]
    result = CheckpointEngine({"save_dir": save_dir}).load(model=fresh_models, optimizer=[fa.optimizer, fb.optimizer])
    assert_state_dicts_equal(dict(fa.model.state_dict()), dict(a.model.state_dict()))
    assert_state_dicts_equal(dict(fb.model.state_dict()), dict(b.model.state_dict()))
    assert_state_dicts_equal(fa.optimizer.state_dict(), a.optimizer.state_dict())
    assert_state_dicts_equal(fb.optimizer.state_dict(), b.optimizer.state_dict())
    assert len(result.report["model"].loaded) == 8


def test_model_list_with_colliding_keys_is_refused(save_dir: str) -> None:
    a, b = _fresh(1), _fresh(2)
    with pytest.raises(CheckpointSaveError, match=r"wrap the modules in one nn\.ModuleDict"):
        CheckpointEngine({"save_dir": save_dir}).save(1, model=[a.model, b.model])
    assert not os.path.exists(os.path.join(save_dir, "latest_checkpoint.txt"))


# -- resume rules -----------------------------------------------------------------------------


def _save_run(save_dir: str, iteration: int = 6) -> TinyTrainingState:
    state = TinyTrainingState.create(steps=3)
    CheckpointEngine({"save_dir": save_dir}).save(iteration, **state.objects())
    return state


def test_rule1_latest_resumes_every_component(save_dir: str) -> None:
    state = _save_run(save_dir)
    fresh = _fresh()
    result = CheckpointEngine({"save_dir": save_dir, "load_path": "/ignored/when/latest/exists"}).load(
        **fresh.objects()
    )
    assert result.source == "latest" and result.iteration == 6
    assert result.components == ("model", "optim", "scheduler", "trainer", "rng")
    assert fresh.scheduler.state_dict() == state.scheduler.state_dict()


def test_rule1_iteration_resumes_without_grad_scaler(save_dir: str) -> None:
    _save_run(save_dir)
    result = CheckpointEngine({"save_dir": save_dir}).load(model=_fresh().model)
    assert result.iteration == 6
    assert result.components == ("model", "trainer", "rng")


@pytest.mark.parametrize(
    ("flags", "components", "iteration"),
    [
        ({}, ("model",), 0),
        ({"load_training_state": True}, ("model", "optim", "scheduler", "trainer", "rng"), 6),
        ({"only_load_scheduler_state": True}, ("model", "scheduler"), 0),
    ],
)
def test_rule2_load_path_folder(
    tmp_path: Path, flags: dict[str, bool], components: tuple[str, ...], iteration: int
) -> None:
    old = str(tmp_path / "old_run")
    state = _save_run(old)
    fresh = _fresh()
    before_optim = copy.deepcopy(fresh.optimizer.state_dict())
    cfg = {"save_dir": str(tmp_path / "new_run"), "load_path": os.path.join(old, "iter_000000006"), **flags}
    result = CheckpointEngine(cfg).load(**fresh.objects())
    assert result.source == "load_path" and result.components == components and result.iteration == iteration
    assert_state_dicts_equal(dict(fresh.model.state_dict()), dict(state.model.state_dict()))
    if "optim" in components:
        assert_state_dicts_equal(fresh.optimizer.state_dict(), state.optimizer.state_dict())
    else:
        assert_state_dicts_equal(fresh.optimizer.state_dict(), before_optim)
    assert (fresh.scheduler.state_dict() == state.scheduler.state_dict()) == ("scheduler" in components)


def test_rule3_pth_state_dict_loads_non_strict(tmp_path: Path) -> None:
    state = TinyTrainingState.create()
    sd = dict(state.model.state_dict())
    sd["2.weight"] = torch.zeros(5, 16)  # a changed head: skipped, not an error
    sd["unknown.weight"] = torch.ones(2)
    del sd["2.bias"]
    pth = tmp_path / "init.pth"
    torch.save(sd, pth)
    fresh = _fresh()
    old_head = fresh.model[2].weight.detach().clone()
    result = CheckpointEngine({"save_dir": str(tmp_path / "ck"), "load_path": str(pth)}).load(model=fresh.model)
    assert result.source == "pth" and result.iteration == 0
    assert torch.equal(fresh.model[0].weight, state.model[0].weight)
    assert torch.equal(fresh.model[2].weight, old_head)
    rep = result.report["model"]
    assert set(rep.loaded) == {"0.weight", "0.bias"}
    assert rep.missing == ("2.bias",) and rep.unexpected == ("unknown.weight",)
    assert set(rep.skipped) == {"2.weight"}


def test_rule3_pth_is_loaded_with_weights_only(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    pth = tmp_path / "evil.pth"
    torch.save({"0.weight": _Evil(str(marker))}, pth)
    with pytest.raises(Exception, match="weights_only"):
        CheckpointEngine({"save_dir": str(tmp_path / "ck"), "load_path": str(pth)}).load(model=_fresh().model)
    assert not marker.exists()


def test_rule4_scratch(save_dir: str) -> None:
    result = CheckpointEngine({"save_dir": save_dir}).load(**_fresh().objects())
    assert result.iteration == 0 and result.checkpoint_path is None and result.source == "scratch"
    assert len(result.report) == 0


def test_load_dir_overrides_save_dir(tmp_path: Path) -> None:
    _save_run(str(tmp_path / "a"))
    result = CheckpointEngine({"save_dir": str(tmp_path / "b"), "load_dir": str(tmp_path / "a")}).load(
        model=_fresh().model
    )
    assert result.iteration == 6


def test_keys_not_to_resume(save_dir: str) -> None:
    state = _save_run(save_dir)
    fresh, counter = _fresh(), Counter()
    untouched = copy.deepcopy(fresh.optimizer.state_dict())
    CheckpointEngine({"save_dir": save_dir}).save(8, **state.objects(), extra={"loader": Counter(4)})
    result = CheckpointEngine({"save_dir": save_dir, "keys_not_to_resume": ["optim", "loader", "trainer"]}).load(
        **fresh.objects(), extra={"loader": counter}
    )
    assert result.components == ("model", "scheduler", "rng")
    assert result.iteration == 0  # trainer not resumed: iteration 0, as in the original
    assert counter.position == 0
    assert_state_dicts_equal(fresh.optimizer.state_dict(), untouched)


def test_keys_not_to_resume_unknown_name_is_refused(save_dir: str) -> None:
    _save_run(save_dir)
    with pytest.raises(ConfigError, match=r"keys_not_to_resume names \['optimizer'\]"):
        CheckpointEngine({"save_dir": save_dir, "keys_not_to_resume": ["optimizer"]}).load(model=_fresh().model)


def test_latest_naming_a_missing_checkpoint_is_an_error(save_dir: str) -> None:
    os.makedirs(save_dir)
    Path(save_dir, "latest_checkpoint.txt").write_text("iter_000000099\n")
    with pytest.raises(CheckpointNotFoundError, match="iter_000000099"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_fresh().model)


@pytest.mark.parametrize("content", ["", "   \n", "../../etc", "/abs/iter_000000001", "a/b", ".."])
def test_bad_latest_pointer_is_refused(save_dir: str, content: str) -> None:
    os.makedirs(save_dir)
    Path(save_dir, "latest_checkpoint.txt").write_text(content)
    with pytest.raises(CorruptCheckpointError, match=r"latest_checkpoint\.txt"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_fresh().model)


def test_missing_load_path_is_an_error_not_a_fresh_start(save_dir: str) -> None:
    with pytest.raises(CheckpointNotFoundError, match="load_path"):
        CheckpointEngine({"save_dir": save_dir, "load_path": "/nonexistent/iter_000000001"}).load(model=_fresh().model)
    with pytest.raises(CheckpointNotFoundError, match="load_path"):
        CheckpointEngine({"save_dir": save_dir, "load_path": "/nonexistent/model.pth"}).load(model=_fresh().model)


def test_incomplete_checkpoint_is_refused(save_dir: str) -> None:
    _save_run(save_dir)
    os.remove(os.path.join(save_dir, "iter_000000006", "optim", ".metadata"))
    with pytest.raises(IncompleteCheckpointError, match=r"optim/\.metadata does not exist"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_fresh().model)


def test_truncated_data_file_is_refused(save_dir: str) -> None:
    _save_run(save_dir)
    data = Path(save_dir, "iter_000000006", "model", "__0_0.distcp")
    data.write_bytes(data.read_bytes()[:100])
    with pytest.raises(IncompleteCheckpointError, match=r"__0_0.distcp is truncated"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_fresh().model)


# -- strictness --------------------------------------------------------------------------------


def _changed_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 5), nn.Linear(5, 5))


def test_strict_lists_every_problem_in_one_error(save_dir: str) -> None:
    _save_run(save_dir)
    with pytest.raises(LoadStrictnessError) as info:
        CheckpointEngine({"save_dir": save_dir}).load(model=_changed_model())
    err = info.value
    assert sorted(err.missing) == ["3.bias", "3.weight"]
    assert sorted(m.split(":")[0] for m in err.mismatched) == ["2.bias", "2.weight"]
    assert "2 missing key(s), 2 mismatch(es)" in str(err) and "float32[4, 16]" in str(err)


def test_non_strict_skips_and_reports(save_dir: str) -> None:
    state = _save_run(save_dir)
    model = _changed_model()
    result = CheckpointEngine({"save_dir": save_dir, "strict": False}).load(model=model)
    rep = result.report["model"]
    assert set(rep.loaded) == {"0.weight", "0.bias"}
    assert sorted(rep.missing) == ["3.bias", "3.weight"]
    assert set(rep.skipped) == {"2.weight", "2.bias"}
    assert "strict=False" in rep.skipped["2.weight"].reason
    assert torch.equal(model[0].weight, state.model[0].weight)
    summary = result.report.summary()
    assert "model: 2 loaded, 0 overlap, 2 skipped, 2 missing, 0 unexpected" in summary


def test_unexpected_keys_are_reported_and_optionally_an_error(save_dir: str) -> None:
    _save_run(save_dir)
    small = nn.Sequential(nn.Linear(8, 16))
    result = CheckpointEngine({"save_dir": save_dir}).load(model=small)
    assert result.report["model"].unexpected == ("2.bias", "2.weight")
    with pytest.raises(LoadStrictnessError, match="2 unexpected key"):
        CheckpointEngine({"save_dir": save_dir, "strict_unexpected": True}).load(model=small)


def test_component_absent_from_checkpoint(save_dir: str) -> None:
    state = TinyTrainingState.create()
    CheckpointEngine({"save_dir": save_dir}).save(1, model=state.model)
    fresh = _fresh()
    # Resuming (rule 1) never leaves a passed component fresh while the rest resumes, strict or not.
    for strict in (True, False):
        with pytest.raises(IncompleteCheckpointError, match=r"no component 'optim'.*keys_not_to_resume"):
            CheckpointEngine({"save_dir": save_dir, "strict": strict}).load(
                model=fresh.model, optimizer=fresh.optimizer
            )
    result = CheckpointEngine({"save_dir": save_dir, "keys_not_to_resume": ["optim"]}).load(
        model=fresh.model, optimizer=fresh.optimizer
    )
    assert result.components == ("model", "trainer", "rng") and result.iteration == 1


def test_dtype_difference_is_cast_and_reported(save_dir: str) -> None:
    state = TinyTrainingState.create()
    CheckpointEngine({"save_dir": save_dir}).save(1, model=state.model)
    bf16 = _fresh().model.to(torch.bfloat16)
    result = CheckpointEngine({"save_dir": save_dir}).load(model=bf16)
    assert torch.equal(bf16[0].weight, state.model[0].weight.to(torch.bfloat16))
    assert result.report["model"].cast["0.weight"] == ("float32", "bfloat16")


# -- safety ------------------------------------------------------------------------------------


class _Evil:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))


class EvilStateful:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def state_dict(self) -> dict[str, Any]:
        return {"payload": _Evil(self.marker)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_non_tensor_payload_is_not_executed(save_dir: str, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    state = TinyTrainingState.create()
    CheckpointEngine({"save_dir": save_dir}).save(1, model=state.model, extra={"evil": EvilStateful(str(marker))})
    assert not marker.exists()  # pickling on save runs nothing; unpickling on load would
    with pytest.raises(UnsafeCheckpointError, match=r"component 'evil', key 'payload'.*trust_checkpoint=True"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_fresh().model, extra={"evil": EvilStateful("x")})
    assert not marker.exists()


def test_crafted_metadata_is_not_executed(save_dir: str, tmp_path: Path) -> None:
    _save_run(save_dir)
    marker = tmp_path / "pwned"
    Path(save_dir, "iter_000000006", "model", ".metadata").write_bytes(pickle.dumps(_Evil(str(marker))))
    # With the manifest, the file is refused by its checksum before it is parsed ...
    with pytest.raises(IntegrityError, match=r"model/\.metadata is \d+ bytes, but ckpt_engine_manifest.json"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_fresh().model)
    # ... and without the check, the parse refuses it.
    with pytest.raises(UnsafeCheckpointError, match=r"references io\.open"):
        CheckpointEngine({"save_dir": save_dir, "verify": "off"}).load(model=_fresh().model)
    assert not marker.exists()


def test_garbage_metadata_is_a_typed_error(save_dir: str) -> None:
    _save_run(save_dir)
    Path(save_dir, "iter_000000006", "model", ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CorruptCheckpointError, match=r"model/\.metadata"):
        CheckpointEngine({"save_dir": save_dir}).load(model=_fresh().model)


def test_closed_engine_refuses_work(save_dir: str) -> None:
    engine = CheckpointEngine({"save_dir": save_dir})
    engine.close()
    engine.close()  # idempotent
    with pytest.raises(Exception, match="closed"):
        engine.save(1, model=_fresh().model)


def test_saving_same_iteration_twice_replaces_it_only_when_allowed(save_dir: str) -> None:
    a, b = TinyTrainingState.create(seed=1), TinyTrainingState.create(seed=2)
    CheckpointEngine({"save_dir": save_dir}).save(3, model=a.model)
    with pytest.raises(CheckpointExistsError, match=r"iteration 3 is already committed.*allow_overwrite"):
        CheckpointEngine({"save_dir": save_dir}).save(3, model=b.model)
    engine = CheckpointEngine({"save_dir": save_dir, "allow_overwrite": True})
    engine.save(3, model=b.model)
    assert sorted(os.listdir(save_dir)) == ["iter_000000003", "latest_checkpoint.txt"]
    fresh = _fresh()
    engine.load(model=fresh.model)
    assert_state_dicts_equal(dict(fresh.model.state_dict()), dict(b.model.state_dict()))


def test_invalid_iteration(save_dir: str) -> None:
    engine = CheckpointEngine({"save_dir": save_dir})
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="iteration"):
            engine.save(bad, model=_fresh().model)  # type: ignore[arg-type]


def test_summary_collapses_large_skip_groups_and_keeps_small_ones() -> None:
    from ckpt_engine.report import ComponentReport, SkipRecord

    skipped = {
        f"net_ema.blocks.{i}.w": SkipRecord(reason=f"shape [{i}] != [9]", plugin="size_mismatch") for i in range(300)
    }
    skipped["head.w"] = SkipRecord(reason="fresh head")
    rep = ComponentReport(component="model", checkpoint_dir="x", skipped=skipped)
    lines = rep.summary_lines(threshold=8)
    big = [line for line in lines if "size_mismatch" in line]
    assert big == [
        "  skipped by size_mismatch: 300 keys (net_ema.* (300 keys)); e.g. net_ema.blocks.0.w: shape [0] != [9]"
    ]
    assert "  skipped by engine: head.w: fresh head" in lines
    assert len(lines) == 3


def test_an_optimizer_with_a_parameter_group_that_holds_no_parameters_round_trips(save_dir: str) -> None:
    """A group without parameters (the Hugging Face Trainer's no-decay group when every bias is
    frozen) has no keys in the flattened optimizer state: it is kept, with its settings, and the
    other groups' state loads (torch's unflattening alone raises an IndexError on it)."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        opt = torch.optim.AdamW([{"params": list(model.parameters())}, {"params": [], "weight_decay": 0.0}], lr=0.1)
        return model, opt

    model, opt = make()
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=model, optimizer=opt)
    model2, opt2 = make()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        assert engine.load(model=model2, optimizer=opt2).iteration == 1
    assert [len(g["params"]) for g in opt2.param_groups] == [2, 0]
    assert opt2.param_groups[1]["weight_decay"] == 0.0
    for p, q in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg"], opt2.state[q]["exp_avg"])


def _train_and_save(config: dict[str, Any], state: TinyTrainingState, steps: range) -> dict[int, dict[str, Any]]:
    saved = {}
    with CheckpointEngine(config) as engine:
        for it in steps:
            state.train(1, seed=it)
            engine.save(it, **state.objects())
            saved[it] = {k: v.clone() for k, v in state.model.state_dict().items()}
    return saved


def test_a_run_resumed_from_an_older_step_with_allow_overwrite_rewrites_the_history(save_dir: str) -> None:
    """Run A saves 1-6. Run B resumes A's step 2 (named exactly, as the integrations resume a
    checkpoint; allow_overwrite: it may save those steps again), saves 3 and 4 with other data
    and stops. latest kept naming A's 6 (it never moved back), so the next restart resumed A's
    history as B's, in silence. B's first save now moves A's newer checkpoints aside and latest
    names B's newest. Run C goes back to step 2 again: B's 4 goes aside beside A's, never over
    them. An engine's own newer save still keeps latest."""
    a = TinyTrainingState.create(seed=1)
    saved_a = _train_and_save({"save_dir": save_dir}, a, range(1, 7))
    older = os.path.join(save_dir, "iter_000000002")
    branch = {
        "save_dir": save_dir,
        "load_dir": older,
        "load_path": older,
        "load_training_state": True,
        "allow_overwrite": True,
    }
    histories = {}
    for run, seed in (("b", 9), ("c", 11)):
        state = TinyTrainingState.create(seed=seed)
        with CheckpointEngine(branch) as engine:
            assert engine.load(**state.objects()).checkpoint_path == older
        assert_state_dicts_equal(dict(state.model.state_dict()), saved_a[2])
        histories[run] = _train_and_save(branch, state, range(3, 5) if run == "b" else range(3, 4))
    restarted = TinyTrainingState.create(seed=5)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        result = engine.load(**restarted.objects())
    assert result.iteration == 3  # C's, not A's 6 nor B's 4
    assert_state_dicts_equal(dict(restarted.model.state_dict()), histories["c"][3])
    root = os.path.join(save_dir, ".ckpt_engine_abandoned")
    aside = sorted(os.listdir(root))
    assert len(aside) == 2 and all(n.startswith("iter_000000003-") for n in aside)
    assert sorted(sorted(os.listdir(os.path.join(root, n))) for n in aside) == [
        ["iter_000000004"],  # B's
        ["iter_000000004", "iter_000000005", "iter_000000006"],  # A's
    ]
    assert sorted(n for n in os.listdir(save_dir) if n.startswith("iter_")) == [
        f"iter_00000000{i}" for i in range(1, 4)
    ]

    # One engine that saves 7, then an older step again: its own newer save keeps latest.
    with CheckpointEngine({"save_dir": save_dir, "allow_overwrite": True}) as engine:
        engine.save(7, **restarted.objects())
        engine.save(2, **restarted.objects())
    with open(os.path.join(save_dir, "latest_checkpoint.txt")) as f:
        assert f.read().strip() == "iter_000000007"
    assert len(os.listdir(root)) == 2
