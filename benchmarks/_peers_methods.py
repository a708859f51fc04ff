"""The checkpointers compared by peers_bench.py, each behind one small adapter (save, wait, load).

Every adapter saves the same live model (and AdamW state, for the transformer-like states) the
way that checkpointer's own documentation does it, and loads back into the same live objects.
An adapter that cannot run here raises :class:`Skip` with the reason, which lands in the table.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from _bench_methods import Skip
from torch import nn

# Where a checkpointer documents its own wait before the optimizer step, the loop calls it
# through ``Peer.guard()``; a checkpointer without one gets a no-op guard.


@dataclass
class Work:
    """The live training objects every adapter saves and loads, and where it writes."""

    model: nn.Module
    optim: torch.optim.Optimizer
    with_optim: bool  # False for the many-small-tensor state: model only (a stateless SGD)
    root: str
    extra: dict[str, Any] = field(default_factory=dict)

    def folder(self, name: str) -> str:
        path = os.path.join(self.root, name)
        os.makedirs(path, exist_ok=True)
        return path


class Peer:
    name = ""
    family = ""  # "ours", "dcp", "torchtitan", "torch_checkpointing", "safetensors"
    #: an untimed first save before the timed one (per-structure buffers, helper processes)
    warm = False
    #: the name of the row whose load this one shares (same reader, same format), or ""
    load_as = ""
    uses_dcp_daemon = False  # DCP's PROCESS executor: one daemon per process, shared
    #: why it cannot save a state sharded over several ranks ("" where it can)
    one_process_only = ""
    #: whether one instance may serve several states in turn (``setup`` again with the next
    #: state; nothing it holds is bound to one state's folder): the smoke run keeps it open
    reusable = False

    def setup(self, w: Work) -> None:
        self.w = w

    def save(self, step: int) -> Any:
        """Start (or do) the save; returns what ``.result()`` waits on, or None when done."""
        raise NotImplementedError

    def paths(self, step: int) -> list[str]:
        """The files and folders the save of ``step`` wrote."""
        raise NotImplementedError

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def load(self, step: int) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


# -- ckpt-engine -------------------------------------------------------------------------------


class Ours(Peer):
    name, family = "ours_sync", "ours"
    plugin: Any = None

    def setup(self, w: Work) -> None:
        super().setup(w)
        from ckpt_engine import CheckpointEngine

        config: dict[str, Any] = {"save_dir": w.folder(self.name)}
        if self.plugin is not None:
            config["plugins"] = [self.plugin]
        self.engine = CheckpointEngine(config)
        self.handles: dict[int, Any] = {}

    def _objs(self) -> dict[str, Any]:
        return {"model": self.w.model, "optimizer": self.w.optim if self.w.with_optim else None}

    def save(self, step: int) -> Any:
        handle = self.engine.save(step, **self._objs())
        self.handles[step] = handle
        return handle

    def paths(self, step: int) -> list[str]:
        folder = os.path.join(self.w.root, self.name)
        return [self.handles[step].path, os.path.join(folder, "latest_checkpoint.txt")]

    def load(self, step: int) -> None:
        result = self.engine.load(**self._objs())
        if result.iteration != step:
            raise RuntimeError(f"{self.name} loaded iteration {result.iteration}, not {step}")

    def close(self) -> None:
        self.engine.close()


class OursPinned(Ours):
    name, warm, load_as = "ours_pinned", True, "ours_sync"
    plugin = "pinned_staging"


class OursOverlap(Ours):
    """``overlap: true``: the next ``optimizer.step()`` waits for the copy (the engine's hook)."""

    name, warm, load_as = "ours_overlap", True, "ours_sync"
    plugin = {"name": "pinned_staging", "options": {"overlap": True}}


# -- torch.distributed.checkpoint --------------------------------------------------------------


class _AppState:
    """The DCP tutorial's ``AppState``: ``get_state_dict`` / ``set_state_dict`` behind ``Stateful``."""

    def __init__(self, w: Work) -> None:
        self.w = w

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        if not self.w.with_optim:
            return {"model": get_model_state_dict(self.w.model)}
        model_sd, optim_sd = get_state_dict(self.w.model, self.w.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

        if not self.w.with_optim:
            set_model_state_dict(self.w.model, sd["model"])
        else:
            set_state_dict(self.w.model, self.w.optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])


class Dcp(Peer):
    name, family = "dcp", "dcp"

    def _path(self, step: int) -> str:
        return os.path.join(self.w.folder(self.name), f"step-{step}")

    def paths(self, step: int) -> list[str]:
        return [self._path(step)]

    def save(self, step: int) -> Any:
        import torch.distributed.checkpoint as dcp

        dcp.save({"app": _AppState(self.w)}, checkpoint_id=self._path(step))
        return None

    def load(self, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load({"app": _AppState(self.w)}, checkpoint_id=self._path(step))


def _checkpoint_group() -> Any:
    """With several ranks, a gloo group of its own for a background save's collectives, as DCP's
    ``async_save`` documentation asks: on the default group they would interleave with the
    training step's (FSDP2's all-gathers) and hang. ``None`` (the default group) on one rank."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


class DcpAsyncThread(Dcp):
    """``dcp.async_save`` with the default thread executor: staging runs in the call."""

    name, load_as = "dcp_async_thread", "dcp"

    def setup(self, w: Work) -> None:
        super().setup(w)
        self.group = _checkpoint_group()

    def save(self, step: int) -> Any:
        import torch.distributed.checkpoint as dcp

        return dcp.async_save({"app": _AppState(self.w)}, checkpoint_id=self._path(step), process_group=self.group)


class DcpAsyncProcess(Dcp):
    """``dcp.async_save`` with the PROCESS executor and one reused ``DefaultStager`` (shared
    memory, background staging; pinned memory and non-blocking copies off: no CUDA here). The
    loop waits for ``staging_completion`` before the next optimizer step."""

    name, load_as, warm, uses_dcp_daemon = "dcp_async_process", "dcp", True, True

    def setup(self, w: Work) -> None:
        super().setup(w)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.stager = DefaultStager(StagingOptions(False, True, True, False))
        self.staging: Any = None
        self.group = _checkpoint_group()

    def save(self, step: int) -> Any:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        response = dcp.async_save(
            {"app": _AppState(self.w)},
            checkpoint_id=self._path(step),
            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
            async_stager=self.stager,
            process_group=self.group,
        )
        self.staging = response.staging_completion
        return response.upload_completion

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        if self.staging is not None:
            self.staging.result()
            self.staging = None
        yield

    def close(self) -> None:
        self.stager.close()


# -- torchtitan --------------------------------------------------------------------------------


class _FlatOptim:
    """torchtitan's ``OptimizersContainer`` contract for one optimizer: a flat, FQN-keyed state
    dict (here through DCP's public ``flatten_optimizer_state_dict``). The container itself is
    not imported: its package pulls in torchtitan's whole distributed stack."""

    def __init__(self, w: Work) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        self.w = w
        self.options = StateDictOptions(flatten_optimizer_state_dict=True)

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        if not self.w.with_optim:
            return {}
        return get_optimizer_state_dict(self.w.model, self.w.optim, options=self.options)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        if self.w.with_optim:
            set_optimizer_state_dict(self.w.model, self.w.optim, sd, options=self.options)


class _NoState:
    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def _quiet_logger(name: str) -> None:
    logging.getLogger(name).setLevel(logging.WARNING)


class Titan(Peer):
    """torchtitan 0.3 ``CheckpointManager`` (``torchtitan.components.checkpoint``)."""

    name, family, mode = "torchtitan_disabled", "torchtitan", "disabled"

    def setup(self, w: Work) -> None:
        super().setup(w)
        try:
            from torchtitan.components.checkpoint import CheckpointManager
        except ImportError as err:
            raise Skip(f"torchtitan is not installed ({err}): pip install -e '.[peers]'") from err
        _quiet_logger("torchtitan")
        config = CheckpointManager.Config(
            enable=True, folder=self.name, interval=1, keep_latest_k=0, async_mode=self.mode
        )
        self.mgr = CheckpointManager(
            config,
            dataloader=None,
            model_parts=[w.model],
            optimizers=_FlatOptim(w),  # type: ignore[arg-type]
            lr_schedulers=_NoState(),  # type: ignore[arg-type]
            states={},
            sd_adapter=None,
            base_folder=w.root,
        )
        self.configure()

    def configure(self) -> None:
        pass

    def paths(self, step: int) -> list[str]:
        folder = os.path.join(self.w.root, self.name)
        return [os.path.join(folder, f"step-{step}")]

    def save(self, step: int) -> Any:
        self.mgr.save(curr_step=step)
        return self.mgr.save_future  # None in the synchronous mode

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        self.mgr.maybe_wait_for_staging()  # torchtitan's trainer: right before optimizers.step()
        yield

    def load(self, step: int) -> None:
        if not self.mgr.load(step=step):
            raise RuntimeError(f"torchtitan found no checkpoint for step {step}")

    def close(self) -> None:
        self.mgr.maybe_wait_for_saving()
        self.mgr.close()


class TitanAsync(Titan):
    name, mode, load_as = "torchtitan_async", "async", "torchtitan_disabled"


class TitanPinned(Titan):
    """``async_with_pinned_mem``: PROCESS executor + a ``DefaultStager`` it creates on the first
    save with every option on, which asserts a CUDA device. torchtitan has no config field for
    those options, so before the first save the manager's public ``stager`` attribute is set to
    the same ``DefaultStager`` with ``use_pinned_memory`` and ``use_non_blocking_copy`` off
    (``StagingOptions(False, True, True, False)``); nothing else changes."""

    name, mode, load_as, warm, uses_dcp_daemon = (
        "torchtitan_pinned_mem",
        "async_with_pinned_mem",
        "torchtitan_disabled",
        True,
        True,
    )

    def configure(self) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if not torch.cuda.is_available():
            self.mgr.stager = DefaultStager(StagingOptions(False, True, True, False))


# -- torch_checkpointing -----------------------------------------------------------------------


class TorchCheckpointing(Peer):
    """torch_checkpointing 0.1 ``CheckpointManager`` (async default: background staging, a
    writer subprocess). Its default ``use_direct_io=True`` fails on ext4 here (EINVAL closing an
    ``O_DIRECT`` file whose size is not block-aligned), so the storage config turns it off."""

    name, family, warm, reusable = "torch_checkpointing", "torch_checkpointing", True, True
    one_process_only = (
        "saves one process's state_dict() to one path: with several ranks each would write the "
        "same files (it has no collective save of sharded state)"
    )

    def setup(self, w: Work) -> None:
        super().setup(w)
        if hasattr(self, "mgr"):  # kept open from the previous state (its writer process too)
            return
        try:
            from torch_checkpointing import CheckpointManager
            from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
        except ImportError as err:
            raise Skip(f"torch_checkpointing is not installed ({err}): pip install -e '.[peers]'") from err
        _quiet_logger("torch_checkpointing")
        storage = LocalFileSystemStorageConfig(use_direct_io=False)
        self.mgr = CheckpointManager(CheckpointManager.Config(storage_config=storage))

    def _payload(self) -> dict[str, Any]:
        out: dict[str, Any] = {"model": self.w.model.state_dict()}
        if self.w.with_optim:
            out["optim"] = self.w.optim.state_dict()
        return out

    def _path(self, step: int) -> str:
        return os.path.join(self.w.folder(self.name), f"step_{step}")

    def paths(self, step: int) -> list[str]:
        return [self._path(step)]

    def save(self, step: int) -> Any:
        return self.mgr.save(self._path(step), self._payload())

    def guard(self) -> contextlib.AbstractContextManager[Any]:
        return self.mgr.lock()  # its documented wrapper around optimizer.step()

    def load(self, step: int) -> None:
        out = self.mgr.load(self._path(step), into=self._payload())
        if self.w.with_optim:
            self.w.optim.load_state_dict(out["optim"])

    def close(self) -> None:
        self.mgr.close()


# -- safetensors -------------------------------------------------------------------------------


class Safetensors(Peer):
    """``save_file`` / ``load_file`` of one file: the model's tensors and AdamW's, the optimizer's
    hyper-parameters as JSON metadata; the load copies into the live tensors."""

    name, family = "safetensors", "safetensors"
    one_process_only = "one file from one process: no sharded (DTensor) state"

    def setup(self, w: Work) -> None:
        super().setup(w)
        try:
            import safetensors.torch as st
        except ImportError as err:
            raise Skip("safetensors is not installed (pip install safetensors)") from err
        self.st = st

    def _live(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        tensors = {f"model/{k}": v for k, v in self.w.model.state_dict().items()}
        meta: dict[str, Any] = {}
        if self.w.with_optim:
            sd = self.w.optim.state_dict()
            for pid, state in sd["state"].items():
                tensors.update({f"optim/{pid}/{k}": v for k, v in state.items()})
            meta["param_groups"] = json.dumps(sd["param_groups"])
        return tensors, meta

    def _path(self, step: int) -> str:
        return os.path.join(self.w.folder(self.name), f"step-{step}.safetensors")

    def paths(self, step: int) -> list[str]:
        return [self._path(step)]

    def save(self, step: int) -> Any:
        tensors, meta = self._live()
        self.st.save_file(tensors, self._path(step), metadata={k: str(v) for k, v in meta.items()})
        return None

    def load(self, step: int) -> None:
        live, _ = self._live()
        with torch.no_grad():
            for key, value in self.st.load_file(self._path(step)).items():
                live[key].copy_(value)


PEERS: dict[str, type[Peer]] = {
    p.name: p
    for p in (
        Ours,
        OursPinned,
        OursOverlap,
        Dcp,
        DcpAsyncThread,
        DcpAsyncProcess,
        Titan,
        TitanAsync,
        TitanPinned,
        TorchCheckpointing,
        Safetensors,
    )
}


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
