"""What an ``EngineTrainer`` checkpoint holds besides the standard components, and how a resume
finds, checks and reads one; nothing here imports ``transformers``.

An ``EngineTrainer`` checkpoint is an engine checkpoint (``model``, ``optim``, ``scheduler``,
``trainer``) with two more components: ``rng`` (every rank's generators, in the engine's own
``rng: true`` format) and :data:`COMPONENT` (the ``TrainerState`` JSON the Trainer writes to
``trainer_state.json``, and which components the save holds). A resume reads it in two engine
loads: :func:`open_resume` picks the checkpoint and reads the small :data:`COMPONENT` (checked at
``verify: sizes`` at most), and :func:`read_training_state` reads the rest of that very folder
once the Trainer has built its optimizer and scheduler.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._dcpio import dist as _dist
from .._engine.rng import RNG_COMPONENT, RngState
from .._format import bounded_json
from .._storage.store import open_store
from ..checkpoints import apply_retention, iteration_of, latest_checkpoint, list_checkpoints
from ..config import EngineConfig
from ..errors import (
    CheckpointNotFoundError,
    CkptEngineError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadStrictnessError,
)
from ..types import STANDARD_COMPONENTS

__all__ = [
    "COMPONENT",
    "FORMAT",
    "TRAINER_STATE_FILE",
    "DeferredRng",
    "NotATrainerCheckpointError",
    "Resume",
    "StateItems",
    "apply_save_total_limit",
    "newer_checkpoints",
    "open_resume",
    "parse_trainer_state",
    "read_training_state",
    "reader_engine",
]

#: The component holding the Trainer's state (``TrainerState`` as JSON) and what the save holds.
COMPONENT = "trainer_state"
#: ``format`` of :data:`COMPONENT`.
FORMAT = "ckpt-engine/transformers"
#: The file name the Trainer reads its state from in a checkpoint folder (``TRAINER_STATE_NAME``).
TRAINER_STATE_FILE = "trainer_state.json"
_MAX_DEPTH = 64
_MAX_INT_DIGITS = 100


def parse_trainer_state(text: str, where: str) -> Any:
    """A ``TrainerState`` JSON text (the engine's copy, or a Trainer checkpoint's
    ``trainer_state.json``) parsed within bounds; anything else is a
    :class:`CorruptCheckpointError` naming ``where``."""
    try:
        return bounded_json.loads(text, max_depth=_MAX_DEPTH, max_int_digits=_MAX_INT_DIGITS)
    except bounded_json.JSONRefused as err:
        raise CorruptCheckpointError(f"{where}: the trainer state cannot be read: {err}") from None


class NotATrainerCheckpointError(CkptEngineError, ValueError):
    """The checkpoint to resume has no :data:`COMPONENT` component: ``EngineTrainer`` did not save it."""


class StateItems:
    """The :data:`COMPONENT` component as an engine ``extra=`` ``Stateful``: the ``TrainerState``
    JSON text and the components the save holds, comma-separated."""

    def __init__(self, trainer_state: str = "", components: Sequence[str] = ()) -> None:
        self.items: dict[str, Any] = {
            "format": FORMAT,
            "version": 1,
            "trainer_state": trainer_state,
            "components": ",".join(components),
        }

    def state_dict(self) -> dict[str, Any]:
        return self.items

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.items = dict(state_dict)

    def checked(self, where: str, iteration: int) -> tuple[str, tuple[str, ...]]:
        """``(trainer_state JSON, components)`` as loaded from ``where``, checked: the format, a
        ``TrainerState`` JSON object within bounds whose ``global_step`` is ``iteration``."""
        items = self.items
        if items.get("format") != FORMAT or items.get("version") != 1:
            raise CorruptCheckpointError(
                f"{where}/{COMPONENT}: format {str(items.get('format'))[:80]!r} version "
                f"{str(items.get('version'))[:20]}, not the {FORMAT!r} version 1 EngineTrainer writes"
            )
        text, components = items.get("trainer_state"), items.get("components")
        if not isinstance(text, str) or not isinstance(components, str):
            raise CorruptCheckpointError(f"{where}/{COMPONENT}: 'trainer_state' and 'components' must be strings")
        state = parse_trainer_state(text, f"{where}/{COMPONENT}")
        step = state.get("global_step") if isinstance(state, dict) else None
        if step != iteration or isinstance(step, bool):
            raise CorruptCheckpointError(
                f"{where}/{COMPONENT}: the trainer state's global_step is {str(step)[:40]}, but the checkpoint is "
                f"iteration {iteration}; the checkpoint was tampered with or mixed up"
            )
        return text, tuple(c for c in components.split(",") if c)


class DeferredRng:
    """The ``rng`` component, read when the checkpoint is loaded but applied only by :meth:`apply`:
    the Trainer restores the random state after it has fetched the resumed epoch's first batches
    (``Trainer._load_rng_state``), not when the checkpoint is read."""

    def __init__(self) -> None:
        self.loaded: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return RngState().state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.loaded = dict(state_dict)

    def apply(self) -> bool:
        """Set this rank's generators to the loaded state; False when nothing was loaded."""
        if self.loaded is None:
            return False
        RngState().load_state_dict(self.loaded)
        return True


def reader_engine(config: EngineConfig, plugins: Sequence[Any], folder: str | None, extra: Sequence[str] = ()) -> Any:
    """An engine that only loads, with the configured load plugins (not ``pinned_staging``): from
    ``folder`` exactly (an ``iter_*`` checkpoint, or a save folder: its latest), or, with ``None``,
    by the engine's resume rules in the configured load folder (``fallback_to_last_complete`` as
    configured). ``keys_not_to_resume`` keeps the standard components and the ``extra`` ones the
    load passes (``rng`` is not in a model-only checkpoint's load)."""
    from .. import CheckpointEngine

    known = {*STANDARD_COMPONENTS, *extra}
    update: dict[str, Any] = {
        "plugins": tuple(p for p in config.plugins if p.name != "pinned_staging"),
        "keys_not_to_resume": tuple(k for k in config.keys_not_to_resume if k in known),
    }
    if folder is not None:
        update |= {"load_dir": folder, "load_path": folder, "load_training_state": True}
        update["only_load_scheduler_state"] = False
    return CheckpointEngine(config.model_copy(update=update), plugins=plugins)


@dataclass
class Resume:
    """The engine checkpoint a ``train()`` resumes, and the local stand-in folder the Trainer is
    handed instead: it holds only ``trainer_state.json``, which the Trainer reads itself."""

    checkpoint: str
    iteration: int
    components: tuple[str, ...]
    stand_in: str
    rng: DeferredRng
    #: With ``fallback_to_last_complete``: the checkpoint refused in favour of ``checkpoint``.
    fell_back_from: str | None = None
    #: The folder the resume asked for (``None``: the load folder's latest, which a second read
    #: resolves again where ``checkpoint`` is gone: a step the node-local tier resharded).
    folder: str | None = None

    def close(self) -> None:
        shutil.rmtree(self.stand_in, ignore_errors=True)


def open_resume(config: EngineConfig, plugins: Sequence[Any], folder: str | None) -> Resume:
    """The checkpoint to resume (``folder``, or the configured load folder's latest with ``None``),
    with its trainer state checked and written to a fresh stand-in folder (collective: every rank)."""
    items = StateItems()
    verify = "sizes" if config.verify == "checksums" else config.verify  # the second load checks checksums
    where = folder or config.resolved_load_dir
    try:
        probe = config.model_copy(update={"verify": verify, "keys_not_to_resume": ()})
        with reader_engine(probe, plugins, folder) as reader:
            result = reader.load(extra={COMPONENT: items})
    except (IncompleteCheckpointError, LoadStrictnessError) as err:
        lacking = _lacking_component(config, folder)
        if lacking is None:
            raise
        raise NotATrainerCheckpointError(
            f"{lacking} has no {COMPONENT!r} component, so EngineTrainer did not save it: resume it with the code "
            "that saved it, or load its weights with CheckpointEngine(...).load(model=...) before train()"
        ) from err
    if result.checkpoint_path is None:
        raise CheckpointNotFoundError(
            f"{where} holds no committed checkpoint to resume (no latest_checkpoint.txt, no iter_* folder); "
            "call train() without resume_from_checkpoint for a fresh start"
        )
    text, components = items.checked(result.checkpoint_path, result.iteration)
    stand_in = tempfile.mkdtemp(prefix="ckpt-engine-resume-")
    with open(os.path.join(stand_in, TRAINER_STATE_FILE), "w", encoding="utf-8") as f:
        f.write(text)
    return Resume(
        result.checkpoint_path, result.iteration, components, stand_in, DeferredRng(), result.fell_back_from, folder
    )


def read_training_state(
    config: EngineConfig, plugins: Sequence[Any], resume: Resume, objects: Mapping[str, Any]
) -> Any:
    """Load ``objects`` (``model``, ``optimizer``, ``scheduler``, ``grad_scaler``) and the random
    state from exactly ``resume.checkpoint`` (or, where that was a resharded step of the node-local
    tier, removed after the first read, the step the same rule takes again, of the same iteration);
    only the components the save holds are asked for."""
    wanted = set(resume.components)
    kwargs = {k: v for k, v in objects.items() if k == "model" or _COMPONENT_OF.get(k) in wanted}
    extra = {RNG_COMPONENT: resume.rng} if RNG_COMPONENT in wanted else {}
    gone = resume.folder is None and not open_store(resume.checkpoint, config.storage).isdir(resume.checkpoint)
    reader = reader_engine(config, plugins, None if gone else resume.checkpoint, tuple(extra))
    with reader:
        result = reader.load(**kwargs, extra=extra)
    if result.checkpoint_path is None or result.iteration != resume.iteration:
        raise CorruptCheckpointError(
            f"{resume.checkpoint}: iteration {resume.iteration} was resumed, but the second read of it found "
            f"iteration {result.iteration}; the folder was replaced while the resume ran"
        )
    return result


def _lacking_component(config: EngineConfig, folder: str | None) -> str | None:
    """The checkpoint a resume chose (``folder``, or the load folder's latest) when it has no
    :data:`COMPONENT` folder at all; ``None`` when it has one (a torn checkpoint) or is unknown."""
    load_dir = folder or config.resolved_load_dir
    store = open_store(load_dir, config.storage)
    try:
        name = latest_checkpoint(load_dir, config.storage)
        checkpoint = store.join(load_dir, name) if name is not None else load_dir
        return None if store.exists(store.join(checkpoint, COMPONENT)) else checkpoint
    except (OSError, CkptEngineError):
        return None


_COMPONENT_OF = {"optimizer": "optim", "scheduler": "scheduler", "grad_scaler": "trainer"}


def apply_save_total_limit(config: EngineConfig, limit: int, protected: str | None) -> list[str]:
    """``save_total_limit`` after a commit (rank 0): the engine's retention keeping the ``limit``
    newest complete checkpoints and ``protected`` (the best one), never the latest. Best effort,
    as the engine's own retention: failures are logged, and retried after the next commit.
    Returns the deleted paths."""
    best = iteration_of(protected) if protected else None
    kept = () if best is None else (best,)
    return apply_retention(config.save_dir, limit, protected=kept, storage=config.storage).deleted


def newer_checkpoints(config: EngineConfig, step: int) -> list[str]:
    """Names of the checkpoint folders in ``save_dir`` of iterations after ``step``, as rank 0
    lists them (every rank gets rank 0's list, so every rank decides alike)."""
    names = None
    if _dist.rank() == 0:
        names = [_name(path) for it, path in list_checkpoints(config.save_dir, config.storage) if it > step]
    if _dist.initialized() and _dist.world_size() > 1:
        names = _dist.broadcast_object(names, step="newer checkpoints")
    return list(names or [])


def _name(path: str) -> str:
    return os.path.basename(path.rstrip("/"))
