"""Which JSON a saved trainer state may hold: checked, field by field, before the Trainer builds
``TrainerState(**state)`` from it (which fails with a bare ``TypeError`` on a field it does not
know or of the wrong type)."""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import TrainerState

from ..errors import CorruptCheckpointError

__all__ = ["check_trainer_state"]


#: The JSON types of the ``TrainerState`` fields a resume reads (``None`` allowed where listed).
_STATE_TYPES: dict[str, tuple[type, ...]] = {
    "epoch": (int, float),
    "global_step": (int,),
    "max_steps": (int,),
    "logging_steps": (int, float),
    "eval_steps": (int, float),
    "save_steps": (int, float),
    "train_batch_size": (int,),  # the Trainer compares it with its own on every resume
    "num_train_epochs": (int, float),
    "num_input_tokens_seen": (int,),
    "total_flos": (int, float),
    "log_history": (list, type(None)),
    "best_metric": (int, float, type(None)),
    "best_global_step": (int, type(None)),
    "best_model_checkpoint": (str, type(None)),
    "is_local_process_zero": (bool,),
    "is_world_process_zero": (bool,),
    "is_hyper_param_search": (bool,),
    "trial_name": (str, type(None)),
    "trial_params": (dict, type(None)),
    "stateful_callbacks": (dict, type(None)),
}


def _callback_state(value: Any) -> bool:
    """Whether ``value`` is one stored callback state: ``{"args": {...}, "attributes": {...}}``."""
    return isinstance(value, dict) and all(isinstance(value.get(k, {}), dict) for k in ("args", "attributes"))


def _entries_fit(key: str, value: Any) -> bool:
    """Whether the entries of a well-typed container field are what the Trainer reads from them."""
    if key == "log_history":
        return all(isinstance(e, dict) for e in value or [])
    if key == "stateful_callbacks":
        states = [s for v in (value or {}).values() for s in (v if isinstance(v, list) else [v])]
        return all(_callback_state(s) for s in states)
    return True


def check_trainer_state(state: Any, where: str) -> None:
    """Raise :class:`~ckpt_engine.CorruptCheckpointError` naming ``where`` and the field when
    ``state`` (a parsed trainer state) is no JSON object of ``TrainerState``'s fields with their
    types: the Trainer builds ``TrainerState(**state)``, which fails with a bare ``TypeError``."""
    if not isinstance(state, dict):
        raise CorruptCheckpointError(f"{where}: the trainer state is a {type(state).__name__}, not a JSON object")
    fields = {f.name for f in dataclasses.fields(TrainerState)}
    for key, value in state.items():
        if key not in fields:
            raise CorruptCheckpointError(
                f"{where}: the trainer state has the field {str(key)[:80]!r}, which this transformers' TrainerState "
                "does not know (saved by another transformers version, or tampered with); resume with the "
                "transformers that saved it, or from another checkpoint"
            )
        kinds = _STATE_TYPES.get(key)
        bad = kinds is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds))
        if bad or not _entries_fit(key, value):
            raise CorruptCheckpointError(
                f"{where}: the trainer state's {key!r} is {str(value)[:60]!r} ({type(value).__name__}), not the "
                f"{' or '.join('null' if k is type(None) else k.__name__ for k in kinds or (list,))} TrainerState "
                "holds; the checkpoint was tampered with: resume from another checkpoint"
            )
