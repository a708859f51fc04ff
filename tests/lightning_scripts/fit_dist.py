"""A Lightning fit on 2 CPU processes through ``EngineCheckpointIO``, started as a user starts one
(run by ``tests/integrations/test_lightning_strategies.py``):

    python fit_dist.py ROOT STRATEGY STEPS kill KILL_AT
    python fit_dist.py ROOT STRATEGY STEPS resume
    python fit_dist.py ROOT STRATEGY STEPS reshard
    python fit_dist.py ROOT STRATEGY STEPS fit

``STRATEGY`` is ``ddp`` (``Trainer(strategy="ddp", devices=2)``) or ``model_parallel``
(``ModelParallelStrategy``, the model sharded with FSDP2's ``fully_shard``); Lightning starts the
second process itself, which runs this script too (under torchrun the ranks exist already);
with ``CKPT_TEST_LIGHTNING_CUDA=1``, one process on the GPU instead.
The fit checkpoints every epoch (4 steps a rank) into ``ROOT/<run>/engine`` (the engine's
save_dir) and ``ROOT/<run>/ckpts`` (Lightning's pointers).

``kill``: fits run ``killed`` to ``STEPS``; during the save of ``KILL_AT``, once its ``model``
component is written and before the commit, each rank prints ``MIDSAVE <step> <rank>`` and waits
to be killed (with ``CKPT_TEST_LIGHTNING_ASYNC=1``, background saves through ``pinned_staging``:
right after the save returned, while the writer process writes).

``resume``: fits run ``reference`` to ``STEPS`` without a stop, then resumes run ``killed`` with
``ckpt_path="last"`` to ``STEPS``; each rank writes ``ROOT/<run>/final_<rank>.pt``: its model and
optimizer state (its own shards under FSDP2) and the loss of every step it ran. ``reshard`` (with
``CKPT_TEST_LIGHTNING_RANKS=1``): resumes run ``killed`` at its last step ``STEPS`` on one
process, and writes what it loaded as run ``resharded``. ``fit``: fits run ``killed`` to ``STEPS``
and writes its final state. With ``CKPT_TEST_LIGHTNING_TIER=1`` the engine saves into the
node-local tier ``ROOT/<run>/local`` only (``persist_every`` longer than the fit).
Every rank prints ``SAVED <run> <iteration> <rank>`` for each save its engine committed.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

from ckpt_engine import SaveResult, WriteContext, WriteResult, hookimpl
from ckpt_engine.defaults import DefaultIO
from ckpt_engine.integrations.lightning import EngineCheckpointIO

STEPS_PER_EPOCH = 4
#: With CKPT_TEST_LIGHTNING_CUDA=1 (the ``cuda`` test): one process on the GPU, NCCL.
CUDA = os.environ.get("CKPT_TEST_LIGHTNING_CUDA") == "1"
#: The processes of the job: 2, or CKPT_TEST_LIGHTNING_RANKS (``reshard``: 1); one on the GPU.
RANKS = 1 if CUDA else int(os.environ.get("CKPT_TEST_LIGHTNING_RANKS", "2"))
#: With CKPT_TEST_LIGHTNING_ASYNC=1: background saves (``pinned_staging``).
ASYNC = os.environ.get("CKPT_TEST_LIGHTNING_ASYNC") == "1"
#: With CKPT_TEST_LIGHTNING_TIER=1: every save to the node-local tier ``ROOT/<run>/local`` only, and
#: no :class:`RankState` (state saved per rank is not resharded from the tier, by design).
TIER = os.environ.get("CKPT_TEST_LIGHTNING_TIER") == "1"


class Regressor(L.LightningModule):
    """Records ``(global_step, loss)`` of every training step; shards itself with FSDP2 under
    ``ModelParallelStrategy`` (``configure_model``)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.losses: dict[int, float] = {}

    def configure_model(self) -> None:
        if isinstance(self.trainer.strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            assert self.device_mesh is not None
            mesh = self.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses[self.global_step] = loss.item()
        return loss

    def configure_optimizers(self) -> Any:
        optim = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optim, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)}


class RankState(Callback):
    """A callback whose state differs by rank: the engine saves it per rank (unlike Lightning's own
    file, which holds global rank 0's), and a resumed run loads each rank's own (``loaded``)."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        rank = torch.distributed.get_rank()
        return {"saved_by": rank, "marker": torch.full((3,), float(rank))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.loaded = state_dict


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8 * STEPS_PER_EPOCH * RANKS, 4, generator=g)
    y = torch.cat([x.sum(dim=1, keepdim=True).sin(), x.prod(dim=1, keepdim=True)], dim=1)
    return DataLoader(TensorDataset(x, y), batch_size=8)


def say(line: str) -> None:
    """``line`` in one write: the ranks share stdout."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def strategy(name: str) -> str | Strategy:
    return ModelParallelStrategy(data_parallel_size=RANKS, tensor_parallel_size=1) if name == "model_parallel" else name


class ReportSaves:
    """An engine observer: prints ``SAVED <run> <iteration> <rank>`` for every committed save."""

    name = "report_saves"

    def __init__(self, run: str) -> None:
        self.run = run

    @hookimpl
    def on_save_done(self, result: SaveResult) -> None:
        if result.succeeded:
            say(f"SAVED {self.run} {result.iteration} {torch.distributed.get_rank()}")


class StopMidWrite:
    """The engine's own ``write``, except that at ``iteration`` it stops once the ``model``
    component is written, and waits to be killed."""

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
    """With background saves: stops each rank right after the save of ``iteration`` returned,
    while the writer process writes it, and waits to be killed."""

    def __init__(self, config: dict[str, Any], plugins: list[Any], iteration: int) -> None:
        super().__init__(config, plugins=plugins)
        self.iteration = iteration

    def _save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any, agree: Any) -> None:
        super()._save(checkpoint, path, storage_options, agree)
        if checkpoint["global_step"] == self.iteration:
            _stop(self.iteration)


def _stop(step: int) -> None:
    say(f"MIDSAVE {step} {torch.distributed.get_rank()}")
    time.sleep(600)  # the test kills the whole job here
    os._exit(3)


def fit(root: str, run: str, name: str, steps: int, *, ckpt_path: str | None = None, stop_at: int = -1) -> Any:
    """Fit :class:`Regressor` as run ``run`` to ``steps``; returns the trainer."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    plugins: list[Any] = [ReportSaves(run)]
    config: dict[str, Any] = {
        "save_dir": os.path.join(root, run, "engine"),
        "plugins": ["pinned_staging"] if ASYNC else [],
    }
    if TIER:
        config |= {"local_dir": os.path.join(root, run, "local"), "persist_every": 1000}
    if stop_at >= 0 and ASYNC:
        io: EngineCheckpointIO = StopAfterAsyncSave(config, plugins, stop_at)
    else:
        io = EngineCheckpointIO(config, plugins=plugins + ([StopMidWrite(stop_at)] if stop_at >= 0 else []))
    trainer = L.Trainer(
        max_steps=steps,
        strategy=strategy(name),
        devices=RANKS,
        plugins=[io],
        callbacks=[
            *([] if TIER else [RankState()]),  # state saved per rank: a tier's step of it is not resharded
            ModelCheckpoint(
                dirpath=os.path.join(root, run, "ckpts"),
                every_n_train_steps=STEPS_PER_EPOCH,
                save_top_k=-1,
                save_last=True,
            ),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cuda" if CUDA else "cpu",
        deterministic=True,
        num_sanity_val_steps=0,
    )
    trainer.fit(Regressor(), data(), ckpt_path=ckpt_path)
    return trainer


def _local(value: Any) -> Any:
    """``value`` with every DTensor replaced by this rank's shard, every tensor copied to the CPU."""
    if isinstance(value, DTensor):
        return value.to_local().detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _local(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_local(v) for v in value)
    return value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value


def dump(trainer: Any, root: str, run: str) -> None:
    """This rank's final model and optimizer state (its shards) and losses, for the test to compare,
    in ``ROOT/<run>/final_<rank>.pt``."""
    module = trainer.lightning_module
    model, optimizer = trainer.strategy.model, trainer.strategy.optimizers[0]
    state = {
        "model": _local(get_model_state_dict(model)),
        "optimizer": _local(get_optimizer_state_dict(model, optimizer)),
        "losses": module.losses,
        "rank_state_loaded": next((c.loaded for c in trainer.callbacks if isinstance(c, RankState)), None),
    }
    os.makedirs(os.path.join(root, run), exist_ok=True)
    torch.save(state, os.path.join(root, run, f"final_{trainer.global_rank}.pt"))


def main() -> None:
    root, name, steps, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    if mode == "kill":
        fit(root, "killed", name, steps, stop_at=int(sys.argv[5]))
        say("FINISHED")
        return
    if mode == "fit":  # run ``killed`` to ``STEPS`` without a stop
        dump(fit(root, "killed", name, steps), root, "killed")
        return
    if mode == "reshard":  # resume run ``killed`` at its last step, on RANKS processes: no step runs
        dump(fit(root, "killed", name, steps, ckpt_path="last"), root, "resharded")
        return
    dump(fit(root, "reference", name, steps), root, "reference")
    dump(fit(root, "killed", name, steps, ckpt_path="last"), root, "killed")
    say("RESUMED")


if __name__ == "__main__":
    main()
