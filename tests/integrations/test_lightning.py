"""``ckpt_engine.integrations.lightning``: a real Lightning ``Trainer`` saving and resuming through the engine.

Every fit is a real ``lightning.Trainer.fit`` on the CPU (a tiny regressor, seeded, 4 steps an
epoch, a checkpoint every epoch; ``tests/lightning_scripts/fit.py``). The kill tests run the fit
in a child forked with Lightning imported (``tests/_forked.py``) and SIGKILL its process group in
the middle of a save, then resume in this process with ``ckpt_path="last"``: every loss after the
resume must equal the uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Any

import _forked
import pytest
import torch
from _paths import LIGHTNING_SCRIPTS

pytest.importorskip("lightning")

import fit as script

from ckpt_engine import (
    ArgumentTypeError,
    CheckpointEngine,
    CheckpointNotFoundError,
    CkptEngineError,
)
from ckpt_engine.cli import main as cli
from ckpt_engine.integrations.lightning import (
    COMPONENT,
    LAST_ALIAS,
    EngineCheckpointIO,
    NotALightningCheckpointError,
    read_pointer,
)

SCRIPT = LIGHTNING_SCRIPTS / "fit.py"
STEPS = 12  # 3 epochs: checkpoints at steps 4, 8 and 12


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The losses of an uninterrupted fit (it checkpoints too, synchronously)."""
    root = str(tmp_path_factory.mktemp("reference"))
    model = script.fit(root, STEPS, EngineCheckpointIO(script.config(root, "sync")))
    assert sorted(model.losses) == list(range(STEPS))
    return model.losses


#: What the fork server imports before forking the fits (tests/_forked.py): Lightning once.
LIGHTNING = ["lightning", "ckpt_engine.integrations.lightning"]


def _run_until_killed(root: str, mode: str, kill_at: int) -> None:
    """Run the fit in a forked child and SIGKILL it (and its writer process) during the save of
    ``kill_at``. Bounded by progress: the child reports ``MIDSAVE`` or exits."""
    with _forked.popen(SCRIPT, root, str(STEPS), mode, str(kill_at), stdout=_forked.PIPE, preload=LIGHTNING) as proc:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                if line.startswith("MIDSAVE"):
                    assert line.split() == ["MIDSAVE", str(kill_at)]
                    os.killpg(proc.pid, signal.SIGKILL)
                    break
            else:
                proc.wait()
                pytest.fail(proc.describe(f"ended (rc={proc.returncode}) without reaching the save of {kill_at}"))
        finally:
            with contextlib.suppress(ProcessLookupError):  # the group may already be gone
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL


SLOW = pytest.mark.skipif(
    not os.environ.get("CKPT_ENGINE_SLOW_TESTS"),
    reason="about 20 s (two pinned_staging writer start-ups): set CKPT_ENGINE_SLOW_TESTS=1; "
    "async saves run by default in test_engine_retention_and_lightning_top_k_are_both_honoured",
)


@pytest.mark.full  # over 2 s on 2 cores: Lightning training runs
@pytest.mark.parametrize("mode", ["sync", pytest.param("async", marks=[pytest.mark.slow, SLOW])])
def test_sigkill_mid_save_then_resume_from_last_is_bit_identical(
    tmp_path: Path, reference: dict[int, float], mode: str
) -> None:
    root = str(tmp_path)
    _run_until_killed(root, mode, kill_at=8)
    engine_dir = tmp_path / "engine"
    latest = (engine_dir / "latest_checkpoint.txt").read_text().strip()
    if mode == "sync":
        # killed between the model's write and the commit: step 8 is half written and not committed
        assert latest == "iter_000000004"
        assert (engine_dir / ".iter_000000008.partial" / "model" / ".metadata").exists()
        assert not (engine_dir / "iter_000000008").exists()
        assert not (tmp_path / "ckpts" / "epoch=1-step=8.ckpt").exists()  # its pointer waits for the commit
    else:
        assert latest in ("iter_000000004", "iter_000000008")  # the background writer may have committed
    resumed_from = int(latest.removeprefix("iter_"))

    model = script.fit(root, STEPS, EngineCheckpointIO(script.config(root, mode)), ckpt_path="last")

    assert sorted(model.losses) == list(range(resumed_from, STEPS))
    assert model.losses == {step: reference[step] for step in model.losses}  # bit for bit
    assert (engine_dir / "latest_checkpoint.txt").read_text().strip() == f"iter_{STEPS:09}"
    assert cli(["verify", str(engine_dir)]) == 0


def test_a_checkpoint_is_a_plain_engine_checkpoint_and_its_pointers_name_it(tmp_path: Path) -> None:
    root = str(tmp_path)
    script.fit(root, 8, EngineCheckpointIO(script.config(root, "sync", save_checksums=True)))
    names = sorted(p.name for p in (tmp_path / "ckpts").iterdir())
    assert names == ["epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt", LAST_ALIAS, "last.ckpt"]
    pointer = read_pointer(tmp_path / "ckpts" / "epoch=0-step=4.ckpt")
    assert pointer is not None and pointer.checkpoint == "iter_000000004" and pointer.iteration == 4
    assert pointer.save_dir == str(tmp_path / "engine")
    folder = tmp_path / "engine" / "iter_000000008"
    assert sorted(p.name for p in folder.iterdir() if p.is_dir()) == [COMPONENT, "model", "rng", "trainer"]
    assert cli(["verify", str(tmp_path / "engine"), "--level", "checksums"]) == 0
    # the model component loads into the LightningModule with the engine alone, strictly
    target = script.Regressor()
    config = {"save_dir": str(tmp_path / "other"), "load_path": str(folder)}
    with CheckpointEngine(config) as engine:
        result = engine.load(model=target)
    assert set(result.report["model"].loaded) == set(target.state_dict())
    io = EngineCheckpointIO(script.config(root, "sync"))
    loaded = io.load_checkpoint(tmp_path / "ckpts" / "epoch=1-step=8.ckpt")
    assert loaded["global_step"] == 8 and loaded["epoch"] == 1
    assert all(torch.equal(target.state_dict()[k], v) for k, v in loaded["state_dict"].items())
    assert list(loaded["state_dict"]) == list(target.state_dict())
    assert [type(s) for s in loaded["optimizer_states"][0]["state"]] == [int, int, int, int]
    assert loaded["lr_schedulers"][0]["last_epoch"] == 2  # an epoch-interval scheduler, two epochs
    assert loaded["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"] == 1


def test_the_checkpoint_dict_round_trips_exactly(tmp_path: Path) -> None:
    """Key types, container kinds, scalars, objects and tensors come back as they were saved."""
    weight = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    checkpoint: dict[str, Any] = {
        "epoch": 3,
        "global_step": 7,
        "state_dict": OrderedDict([("layer.weight", weight), ("layer.bias", torch.ones(2, dtype=torch.bfloat16))]),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "lr_schedulers": [],
        "callbacks": {},
        "hyper_parameters": {"betas": (0.9, 0.999), "name": "run", "flag": None, "nan": float("nan"), 5: True},
        "extra_bytes": b"\x00\x01",
    }
    io = EngineCheckpointIO({"save_dir": str(tmp_path / "engine")})
    io.save_checkpoint(checkpoint, str(tmp_path / "a.ckpt"))
    io.teardown()
    back = EngineCheckpointIO({"save_dir": str(tmp_path / "engine")}).load_checkpoint(str(tmp_path / "a.ckpt"))
    hp = back.pop("hyper_parameters")
    nan = hp.pop("nan")
    assert nan != nan and hp == {"betas": (0.9, 0.999), "name": "run", "flag": None, 5: True}
    assert isinstance(back["state_dict"], OrderedDict) and list(back["state_dict"]) == ["layer.weight", "layer.bias"]
    assert back["state_dict"]["layer.bias"].dtype == torch.bfloat16 and torch.equal(
        back["state_dict"]["layer.weight"], weight
    )
    assert back["optimizer_states"] == [
        {"state": {0: {"step": torch.tensor(7.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    ]
    assert {k: back[k] for k in ("epoch", "global_step", "lr_schedulers", "callbacks", "extra_bytes")} == {
        "epoch": 3,
        "global_step": 7,
        "lr_schedulers": [],
        "callbacks": {},
        "extra_bytes": b"\x00\x01",
    }


@pytest.mark.full  # over 2 s on 2 cores: Lightning training runs
def test_engine_retention_and_lightning_top_k_are_both_honoured(tmp_path: Path) -> None:
    # the engine's keep_last: two checkpoints stay, whatever Lightning keeps
    root = str(tmp_path / "engine_retention")
    script.fit(root, 12, EngineCheckpointIO(script.config(root, "sync", keep_last=2)))
    kept = sorted(p.name for p in Path(root, "engine").glob("iter_*"))
    assert kept == ["iter_000000008", "iter_000000012"]
    with pytest.raises(CheckpointNotFoundError):  # a pointer whose checkpoint retention removed: a typed error
        EngineCheckpointIO(script.config(root, "sync")).load_checkpoint(
            os.path.join(root, "ckpts", "epoch=0-step=4.ckpt")
        )
    # Lightning's save_top_k=1: it removes the older pointer, and with it the engine checkpoint
    root = str(tmp_path / "top_k")
    script.fit(root, 12, EngineCheckpointIO(script.config(root, "async")), save_top_k=1, save_last=False)
    assert sorted(p.name for p in Path(root, "engine").glob("iter_*")) == ["iter_000000012"]
    assert sorted(p.name for p in Path(root, "ckpts").iterdir()) == ["epoch=2-step=12.ckpt", LAST_ALIAS]


def test_errors_are_typed_and_name_the_path(tmp_path: Path) -> None:
    io = EngineCheckpointIO({"save_dir": str(tmp_path / "engine")})
    good = {"global_step": 1, "state_dict": {"w": torch.zeros(2)}}
    with pytest.raises(ArgumentTypeError, match="storage_options"):
        io.save_checkpoint(good, str(tmp_path / "a.ckpt"), storage_options={"x": 1})
    with pytest.raises(ArgumentTypeError, match="global_step"):
        io.save_checkpoint({"state_dict": {}}, str(tmp_path / "a.ckpt"))
    with pytest.raises(CheckpointNotFoundError, match=r"nothing\.ckpt"):
        io.load_checkpoint(str(tmp_path / "nothing.ckpt"))
    torch.save({"state_dict": {}}, tmp_path / "plain.ckpt")  # what Lightning's default CheckpointIO writes
    with pytest.raises(NotALightningCheckpointError, match=r"plain\.ckpt"):
        io.load_checkpoint(str(tmp_path / "plain.ckpt"))
    with CheckpointEngine({"save_dir": str(tmp_path / "plain_engine")}) as engine:  # no lightning component
        engine.save(3, model=torch.nn.Linear(2, 2))
    with pytest.raises(NotALightningCheckpointError, match="lightning"):
        io.load_checkpoint(str(tmp_path / "plain_engine"))
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        io.load_checkpoint(str(tmp_path))  # a folder without latest_checkpoint.txt
    (tmp_path / "mangled.ckpt").write_text(json.dumps({"format": "ckpt-engine/lightning", "save_dir": "x"}))
    with pytest.raises(CkptEngineError, match="mangled"):
        io.load_checkpoint(str(tmp_path / "mangled.ckpt"))
    io.teardown()


def test_importing_the_integrations_package_leaves_lightning_out() -> None:
    code = (
        "import ckpt_engine, ckpt_engine.integrations, sys; print('lightning' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["False", "False"]


# -- check_exact_resume around a LightningModule -------------------------------------------------


class _Batches:
    """The data position of the manual loop below (an extra state)."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.index = state["index"]


def build_regressor() -> dict[str, Any]:
    """The fit's Regressor with the optimizer and scheduler its ``configure_optimizers`` returns."""
    torch.manual_seed(0)
    module = script.Regressor()
    configured = module.configure_optimizers()
    return {
        "model": module,
        "optimizer": configured["optimizer"],
        "scheduler": configured["lr_scheduler"],
        "extra": {"batches": _Batches()},
    }


def step_regressor(objs: dict[str, Any], i: int) -> None:
    batches = objs["extra"]["batches"]
    x, y = script.data().dataset[batches.index * 8 : batches.index * 8 + 8]
    batches.index = (batches.index + 1) % script.STEPS_PER_EPOCH
    loss = objs["model"].training_step((x, y), i)
    objs["optimizer"].zero_grad()
    loss.backward()
    objs["optimizer"].step()
    objs["scheduler"].step()


@pytest.mark.full  # three new processes, each importing lightning
def test_a_lightning_module_trained_by_hand_resumes_exactly(tmp_path: Path) -> None:
    from ckpt_engine.testing import check_exact_resume

    report = check_exact_resume(build_regressor, step_regressor, steps=7, save_at=3, workdir=tmp_path)
    report.raise_if_not_exact()
    assert report.keys_compared > 10


@pytest.mark.parametrize("tier", [False, True], ids=["save_dir", "node_local_tier"])
def test_a_fit_resumed_mid_accumulation_points_the_resaved_step_at_its_checkpoint(tmp_path: Path, tier: bool) -> None:
    """With ``accumulate_grad_batches``, ``ModelCheckpoint`` saves the step a fit resumed from
    again after its first micro-batch (it does not keep which step it saved last). In a new
    process that was a save of a committed iteration: ``CheckpointExistsError``, and the resumed
    fit crashed. The step's checkpoint stays as the run saved it and the new names point at it.
    From the node-local tier (step 3 saved there only) the IO did not take the resumed step for
    the run's: the re-save was refused on every restart."""
    import lightning as L
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint

    class StopAt3(Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 3:
                trainer.should_stop = True

    def fit(stop: bool, ckpt_path: str | None) -> int:
        torch.manual_seed(0)
        trainer = L.Trainer(
            max_steps=6,
            accumulate_grad_batches=2,
            plugins=[EngineCheckpointIO(script.config(str(tmp_path), "sync", **tier_options))],
            callbacks=[
                ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_top_k=-1, save_last=True),
                *([StopAt3()] if stop else []),
            ],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            accelerator="cpu",
            num_sanity_val_steps=0,
        )
        trainer.fit(script.Regressor(), script.data(), ckpt_path=ckpt_path)
        return int(trainer.global_step)

    tier_options = {"local_dir": str(tmp_path / "local"), "persist_every": 100} if tier else {}
    step3 = (tmp_path / "local" / "rank_00000" if tier else tmp_path / "engine") / "iter_000000003"
    assert fit(True, None) == 3
    assert tier != (tmp_path / "engine" / "iter_000000003").exists()
    manifest = (step3 / "ckpt_engine_manifest.json").read_text()
    assert fit(False, "last") == 6
    assert (step3 / "ckpt_engine_manifest.json").read_text() == manifest
    for pointer in (tmp_path / "ckpts").glob("*step=3*.ckpt"):
        got = read_pointer(pointer)
        assert got is not None and got.checkpoint == "iter_000000003", pointer
