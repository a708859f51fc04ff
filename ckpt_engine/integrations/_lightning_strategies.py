"""Which Lightning strategies ``EngineCheckpointIO`` runs under, how each reaches the engine on
every rank, and the refusal of the others when the ``Trainer`` is built.

Lightning saves through a ``CheckpointIO`` on global rank 0 alone (``Strategy.save_checkpoint``
is guarded by ``is_global_zero``), while an engine save is collective: every rank writes its
part and the ranks agree on the commit. Lightning's own sharded checkpoints therefore bypass the
``CheckpointIO`` one level up, in ``ModelParallelStrategy.save_checkpoint``, which runs on every
rank; this module does the same for the engine. :func:`install` wraps the setter of
``Strategy.checkpoint_io``, through which Lightning connects its plugins to the strategy while the
``Trainer`` is built, so that the integration sees the strategy then; :func:`connect` chooses,
once, how the IO runs under it:

* a single-device strategy (:class:`OneProcess`): Lightning's own calls are right;
* DDP, ``strategy="ddp"`` (:class:`DataParallel`): the strategy's ``save_checkpoint`` and
  ``load_checkpoint`` call the IO on every rank; every rank gives its checkpoint dict, and the
  engine writes what is replicated once, from global rank 0, so the checkpoint holds rank 0's
  values as Lightning's own would;
* ``ModelParallelStrategy``, FSDP2 and DTensor (:class:`ModelParallel`): the same, the
  DTensors written as each rank's shards; a load reads into the live model's and optimizers'
  DTensors and sets them (``set_model_state_dict``, ``set_optimizer_state_dict``), as
  Lightning's own sharded load does;
* anything else raises :class:`UnsupportedStrategyError`, one line naming the fix.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.strategies import (
    DDPStrategy,
    DeepSpeedStrategy,
    FSDPStrategy,
    ModelParallelStrategy,
    SingleDeviceStrategy,
    Strategy,
)
from lightning.pytorch.strategies.xla import XLAStrategy

from ..errors import CheckpointLoadError, CkptEngineError

__all__ = [
    "Connection",
    "DataParallel",
    "IOCalls",
    "ModelParallel",
    "OneProcess",
    "UnsupportedStrategyError",
    "connect",
    "install",
]


class UnsupportedStrategyError(CkptEngineError, RuntimeError):
    """``EngineCheckpointIO`` was given to a strategy it cannot save under (raised while the
    ``Trainer`` is built), or is called by one rank of a job of several without a strategy that
    calls it on every rank; the message names the fix (``docs/integrations.md``)."""


@dataclass(frozen=True)
class IOCalls:
    """What a :class:`Connection` calls on its ``EngineCheckpointIO``, on every rank."""

    #: ``(checkpoint, path, storage_options, agree)``: one collective save; ``agree(flag)`` is
    #: true on every rank when ``flag`` is true on any.
    save: Callable[[dict[str, Any], Any, Any, Callable[[bool], bool]], None]
    #: ``(path, like)``: the checkpoint dict, its tensors read into ``like``'s where they match.
    load: Callable[[Any, Mapping[str, Any] | None], dict[str, Any]]
    teardown: Callable[[], None]


class Connection:
    """How an ``EngineCheckpointIO`` runs under one strategy, chosen once by :func:`connect`."""

    #: Whether every rank calls the IO (a collective save), not Lightning's global rank 0 alone.
    collective: ClassVar[bool] = False

    def __init__(self, strategy: Strategy, calls: IOCalls) -> None:
        self.strategy = strategy
        self.calls = calls

    def install(self) -> None:
        """Make the strategy call the IO as this kind of strategy needs (nothing by default)."""


class OneProcess(Connection):
    """A single-device strategy: Lightning calls the IO itself, in the one process."""


class DataParallel(Connection):
    """DDP: the strategy saves and loads through the IO on every rank."""

    collective = True

    def install(self) -> None:
        # The strategy object's own attributes: Lightning calls these on every rank, and no other
        # strategy (nor the class) changes.
        setattr(self.strategy, "save_checkpoint", self.save_checkpoint)  # noqa: B010
        setattr(self.strategy, "load_checkpoint", self.load_checkpoint)  # noqa: B010

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None) -> None:
        """``Strategy.save_checkpoint`` on every rank: one collective engine save."""
        self.calls.save(checkpoint, filepath, storage_options, self._any)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """``Strategy.load_checkpoint`` on every rank, from global rank 0's path."""
        torch.cuda.empty_cache()  # as Lightning's own does before it reads a checkpoint
        return self.calls.load(self.strategy.broadcast(checkpoint_path), None)

    def _any(self, flag: bool) -> bool:
        return self.strategy.reduce_boolean_decision(flag, all=False)


class ModelParallel(DataParallel):
    """``ModelParallelStrategy`` (FSDP2, DTensor): saves as DDP does, each rank with its shards;
    loads into the live model's and optimizers' DTensors, then sets them."""

    def install(self) -> None:
        super().install()
        # ModelParallelStrategy.teardown never tears its CheckpointIO down (Strategy.teardown does):
        # without this, a background save of the last step would not be waited for.
        self._teardown = functools.partial(type(self.strategy).teardown, self.strategy)
        setattr(self.strategy, "teardown", self.teardown)  # noqa: B010

    def teardown(self) -> None:
        try:
            self._teardown()
        finally:
            self.calls.teardown()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        model, optimizers = self.strategy.model, self.strategy.optimizers
        module = self.strategy.lightning_module
        assert model is not None and module is not None
        like = {
            "state_dict": get_model_state_dict(model),
            "optimizer_states": [get_optimizer_state_dict(model, optimizer) for optimizer in optimizers],
        }
        checkpoint = self.calls.load(self.strategy.broadcast(checkpoint_path), like)
        if "state_dict" in checkpoint:
            options = StateDictOptions(strict=module.strict_loading)
            set_model_state_dict(model, checkpoint.pop("state_dict"), options=options)
        states = checkpoint.pop("optimizer_states", [])
        if optimizers and len(states) != len(optimizers):
            raise CheckpointLoadError(
                f"{checkpoint_path}: the checkpoint holds {len(states)} optimizer state(s), the LightningModule "
                f"configures {len(optimizers)} optimizer(s); resume with the configure_optimizers it was saved with"
            )
        for optimizer, state in zip(optimizers, states, strict=False):  # no optimizers: not fitting
            set_optimizer_state_dict(model, optimizer, state)
        return checkpoint  # what Lightning's own sharded load returns: all but the model and optimizers


def _refusal(strategy: Strategy) -> str | None:
    """Why ``strategy`` cannot run ``EngineCheckpointIO``, and the fix; ``None`` if it can."""
    if isinstance(strategy, DeepSpeedStrategy):
        return (
            "DeepSpeed saves its own checkpoints and never calls a CheckpointIO; leave out EngineCheckpointIO, or "
            "shard with ModelParallelStrategy (FSDP2) instead"
        )
    if isinstance(strategy, XLAStrategy):
        return "it takes Lightning's XLACheckpointIO only; leave out EngineCheckpointIO"
    if isinstance(strategy, FSDPStrategy):
        return (
            "FSDP1 is not supported; shard with ModelParallelStrategy and fully_shard in configure_model (FSDP2), "
            "or leave out EngineCheckpointIO to keep Lightning's own checkpoints"
        )
    if isinstance(strategy, ModelParallelStrategy) and not saves_sharded(strategy):
        return (
            "it gathers the whole state on global rank 0; keep save_distributed_checkpoint=True (the default): "
            "engine checkpoints are sharded, and `ckpt-engine convert` consolidates one"
        )
    if isinstance(strategy, DDPStrategy) and start_method(strategy) != "popen":
        return (
            "it hands the final weights back to the main process through the CheckpointIO; use strategy='ddp' "
            "(Lightning starts the processes as scripts, or torchrun does)"
        )
    if isinstance(strategy, (SingleDeviceStrategy, DDPStrategy, ModelParallelStrategy)):
        return None
    return (
        "it runs under SingleDeviceStrategy, DDPStrategy (strategy='ddp') and ModelParallelStrategy only; use one of "
        "them, or leave out EngineCheckpointIO"
    )


def _described(strategy: Strategy) -> str:
    """The strategy's class, with the setting that decides a refusal where there is one."""
    name = type(strategy).__name__
    if isinstance(strategy, ModelParallelStrategy):
        return f"{name}(save_distributed_checkpoint={saves_sharded(strategy)})"
    if isinstance(strategy, DDPStrategy) and not isinstance(strategy, (DeepSpeedStrategy, XLAStrategy)):
        return f"{name}(start_method={start_method(strategy)!r})"
    return name


def connect(strategy: Strategy, calls: IOCalls) -> Connection:
    """How the IO runs under ``strategy``, installed on it; raises
    :class:`UnsupportedStrategyError` (one line, naming the fix) for a strategy it cannot run under."""
    reason = _refusal(strategy)
    if reason is not None:
        raise UnsupportedStrategyError(f"EngineCheckpointIO cannot run under {_described(strategy)}: {reason}")
    kind: type[Connection]
    if isinstance(strategy, ModelParallelStrategy):
        kind = ModelParallel
    elif isinstance(strategy, DDPStrategy):
        kind = DataParallel
    else:
        kind = OneProcess
    connection = kind(strategy, calls)
    connection.install()
    return connection


class _ConnectingProperty(property):
    """``Strategy.checkpoint_io`` whose setter also tells the integration (see :func:`install`)."""

    #: Lightning's own property, which this one wraps.
    original: property


def install(on_connect: Callable[[Strategy, CheckpointIO], None]) -> None:
    """Make every ``strategy.checkpoint_io = io`` (how Lightning connects ``plugins=[io]``, or a
    strategy's ``checkpoint_io=io``, while the ``Trainer`` is built) also call
    ``on_connect(strategy, io)``. Installing again replaces the callback (a reloaded module);
    the property otherwise behaves as Lightning's."""
    current = Strategy.__dict__["checkpoint_io"]
    original = current.original if isinstance(current, _ConnectingProperty) else current
    assert isinstance(original, property) and original.fset is not None, "Lightning's Strategy.checkpoint_io changed"
    setter = original.fset

    def connecting_setter(strategy: Strategy, io: CheckpointIO) -> None:
        setter(strategy, io)
        on_connect(strategy, io)

    connecting = _ConnectingProperty(original.fget, connecting_setter, original.fdel, original.__doc__)
    connecting.original = original
    setattr(Strategy, "checkpoint_io", connecting)  # noqa: B010


# -- Lightning's private attributes, read here only (pinned by tests/integrations/test_lightning_strategies.py) --


def start_method(strategy: DDPStrategy) -> str:
    """How ``strategy`` starts its processes: ``"popen"`` (as scripts, or none: torchrun started
    them), ``"spawn"``, ``"fork"`` or ``"forkserver"``. Lightning keeps the constructor's
    ``start_method`` only in a private attribute, and its launcher exists only later."""
    return str(strategy._start_method)


def saves_sharded(strategy: ModelParallelStrategy) -> bool:
    """``ModelParallelStrategy``'s ``save_distributed_checkpoint`` (kept in a private attribute)."""
    return bool(strategy._save_distributed_checkpoint)
