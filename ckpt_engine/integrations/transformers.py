"""A Hugging Face ``transformers.Trainer`` whose checkpoints are engine checkpoints (``EngineTrainer``).

``EngineTrainer`` is a ``Trainer``; ``EngineTrainerMixin`` gives the same behaviour to a Trainer
subclass (``class MyTrainer(EngineTrainerMixin, SFTTrainer)``). Where the Trainer writes a
``checkpoint-N`` folder of ``torch.save`` files, they save ``<save_dir>/iter_{global_step:09}/``
through a :class:`~ckpt_engine.CheckpointEngine`: committed atomically with a manifest and
checksums, on every rank together, async with ``pinned_staging``, incremental, on object storage,
as the engine config says. Its components:

* ``model``, ``optim``, ``scheduler``, ``trainer`` (the global step, the grad scaler): the
  engine's standard components, so ``ckpt-engine`` commands and ``CheckpointEngine.load`` read them;
* ``rng``: every rank's Python, NumPy, torch and CUDA generators, restored where the Trainer
  restores them (after the resumed epoch's first batches are fetched);
* ``trainer_state``: the ``TrainerState`` JSON the Trainer writes to ``trainer_state.json``
  (global step, log history, best metric, stateful callbacks).

``train(resume_from_checkpoint=True)`` resumes from the engine's latest checkpoint (or, with
``fallback_to_last_complete``, the newest complete one, with a warning); a path resumes exactly
that checkpoint. ``docs/integrations.md`` describes the mapping and its limits.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy, get_last_checkpoint

from .. import hookimpl
from .._dcpio import dist as _dist
from .._engine.rng import RNG_COMPONENT, RngState
from .._storage.store import open_store
from .._storage.urls import is_url
from ..checkpoints import checkpoint_name, iteration_of
from ..config import EngineConfig
from ..errors import (
    ArgumentTypeError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptEngineError,
    ConfigError,
)
from ..types import SaveResult
from ._trainer_checkpoint import (
    COMPONENT,
    TRAINER_STATE_FILE,
    NotATrainerCheckpointError,
    Resume,
    StateItems,
    apply_save_total_limit,
    newer_checkpoints,
    open_resume,
    parse_trainer_state,
    read_training_state,
    reader_engine,
)
from ._trainer_state import check_trainer_state

if TYPE_CHECKING:
    from .. import CheckpointEngine

    _TrainerBase = Trainer
else:  # at run time the mixin is a plain class, so it composes with any Trainer subclass
    _TrainerBase = object

__all__ = [
    "COMPONENT",
    "TRAINER_METHODS",
    "EngineTrainer",
    "EngineTrainerMixin",
    "NotATrainerCheckpointError",
    "UnsupportedTrainerSetupError",
    "check_trainer_state",
]

logger = logging.getLogger("ckpt_engine")

EngineConfigLike = EngineConfig | Mapping[str, Any] | str | os.PathLike[str]
#: The name of a checkpoint folder the Trainer itself writes (``PREFIX_CHECKPOINT_DIR``-N).
_TRAINER_CHECKPOINT = re.compile(r"^checkpoint-\d+$")


class UnsupportedTrainerSetupError(CkptEngineError, ValueError):
    """The Trainer runs a set-up whose checkpoints the engine cannot take over (DeepSpeed, FSDP1,
    ``push_to_hub``, hyper-parameter search), or the engine config contradicts the Trainer's
    arguments; the message names the setting and the way out."""


class _SaveObserver:
    """An engine plugin: hands every save's result to its trainer (after the commit or failure)."""

    name = "transformers_trainer"

    def __init__(self, trainer: EngineTrainerMixin) -> None:
        self._trainer = trainer

    @hookimpl
    def on_save_done(self, result: SaveResult) -> None:
        self._trainer._save_done(result)


#: The ``Trainer`` methods the mixin overrides: where the Trainer saves a checkpoint and reads one
#: back (transformers 5.x). They are checked when this module is imported, so a transformers that
#: renamed one fails here instead of quietly writing its own checkpoints.
TRAINER_METHODS = (
    "train",
    "_save_checkpoint",
    "_load_from_checkpoint",
    "_load_optimizer_and_scheduler",
    "_load_scaler",
    "_load_rng_state",
    "_load_best_model",
)


def _require_trainer_api() -> None:
    missing = [name for name in TRAINER_METHODS if not callable(getattr(Trainer, name, None))]
    if missing:
        import transformers

        raise ImportError(
            f"ckpt_engine.integrations.transformers overrides Trainer.{', Trainer.'.join(missing)}, which "
            f"transformers {transformers.__version__} does not have; install a transformers 5 release "
            "(tested with 5.24.0)"
        )


_require_trainer_api()


def _last_trainer_checkpoint(output_dir: str) -> str | None:
    """The newest ``checkpoint-N`` folder the Trainer itself saved in ``output_dir``, if any."""
    found: str | None = get_last_checkpoint(output_dir)  # type: ignore[no-untyped-call]
    return found


def _is_fsdp1(trainer: Trainer) -> bool:
    """Whether accelerate runs the trainer's model under FSDP1. Under FSDP2 (``fsdp_version: 2``)
    the parameters are ``DTensor`` shards that the engine saves and loads as DCP does, every rank
    its own, after accelerate has sharded the model and the Trainer built the optimizer."""
    if not trainer.is_fsdp_enabled:
        return False
    return getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1) != 2


def _require_mixin_first(cls: type) -> None:
    """``EngineTrainerMixin`` must come before ``transformers.Trainer`` in ``cls``'s MRO, or the
    Trainer's own checkpoint methods win and it writes ``checkpoint-N`` folders, unnoticed."""
    mro = cls.__mro__
    if Trainer in mro and mro.index(Trainer) < mro.index(EngineTrainerMixin):
        raise UnsupportedTrainerSetupError(
            f"{cls.__name__} lists EngineTrainerMixin after a Trainer class ({' -> '.join(c.__name__ for c in mro)}), "
            "so the Trainer's own checkpointing would run; put the mixin first: "
            f"class {cls.__name__}(EngineTrainerMixin, <your Trainer class>)"
        )


def _checked(resume: Resume) -> Resume:
    """``resume``, its trainer state checked (:func:`check_trainer_state`); closed if it fails."""
    with open(os.path.join(resume.stand_in, TRAINER_STATE_FILE), encoding="utf-8") as f:
        state = json.load(f)  # checked JSON within bounds by open_resume
    try:
        check_trainer_state(state, f"{resume.checkpoint}/{COMPONENT}")
    except BaseException:
        resume.close()
        raise
    return resume


def _engine_config_for(config: EngineConfigLike | None, output_dir: str | None) -> EngineConfig:
    """The engine config of a trainer: ``config`` (``None``, or a mapping without ``save_dir``:
    ``<output_dir>/checkpoints``), with ``rng`` off (the trainer saves the random state itself,
    to restore it when the Trainer does) and no ``load_path`` (a resume names its checkpoint)."""
    if config is None or (isinstance(config, Mapping) and "save_dir" not in config):
        config = {**(config or {}), "save_dir": os.path.join(output_dir or ".", "checkpoints")}
    coerced = EngineConfig.coerce(config)
    unknown = sorted(set(coerced.keys_not_to_resume) - {"model", "optim", "scheduler", "trainer", RNG_COMPONENT})
    if unknown:
        raise ConfigError(
            f"engine_config's keys_not_to_resume names {unknown}: an EngineTrainer checkpoint's components that "
            f"a resume may leave out are model, optim, scheduler, trainer and {RNG_COMPONENT} ({COMPONENT!r}, the "
            "Trainer's own state, is always read)"
        )
    if coerced.load_path is not None:
        raise ConfigError(
            f"engine_config sets load_path {coerced.load_path!r}: an EngineTrainer resumes what "
            "train(resume_from_checkpoint=...) names; pass the checkpoint there, or load initial weights into the "
            "model before building the trainer"
        )
    return coerced.model_copy(update={"rng": False})


class EngineTrainerMixin(_TrainerBase):
    """Makes a ``transformers.Trainer`` (sub)class save and resume engine checkpoints.

    Put it first: ``class MyTrainer(EngineTrainerMixin, SFTTrainer)``. It takes two keyword
    arguments besides the Trainer's: ``engine_config`` (what :class:`~ckpt_engine.CheckpointEngine`
    takes; a mapping may leave out ``save_dir``, which then is ``<output_dir>/checkpoints``) and
    ``engine_plugins`` (plugin objects registered besides the configured ones). The engine is
    created at the first save and closed when ``train()`` returns, which waits for pending
    background saves and raises a failed one. ``save_results`` lists the
    :class:`~ckpt_engine.SaveResult` of every save this trainer made (this rank's bytes).
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _require_mixin_first(cls)

    def __init__(
        self,
        *args: Any,
        engine_config: EngineConfigLike | None = None,
        engine_plugins: Sequence[Any] = (),
        **kwargs: Any,
    ) -> None:
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "push_to_hub", False):  # before the Trainer creates a hub repository
            raise UnsupportedTrainerSetupError(
                "EngineTrainer cannot take over this Trainer's checkpoints: push_to_hub uploads the checkpoint-N "
                "folders the engine does not write. Leave push_to_hub off and push the final model with "
                "trainer.push_to_hub() after training"
            )
        super().__init__(*args, **kwargs)
        self.engine_config = _engine_config_for(engine_config, self.args.output_dir)
        self.engine_plugins = tuple(engine_plugins)
        self.save_results: list[SaveResult] = []
        self._engine: CheckpointEngine | None = None
        self._resume: Resume | None = None
        #: This ``train()`` replaces newer checkpoints refused as broken (see :meth:`train`).
        self._overwrite = False
        self._lock = threading.Lock()
        #: iteration -> the best checkpoint when it was saved (``save_total_limit`` keeps it).
        self._protected: dict[int, str | None] = {}
        self._saved_steps: set[int] = set()
        self._refuse_unsupported()

    # -- the engine -------------------------------------------------------------------------

    @property
    def engine(self) -> CheckpointEngine:
        """The :class:`~ckpt_engine.CheckpointEngine` this trainer saves with (created on first use)."""
        if self._engine is None:
            from .. import CheckpointEngine

            config = self.engine_config
            if self._overwrite:
                config = config.model_copy(update={"allow_overwrite": True})
            self._engine = CheckpointEngine(config, plugins=[*self.engine_plugins, _SaveObserver(self)])
            if self._resume is not None:  # its node-local tier's saves go on from that step
                self._engine.resumed_from(self._resume.iteration)
        return self._engine

    @property
    def checkpoint_dir(self) -> str:
        """Where the engine checkpoints are: ``save_dir``, absolute for a local folder."""
        d = self.engine_config.save_dir
        return d if is_url(d) else os.path.abspath(d)

    def checkpoint_path(self, step: int) -> str:
        """The engine checkpoint folder of global step ``step`` (it may not exist)."""
        return f"{self.checkpoint_dir.rstrip('/')}/{checkpoint_name(step)}"

    def _refuse_unsupported(self) -> None:
        args, cfg = self.args, self.engine_config
        for flag, what in (
            (self.is_deepspeed_enabled, "DeepSpeed saves its own partitioned engine state"),
            (
                _is_fsdp1(self),
                "accelerate's FSDP1 (fsdp_version 1) saves and loads its own sharded state dicts; FSDP2 is "
                "supported: set fsdp_config's fsdp_version to 2",
            ),
        ):
            if flag:
                raise UnsupportedTrainerSetupError(
                    f"EngineTrainer cannot take over this Trainer's checkpoints: {what}. Use the plain Trainer for "
                    "this set-up"
                )
        if cfg.keep_last is not None and args.save_total_limit is not None:
            raise UnsupportedTrainerSetupError(
                f"both save_total_limit ({args.save_total_limit}) and the engine's keep_last ({cfg.keep_last}) are "
                "set; set one of them"
            )
        if cfg.keep_last is not None and args.load_best_model_at_end:
            raise UnsupportedTrainerSetupError(
                "the engine's keep_last deletes old checkpoints whichever is best, but load_best_model_at_end needs "
                "the best one; use save_total_limit instead (it keeps the best checkpoint)"
            )

    def _close_engine(self, *, after_error: bool = False) -> None:
        engine, self._engine = self._engine, None
        if engine is None:
            return
        if not after_error:
            engine.close()  # waits for background saves; raises one that failed
            return
        try:
            engine.close()
        except CkptEngineError:
            logger.exception("closing the checkpoint engine failed while handling another error")

    # -- train ------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``, resuming engine checkpoints: ``True`` resumes the engine's latest
        (``fallback_to_last_complete`` as configured), a path resumes that engine checkpoint
        (``.../iter_000000100``) or save folder (its latest), or a Trainer ``checkpoint-N``
        folder through the Trainer's own loader. Waits for pending saves before it returns.

        A ``save_dir`` holding checkpoints newer than the step training starts from is refused
        before the first step (``CheckpointExistsError``): the run would save those steps again,
        and ``latest`` would keep naming the other run's. ``allow_overwrite: true`` lets the run
        replace them; after a ``fallback_to_last_complete`` resume they are the ones refused as
        broken, and are replaced without it."""
        resume, passed = self._resolve_resume(resume_from_checkpoint)
        self._resume = resume
        if resume is not None and self._engine is not None:  # made before train(): tell it too
            self._engine.resumed_from(resume.iteration)
        try:
            self._overwrite = self._replaces_newer(resume, passed)
            output = super().train(passed, *args, **kwargs)
        except BaseException:
            self._close_engine(after_error=True)
            raise
        finally:
            self._resume = None
            if resume is not None:
                resume.close()
        self._close_engine()
        return output

    def _replaces_newer(self, resume: Resume | None, passed: str | None) -> bool:
        """Whether this run's saves must replace newer checkpoints (see :meth:`train`); raises
        ``CheckpointExistsError`` where that would replace good ones unasked."""
        if resume is not None:
            start = resume.iteration
        elif passed is not None:  # a Trainer checkpoint folder: the step its own trainer state names
            start = TrainerState.load_from_json(os.path.join(passed, TRAINER_STATE_FILE)).global_step
        else:
            start = 0
        newer = newer_checkpoints(self.engine_config, start)
        if not newer or self.engine_config.allow_overwrite:
            return False
        cfg = self.engine_config
        if resume is not None and resume.fell_back_from is not None and cfg.resolved_load_dir == cfg.save_dir:
            logger.warning(
                "resumed %s after refusing %s: the run replaces the newer checkpoints that failed the checks (%s) "
                "as it reaches their steps",
                resume.checkpoint,
                resume.fell_back_from,
                ", ".join(newer),
            )
            return True
        raise CheckpointExistsError(
            f"{self.checkpoint_dir} holds checkpoints after step {start}, where this run starts ({', '.join(newer[:5])}"
            f"{', ...' if len(newer) > 5 else ''}): the run would save those steps again and latest_checkpoint.txt "
            "would keep naming the newest of them. Resume the newest with train(resume_from_checkpoint=True), use "
            "another save_dir, delete them, or set allow_overwrite: true in engine_config to replace them"
        )

    def _resolve_resume(self, value: str | bool | os.PathLike[str] | None) -> tuple[Resume | None, str | None]:
        """``(the engine resume, the argument for Trainer.train)``."""
        if value is None or value is False:
            return None, None
        if value is True:
            try:
                resume = open_resume(self.engine_config, self.engine_plugins, None)
            except CheckpointNotFoundError as err:
                output_dir = self.args.output_dir
                theirs = _last_trainer_checkpoint(output_dir) if output_dir and os.path.isdir(output_dir) else None
                if theirs is None:
                    raise
                raise CheckpointNotFoundError(
                    f"{err}. {self.args.output_dir} holds the Trainer's own {theirs}: pass it as "
                    "resume_from_checkpoint to resume it (later saves are engine checkpoints)"
                ) from err
            return _checked(resume), resume.stand_in
        if not isinstance(value, (str, os.PathLike)):
            raise ArgumentTypeError(
                f"resume_from_checkpoint must be True, a checkpoint path or None, got {type(value).__name__}"
            )
        path = os.fspath(value)
        state_file = os.path.join(path, TRAINER_STATE_FILE)
        if not is_url(path) and os.path.isfile(state_file):
            logger.info("%s is a Trainer checkpoint folder: resumed by the Trainer's own loader", path)
            with open(state_file, encoding="utf-8") as f:
                text = f.read()
            state = parse_trainer_state(text, state_file)
            check_trainer_state(state, state_file)
            return None, path
        resume = open_resume(self.engine_config, self.engine_plugins, path)
        return _checked(resume), resume.stand_in

    def _resume_for(self, checkpoint: str | None) -> Resume | None:
        """The engine resume when the Trainer asks for its stand-in folder (else: its own checkpoint)."""
        resume = self._resume
        return resume if resume is not None and checkpoint == resume.stand_in else None

    # -- save -------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """The Trainer's checkpoint, as engine checkpoint ``iter_{global_step:09}`` (every rank)."""
        if trial is not None or self.hp_search_backend is not None:
            raise UnsupportedTrainerSetupError(
                "EngineTrainer does not save during hyper-parameter search: every trial would save the same "
                "global steps into one save_dir. Search with the plain Trainer, then train the chosen one"
            )
        self.store_flos()
        step = self.state.global_step
        self._track_best(step)
        self._export_callback_states()
        full = not self.args.save_only_model
        components = ("model", "trainer", COMPONENT, *(("optim", "scheduler", RNG_COMPONENT) if full else ()))
        extra: dict[str, Any] = {COMPONENT: StateItems(self._state_json(), components)}
        training: dict[str, Any] = {}
        if full:
            extra[RNG_COMPONENT] = RngState()
            training = self._training_objects()
            del training["model"]
        with self._lock:
            self._protected[step] = self.state.best_model_checkpoint
        # load_best_model_at_end loads the best step from save_dir: never a node-local tier's only
        best = self.args.load_best_model_at_end and self.state.best_global_step == step
        self.engine.save(step, model=self._model(), extra=extra, durable=bool(best), **training)
        self._saved_steps.add(step)

    def _state_json(self) -> str:
        """The trainer state as the Trainer's ``trainer_state.json`` holds it, the same text on
        every rank: the world process zero's, which writes that file. Its ``is_*_process_zero``
        flags differ between ranks, and a resume sets them anew
        (``TrainerState.init_training_references``); saved as each rank has them, they (like
        callback states exported on one rank only) would make the component per-rank state,
        which a resume on another number of ranks refuses."""
        state = dataclasses.asdict(self.state) | {"is_local_process_zero": True, "is_world_process_zero": True}
        return json.dumps(state, indent=2, sort_keys=True) + "\n"

    def _training_objects(self) -> dict[str, Any]:
        """What the engine saves and loads: the model (unwrapped), the optimizer (accelerate's
        wrapper removed), the LR scheduler, the grad scaler (``None`` without one)."""
        optimizer = self.optimizer
        inner = getattr(optimizer, "optimizer", None)  # accelerate's AcceleratedOptimizer wraps the real one
        if isinstance(inner, torch.optim.Optimizer):
            optimizer = inner
        return {
            "model": self._model(),
            "optimizer": optimizer,
            "scheduler": self.lr_scheduler,
            "grad_scaler": getattr(self.accelerator, "scaler", None),
        }

    def _model(self) -> torch.nn.Module:
        if self.model is None:
            raise ArgumentTypeError("the trainer has no model (pass model= or model_init=)")
        return self.model

    def _track_best(self, step: int) -> None:
        """``best_model_checkpoint`` names the engine checkpoint of the best step, as the Trainer
        names its ``checkpoint-N`` folder: once that checkpoint is saved (this save, an earlier
        one of this trainer, or one on storage)."""
        best = self.state.best_global_step
        if not best or self.args.save_strategy not in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST):
            return
        folder = self.checkpoint_path(best)
        if best == step or best in self._saved_steps or open_store(folder, self.engine_config.storage).isdir(folder):
            self.state.best_model_checkpoint = folder

    def _export_callback_states(self) -> None:
        """The stateful callbacks' states into the trainer state, as ``Trainer._save_checkpoint`` does
        on the process that saves; here on every rank, so that every rank saves the same trainer state."""
        stored = cast(dict[str, Any], self.state.stateful_callbacks)  # a dict once TrainerState is built
        for cb in [cb for cb in [*self.callback_handler.callbacks, self.control] if isinstance(cb, ExportableState)]:
            name, state = type(cb).__name__, cb.state()
            if isinstance(stored[name], list):
                stored[name].append(state)
            else:
                stored[name] = state

    def _save_done(self, result: SaveResult) -> None:
        """Every rank, after each commit or failure (the commit thread for a background save):
        record the result; rank 0 applies ``save_total_limit``, keeping the best checkpoint."""
        with self._lock:
            self.save_results.append(result)
            protected = self._protected.pop(result.iteration, None)
        limit = self.args.save_total_limit
        if result.succeeded and limit is not None and _dist.rank() == 0:
            apply_save_total_limit(self.engine_config, max(limit, 1), protected)

    # -- resume -----------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._resume_for(resume_from_checkpoint) is None:
            super()._load_from_checkpoint(resume_from_checkpoint, model)
        # an engine resume reads the model with the optimizer, once it exists (_load_optimizer_and_scheduler)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        resume = self._resume_for(checkpoint)
        if resume is None:
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        read_training_state(self.engine_config, self.engine_plugins, resume, self._training_objects())
        logger.info("resumed %s (global step %d)", resume.checkpoint, resume.iteration)

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._resume_for(checkpoint) is None:
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        resume = self._resume_for(checkpoint)
        if resume is None:
            super()._load_rng_state(checkpoint)
        elif not resume.rng.apply():
            logger.info("%s: no random state resumed (not saved, or in keys_not_to_resume)", resume.checkpoint)

    def _load_best_model(self) -> None:
        best = self.state.best_model_checkpoint
        if best is None or self._is_own_trainer_checkpoint(best):  # a Trainer checkpoint-N this run resumed
            super()._load_best_model()
            return
        if not self._is_engine_checkpoint(best):
            logger.warning(
                "load_best_model_at_end: not loading the best model from %s, which is outside this run's save_dir "
                "%s and output_dir %s (the trainer state names it: it was resumed from another run's checkpoint, or "
                "tampered with); the model stays the final one. Load that checkpoint yourself if you trust it, or "
                "copy it into %s",
                best,
                self.checkpoint_dir,
                self.args.output_dir,
                self.checkpoint_dir,
            )
            return
        if self._engine is not None:
            self._engine.wait()  # the best may be a background save still being committed
        logger.info("loading the best model from %s (score: %s)", best, self.state.best_metric)
        with reader_engine(self.engine_config, self.engine_plugins, best) as reader:
            reader.load(model=self._model())

    def _is_own_trainer_checkpoint(self, path: str) -> bool:
        """Whether ``path`` is a Trainer ``checkpoint-N`` folder directly in this run's output_dir."""
        output_dir = self.args.output_dir
        if not output_dir or is_url(path) or not _TRAINER_CHECKPOINT.match(os.path.basename(path.rstrip("/"))):
            return False
        return os.path.realpath(os.path.dirname(path.rstrip("/"))) == os.path.realpath(output_dir)

    def _is_engine_checkpoint(self, path: str) -> bool:
        parent, name = path.rstrip("/").rsplit("/", 1) if "/" in path else ("", path)
        return iteration_of(name) is not None and parent == self.checkpoint_dir.rstrip("/")


class EngineTrainer(EngineTrainerMixin, Trainer):
    """A ``transformers.Trainer`` whose checkpoints are engine checkpoints (see the module docstring)."""
