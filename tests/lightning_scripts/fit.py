"""A tiny deterministic Lightning fit through ``EngineCheckpointIO`` (run by ``tests/integrations/test_lightning.py``).

Imported by the test for in-process fits, and run as a script to be killed with SIGKILL in the
middle of a save:

    python tests/lightning_scripts/fit.py ROOT STEPS {sync,async} KILL_AT

trains to ``STEPS`` with a checkpoint every epoch (4 steps) into ``ROOT/engine`` (the engine's
save_dir) and ``ROOT/ckpts`` (Lightning's pointers), and during the save of step ``KILL_AT``
prints ``MIDSAVE <step>`` and stops there until it is killed: a synchronous save after its
``model`` component is written and before the commit (a write provider that wraps the engine's
own); an async one (``pinned_staging``) right after ``save()`` returned, while the background
writer writes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ckpt_engine import WriteContext, WriteResult, hookimpl
from ckpt_engine.defaults import DefaultIO
from ckpt_engine.integrations.lightning import EngineCheckpointIO

STEPS_PER_EPOCH = 4


class Regressor(L.LightningModule):
    """Records ``(global_step, loss)`` of every training step."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.losses: dict[int, float] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        optim = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optim, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)}


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS_PER_EPOCH, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=8)


def config(root: str, mode: str, **extra: Any) -> dict[str, Any]:
    plugins = ["pinned_staging"] if mode == "async" else []
    return {"save_dir": os.path.join(root, "engine"), "plugins": plugins, **extra}


def fit(
    root: str,
    steps: int,
    io: EngineCheckpointIO,
    *,
    ckpt_path: str | None = None,
    every: int = STEPS_PER_EPOCH,
    **checkpoint_options: Any,
) -> Regressor:
    """Fit :class:`Regressor` to ``steps`` through ``io``; returns the module (with its losses)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Regressor()
    options: dict[str, Any] = {"save_top_k": -1, "save_last": True, **checkpoint_options}
    callback = ModelCheckpoint(dirpath=os.path.join(root, "ckpts"), every_n_train_steps=every, **options)
    trainer = L.Trainer(
        max_steps=steps,
        plugins=[io],
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        deterministic=True,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, data(), ckpt_path=ckpt_path)
    return model


class StopMidWrite:
    """A ``write`` provider that is the engine's own, except that at ``iteration`` it stops after
    the ``model`` component is on disk and waits to be killed."""

    name = "stop_mid_write"

    def __init__(self, iteration: int) -> None:
        self.iteration = iteration
        self.default = DefaultIO()

    @hookimpl
    def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> WriteResult:
        result = self.default.write(ctx, state_dict)
        if ctx.iteration == self.iteration and ctx.component == "model":
            _stop(ctx.iteration)
        return result


class StopAfterAsyncSave(EngineCheckpointIO):
    """Stops right after ``save_checkpoint`` of ``iteration`` returned (the write goes on)."""

    def __init__(self, config: Mapping[str, Any], iteration: int) -> None:
        super().__init__(config)
        self.iteration = iteration

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        if checkpoint["global_step"] == self.iteration:
            _stop(self.iteration)


def _stop(step: int) -> None:
    print(f"MIDSAVE {step}", flush=True)
    time.sleep(600)  # the test kills the process group here
    os._exit(3)


def main() -> None:
    os.setpgid(0, 0)  # the test kills the whole group: pinned_staging's writer process dies with us
    root, steps, mode, kill_at = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    if mode == "async":
        io: EngineCheckpointIO = StopAfterAsyncSave(config(root, mode), kill_at)
    else:
        io = EngineCheckpointIO(config(root, mode), plugins=[StopMidWrite(kill_at)])
    fit(root, steps, io)
    print("FINISHED", flush=True)


if __name__ == "__main__":
    main()
