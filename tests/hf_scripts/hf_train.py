"""A tiny deterministic Hugging Face Trainer run through ``EngineTrainer`` (run by ``tests/integrations/``).

Imported by the tests for in-process runs, and run as a script in a new process (under
``torchrun`` too) to stop, resume, or be killed with SIGKILL in the middle of a save:

    python tests/hf_scripts/hf_train.py ROOT MODEL MODE [STEP] [+ ROOT MODEL MODE [STEP] ...]

Several jobs joined by ``+`` run one after the other in the one process (one start-up of torch
and transformers for all, fresh objects for each); a ``kill`` job comes last.

``MODEL`` is ``gpt2``, ``llama`` (tiny configs, built from scratch, dropout on so the random
state matters) or ``lora`` (``gpt2`` with a ``peft`` LoRA adapter); ``gpt2-fsdp2`` trains ``gpt2``
under accelerate's FSDP2 (``fsdp_version: 2``, each ``GPT2Block`` and the model sharded), on the
GPU where there is one, else on CPU ranks (see :func:`fsdp2_on_cpu`). The run trains to
:data:`STEPS` steps, a checkpoint every :data:`SAVE_EVERY` into ``ROOT/checkpoints`` (the engine's
save_dir), across an epoch boundary. ``MODE``:

* ``full``: train to the end; ``stop``: stop after the save of ``STEP`` (an interrupted job);
  ``resume``: ``train(resume_from_checkpoint=True)``;
* ``kill``: during the save of ``STEP``, after its ``model`` component is written and before the
  commit, print ``MIDSAVE <step>`` and wait to be killed; ``kill-async``: the same with
  ``pinned_staging``, right after ``save()`` returned while the background writer writes.

The end state (parameters, optimizer state, the loss log) goes to ``ROOT/result-<rank>.pt``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from hf_models import SAMPLES as SAMPLES
from hf_models import VOCAB as VOCAB
from hf_models import Tokens as Tokens
from hf_models import build_model as build_model
from torch.distributed.tensor import DTensor
from transformers import TrainerCallback, TrainingArguments

from ckpt_engine import WriteContext, WriteResult, hookimpl
from ckpt_engine.defaults import DefaultIO
from ckpt_engine.integrations.transformers import EngineTrainer

STEPS = 14
SAVE_EVERY = 3


class StopAfterSave(TrainerCallback):
    """Ends training right after the checkpoint of ``step`` is saved: a job stopped at a checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def fsdp2_args() -> dict[str, Any]:
    """``TrainingArguments`` overrides that train under accelerate's FSDP2. On CUDA the run is
    fully deterministic (``full_determinism``), so a resume can be compared bit for bit."""
    config = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"], "reshard_after_forward": True}
    cuda = torch.cuda.is_available()
    return {"fsdp": True, "fsdp_config": config, "use_cpu": not cuda, "full_determinism": cuda}


def fsdp2_on_cpu() -> None:
    """Let accelerate run FSDP2 on CPU (gloo) ranks, as it runs it on GPUs.

    accelerate 1.16 applies the FSDP plugin only to accelerator ranks: ``AcceleratorState``
    (accelerate/state.py) sets ``DistributedType.FSDP`` and keeps ``fsdp_plugin`` only when the
    process state is ``MULTI_GPU`` (or another ``MULTI_<accelerator>``); on ``MULTI_CPU`` it drops
    the plugin without a word, and the Trainer trains plain DDP (``is_fsdp_enabled`` is False).
    ``fully_shard`` itself runs on CPU with gloo, so the test marks the process state ``MULTI_GPU``
    after ``TrainingArguments`` set it up (it resets accelerate's state) and before the Trainer
    builds its ``Accelerator``. Everything after that is accelerate's and the Trainer's own FSDP2
    path (``fsdp2_prepare_model``, the optimizer switched to the DTensor parameters). Only the CPU
    runs need it; ``scripts/gpu_check.sh`` runs the same on CUDA without it.
    """
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True)  # the one TrainingArguments set up
    if state.distributed_type == DistributedType.MULTI_CPU:
        PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU


def training_args(root: str, **overrides: Any) -> TrainingArguments:
    options: dict[str, Any] = {
        "output_dir": os.path.join(root, "out"),
        "max_steps": STEPS,
        "per_device_train_batch_size": 4,
        "save_steps": SAVE_EVERY,
        "logging_steps": 1,
        "learning_rate": 1e-3,
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
        "ddp_find_unused_parameters": False,
        **overrides,
    }
    return TrainingArguments(**options)


def trainer(
    root: str,
    model: str = "gpt2",
    *,
    stop_at: int | None = None,
    engine: dict[str, Any] | None = None,
    plugins: Sequence[Any] = (),
    cls: type[EngineTrainer] = EngineTrainer,
    eval_dataset: Tokens | None = None,
    fsdp2: bool = False,
    **overrides: Any,
) -> EngineTrainer:
    """An :class:`EngineTrainer` over a fresh tiny model, saving into ``ROOT/checkpoints``;
    ``fsdp2``: under accelerate's FSDP2 (run under ``torchrun``)."""
    torch.set_num_threads(1)
    args = training_args(root, **(fsdp2_args() if fsdp2 else {}), **overrides)  # sets up the process state
    if fsdp2 and not torch.cuda.is_available():
        fsdp2_on_cpu()
    config = {"save_dir": os.path.join(root, "checkpoints"), **(engine or {})}
    return cls(
        model=build_model(model),
        args=args,
        train_dataset=Tokens(),
        eval_dataset=eval_dataset,
        callbacks=[StopAfterSave(stop_at)] if stop_at is not None else [],
        engine_config=config,
        engine_plugins=plugins,
    )


def losses(trainer: EngineTrainer) -> list[dict[str, Any]]:
    """The per-step log entries (the summary entry with run times left out)."""
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def _full(value: Any) -> Any:
    """``value`` with every (FSDP2-sharded) ``DTensor`` gathered into a whole CPU tensor (collective)."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().cpu().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _full(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_full(v) for v in value]
    return value


def end_state(trainer: EngineTrainer) -> dict[str, Any]:
    """What a resumed run must reproduce bit for bit: parameters, optimizer state, loss log
    (whole tensors on CPU, also under FSDP2: every rank calls it)."""
    optimizer = trainer.optimizer
    inner = getattr(optimizer, "optimizer", optimizer)
    return {
        "model": _full(trainer.model.state_dict()),
        "optim": _full(inner.state_dict()),
        "log": losses(trainer),
        "global_step": trainer.state.global_step,
        "sharded": isinstance(next(trainer.model.parameters()), DTensor),  # trained under FSDP2
    }


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    """``a`` and ``b`` are bit-identical end states."""
    assert a["global_step"] == b["global_step"]
    assert a["model"].keys() == b["model"].keys()
    for key, value in a["model"].items():
        assert torch.equal(value, b["model"][key]), key
    sa, sb = a["optim"]["state"], b["optim"]["state"]
    assert sa.keys() == sb.keys() and sa
    for index, state in sa.items():
        assert state.keys() == sb[index].keys()
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(sb[index][name])), (index, name)
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    assert a["log"] == b["log"]


class StopMidWrite:
    """A ``write`` provider that is the engine's own, except that at ``iteration`` it stops after
    the ``model`` component is written, before the commit, and waits to be killed."""

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


class StopAfterAsyncSave(EngineTrainer):
    """Stops right after the background save of ``stop_at`` was handed off (the writer goes on)."""

    stop_at = -1

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        super()._save_checkpoint(model, trial)
        if self.state.global_step == self.stop_at:
            _stop(self.stop_at)


def _stop(step: int) -> None:
    print(f"MIDSAVE {step}", flush=True)
    time.sleep(600)  # the test kills the process group here
    os._exit(3)


def run_job(root: str, model: str, mode: str, step: int | None) -> None:
    """One job: train ``model`` into ``root`` as ``mode`` says and write its end state."""
    fsdp2 = model.endswith("-fsdp2")
    model = model.removesuffix("-fsdp2")
    if mode == "kill":
        assert step is not None
        run = trainer(root, model, plugins=[StopMidWrite(step)])
    elif mode == "kill-async":
        StopAfterAsyncSave.stop_at = step if step is not None else -1
        run = trainer(root, model, engine={"plugins": ["pinned_staging"]}, cls=StopAfterAsyncSave)
    else:
        run = trainer(root, model, stop_at=step if mode == "stop" else None, fsdp2=fsdp2)
    run.train(resume_from_checkpoint=True if mode == "resume" else None)
    rank = int(os.environ.get("RANK", "0"))
    torch.save(end_state(run), os.path.join(root, f"result-{rank}.pt"))


def jobs(argv: Sequence[str]) -> list[tuple[str, str, str, int | None]]:
    """``ROOT MODEL MODE [STEP]`` groups of ``argv``, joined by ``+``."""
    out: list[tuple[str, str, str, int | None]] = []
    words = list(argv)
    while words:
        cut = words.index("+") if "+" in words else len(words)
        group, words = words[:cut], words[cut + 1 :]
        root, model, mode = group[:3]
        out.append((root, model, mode, int(group[3]) if len(group) > 3 else None))
    return out


def main() -> None:
    todo = jobs(sys.argv[1:])
    if any(mode.startswith("kill") for _, _, mode, _ in todo):
        os.setpgid(0, 0)  # the test kills the whole group: pinned_staging's writer process dies with us
    for job in todo:
        run_job(*job)
    print("FINISHED", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
