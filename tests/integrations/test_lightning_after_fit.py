"""What users do with a Lightning run's checkpoints after ``fit`` (``EngineCheckpointIO``).

Each test is a real ``lightning.Trainer.fit`` on the CPU (``tests/lightning_scripts/fit.py``,
4 steps: one checkpoint, under ``epoch=0-step=4.ckpt`` and ``last.ckpt``). Before these were
fixed, ``LightningModule.load_from_checkpoint`` on the path ``ModelCheckpoint`` reports failed
in ``torch.load`` (a pointer file is no ``torch.save`` file), a second
``trainer.save_checkpoint`` of the same global step with other weights silently named the first
save, a copied run folder refused ``ckpt_path="last"`` (its pointers named the original folder),
and ``torch.save(trainer)`` failed on the IO's lock.
"""

from __future__ import annotations

import copy
import io
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

import fit as script
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn

from ckpt_engine import CheckpointExistsError
from ckpt_engine.integrations.lightning import EngineCheckpointIO, PointerMismatchError, read_pointer


class Wide(script.Regressor):
    """The regressor with hyper-parameters that shape it."""

    def __init__(self, width: int = 16, name: str = "default") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 1))


def _fit(root: Path, model: L.LightningModule, steps: int = 4, **engine: Any) -> tuple[L.Trainer, ModelCheckpoint]:
    torch.manual_seed(0)
    callback = ModelCheckpoint(dirpath=root / "ckpts", every_n_train_steps=4, save_top_k=-1, save_last=True)
    trainer = L.Trainer(
        max_steps=steps,
        plugins=[EngineCheckpointIO(script.config(str(root), "sync", **engine))],
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        num_sanity_val_steps=0,
    )
    trainer.fit(model, script.data())
    return trainer, callback


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return list(sa) == list(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_load_from_checkpoint_gives_the_trained_weights_and_hyper_parameters(tmp_path: Path) -> None:
    torch.manual_seed(1)
    model = Wide(width=8, name="run")
    _, callback = _fit(tmp_path, model)
    for path in (callback.best_model_path, callback.last_model_path, tmp_path / "engine" / "iter_000000004"):
        loaded = Wide.load_from_checkpoint(path)
        assert dict(loaded.hparams) == {"width": 8, "name": "run"}
        assert _same_weights(loaded, model)
    # another path is Lightning's own: a torch.save checkpoint loads as before
    plain = tmp_path / "plain.ckpt"
    torch.save(
        {
            "state_dict": model.state_dict(),
            "hyper_parameters": {"width": 8},
            "pytorch-lightning_version": L.__version__,
        },
        plain,
    )
    assert _same_weights(Wide.load_from_checkpoint(plain), model)


def test_a_second_save_of_a_step_with_another_state_is_refused_or_replaces_it(tmp_path: Path) -> None:
    model = script.Regressor()
    trainer, callback = _fit(tmp_path, model)
    trained = copy.deepcopy(model.state_dict())
    # after fit only the progress counters differ (loops, epoch): the same checkpoint, named again
    trainer.save_checkpoint(tmp_path / "final.ckpt")
    assert sorted(p.name for p in (tmp_path / "engine").glob("iter_*")) == ["iter_000000004"]
    with torch.no_grad():
        model.net[0].weight.add_(1.0)
    with pytest.raises(CheckpointExistsError, match=r"global step 4 is already saved.*state_dict.*allow_overwrite"):
        trainer.save_checkpoint(tmp_path / "changed.ckpt")
    assert not (tmp_path / "changed.ckpt").exists()
    assert _same_weights(script.Regressor.load_from_checkpoint(tmp_path / "final.ckpt"), _module(trained))
    # with allow_overwrite the new state replaces it, and the pointers of the old one refuse it
    root = tmp_path / "overwrite"
    model = script.Regressor()
    trainer, callback = _fit(root, model, allow_overwrite=True)
    with torch.no_grad():
        model.net[0].weight.add_(1.0)
    trainer.save_checkpoint(root / "changed.ckpt")
    assert _same_weights(script.Regressor.load_from_checkpoint(root / "changed.ckpt"), model)
    with pytest.raises(PointerMismatchError, match="replaced"):
        script.Regressor.load_from_checkpoint(callback.best_model_path)


def _module(state: dict[str, torch.Tensor]) -> nn.Module:
    module = script.Regressor()
    module.load_state_dict(state)
    return module


def test_a_copied_run_folder_resumes_from_last(tmp_path: Path) -> None:
    original = tmp_path / "original"
    _fit(original, script.Regressor())
    copied = tmp_path / "copied"
    shutil.copytree(original, copied)
    shutil.rmtree(original)  # moved, not only copied: nothing of the original is left to read
    model = script.fit(str(copied), 8, EngineCheckpointIO(script.config(str(copied), "sync")), ckpt_path="last")
    assert sorted(model.losses) == [4, 5, 6, 7]  # resumed at step 4
    pointer = read_pointer(copied / "ckpts" / "epoch=1-step=8.ckpt")
    assert pointer is not None and pointer.save_dir == str(copied / "engine")
    # a pointer copied alone into another run's folder still names its own run's checkpoint, even
    # where that run has a checkpoint of the same name (another save)
    other = tmp_path / "other"
    _fit(other, script.Regressor())
    planted = other / "ckpts" / "planted.ckpt"
    shutil.copy(copied / "ckpts" / "epoch=0-step=4.ckpt", planted)
    with pytest.raises(PointerMismatchError, match="allow_foreign_pointers"):
        EngineCheckpointIO(script.config(str(other), "sync")).load_checkpoint(str(planted))


def test_a_trainer_with_the_io_pickles(tmp_path: Path) -> None:
    trainer, _ = _fit(tmp_path, script.Regressor())
    buffer = io.BytesIO()
    torch.save(trainer, buffer)
    buffer.seek(0)
    copied = torch.load(buffer, weights_only=False)
    plugin = copied.strategy.checkpoint_io
    assert isinstance(plugin, EngineCheckpointIO) and plugin.save_dir == str(tmp_path / "engine")
    checkpoint = {"global_step": 9, "state_dict": {"w": torch.ones(2)}}
    plugin.save_checkpoint(checkpoint, os.path.join(tmp_path, "copy.ckpt"))  # its own lock and engine
    plugin.teardown()
    assert torch.equal(plugin.load_checkpoint(tmp_path / "copy.ckpt")["state_dict"]["w"], torch.ones(2))


def test_installing_again_wraps_lightnings_load_from_checkpoint_once() -> None:
    from lightning.pytorch import LightningDataModule, LightningModule

    from ckpt_engine.integrations.lightning import install_load_from_checkpoint

    before = [owner.__dict__["load_from_checkpoint"].method for owner in (LightningModule, LightningDataModule)]
    install_load_from_checkpoint()
    for owner, wrapper in zip((LightningModule, LightningDataModule), before, strict=True):
        now = owner.__dict__["load_from_checkpoint"].method
        assert now is not wrapper and now.__ckpt_engine_original__ is wrapper.__ckpt_engine_original__
        assert not hasattr(now.__ckpt_engine_original__, "__ckpt_engine_original__")  # Lightning's own, once
