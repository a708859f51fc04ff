"""``CheckpointEngine``: save and restore the full training state as DCP checkpoints.

The facade: it checks arguments, builds the training objects and hands them to its parts, the
save pipeline (:class:`~.saver.Saver`) and the resume side (:class:`~.loader.Loader`); it owns
the engine's lifetime (the saves in flight, the collective watch, the plugins' close).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import torch
from torch import nn

from .._dcpio.fast_read import gc_paused
from .._format.hashing import DEFAULT_ALGORITHM
from ..config import EngineConfig
from ..errors import ArgumentTypeError, CkptEngineError, InvalidArgumentError, clip
from ..pipeline import Pipeline
from ..plugin_manager import build_plugin_manager
from ..types import LoadResult
from .collectives import EngineCollectives, bounded
from .loader import Loader
from .local_tier import node_local_tiers
from .pending import SaveHandle, SaveQueue
from .preemption import PreemptionSaver
from .resume import ResumePlanner
from .rng import with_rng
from .saver import Saver
from .state import TrainingObjects
from .targets import open_target
from .tiers import DurableTier, TierStack

__all__ = ["CheckpointEngine", "SaveHandle"]

logger = logging.getLogger("ckpt_engine")


class CheckpointEngine:
    """Saves and restores model, optimizer, scheduler, grad scaler, iteration and extra state.

    ``config`` is an :class:`EngineConfig`, a mapping of its fields, or a path to a YAML, TOML
    or JSON file. ``plugins`` are plugin objects registered in addition to the configured ones.
    Works in one process without a process group and on every rank under ``torchrun``.
    """

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
        *,
        plugins: Sequence[Any] = (),
    ) -> None:
        self.config = EngineConfig.coerce(config)
        self._plugins = build_plugin_manager(self.config, plugins)
        self.pipeline = Pipeline(self._plugins)
        #: The saves in flight: their handles, the commit thread, failures nobody asked about.
        self._queue = SaveQueue()
        self._closed = False
        #: ``collective_timeout_s`` around every save and load, and whether a lost rank broke them.
        self._collectives = EngineCollectives(self.config.collective_timeout_s)
        #: Names this engine's save-plan caches (``fast_save``): one per component.
        self._plan_prefix = f"engine-{os.getpid()}-{id(self):x}:"
        checksum = DEFAULT_ALGORITHM if self.config.save_checksums else None
        #: The tiers every save is committed to and a resume reads from: the durable tier
        #: (``save_dir`` through its storage mode, chosen once) and the nearer ones configured.
        try:
            nearer = node_local_tiers(self.config, self.pipeline)
        except BaseException:
            self.pipeline.close()  # a plugin that started something (a writer process) stops it
            raise
        #: The storage mode of ``save_dir``, chosen once: staging folder, commit, uploads, cleanup, retention.
        self._target = open_target(self.config)
        durable = DurableTier(self.config, self.pipeline, self._target, checksum)
        self._tiers = TierStack(durable, nearer, persist_every=self.config.persist_every)
        self._saver = Saver(
            self.config, self.pipeline, self._tiers, self._queue, plan_prefix=self._plan_prefix, checksum=checksum
        )
        #: The resume side: where a load reads from, chosen once, and the reads of what it chose.
        self._loader = Loader(self.config, self.pipeline)
        self._resume = ResumePlanner(self._loader, self._target, self._tiers.nearer)
        self._saver.remove_leftovers_at_start()

    # -- context manager --------------------------------------------------------------------

    def __enter__(self) -> CheckpointEngine:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc is None:
            self.close()
        else:
            try:
                self.close()
            except CkptEngineError:
                logger.exception("closing the checkpoint engine failed while handling another error")

    @property
    def save_dir(self) -> str:
        return self.config.save_dir

    @property
    def plugin_names(self) -> tuple[str, ...]:
        """Registered plugins, in fold order."""
        return self._plugins.order

    # -- save -------------------------------------------------------------------------------

    @bounded
    @gc_paused()
    def save(
        self,
        iteration: int,
        *,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        grad_scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
        durable: bool = False,
    ) -> SaveHandle:
        """Save the training state as ``<save_dir>/iter_{iteration:09}/``.

        Returns once the checkpoint's content is fixed: later in-place updates never leak into
        it. With the default (synchronous) providers the checkpoint is also committed; with a
        background writer, ``handle.result()`` or :meth:`wait` waits for the commit.

        With a node-local tier every save is committed there, and only one whose
        iteration is a multiple of ``persist_every``, or with ``durable=True``, also to
        ``save_dir`` (``SaveResult.tier`` says which).
        """
        self._check_open()
        extra = with_rng(extra, self.config.rng)
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise ArgumentTypeError(
                f"iteration must be a non-negative int, got {type(iteration).__name__} {clip(repr(iteration), 40)}"
            )
        if iteration < 0:
            raise InvalidArgumentError(f"iteration must be a non-negative int, got {iteration}")
        objs = TrainingObjects.from_args(model, optimizer, scheduler, grad_scaler, extra)
        if not objs.modules:
            raise InvalidArgumentError("save() needs model=: a module or a list of modules")
        if not isinstance(durable, bool):
            raise ArgumentTypeError(f"durable must be a bool, got {type(durable).__name__}")
        return self._saver.save(iteration, objs, durable=durable)

    def save_on_preemption(self, *, every: int | None = None, exit_code: int = 0) -> PreemptionSaver:
        """A context manager turning SIGTERM into a save at the next ``step_done()`` and a clean
        exit; also saves every ``every`` steps (see :mod:`ckpt_engine.preemption`)."""
        return PreemptionSaver(self, every=every, exit_code=exit_code)

    def wait_ready(self, timeout: float | None = None) -> float:
        """Block until plugins that start in the background (``pinned_staging``'s writer process)
        are ready; returns their start-up seconds. Never needed for correctness: saves queue until
        then. Useful to keep start-up out of a measurement."""
        return self.pipeline.wait_ready(timeout)

    def resumed_from(self, iteration: int) -> None:
        """Training goes on from step ``iteration``, read other than by :meth:`load` (an
        integration's reader, another engine): the node-local tier's saves then treat the steps an
        earlier job saved past it as a future it abandoned, as after a :meth:`load` of that step.
        Call it on every rank, as :meth:`load` runs: with ``allow_overwrite``, the next save asks
        rank 0 whether ``save_dir``'s latest is past that step (a collective)."""
        self._tiers.resumed(iteration)

    def wait(self) -> None:
        """Block until every pending save is committed; raise if one failed."""
        self._queue.wait()

    def wait_replicated(self, timeout: float | None = None) -> None:
        """Block until every save so far is committed and its peer replicas (``peer_replicas``)
        are copied; raise :class:`~ckpt_engine.errors.ReplicationError` for copies that failed
        since the last call (the local checkpoints themselves stay committed). Returns at once
        without a local tier or peers."""
        self._queue.wait()
        self._tiers.wait(timeout)

    def close(self) -> None:
        """Wait for pending saves, then release workers and plugin resources. Idempotent.

        Plugins take part through the protocols of :mod:`ckpt_engine.lifecycle`: ``begin_close()``
        first, before the wait, so that a plugin can bound how long its in-flight work may still
        take; ``close()`` once, in reverse fold order, after every pending save finished.
        """
        if self._closed:
            return
        self.pipeline.begin_close()  # lets a plugin bound the wait below (pinned_staging: close_timeout_s)
        try:
            self._queue.wait()
        finally:
            self._closed = True
            try:
                self._tiers.close()  # the replication rounds, bounded by collective_timeout_s; the locks
            finally:
                self._collectives.close()
                self._queue.shutdown()
                self._saver.close()  # its plan caches
                self.pipeline.close()

    def _check_open(self) -> None:
        if self._closed:
            raise CkptEngineError("this CheckpointEngine is closed; create a new one")

    # -- load -------------------------------------------------------------------------------

    @bounded
    def load(
        self,
        *,
        model: nn.Module | Sequence[nn.Module] | None = None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        grad_scaler: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> LoadResult:
        """Resume by the rules of docs/design.md, section 4; returns the iteration, path and report.

        1. ``latest_checkpoint.txt`` in the load directory: every component passed in.
        2. else ``load_path`` is a checkpoint folder: ``model`` (all with
           ``load_training_state``; ``model`` + ``scheduler`` with ``only_load_scheduler_state``).
        3. else ``load_path`` ends in ``.pth``: a plain model state dict, non-strict; or it is
           safetensors weights (a ``.safetensors`` file, or a Hugging Face folder): ``model`` only.
        4. else nothing: iteration 0.
        """
        self._check_open()
        self.wait()  # never read a checkpoint that is still being committed
        extra = with_rng(extra, self.config.rng)
        objs = TrainingObjects.from_args(model, optimizer, scheduler, grad_scaler, extra)
        # No cyclic GC while loading: a load allocates millions of small objects (metadata,
        # plan entries, read items) and few cycles, and each full collection walks them all:
        # with 50 000 tensors that made the load grow faster than linearly (9 s against 25 s).
        with gc_paused():
            result = self._resume.load(objs)
        if result.checkpoint_path is not None:
            self.resumed_from(result.iteration)
        return result
