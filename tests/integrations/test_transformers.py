"""``ckpt_engine.integrations.transformers``: a real Hugging Face ``Trainer`` saving and resuming engine checkpoints.

Every run is a real ``Trainer.train`` on the CPU (tiny GPT-2, Llama or GPT-2 with a ``peft`` LoRA
adapter, built from a config, dropout on; ``tests/hf_scripts/hf_train.py``): 14 steps, a
checkpoint every 3, across an epoch boundary. Here the interrupted run and its resume run in this
process with fresh objects (a background save and an object-store save_dir in the full tier);
``test_transformers_processes.py`` runs them in new processes, kills them with SIGKILL mid-save
and runs them on two ranks. A resumed run must end bit for bit where the uninterrupted run ends:
parameters, optimizer state and every logged loss.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import hf_models
import hf_train as script
from transformers import Trainer, TrainingArguments

from ckpt_engine import (
    CheckpointEngine,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptEngineError,
    ConfigError,
    CorruptCheckpointError,
    EngineConfig,
    IncompleteCheckpointError,
)
from ckpt_engine.cli import main as cli
from ckpt_engine.integrations._trainer_checkpoint import StateItems
from ckpt_engine.integrations.transformers import (
    COMPONENT,
    TRAINER_METHODS,
    EngineTrainer,
    EngineTrainerMixin,
    NotATrainerCheckpointError,
    UnsupportedTrainerSetupError,
)

CKPT = "checkpoints"


def _iters(root: Path) -> list[str]:
    return sorted(p.name for p in (root / CKPT).glob("iter_*"))


def _latest(root: Path) -> str:
    return (root / CKPT / "latest_checkpoint.txt").read_text().strip()


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """End states of uninterrupted runs (they save too: saving must not change training)."""
    out = {}
    for model in ("gpt2", "lora"):
        trainer = script.trainer(str(tmp_path_factory.mktemp(f"reference-{model}")), model)
        trainer.train()
        out[model] = script.end_state(trainer)
    return out


def _stop_then_resume(root: Path, model: str, stop_at: int, **engine: Any) -> EngineTrainer:
    script.trainer(str(root), model, stop_at=stop_at, engine=engine).train()
    assert _latest(root) == f"iter_{stop_at:09}"
    resumed = script.trainer(str(root), model, engine=engine)
    resumed.train(resume_from_checkpoint=True)
    return resumed


@pytest.mark.full  # over 2 s on 2 cores: Trainer runs
@pytest.mark.parametrize("model", ["gpt2", "lora"])
def test_stop_at_a_checkpoint_then_resume_is_bit_identical(
    tmp_path: Path, reference: dict[str, dict[str, Any]], model: str
) -> None:
    resumed = _stop_then_resume(tmp_path, model, stop_at=6)  # mid-epoch: the data order is resumed too
    script.assert_same(script.end_state(resumed), reference[model])
    assert [r.iteration for r in resumed.save_results] == [9, 12, 14]
    assert _iters(tmp_path) == [f"iter_{s:09}" for s in (3, 6, 9, 12, 14)]


def test_a_checkpoint_is_a_plain_engine_checkpoint(tmp_path: Path) -> None:
    trainer = script.trainer(str(tmp_path), stop_at=6, engine={"save_checksums": True})
    trainer.train()
    folder = tmp_path / CKPT / "iter_000000006"
    components = sorted(p.name for p in folder.iterdir() if p.is_dir())
    assert components == sorted(["model", "optim", "scheduler", "trainer", "rng", COMPONENT])
    assert cli(["verify", str(tmp_path / CKPT), "--level", "checksums"]) == 0
    # the model loads into a fresh model with the engine alone, strictly, and equals the trained one
    fresh = script.build_model("gpt2")
    with CheckpointEngine({"save_dir": str(tmp_path / "other"), "load_path": str(folder)}) as engine:
        result = engine.load(model=fresh)
    assert set(result.report["model"].loaded) == set(fresh.state_dict())
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in fresh.state_dict().items())
    # the trainer state is the JSON the Trainer writes to trainer_state.json
    items = StateItems()
    config = {"save_dir": str(tmp_path / "other"), "load_path": str(folder), "load_training_state": True}
    with CheckpointEngine(config) as engine:
        engine.load(extra={COMPONENT: items})
    text, saved = items.checked(str(folder), 6)
    state = json.loads(text)
    assert state["global_step"] == 6 and state["max_steps"] == script.STEPS
    assert [e["step"] for e in state["log_history"]] == [1, 2, 3, 4, 5, 6]
    assert state["log_history"] == trainer.state.log_history[:6]
    assert set(saved) == set(components)


@pytest.mark.full  # over 2 s on 2 cores: Trainer runs
def test_a_torn_latest_is_an_error_or_the_previous_checkpoint_as_configured(
    tmp_path: Path, reference: dict[str, dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    script.trainer(str(tmp_path), stop_at=9).train()
    optim = tmp_path / CKPT / "iter_000000009" / "optim"
    next(optim.glob("*.distcp")).unlink()  # storage lost a file of the latest checkpoint
    with pytest.raises(IncompleteCheckpointError, match=r"iter_000000009/optim/.*\.distcp is missing"):
        script.trainer(str(tmp_path)).train(resume_from_checkpoint=True)
    assert _latest(tmp_path) == "iter_000000009"  # nothing was trained or saved
    resumed = script.trainer(str(tmp_path), engine={"fallback_to_last_complete": True})
    with caplog.at_level(logging.WARNING, logger="ckpt_engine"):
        resumed.train(resume_from_checkpoint=True)
    assert "fell back to" in caplog.text and "iter_000000006" in caplog.text
    assert "replaces the newer checkpoints that failed the checks (iter_000000009)" in caplog.text
    script.assert_same(script.end_state(resumed), reference["gpt2"])
    assert cli(["verify", str(tmp_path / CKPT)]) == 0  # the broken step 9 was replaced


def test_a_latest_naming_a_missing_checkpoint_is_an_error(tmp_path: Path) -> None:
    script.trainer(str(tmp_path), stop_at=6).train()
    shutil.rmtree(tmp_path / CKPT / "iter_000000006")
    with pytest.raises(CheckpointNotFoundError, match="iter_000000006"):
        script.trainer(str(tmp_path)).train(resume_from_checkpoint=True)


def test_resume_true_with_nothing_saved_is_an_error_naming_the_trainers_own_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        script.trainer(str(tmp_path)).train(resume_from_checkpoint=True)
    plain = Trainer(
        model=script.build_model("gpt2"),
        args=script.training_args(str(tmp_path), max_steps=3),
        train_dataset=script.Tokens(),
    )
    plain.train()
    with pytest.raises(CheckpointNotFoundError, match="checkpoint-3: pass it as resume_from_checkpoint"):
        script.trainer(str(tmp_path)).train(resume_from_checkpoint=True)


def test_a_trainer_checkpoint_folder_resumes_through_the_trainers_own_loader(
    tmp_path: Path, reference: dict[str, dict[str, Any]]
) -> None:
    """A run that switches to EngineTrainer resumes its last ``checkpoint-N``; later saves are
    engine checkpoints."""
    plain = Trainer(
        model=script.build_model("gpt2"),
        args=script.training_args(str(tmp_path)),
        train_dataset=script.Tokens(),
        callbacks=[script.StopAfterSave(6)],
    )
    plain.train()
    resumed = script.trainer(str(tmp_path))
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-6"))
    script.assert_same(script.end_state(resumed), reference["gpt2"])
    assert _iters(tmp_path) == ["iter_000000009", "iter_000000012", "iter_000000014"]


@pytest.mark.full  # over 2 s on 2 cores: Trainer runs
def test_a_path_resumes_exactly_that_checkpoint(tmp_path: Path, reference: dict[str, dict[str, Any]]) -> None:
    script.trainer(str(tmp_path), stop_at=9).train()
    older = str(tmp_path / CKPT / "iter_000000006")
    # its newer steps would be saved again: refused before the first step, unless allowed
    with pytest.raises(CheckpointExistsError, match=r"after step 6, where this run starts \(iter_000000009\)"):
        script.trainer(str(tmp_path)).train(resume_from_checkpoint=older)
    resumed = script.trainer(str(tmp_path), engine={"allow_overwrite": True})
    resumed.train(resume_from_checkpoint=older)
    script.assert_same(script.end_state(resumed), reference["gpt2"])
    # a save folder resumes its latest
    again = script.trainer(str(tmp_path), max_steps=17)
    again.train(resume_from_checkpoint=str(tmp_path / CKPT))
    assert [r.iteration for r in again.save_results] == [15, 17]


def test_a_fresh_run_into_a_used_save_dir_is_refused_before_training(tmp_path: Path) -> None:
    script.trainer(str(tmp_path), stop_at=3).train()
    trainer = script.trainer(str(tmp_path))
    with pytest.raises(CheckpointExistsError, match="after step 0"):
        trainer.train()
    assert trainer.state.global_step == 0


def test_an_engine_checkpoint_of_other_code_is_not_a_trainer_checkpoint(tmp_path: Path) -> None:
    with CheckpointEngine({"save_dir": str(tmp_path / CKPT)}) as engine:
        engine.save(3, model=script.build_model("gpt2"))
    for target in (True, str(tmp_path / CKPT / "iter_000000003")):
        with pytest.raises(NotATrainerCheckpointError, match="has no 'trainer_state' component"):
            script.trainer(str(tmp_path)).train(resume_from_checkpoint=target)


@pytest.mark.full  # over 2 s on 2 cores: Trainer runs
def test_save_total_limit_keeps_the_newest_and_the_best_which_loads_at_the_end(tmp_path: Path) -> None:
    evaluated = {
        "eval_strategy": "steps",
        "eval_steps": 3,
        "metric_for_best_model": "loss",
        "greater_is_better": True,  # the highest eval loss is "best": an early step, not the latest
        "load_best_model_at_end": True,
        "save_total_limit": 2,
    }
    trainer = script.trainer(str(tmp_path), eval_dataset=script.Tokens(8), **evaluated)
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None and best == str(tmp_path / CKPT / f"iter_{trainer.state.best_global_step:09}")
    assert trainer.state.best_global_step not in (12, 14)
    assert _iters(tmp_path) == sorted([os.path.basename(best), "iter_000000012", "iter_000000014"])
    # the model at the end is the best checkpoint's
    stored = script.build_model("gpt2")
    with CheckpointEngine({"save_dir": str(tmp_path / "x"), "load_path": best}) as engine:
        engine.load(model=stored)
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in stored.state_dict().items())


@pytest.mark.full  # over 2 s on 2 cores: Trainer runs
def test_with_a_node_local_tier_the_best_step_is_saved_durably_and_loads_at_the_end(tmp_path: Path) -> None:
    """With ``local_dir`` and a ``persist_every`` longer than the run, only the saves of a new
    best step reach ``save_dir``: ``load_best_model_at_end`` found the best step in the
    node-local tier only, and failed at the end of training."""
    evaluated = {
        "eval_strategy": "steps",
        "eval_steps": 3,
        "metric_for_best_model": "loss",
        "greater_is_better": True,
        "load_best_model_at_end": True,
    }
    engine = {"local_dir": str(tmp_path / "local"), "persist_every": 1000}
    trainer = script.trainer(str(tmp_path), engine=engine, eval_dataset=script.Tokens(8), **evaluated)
    trainer.train()
    best_step = trainer.state.best_global_step
    best = trainer.state.best_model_checkpoint
    assert best is not None and best == str(tmp_path / CKPT / f"iter_{best_step:09}")
    assert os.path.basename(best) in _iters(tmp_path)
    assert "iter_000000012" not in _iters(tmp_path)  # not a new best (eval loss falls): tier only
    stored = script.build_model("gpt2")
    with CheckpointEngine({"save_dir": str(tmp_path / "x"), "load_path": best}) as reader:
        reader.load(model=stored)
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in stored.state_dict().items())


@pytest.mark.full  # over 2 s on 2 cores: Trainer runs
def test_lora_with_incremental_writes_only_the_adapter_and_its_optimizer_state_after_the_first_save(
    tmp_path: Path, reference: dict[str, dict[str, Any]]
) -> None:
    first = script.trainer(str(tmp_path), "lora", stop_at=6, engine={"incremental": True})
    first.train()
    resumed = script.trainer(str(tmp_path), "lora", engine={"incremental": True})
    resumed.train(resume_from_checkpoint=True)
    script.assert_same(script.end_state(resumed), reference["lora"])
    frozen = sum(p.numel() * p.element_size() for p in resumed.model.parameters() if not p.requires_grad)
    full, *later = first.save_results + resumed.save_results
    assert full.bytes_reused == 0 and full.carried_by == "off"
    for result in later:  # carried over from the previous save, or from the checkpoint the job resumed
        assert result.carried_by == "link"
        assert result.bytes_reused >= frozen
        assert abs(result.bytes_written + result.bytes_reused - full.bytes_written) < 16 * 1024  # the log grows
    manifest = json.loads((tmp_path / CKPT / "iter_000000014" / "ckpt_engine_manifest.json").read_text())
    carried = {rel for rel, entry in manifest["files"].items() if entry.get("carried")}
    assert carried and all(rel.startswith("model/") for rel in carried)  # the frozen base, not the adapter
    assert cli(["verify", str(tmp_path / CKPT), "--level", "checksums"]) == 0


@pytest.mark.full  # two pinned_staging writer start-ups (about 20 s on 2 cores)
def test_pinned_staging_saves_in_the_background_and_resumes_bit_identical(
    tmp_path: Path, reference: dict[str, dict[str, Any]]
) -> None:
    resumed = _stop_then_resume(tmp_path, "gpt2", stop_at=9, plugins=["pinned_staging"])
    script.assert_same(script.end_state(resumed), reference["gpt2"])
    assert all(r.succeeded for r in resumed.save_results)  # train() returned after every commit
    assert _latest(tmp_path) == "iter_000000014"


@pytest.mark.full  # the S3 server and a few hundred requests (about 10 s)
def test_object_storage_save_dir(s3_bucket: Any, tmp_path: Path, reference: dict[str, dict[str, Any]]) -> None:
    engine = {"save_dir": s3_bucket.url, "storage": dict(s3_bucket.storage)}
    resumed = _stop_then_resume_remote(tmp_path, engine)
    script.assert_same(script.end_state(resumed), reference["gpt2"])
    objects = s3_bucket.objects()
    assert "latest_checkpoint.txt" in objects and any(o.startswith(f"iter_000000014/{COMPONENT}/") for o in objects)


def _stop_then_resume_remote(root: Path, engine: dict[str, Any]) -> EngineTrainer:
    script.trainer(str(root), stop_at=6, engine=engine).train()
    resumed = script.trainer(str(root), engine=engine)
    resumed.train(resume_from_checkpoint=True)
    return resumed


class LossScaled(EngineTrainerMixin, Trainer):
    """A Trainer subclass of the usual kind (its own ``compute_loss``), made an engine trainer."""

    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False, **kwargs: Any) -> Any:
        return super().compute_loss(model, inputs, return_outputs=return_outputs, **kwargs)


def test_the_mixin_composes_with_a_trainer_subclass(tmp_path: Path, reference: dict[str, dict[str, Any]]) -> None:
    script.trainer(str(tmp_path), stop_at=6, cls=LossScaled).train()
    resumed = script.trainer(str(tmp_path), cls=LossScaled)
    resumed.train(resume_from_checkpoint=True)
    script.assert_same(script.end_state(resumed), reference["gpt2"])


def _sft_run(root: Path, stop_at: int | None = None, resume: bool = False) -> Any:
    """TRL's ``SFTTrainer`` with the mixin, on text of a word-level tokenizer built here (no download)."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    class EngineSFTTrainer(EngineTrainerMixin, SFTTrainer):
        pass

    words = [f"w{i}" for i in range(script.VOCAB - 3)]
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    special = {"pad_token": "<pad>", "eos_token": "<eos>", "unk_token": "<unk>"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, **special)
    draw = torch.Generator().manual_seed(1)
    texts = [" ".join(words[j] for j in torch.randint(0, len(words), (12,), generator=draw)) for _ in range(40)]
    args = SFTConfig(
        output_dir=str(root / "out"),
        max_steps=8,
        per_device_train_batch_size=4,
        save_steps=3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
        max_length=16,
    )
    trainer = EngineSFTTrainer(
        model=script.build_model("gpt2"),
        args=args,
        train_dataset=Dataset.from_dict({"text": texts}),
        processing_class=tokenizer,
        callbacks=[script.StopAfterSave(stop_at)] if stop_at is not None else [],
        engine_config={"save_dir": str(root / CKPT)},
    )
    trainer.train(resume_from_checkpoint=resume or None)
    return trainer


@pytest.mark.full  # over 2 s on 2 cores: Trainer runs
def test_the_mixin_composes_with_trls_sft_trainer(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    whole = script.end_state(_sft_run(tmp_path / "whole"))
    _sft_run(tmp_path / "split", stop_at=3)
    resumed = script.end_state(_sft_run(tmp_path / "split", resume=True))
    assert _iters(tmp_path / "split") == [f"iter_{s:09}" for s in (3, 6, 8)]
    # TRL's num_tokens is a running count TRL keeps outside the trainer state: after a resume it
    # counts from there, with TRL's own checkpoints as with these; every other logged value is exact
    assert [e["num_tokens"] for e in resumed["log"]][3:] != [e["num_tokens"] for e in whole["log"]][3:]
    for state in (whole, resumed):
        state["log"] = [{k: v for k, v in e.items() if k != "num_tokens"} for e in state["log"]]
    script.assert_same(resumed, whole)


def test_the_mixin_after_the_trainer_class_is_refused() -> None:
    with pytest.raises(UnsupportedTrainerSetupError, match="put the mixin first"):

        class Wrong(Trainer, EngineTrainerMixin):  # the Trainer's own checkpointing would win
            pass


@pytest.mark.parametrize(
    ("engine", "overrides", "error", "match"),
    [
        ({"keep_last": 2}, {"save_total_limit": 2}, UnsupportedTrainerSetupError, "set one of them"),
        (
            {"keep_last": 2},
            {"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3},
            UnsupportedTrainerSetupError,
            "use save_total_limit instead",
        ),
        ({"load_path": "x/iter_000000003"}, {}, ConfigError, "resume_from_checkpoint"),
        ({"keys_not_to_resume": ["optimizer"]}, {}, ConfigError, r"names \['optimizer'\]"),
        ({"keys_not_to_resume": [COMPONENT]}, {}, ConfigError, "always read"),
        ({}, {"push_to_hub": True, "hub_model_id": "me/tiny"}, UnsupportedTrainerSetupError, "push_to_hub"),
    ],
)
def test_contradicting_settings_are_refused(
    tmp_path: Path, engine: dict[str, Any], overrides: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        script.trainer(str(tmp_path), engine=engine, eval_dataset=script.Tokens(8), **overrides)
    assert issubclass(error, CkptEngineError)


def test_engine_config_defaults_to_a_folder_in_output_dir(tmp_path: Path) -> None:
    trainer = EngineTrainer(
        model=script.build_model("gpt2"),
        args=script.training_args(str(tmp_path), max_steps=3),
        train_dataset=script.Tokens(),
        engine_config={"incremental": True},
    )
    assert trainer.checkpoint_dir == str(tmp_path / "out" / CKPT) and trainer.engine_config.incremental
    assert trainer.checkpoint_path(3) == str(tmp_path / "out" / CKPT / "iter_000000003")
    trainer.train()
    assert (tmp_path / "out" / CKPT / "iter_000000003" / COMPONENT).is_dir()
    assert not list((tmp_path / "out").glob("checkpoint-*"))  # no Trainer checkpoint folder besides


def test_the_trainer_methods_it_overrides_are_the_trainers() -> None:
    """Pins the transformers API the mixin takes over: a release that renames one of these would
    have the Trainer write its own checkpoints unnoticed (the module also refuses to import)."""
    import inspect

    expected = {
        "train": ["self", "resume_from_checkpoint", "trial", "ignore_keys_for_eval"],
        "_save_checkpoint": ["self", "model", "trial"],
        "_load_from_checkpoint": ["self", "resume_from_checkpoint", "model"],
        "_load_optimizer_and_scheduler": ["self", "checkpoint"],
        "_load_scaler": ["self", "checkpoint"],
        "_load_rng_state": ["self", "checkpoint"],
        "_load_best_model": ["self"],
    }
    assert set(expected) == set(TRAINER_METHODS)
    for name, params in expected.items():
        assert list(inspect.signature(getattr(Trainer, name)).parameters) == params, name
    assert isinstance(script.training_args("."), TrainingArguments)


@pytest.mark.parametrize(("enabled", "version", "refused"), [(False, None, False), (True, 1, True), (True, 2, False)])
def test_only_fsdp1_is_refused(enabled: bool, version: int | None, refused: bool) -> None:
    """accelerate's FSDP1 is refused, FSDP2 taken over (a stand-in for the trainer: accelerate
    runs FSDP only on accelerators and FSDP1 is not run here; FSDP2 runs in
    test_transformers_processes.py::test_fsdp2_two_ranks_...)."""
    from types import SimpleNamespace

    from ckpt_engine.integrations.transformers import _is_fsdp1

    plugin = SimpleNamespace(fsdp_version=version) if enabled else None
    trainer = SimpleNamespace(
        is_fsdp_enabled=enabled, accelerator=SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin))
    )
    assert _is_fsdp1(trainer) is refused  # type: ignore[arg-type]


# -- check_exact_resume around a tiny Hugging Face model ------------------------------------------


@pytest.mark.full  # three new processes, each importing transformers
def test_a_tiny_gpt2_trained_by_hand_resumes_exactly(tmp_path: Path) -> None:
    from ckpt_engine.testing import check_exact_resume

    # the three processes import hf_models alone (the models, not the Trainer, nor this module)
    report = check_exact_resume(hf_models.build_gpt2, hf_models.step_gpt2, steps=5, save_at=2, workdir=tmp_path)
    report.raise_if_not_exact()
    assert report.keys_compared > 50  # every parameter, its AdamW state, the schedule, the position, the generators


def test_the_second_read_of_a_resume_whose_folder_is_gone_takes_the_same_step_again(tmp_path: Path) -> None:
    """A resume's second read (the model, optimizer and scheduler, after the trainer-state probe)
    named the folder the probe read. A step the node-local tier resharded into another number of
    ranks is read from a folder the engine removes after each read: CheckpointNotFoundError on
    every such resume. The second read takes the step by the probe's rule again (same iteration)."""
    from ckpt_engine.integrations._trainer_checkpoint import DeferredRng, Resume, read_training_state

    save_dir = str(tmp_path / "ckpt")
    saved = torch.nn.Linear(4, 3)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(3, model=saved)
    gone = str(tmp_path / "local" / ".ckpt_engine_reshard" / "rank_00000" / "iter_000000003")
    resume = Resume(gone, 3, ("model",), str(tmp_path / "stand_in"), DeferredRng(), None, None)
    fresh = torch.nn.Linear(4, 3)
    result = read_training_state(EngineConfig(save_dir=save_dir), (), resume, {"model": fresh})
    assert result.iteration == 3
    assert all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), fresh.state_dict().values(), strict=True))
    with pytest.raises(CorruptCheckpointError, match="second read of it found iteration 3"):
        read_training_state(
            EngineConfig(save_dir=save_dir), (), dataclasses.replace(resume, iteration=5), {"model": fresh}
        )
