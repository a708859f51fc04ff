"""``pinned_staging`` with ``overlap: true``: the snapshot copy runs behind the next forward and
backward pass, the next ``optimizer.step()`` waits for it, and a tensor changed before it was
copied fails that save with ``SnapshotChangedError`` instead of tearing the checkpoint.

Real training loops (BatchNorm, AdamW, a scheduler, a grad scaler), real writer processes, real
DCP checkpoints; the SIGKILL test kills a real process during an overlapped copy, and the FSDP2
variant runs 2 gloo ranks under torchrun (marker ``dist``).
"""

from __future__ import annotations

import copy
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _forked
import pytest
import torch
from _paths import CRASH_SCRIPTS
from _torchrun import run_torchrun
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin, SnapshotChangedError
from torch import nn

from ckpt_engine import CheckpointEngine, CheckpointSaveError
from ckpt_engine.testing import assert_state_dicts_equal

CRASH_SCRIPT = CRASH_SCRIPTS / "overlap_kill.py"


class Trainer:
    """A BatchNorm model with AdamW, StepLR and a grad scaler, trained on fixed random batches."""

    def __init__(self, seed: int = 0, width: int = 64) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(width, width), nn.BatchNorm1d(width), nn.ReLU(), nn.Linear(width, 4))
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.optim, step_size=2, gamma=0.5)
        self.scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        self.width = width
        self.steps = 0

    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optim, "scheduler": self.sched, "grad_scaler": self.scaler}

    def forward_backward(self) -> None:
        gen = torch.Generator().manual_seed(1000 + self.steps)
        out = self.model(torch.randn(16, self.width, generator=gen))
        self.scaler.scale(out.square().mean()).backward()

    def step(self) -> None:
        self.forward_backward()
        self.scaler.step(self.optim)
        self.scaler.update()
        self.sched.step()
        self.optim.zero_grad()
        self.steps += 1

    def snapshot(self) -> dict[str, Any]:
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optim": copy.deepcopy(self.optim.state_dict()),
            "scheduler": copy.deepcopy(self.sched.state_dict()),
            "scaler": copy.deepcopy(self.scaler.state_dict()),
        }


def loaded(path: Path, tmp: Path, width: int = 64) -> dict[str, Any]:
    """Everything the checkpoint at ``path`` holds, loaded into a fresh trainer."""
    fresh = Trainer(seed=123, width=width)
    config = {"save_dir": str(tmp / "unused"), "load_path": str(path), "load_training_state": True}
    with CheckpointEngine(config) as engine:
        engine.load(**fresh.objects())
    return fresh.snapshot()


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[CheckpointEngine]:
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(overlap=True, close_timeout_s=60))
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}, plugins=[plugin]) as eng:
        yield eng


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_every_overlapped_checkpoint_is_the_state_at_its_save(engine: CheckpointEngine, tmp_path: Path) -> None:
    trainer = Trainer()
    expected: dict[int, dict[str, Any]] = {}
    handles = []
    for i in range(1, 9):
        trainer.step()
        if i % 3 == 0:
            expected[i] = trainer.snapshot()
            handles.append(engine.save(i, **trainer.objects()))
            # The next forward pass changes BatchNorm's running stats while the copy may still
            # run: buffers are copied inside save(), parameters behind it.
    results = [h.result() for h in handles]
    for result in results:
        assert result.succeeded and result.background_copy_seconds > 0
        assert result.loop_wait_seconds == result.blocked_seconds + result.step_wait_seconds
    assert not trainer.optim._optimizer_step_pre_hooks  # the guard is gone once the copy is done
    assert not trainer.optim._optimizer_step_post_hooks
    for i, want in expected.items():
        assert_state_dicts_equal(loaded(tmp_path / "ckpt" / f"iter_{i:09}", tmp_path), want)


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_the_step_hook_waits_for_the_copy_then_removes_itself(engine: CheckpointEngine) -> None:
    trainer = Trainer(width=256)
    trainer.step()
    handle = engine.save(1, **trainer.objects())
    assert len(trainer.optim._optimizer_step_pre_hooks) == 1
    trainer.step()  # the hook waits for the copy, confirms it and leaves
    assert not trainer.optim._optimizer_step_pre_hooks
    assert not trainer.optim._optimizer_step_post_hooks
    handle.wait_staged(timeout=0)  # complete: returns at once
    assert handle.result().succeeded


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_an_edit_right_after_save_fails_that_save_with_the_key_and_the_fix(
    engine: CheckpointEngine, tmp_path: Path
) -> None:
    trainer = Trainer()
    trainer.step()
    engine.save(1, **trainer.objects()).result()
    handle = engine.save(2, **trainer.objects())
    with torch.no_grad():
        trainer.model[0].weight.mul_(2.0)  # a weight edit outside the optimizer, before the copy is confirmed
    with pytest.raises(SnapshotChangedError, match=r"model: 0\.weight .*wait_staged\(\)"):
        handle.wait_staged()
    with pytest.raises(CheckpointSaveError, match=r"0\.weight was changed in place"):
        handle.result()
    assert (tmp_path / "ckpt" / "latest_checkpoint.txt").read_text() == "iter_000000001\n"
    assert not (tmp_path / "ckpt" / "iter_000000002").exists()
    with pytest.raises(CheckpointSaveError):
        engine.wait()  # reported like any failed async save
    trainer.step()  # the failed snapshot's hook is harmless and goes away
    assert not trainer.optim._optimizer_step_pre_hooks


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_a_failure_seen_through_wait_staged_is_not_raised_again_by_close(tmp_path: Path) -> None:
    """wait_staged() raising is the caller seeing the failure, as result() raising is: the saves
    after it go on, and close() does not raise it a second time."""
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(overlap=True, close_timeout_s=60))
    engine = CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}, plugins=[plugin])
    trainer = Trainer()
    trainer.step()
    handle = engine.save(1, **trainer.objects())
    with torch.no_grad():
        trainer.model[0].weight.mul_(2.0)
    with pytest.raises(SnapshotChangedError):
        handle.wait_staged()
    trainer.step()
    assert engine.save(2, **trainer.objects()).result().succeeded
    engine.close()  # raised the SnapshotChangedError of iteration 1 again before
    assert (tmp_path / "ckpt" / "latest_checkpoint.txt").read_text() == "iter_000000002\n"


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_an_edit_after_wait_staged_never_reaches_the_checkpoint(engine: CheckpointEngine, tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.step()
    want = trainer.snapshot()
    handle = engine.save(1, **trainer.objects())
    handle.wait_staged()
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.fill_(-7.0)
        trainer.optim.state[trainer.model[0].weight]["exp_avg"].fill_(-7.0)
    assert handle.result().succeeded
    assert_state_dicts_equal(loaded(tmp_path / "ckpt" / "iter_000000001", tmp_path), want)


def test_an_edit_racing_the_copy_is_exact_or_a_typed_error(engine: CheckpointEngine, tmp_path: Path) -> None:
    trainer = Trainer(width=512)
    trainer.step()
    for i in range(1, 4):
        want = trainer.snapshot()
        handle = engine.save(i, **trainer.objects())
        with torch.no_grad():
            trainer.optim.state[trainer.model[3].weight]["exp_avg"].add_(1.0)  # the last tensors copied
        try:
            handle.result()
        except CheckpointSaveError as err:
            assert isinstance(err.__cause__, SnapshotChangedError), err
            assert "optim: state.3.weight.exp_avg" in str(err)
            with pytest.raises(CheckpointSaveError):
                engine.wait()  # the engine reports a failed save once more, then forgets it
        else:
            assert_state_dicts_equal(loaded(tmp_path / "ckpt" / f"iter_{i:09}", tmp_path, 512), want)
        trainer.step()


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_without_overlap_wait_staged_returns_at_once_and_nothing_is_hooked(tmp_path: Path) -> None:
    trainer = Trainer()
    trainer.step()
    with CheckpointEngine({"save_dir": str(tmp_path), "plugins": ["pinned_staging"]}) as engine:
        handle = engine.save(1, **trainer.objects())
        handle.wait_staged(timeout=0)
        assert not trainer.optim._optimizer_step_pre_hooks
        result = handle.result()
    assert result.step_wait_seconds == 0.0 and result.background_copy_seconds == 0.0
    assert result.loop_wait_seconds == result.blocked_seconds


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_an_exception_in_training_while_a_copy_is_pending_never_hangs(tmp_path: Path) -> None:
    trainer = Trainer(width=256)
    trainer.step()
    want = trainer.snapshot()
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(overlap=True, close_timeout_s=60))
    config = {"save_dir": str(tmp_path / "ckpt")}
    with pytest.raises(RuntimeError, match="diverged"), CheckpointEngine(config, plugins=[plugin]) as engine:
        engine.save(1, **trainer.objects())
        raise RuntimeError("loss diverged")
    # close() confirmed the snapshot (nothing stepped since save) and committed it.
    assert (tmp_path / "ckpt" / "latest_checkpoint.txt").read_text() == "iter_000000001\n"
    assert_state_dicts_equal(loaded(tmp_path / "ckpt" / "iter_000000001", tmp_path, 256), want)


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_sigkill_during_an_overlapped_copy_leaves_latest_on_the_previous_checkpoint(tmp_path: Path) -> None:
    from overlap_kill import state_at

    save_dir = tmp_path / "ckpt"
    # A forked child: torch imported once, by the fork server (tests/_forked.py).
    with _forked.popen(CRASH_SCRIPT, str(save_dir), stdout=_forked.PIPE) as proc:
        assert proc.stdout is not None
        lines = []
        try:
            for line in proc.stdout:
                lines.append(line.strip())
                if line.startswith("STAGING"):
                    os.killpg(proc.pid, signal.SIGKILL)  # while the copy (or the write) of save 2 runs
                    break
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert lines == ["COMMITTED 1", "STAGING 2"], lines
    latest = (save_dir / "latest_checkpoint.txt").read_text().strip()
    assert latest in ("iter_000000001", "iter_000000002")  # 2 only if it was fully committed
    iteration = int(latest.removeprefix("iter_"))
    torch.set_num_threads(1)
    want = state_at(iteration)
    from overlap_kill import make

    model, optim = make()
    config = {"save_dir": str(save_dir), "verify": "checksums"}
    with CheckpointEngine(config) as engine:
        result = engine.load(model=model, optimizer=optim)
    assert result.iteration == iteration and result.verified
    assert_state_dicts_equal({"model": model.state_dict(), "optim": optim.state_dict()}, want)


@pytest.mark.dist
def test_fsdp2_overlap_saves_are_exact_and_an_edit_on_one_rank_fails_the_save_everywhere(tmp_path: Path) -> None:
    from _common import make_model

    save_dir = tmp_path / "ckpt"
    run = run_torchrun("overlap_fsdp_save.py", str(save_dir), nproc=2, timeout=150.0)
    assert run.returncode == 0, run.describe()
    ranks = {rank: payloads[0] for rank, payloads in run.results().items()}
    assert sorted(ranks) == [0, 1], run.describe()
    for rank, report in ranks.items():
        assert [s["succeeded"] for s in report["saves"]] == [True, True], (rank, report)
        assert [s["hooks_left"] for s in report["saves"]] == [0, 0]
        assert all(s["background_copy"] > 0 for s in report["saves"])
        assert not report["reported_again"] and report["recovered"]["succeeded"]  # the next save proceeds
    assert "SnapshotChangedError" in ranks[1]["failure"] and "was changed in place" in ranks[1]["failure"]
    assert ranks[0]["failure"] is not None and "rank 1: pinned_staging (overlap)" in ranks[0]["failure"]
    assert (save_dir / "latest_checkpoint.txt").read_text() == "iter_000000005\n"
    assert not [p.name for p in save_dir.iterdir() if "iter_000000004" in p.name]
    for saved in ranks[0]["saves"]:
        model = make_model(seed=5)
        optim = torch.optim.AdamW(model.parameters(), lr=0.1)
        path = save_dir / f"iter_{saved['iteration']:09}"
        config = {"save_dir": str(tmp_path / "unused"), "load_path": str(path), "load_training_state": True}
        with CheckpointEngine(config) as engine:
            engine.load(model=model, optimizer=optim)
        for name, param in model.named_parameters():
            assert torch.equal(param.detach(), torch.tensor(saved["params"][name])), name
            exp_avg = torch.tensor(saved["exp_avg"][name])
            assert torch.equal(optim.state[param]["exp_avg"], exp_avg), name


@pytest.mark.cuda
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_training_loop_checkpoints_are_bit_exact(tmp_path: Path, overlap: bool) -> None:
    trainer = Trainer(width=1024)
    trainer.model.cuda()
    trainer.optim = torch.optim.AdamW(trainer.model.parameters(), lr=1e-2)
    trainer.sched = torch.optim.lr_scheduler.StepLR(trainer.optim, step_size=2, gamma=0.5)
    trainer.scaler = torch.amp.GradScaler("cuda", init_scale=256.0)

    def forward_backward() -> None:
        gen = torch.Generator(device="cuda").manual_seed(1000 + trainer.steps)
        out = trainer.model(torch.randn(16, trainer.width, generator=gen, device="cuda"))
        trainer.scaler.scale(out.square().mean()).backward()

    trainer.forward_backward = forward_backward  # type: ignore[method-assign]
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(overlap=overlap))
    expected, handles = {}, []
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}, plugins=[plugin]) as engine:
        for i in range(1, 7):
            trainer.step()
            if i % 2 == 0:
                expected[i] = {k: v.cpu() for k, v in trainer.model.state_dict().items()}
                handles.append(engine.save(i, **trainer.objects()))
        assert all(h.result().succeeded for h in handles)
    assert not trainer.optim._optimizer_step_pre_hooks
    for i, want in expected.items():
        fresh = Trainer(seed=9, width=1024)
        config = {"save_dir": str(tmp_path / "x"), "load_path": str(tmp_path / "ckpt" / f"iter_{i:09}")}
        with CheckpointEngine(config) as engine:
            engine.load(model=fresh.model)
        assert_state_dicts_equal(fresh.model.state_dict(), want)
