"""A Lightning checkpoint dict read back from its engine checkpoint: the path resolved (a pointer
file, a checkpoint folder, a save folder), verified and strict, into tensors of the stored
shapes or, for a sharded model, into its live DTensors.

It also names what such an engine checkpoint holds besides the ``model`` component: the
:data:`COMPONENT` of everything else Lightning saved, and in it the structure JSON under
:data:`STRUCTURE_KEY`, parsed within bounds (:func:`parse_structure`). Nothing here imports
Lightning.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from .._format import bounded_json
from .._storage.paths import same_folder
from ..checkpoints import latest_checkpoint
from ..config import EngineConfig
from ..errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    CkptEngineError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadStrictnessError,
)
from ._pointers import (
    ITER_NAME,
    POINTER_FORMAT,
    NotALightningCheckpointError,
    Pointer,
    PointerMismatchError,
    read_pointer,
    url_to_fs,
)
from ._state_tree import live_target, parse_dtype, skeleton, tensor_module, unflatten

__all__ = ["COMPONENT", "MAX_STRUCTURE_DEPTH", "STRUCTURE_KEY", "CheckpointReader", "Items", "parse_structure"]

logger = logging.getLogger("ckpt_engine")

#: The engine component that holds everything of a Lightning checkpoint but the model weights.
COMPONENT = "lightning"
#: The key, in :data:`COMPONENT`, of the JSON that describes the checkpoint dict's structure.
STRUCTURE_KEY = "__structure__"
#: Deepest nesting of the structure JSON (each level of the checkpoint dict takes about three),
#: checked when it is written and before it is parsed; the most digits of an integer in it.
MAX_STRUCTURE_DEPTH = 384
MAX_STRUCTURE_INT_DIGITS = 4000
_LAST_NAME = re.compile(r"^last(-\d+|-v\d+|-engine)?\.ckpt$")


class Items:
    """A flat mapping as an engine ``extra=`` component (``Stateful``)."""

    #: A checkpoint dict whose items differ by rank (a callback's state) is saved per rank, and each
    #: rank resumes its own; on another number of ranks, rank r takes saving rank r % n's whole dict
    #: (on one process, global rank 0's: what Lightning's own file holds), so that a sharded
    #: checkpoint still resumes on another world size (docs/reliability.md, Per-rank state).
    repartitions_state = True
    #: A load may read part of it on purpose (the structure first): its other keys are no loss.
    reads_part_of_its_state = True

    def __init__(self, items: dict[str, Any]) -> None:
        self.items = items

    def state_dict(self) -> dict[str, Any]:
        return self.items

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.items = dict(state_dict)


def parse_structure(raw: str, where: str) -> Any:
    """The structure JSON ``raw`` of the checkpoint component ``where``, parsed within bounds:
    :class:`~ckpt_engine.CorruptCheckpointError` naming ``where`` for text nested deeper than
    :data:`MAX_STRUCTURE_DEPTH`, an integer of thousands of digits, or text that is not JSON."""
    try:
        return bounded_json.loads(raw, max_depth=MAX_STRUCTURE_DEPTH, max_int_digits=MAX_STRUCTURE_INT_DIGITS)
    except bounded_json.JSONRefused as err:
        raise CorruptCheckpointError(f"{where}: {STRUCTURE_KEY!r} cannot be read: {err}") from None


class CheckpointReader:
    """Reads the checkpoint dicts ``EngineCheckpointIO`` saved into ``save_dir``.

    ``config`` and ``plugins`` are the IO's; each read runs two loads through engines that only
    load (the configured load plugins, not ``pinned_staging``). A pointer of another save folder
    is refused unless ``allow_foreign_pointers`` (then loaded with a warning naming both).
    """

    def __init__(
        self, config: EngineConfig, plugins: Sequence[Any], save_dir: str, *, allow_foreign_pointers: bool
    ) -> None:
        self.config = config
        self.plugins = tuple(plugins)
        self.save_dir = save_dir
        self.allow_foreign_pointers = allow_foreign_pointers
        #: The engine checkpoint folder the last :meth:`read` read, and the save id it records.
        self.last_read: tuple[str, str | None] | None = None

    def read(self, where: str, like: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The checkpoint dict at ``where`` (a pointer file, an ``iter_*`` folder or a save
        folder). ``like`` is a partial checkpoint dict of live tensors (``state_dict``,
        ``optimizer_states``): each stored tensor of the same dtype and shape is read into it."""
        save_dir, folder, pointer = self._resolve(where)
        structure, checkpoint_dir, iteration = self._read_structure(save_dir, folder, where=where)
        if pointer is not None and iteration != pointer.iteration:
            raise PointerMismatchError(
                f"{where} claims iteration {pointer.iteration}, but {checkpoint_dir} holds iteration {iteration}; the "
                "pointer or the checkpoint was replaced. Load the checkpoint folder itself if it is the one you want"
            )
        saved = structure.get("save_id")
        if pointer is not None and pointer.save_id is not None and saved is not None and saved != pointer.save_id:
            raise PointerMismatchError(
                f"{where} was written for a save of iteration {iteration} that a later save of the same global step "
                f"replaced (allow_overwrite) in {checkpoint_dir}; load the checkpoint folder itself to get the later "
                "state, or the pointer that save wrote"
            )
        checkpoint = self._read_checkpoint(structure, checkpoint_dir, like or {}, (save_dir, folder, iteration))
        self.last_read = (checkpoint_dir, saved if isinstance(saved, str) else None)
        return checkpoint

    def _resolve(self, path: str) -> tuple[str, str | None, Pointer | None]:
        """``(save_dir, checkpoint folder, the pointer that names it)``; the folder ``None`` means
        the save folder's latest (which is what a ``last*.ckpt`` pointer stands for)."""
        fs, inner = url_to_fs(path)
        if not fs.exists(inner):
            raise CheckpointNotFoundError(f"{path} does not exist: no checkpoint to load")
        if fs.isdir(inner):
            trimmed = path.rstrip("/")
            if ITER_NAME.match(os.path.basename(trimmed)):
                return os.path.dirname(trimmed), trimmed, None
            return trimmed, None, None
        pointer = read_pointer(path)
        assert pointer is not None
        pointer = self.locate(pointer)
        if not same_folder(pointer.save_dir, self.save_dir):
            if not self.allow_foreign_pointers:
                raise PointerMismatchError(
                    f"{path} names a checkpoint of {pointer.save_dir[:200]}, not of this engine's save_dir "
                    f"{self.save_dir}; pass EngineCheckpointIO(..., allow_foreign_pointers=True) to resume another "
                    "run's checkpoint, or load its checkpoint folder (iter_*) itself"
                )
            logger.warning(
                "%s names a checkpoint of %s, not of this engine's save_dir %s; loading it "
                "(allow_foreign_pointers=True)",
                path,
                pointer.save_dir[:200],
                self.save_dir,
            )
        if _LAST_NAME.match(os.path.basename(path)):
            return pointer.save_dir, None, None
        return pointer.save_dir, pointer.folder, pointer

    def locate(self, pointer: Pointer) -> Pointer:
        """``pointer``, in the folder it names relative to itself where that is elsewhere than the
        ``save_dir`` it was written with (a copied or moved run) and the checkpoint there is the
        very save it was written for (its ``save_id``); else as written. A pointer copied alone
        into another run's folder therefore still names its own run's checkpoint."""
        moved = pointer.moved_dir
        if moved is None or pointer.save_id is None:
            return pointer
        try:
            structure, _, _ = self._read_structure(moved, f"{moved.rstrip('/')}/{pointer.checkpoint}", where=moved)
        except CkptEngineError:
            return pointer
        if structure.get("save_id") != pointer.save_id:
            return pointer
        return dataclasses.replace(pointer, save_dir=moved, moved_dir=None)

    def _engine(self, save_dir: str, folder: str | None, *, verify: str | None = None) -> Any:
        """An engine that only loads: ``folder`` exactly, or the latest of ``save_dir``."""
        from .. import CheckpointEngine

        update: dict[str, Any] = {
            "plugins": tuple(p for p in self.config.plugins if p.name != "pinned_staging"),
            "keys_not_to_resume": tuple(k for k in self.config.keys_not_to_resume if k != COMPONENT),
        }
        if folder is None:
            update |= {"load_dir": save_dir, "load_path": None}
        else:
            update |= {"load_dir": folder, "load_path": folder, "load_training_state": True}
            update["only_load_scheduler_state"] = False
        if verify is not None:
            update["verify"] = verify
        return CheckpointEngine(self.config.model_copy(update=update), plugins=self.plugins)

    def _read_structure(self, save_dir: str, folder: str | None, where: str) -> tuple[dict[str, Any], str, int]:
        """The checkpoint's structure JSON, folder and iteration (a first, small load of one key)."""
        probe = Items({STRUCTURE_KEY: ""})
        verify = "sizes" if self.config.verify == "checksums" else None  # the full load verifies checksums
        try:
            with self._engine(save_dir, folder, verify=verify) as reader:
                result = reader.load(extra={COMPONENT: probe})
        except IncompleteCheckpointError as err:
            if self._has_component(save_dir, folder):
                raise
            raise NotALightningCheckpointError(
                f"{where}: the checkpoint has no {COMPONENT!r} component, so it was not saved by EngineCheckpointIO; "
                f"load its model weights with CheckpointEngine.load(model=...) instead ({err})"
            ) from err
        except LoadStrictnessError as err:
            raise NotALightningCheckpointError(
                f"{where}: the checkpoint has no {COMPONENT!r} component with a {STRUCTURE_KEY!r} key, so it was not "
                "saved by EngineCheckpointIO; load its model weights with CheckpointEngine.load(model=...) "
                f"instead ({err})"
            ) from err
        if result.checkpoint_path is None:
            raise CheckpointNotFoundError(
                f"{where}: {save_dir} has no committed checkpoint yet (no latest_checkpoint.txt); "
                "start without ckpt_path, or pass an existing checkpoint"
            )
        raw = probe.items.get(STRUCTURE_KEY)
        structure = parse_structure(raw, f"{result.checkpoint_path}/{COMPONENT}") if isinstance(raw, str) else None
        if not isinstance(structure, dict) or structure.get("format") != POINTER_FORMAT:
            raise CorruptCheckpointError(
                f"{result.checkpoint_path}/{COMPONENT}: {STRUCTURE_KEY!r} is not the structure "
                "EngineCheckpointIO writes"
            )
        return structure, result.checkpoint_path, result.iteration

    def _has_component(self, save_dir: str, folder: str | None) -> bool:
        if folder is None:
            name = latest_checkpoint(save_dir, self.config.storage)
            if name is None:
                return True  # nothing to tell: let the engine's error stand
            folder = f"{save_dir.rstrip('/')}/{name}"
        fs, inner = url_to_fs(f"{folder}/{COMPONENT}")
        return bool(fs.exists(inner))

    def _read_checkpoint(
        self,
        structure: dict[str, Any],
        checkpoint_dir: str,
        like: Mapping[str, Any],
        source: tuple[str, str | None, int],
    ) -> dict[str, Any]:
        """The checkpoint dict, read by the rule that found ``structure`` (``source``: the save
        folder, the folder named, and the iteration found): a step the node-local tier resharded
        for the first read is gone after it, and is resharded again."""
        where = f"{checkpoint_dir}/{COMPONENT}"
        live_model = like.get("state_dict")
        live_model = live_model if isinstance(live_model, Mapping) else {}
        live_rest = {k: v for k, v in like.items() if k != "state_dict"}
        try:
            model_spec = {
                k: live_target(live_model.get(k), parse_dtype(d, where), shape)
                for k, (d, shape) in structure["model"].items()
            }
            items = Items({STRUCTURE_KEY: "", **skeleton(structure["tree"], where, like={"checkpoint": live_rest})})
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptCheckpointError(f"{where}: malformed structure ({err})") from err
        module = tensor_module(model_spec)
        save_dir, folder, iteration = source
        with self._engine(save_dir, folder) as reader:
            result = reader.load(model=module if model_spec else None, extra={COMPONENT: items})
        if result.iteration != iteration:
            raise CheckpointNotFoundError(
                f"{where}: {save_dir}'s latest moved from iteration {iteration} to {result.iteration} while it "
                "was read (another job saving into it?); load again"
            )
        skipped = set(result.report["model"].skipped) if model_spec else set()
        value = unflatten(structure["tree"], items.items, where)
        checkpoint: dict[str, Any] = value["checkpoint"]
        if structure.get("has_state_dict", True):
            state_dict: OrderedDict[Any, Any] = OrderedDict()
            for key in structure.get("state_dict_order", []):
                if key in model_spec and key not in skipped:
                    state_dict[key] = model_spec[key]
            for key, other in value["state_dict_other"].items():
                state_dict[key] = other
            checkpoint["state_dict"] = state_dict
        if checkpoint.get("global_step", result.iteration) != result.iteration:
            raise CheckpointLoadError(
                f"{checkpoint_dir}: global_step {checkpoint.get('global_step')} differs from the engine iteration "
                f"{result.iteration}"
            )
        return checkpoint
