"""``EngineTrainer`` across processes: a job stopped at a checkpoint resumes in a new process, a
job killed with SIGKILL in the middle of a save resumes from the previous checkpoint, and two
ranks under ``torchrun`` (DDP, gloo) do both, and so do two ranks under accelerate's FSDP2; each ends bit
for bit where an uninterrupted run ends (parameters, optimizer state, every logged loss).

The runs are ``tests/hf_scripts/hf_train.py`` (tiny GPT-2 and Llama built from configs, dropout
on): 14 steps, a checkpoint every 3, across an epoch boundary. Every test here starts processes
(each imports torch and transformers, several seconds), so all are in the full tier. A process
runs several jobs one after the other (the script's ``+``), so the module starts few of them: one
process stops both models' jobs and then runs the job killed mid-save, a new one resumes the
stopped jobs; one ``torchrun`` launch runs the uninterrupted and the stopped DDP and FSDP2 jobs,
a second one resumes both.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import _forked
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from transformers import TrainerCallback

pytest.importorskip("transformers")

import hf_train as script
from _paths import HF_SCRIPTS
from _torchrun import run_torchrun

from ckpt_engine import RngWorldSizeError
from ckpt_engine.cli import main as cli

SCRIPT = HF_SCRIPTS / "hf_train.py"
pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """End states of uninterrupted runs in this process."""
    out = {}
    for model in ("gpt2", "llama"):
        trainer = script.trainer(str(tmp_path_factory.mktemp(f"reference-{model}")), model)
        trainer.train()
        out[model] = script.end_state(trainer)
    return out


#: What the fork server imports once for the script's processes: transformers and its Trainer
#: (7 CPU-s a process on the 2-core machine, against 0.2 for the script's own imports after it).
HF = ("ckpt_engine.integrations.transformers",)


def _args(*jobs: Sequence[str | Path]) -> list[str]:
    """The script's arguments for ``jobs`` (each ``ROOT MODEL MODE [STEP]``), run one after the other."""
    out: list[str] = []
    for job in jobs:
        out += [*(["+"] if out else []), *map(str, job)]
    return out


def _run(*jobs: Sequence[str | Path]) -> None:
    env = {"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = _forked.run(SCRIPT, *_args(*jobs), env=env, timeout=300, preload=HF)
    assert proc.returncode == 0 and "FINISHED" in proc.stdout, proc.stderr[-4000:]


def _result(root: Path, rank: int = 0) -> dict[str, Any]:
    loaded: dict[str, Any] = torch.load(root / f"result-{rank}.pt", weights_only=True)
    return loaded


MODELS = ("gpt2", "llama")
KILL_AT = 9


def _latest(root: Path) -> str:
    return (root / "checkpoints" / "latest_checkpoint.txt").read_text().strip()


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process stops a job of each model after the save of step 6, then runs a ``gpt2`` job
    that is killed with SIGKILL in the save of :data:`KILL_AT`; a new process resumes the stopped
    jobs. Their folders by model (``kill``: the killed job's), and what ``latest`` named after the stop."""
    root = tmp_path_factory.mktemp("jobs")
    folders = {name: root / name for name in (*MODELS, "kill")}
    stops = [(folders[model], model, "stop", 6) for model in MODELS]
    _run_until_killed(folders["kill"], "kill", KILL_AT, before=stops)
    latest = {model: _latest(folders[model]) for model in MODELS}
    _run(*[(folders[model], model, "resume") for model in MODELS])
    return {"folders": folders, "latest_after_stop": latest}


@pytest.mark.parametrize("model", MODELS)
def test_stopped_at_a_checkpoint_then_resumed_in_a_new_process_is_bit_identical(
    jobs: dict[str, Any], reference: dict[str, dict[str, Any]], model: str
) -> None:
    assert jobs["latest_after_stop"][model] == "iter_000000006"
    script.assert_same(_result(jobs["folders"][model]), reference[model])


def _run_until_killed(root: Path, mode: str, kill_at: int, before: Sequence[Sequence[str | Path]] = ()) -> None:
    """Run a job (after the jobs ``before``, in the same process) and SIGKILL its process group
    during the save of ``kill_at``. Bounded by progress: the child reports ``MIDSAVE`` or exits."""
    proc = _forked.popen(
        SCRIPT,
        *_args(*before, (root, "gpt2", mode, kill_at)),
        stdout=_forked.PIPE,
        stderr=_forked.PIPE,
        env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""},
        preload=HF,
    )
    assert proc.stdout is not None and proc.stderr is not None
    err: list[str] = []
    drain = threading.Thread(target=lambda: err.extend(proc.stderr or []), daemon=True)
    drain.start()
    try:
        for line in proc.stdout:
            if line.startswith("MIDSAVE"):
                assert line.split() == ["MIDSAVE", str(kill_at)]
                os.killpg(proc.pid, signal.SIGKILL)
                break
        else:
            proc.wait()
            drain.join(5)
            pytest.fail(f"the job ended (rc={proc.returncode}) without reaching the save of {kill_at}:\n{''.join(err)}")
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group may already be gone
            os.killpg(proc.pid, signal.SIGKILL)
        proc.close()
    assert proc.returncode == -signal.SIGKILL


SLOW = pytest.mark.skipif(
    not os.environ.get("CKPT_ENGINE_SLOW_TESTS"),
    reason="a pinned_staging writer start-up in the killed job and in the resume: set CKPT_ENGINE_SLOW_TESTS=1; "
    "background saves run by default in test_transformers.py::test_pinned_staging_saves_in_the_background_...",
)


@pytest.mark.parametrize("mode", ["kill", pytest.param("kill-async", marks=[pytest.mark.slow, SLOW])])
def test_sigkill_mid_save_leaves_the_previous_checkpoint_resumable(
    tmp_path: Path, jobs: dict[str, Any], reference: dict[str, dict[str, Any]], mode: str
) -> None:
    if mode == "kill":
        tmp_path = jobs["folders"]["kill"]  # killed by the fixture, after the stopped jobs
    else:
        _run_until_killed(tmp_path, mode, kill_at=KILL_AT)
    save_dir = tmp_path / "checkpoints"
    latest = (save_dir / "latest_checkpoint.txt").read_text().strip()
    if mode == "kill":
        # killed after the model component of step 9 was written, before the commit
        assert latest == "iter_000000006"
        assert (save_dir / ".iter_000000009.partial" / "model" / ".metadata").exists()
        assert not (save_dir / "iter_000000009").exists()
    else:
        assert latest in ("iter_000000006", "iter_000000009")  # the background writer may have committed
    resumed = script.trainer(str(tmp_path), engine={"plugins": ["pinned_staging"]} if mode != "kill" else None)
    resumed.train(resume_from_checkpoint=True)
    script.assert_same(script.end_state(resumed), reference["gpt2"])
    assert (save_dir / "latest_checkpoint.txt").read_text().strip() == "iter_000000014"
    assert not list(save_dir.glob(".iter_*"))  # the killed save's leftovers were cleaned up
    assert cli(["verify", str(save_dir)]) == 0


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two ranks under ``torchrun``: one launch trains uninterrupted and stopped-after-step-6 jobs
    of ``gpt2`` (DDP) and ``gpt2-fsdp2``, a second launch resumes the stopped ones. The folders by
    ``(model, "full" | "stopped")``, and the stopped FSDP2 job's end states at the stop, by rank."""
    root = tmp_path_factory.mktemp("two-ranks")
    models = ("gpt2", "gpt2-fsdp2")
    folders = {(model, run): root / model / run for model in models for run in ("full", "stopped")}
    first = _args(
        *[job for m in models for job in ((folders[m, "full"], m, "full"), (folders[m, "stopped"], m, "stop", 6))]
    )
    second = _args(*[(folders[m, "stopped"], m, "resume") for m in models])
    result = run_torchrun(str(SCRIPT), *first, nproc=2, timeout=480, preload=HF)
    assert result.returncode == 0, result.describe()
    at_stop = {rank: _result(folders["gpt2-fsdp2", "stopped"], rank) for rank in (0, 1)}
    result = run_torchrun(str(SCRIPT), *second, nproc=2, timeout=300, preload=HF)
    assert result.returncode == 0, result.describe()
    return {"folders": folders, "fsdp2_at_stop": at_stop}


@pytest.mark.dist
def test_two_ranks_under_torchrun_stop_and_resume_bit_identical(two_ranks: dict[str, Any]) -> None:
    full, stopped = two_ranks["folders"]["gpt2", "full"], two_ranks["folders"]["gpt2", "stopped"]
    for rank in (0, 1):
        script.assert_same(_result(stopped, rank), _result(full, rank))
    script.assert_same(_result(full, 0), _result(full, 1))  # DDP kept the replicas equal
    assert cli(["verify", str(stopped / "checkpoints"), "--level", "checksums"]) == 0
    # each rank's random state is in the checkpoint: one process cannot resume it as rank 0 of 2
    with pytest.raises(RngWorldSizeError, match="holds the random state of 2 rank"):
        script.trainer(str(stopped), engine={"allow_overwrite": True}).train(resume_from_checkpoint=True)
    one = script.trainer(str(stopped), engine={"allow_overwrite": True, "keys_not_to_resume": ["rng"]})
    one.train(resume_from_checkpoint=str(stopped / "checkpoints" / "iter_000000006"))
    assert one.state.global_step == script.STEPS


class _ParamsAtStart(TrainerCallback):
    """Keeps the model's parameters when training begins (after a resume has loaded them)."""

    params: dict[str, torch.Tensor] | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> Any:
        self.params = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return control


@pytest.mark.dist
def test_fsdp2_two_ranks_save_sharded_and_resume_bit_identical_and_on_one_rank(two_ranks: dict[str, Any]) -> None:
    """accelerate's FSDP2 (``fsdp_version: 2``): the model's parameters are DTensor shards, the
    optimizer is built by the Trainer after accelerate shards the model. Every rank writes its own
    shards; a new launch resumes bit-identical; one process resumes the 2-rank checkpoint.
    On CPU ranks accelerate drops FSDP (see ``hf_train.fsdp2_on_cpu``); the GPU run is
    ``test_fsdp2_on_a_gpu_stop_and_resume_bit_identical``."""
    full, stopped = two_ranks["folders"]["gpt2-fsdp2", "full"], two_ranks["folders"]["gpt2-fsdp2", "stopped"]
    at_stop: dict[int, dict[str, Any]] = two_ranks["fsdp2_at_stop"]
    for rank in (0, 1):
        script.assert_same(_result(stopped, rank), _result(full, rank))
        assert _result(full, rank)["sharded"] and _result(stopped, rank)["sharded"]
    script.assert_same(_result(full, 0), _result(full, 1))
    checkpoint = stopped / "checkpoints" / "iter_000000006"
    for component in ("model", "optim"):  # sharded: each rank wrote half of every block's weight
        meta = dcp.FileSystemReader(str(checkpoint / component)).read_metadata()
        items = meta.state_dict_metadata.items()
        chunks = [m.chunks for k, m in items if "h.0.attn.c_attn.weight" in k and isinstance(m, TensorStorageMetadata)]
        chunks = [c for c in chunks if c[0].sizes.numel() > 1]  # not the optimizer's step counter
        assert chunks and all(len(c) == 2 for c in chunks), (component, chunks)
    assert cli(["verify", str(stopped / "checkpoints"), "--level", "checksums"]) == 0
    # 2 -> 1: one process (no FSDP) resumes the 2-rank sharded checkpoint, the weights whole
    start = _ParamsAtStart()
    one = script.trainer(str(stopped), engine={"allow_overwrite": True, "keys_not_to_resume": ["rng"]})
    one.add_callback(start)
    one.train(resume_from_checkpoint=str(checkpoint))
    assert start.params is not None and start.params.keys() == at_stop[0]["model"].keys()
    for key, value in at_stop[0]["model"].items():
        assert torch.equal(start.params[key], value), key
    assert one.state.global_step == script.STEPS


@pytest.mark.cuda
def test_fsdp2_on_a_gpu_stop_and_resume_bit_identical(tmp_path: Path) -> None:
    """accelerate's own FSDP2 on CUDA, nothing lifted (one rank under torchrun, NCCL,
    ``full_determinism``): stopped at step 6, resumed in a new launch, bit-identical to an
    uninterrupted run (run by scripts/gpu_check.sh)."""
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    for root, args in ((full, ["full"]), (stopped, ["stop", "6"]), (stopped, ["resume"])):
        cmd = [*launcher, str(SCRIPT), str(root), "gpt2-fsdp2", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0 and "FINISHED" in done.stdout, done.stdout[-3000:] + done.stderr[-6000:]
    script.assert_same(_result(stopped), _result(full))
    assert _result(full)["sharded"] and _result(stopped)["sharded"]  # accelerate did shard the model
    assert cli(["verify", str(stopped / "checkpoints"), "--level", "checksums"]) == 0
