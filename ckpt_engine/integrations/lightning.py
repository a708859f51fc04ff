"""A Lightning ``CheckpointIO`` that saves and resumes through the engine (``Trainer(plugins=[io])``).

Every checkpoint Lightning saves becomes an engine checkpoint ``<save_dir>/iter_{global_step:09}/``
(committed atomically, with its manifest and checksums, retention, ``pinned_staging`` async saves
and object storage as configured), with these components:

* ``model``: the LightningModule's state dict (its tensors, same keys), as any engine model;
* ``trainer``: the iteration, which is Lightning's ``global_step``;
* ``lightning``: everything else Lightning put in the checkpoint (optimizer and LR scheduler
  states, loops, callbacks, epoch, hyper-parameters, precision state, what ``on_save_checkpoint``
  added), its tensors as tensors and its shape as JSON under the key ``__structure__``.

At the path Lightning chose (``epoch=1-step=8.ckpt``, ``last.ckpt``) a small JSON *pointer file*
names the engine checkpoint; it is written once the checkpoint is committed. Loading a pointer
named ``last*.ckpt`` (what ``ckpt_path="last"`` resolves to) resumes from the engine's
``latest_checkpoint.txt``; any other pointer loads the checkpoint it names. ``docs/integrations.md``
describes the mapping and its limits.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO

from .._format import bounded_json
from .._format.layout import CheckpointInUseError, remove_checkpoint
from .._format.pointer import read_latest
from .._markers import hookimpl
from .._storage.store import open_store
from .._storage.urls import is_url
from ..config import EngineConfig
from ..errors import (
    ArgumentTypeError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointSaveError,
    CkptEngineError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadStrictnessError,
)
from ..types import SaveResult
from ._pointers import (
    ITER_NAME,
    LAST_ALIAS,
    POINTER_FOLDERS_FILE,
    POINTER_FORMAT,
    NotALightningCheckpointError,
    Pointer,
    PointerFolders,
    PointerMismatchError,
    read_pointer,
    same_save_dir,
    url_to_fs,
    write_file,
)
from ._state_tree import dtype_name, flatten, parse_dtype, skeleton, tensor_module, unflatten

__all__ = [
    "COMPONENT",
    "LAST_ALIAS",
    "MAX_STRUCTURE_DEPTH",
    "POINTER_FOLDERS_FILE",
    "POINTER_FORMAT",
    "EngineCheckpointIO",
    "NotALightningCheckpointError",
    "PointerMismatchError",
    "UnsupportedStrategyError",
    "parse_structure",
    "read_pointer",
]

logger = logging.getLogger("ckpt_engine")

#: The engine component that holds everything of a Lightning checkpoint but the model weights.
COMPONENT = "lightning"
#: The key, in :data:`COMPONENT`, of the JSON that describes the checkpoint dict's structure.
STRUCTURE_KEY = "__structure__"
_LAST_NAME = re.compile(r"^last(-\d+|-v\d+|-engine)?\.ckpt$")
#: Deepest nesting of the structure JSON (each level of the checkpoint dict takes about three),
#: checked when it is written and before it is parsed; the most digits of an integer in it.
MAX_STRUCTURE_DEPTH = 384
_MAX_STRUCTURE_INT_DIGITS = 4000


class UnsupportedStrategyError(CkptEngineError, RuntimeError):
    """The strategy runs several processes: Lightning calls ``CheckpointIO`` on global rank 0
    only, while every engine save is collective (see ``docs/integrations.md``)."""


class _Items:
    """A flat mapping as an engine ``extra=`` component (``Stateful``)."""

    def __init__(self, items: dict[str, Any]) -> None:
        self.items = items

    def state_dict(self) -> dict[str, Any]:
        return self.items

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        self.items = dict(state_dict)


class _CommitObserver:
    """An engine plugin: writes the pointer files of a save once the engine has committed it."""

    name = "lightning_pointers"

    def __init__(self, io: EngineCheckpointIO) -> None:
        self._io = io

    @hookimpl
    def on_save_done(self, result: SaveResult) -> None:
        self._io._save_done(result)


def parse_structure(raw: str, where: str) -> Any:
    """The structure JSON ``raw`` of the checkpoint component ``where``, parsed within bounds:
    :class:`~ckpt_engine.CorruptCheckpointError` naming ``where`` for text nested deeper than
    :data:`MAX_STRUCTURE_DEPTH`, an integer of thousands of digits, or text that is not JSON."""
    try:
        return bounded_json.loads(raw, max_depth=MAX_STRUCTURE_DEPTH, max_int_digits=_MAX_STRUCTURE_INT_DIGITS)
    except bounded_json.JSONRefused as err:
        raise CorruptCheckpointError(f"{where}: {STRUCTURE_KEY!r} cannot be read: {err}") from None


def _require_one_process(what: str) -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            raise UnsupportedStrategyError(
                f"EngineCheckpointIO cannot {what} under a strategy with {world} processes: Lightning calls a "
                "CheckpointIO on global rank 0 only, and every engine save is collective over all ranks. Use a "
                "single-device strategy, or call CheckpointEngine.save()/load() on every rank from your own "
                "callback (docs/integrations.md)"
            )


class EngineCheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O through a :class:`~ckpt_engine.CheckpointEngine`.

    ``config`` is what :class:`~ckpt_engine.CheckpointEngine` takes (an :class:`EngineConfig`, a
    mapping or a config file path); ``plugins`` are plugin objects registered besides the
    configured ones. The engine is created at the first save and closed by ``teardown()`` (the
    end of ``fit``), which waits for pending async saves. A pointer file is trusted only as far as
    it checks out: it must name a checkpoint of this engine's ``save_dir`` (another run's only with
    ``allow_foreign_pointers=True``, and then with a warning naming both), holding the iteration
    it claims.
    """

    def __init__(
        self,
        config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str],
        *,
        plugins: Sequence[Any] = (),
        allow_foreign_pointers: bool = False,
    ):
        super().__init__()
        self.config = EngineConfig.coerce(config)
        self._plugins = tuple(plugins)
        self.allow_foreign_pointers = allow_foreign_pointers
        self._engine: Any = None
        self._lock = threading.Lock()
        #: iteration -> Lightning paths whose pointer waits for that iteration's commit.
        self._pending: dict[int, list[str]] = {}
        #: Iterations this object saved (or is saving) and those committed: Lightning saves one
        #: step under several names (a top-k file, then ``last.ckpt``); the engine writes it once.
        self._saved: set[int] = set()
        self._committed: set[int] = set()
        self._pointer_errors: list[str] = []
        #: Engine checkpoints whose last pointer Lightning removed, to delete once not the latest.
        self._doomed: dict[str, Pointer] = {}
        self._folders = PointerFolders(self.save_dir)

    # -- the engine -------------------------------------------------------------------------

    @property
    def save_dir(self) -> str:
        """Where the engine checkpoints are (absolute for a local folder)."""
        d = self.config.save_dir
        return d if is_url(d) else os.path.abspath(d)

    @property
    def engine(self) -> Any:
        """The :class:`~ckpt_engine.CheckpointEngine` of this run (created on first use)."""
        if self._engine is None:
            from .._engine.engine import CheckpointEngine

            self._engine = CheckpointEngine(self.config, plugins=[*self._plugins, _CommitObserver(self)])
        return self._engine

    def teardown(self) -> None:
        """Wait for pending saves (raising a failed one), then close the engine."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()
        self._raise_pointer_errors()

    # -- save -------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as engine checkpoint ``iter_{global_step:09}``; the pointer at
        ``path`` is written once it is committed (at once for a synchronous save)."""
        if storage_options is not None:
            raise ArgumentTypeError(
                "EngineCheckpointIO takes no storage_options: storage is configured in the engine config "
                "(save_dir, storage); remove storage_options from trainer.save_checkpoint()"
            )
        _require_one_process("save")
        self._raise_pointer_errors()
        if not isinstance(checkpoint, Mapping):
            raise ArgumentTypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}")
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ArgumentTypeError(
                f"the checkpoint's 'global_step' is {step!r}; EngineCheckpointIO names engine checkpoints by it "
                "and needs a non-negative int"
            )
        target = os.fspath(path)
        with self._lock:
            again, committed = step in self._saved, step in self._committed
            if not committed:
                self._pending.setdefault(step, []).append(target)
            self._saved.add(step)
        if again:  # the same step under another name: point at the one engine checkpoint
            if committed:
                self._write_pointers(step, [target])
            return
        model, items = self._split(checkpoint)
        try:
            self.engine.save(step, model=model, extra={COMPONENT: _Items(items)})
        except BaseException:
            with self._lock:
                self._pending.pop(step, None)
                self._saved.discard(step)
            raise

    def _split(self, checkpoint: Mapping[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]]:
        """The model module (the state dict's tensors) and the ``lightning`` component's items."""
        rest = dict(checkpoint)
        state_dict = rest.pop("state_dict", None)
        state_dict = state_dict if isinstance(state_dict, Mapping) else {}
        tensors = {k: v for k, v in state_dict.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
        others = {k: v for k, v in state_dict.items() if k not in tensors}
        encoded: str | None = None
        try:  # a dict nested past the recursion limit fails in flatten or in json.dumps
            tree, items = flatten({"checkpoint": rest, "state_dict_other": others}, frozenset({STRUCTURE_KEY}))
            structure = {
                "format": POINTER_FORMAT,
                "version": 1,
                "has_state_dict": "state_dict" in checkpoint,
                "state_dict_order": [k if isinstance(k, str) else None for k in state_dict],
                "model": {k: [dtype_name(v.dtype), list(v.shape)] for k, v in tensors.items()},
                "tree": tree,
            }
            encoded = json.dumps(structure, separators=(",", ":"))
        except RecursionError:
            pass
        if encoded is None or bounded_json.nesting(encoded.encode()) > MAX_STRUCTURE_DEPTH:
            raise ArgumentTypeError(
                f"the checkpoint dict nests deeper than EngineCheckpointIO stores (about {MAX_STRUCTURE_DEPTH // 3} "
                "levels of dicts and lists); flatten the deep part in on_save_checkpoint"
            )
        items[STRUCTURE_KEY] = encoded
        return tensor_module(tensors), items

    def _save_done(self, result: SaveResult) -> None:
        with self._lock:
            paths = self._pending.pop(result.iteration, [])
            if result.succeeded:
                self._committed.add(result.iteration)
            else:
                self._saved.discard(result.iteration)
        if result.succeeded and paths:
            self._write_pointers(result.iteration, paths)
        if result.succeeded:
            try:
                self._remove_doomed()
            except (CkptEngineError, OSError) as err:  # on the commit thread: never fail the committed save
                logger.error("removing checkpoints Lightning no longer keeps failed: %s", err)

    def _write_pointers(self, iteration: int, paths: list[str]) -> None:
        """Write the pointers of a committed checkpoint, and refresh :data:`LAST_ALIAS` beside them.
        Runs on the engine's commit thread for background saves: a failure is raised by the next
        save or ``teardown()`` (the checkpoint itself stays committed)."""
        name = f"iter_{iteration:09}"
        body = {"format": POINTER_FORMAT, "save_dir": self.save_dir, "checkpoint": name, "iteration": iteration}
        folders = {os.path.dirname(p) for p in paths}
        try:
            self._folders.add(folders)
        except (CkptEngineError, OSError) as err:
            logger.error("cannot record the pointer folders %s in %s: %s", sorted(folders), self.save_dir, err)
            with self._lock:
                self._pointer_errors.append(f"{self._folders.record}: {err}")
        jobs = [(p, body) for p in paths] + [(os.path.join(d, LAST_ALIAS), {**body, "latest": True}) for d in folders]
        for p, content in jobs:
            try:
                write_file(p, (json.dumps(content, indent=1) + "\n").encode())
            except OSError as err:
                logger.error("cannot write the Lightning pointer %s to %s: %s", p, name, err)
                with self._lock:
                    self._pointer_errors.append(f"{p}: {err}")

    def _raise_pointer_errors(self) -> None:
        with self._lock:
            errors, self._pointer_errors = self._pointer_errors, []
        if errors:
            raise CheckpointSaveError(
                "the engine committed the checkpoint, but writing its Lightning pointer file failed: "
                + "; ".join(errors)
                + f". Resume with ckpt_path='last' or with the checkpoint folder in {self.save_dir}"
            )

    # -- load -------------------------------------------------------------------------------

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict Lightning saved, read through the engine (verified, strict).

        ``path`` is a pointer file (``last*.ckpt``: the engine's latest), an engine checkpoint
        folder ``iter_*`` or a save folder (its latest). Tensors are returned on the CPU, and
        values are read with ``weights_only`` unless the config sets ``trust_checkpoint``
        (``map_location`` and ``weights_only`` are not needed: Lightning copies the tensors
        into the model and optimizers on their devices).
        """
        _require_one_process("load")
        if self._engine is not None:
            self._engine.wait()  # a pending async save of this run commits before anything is read
        where = os.fspath(path)
        save_dir, folder, claimed = self._resolve(where)
        structure, checkpoint_dir, iteration = self._read_structure(save_dir, folder, where=where)
        if claimed is not None and iteration != claimed:
            raise PointerMismatchError(
                f"{where} claims iteration {claimed}, but {checkpoint_dir} holds iteration {iteration}; the pointer "
                "or the checkpoint was replaced. Load the checkpoint folder itself if it is the one you want"
            )
        return self._read_checkpoint(structure, checkpoint_dir)

    def _resolve(self, path: str) -> tuple[str, str | None, int | None]:
        """``(save_dir, checkpoint folder, the iteration a pointer claims)``; the folder ``None``
        means the save folder's latest (which is what a ``last*.ckpt`` pointer stands for)."""
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
        if not same_save_dir(pointer.save_dir, self.save_dir):
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
        return pointer.save_dir, pointer.folder, pointer.iteration

    def _reader(self, save_dir: str, folder: str | None, *, verify: str | None = None) -> Any:
        """An engine that only loads: ``folder`` exactly, or the latest of ``save_dir``. It has
        the configured load plugins, not ``pinned_staging`` (it never saves)."""
        from .._engine.engine import CheckpointEngine

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
        return CheckpointEngine(self.config.model_copy(update=update), plugins=self._plugins)

    def _read_structure(self, save_dir: str, folder: str | None, where: str) -> tuple[dict[str, Any], str, int]:
        """The checkpoint's structure JSON, folder and iteration (a first, small load of one key)."""
        probe = _Items({STRUCTURE_KEY: ""})
        verify = "sizes" if self.config.verify == "checksums" else None  # the full load verifies checksums
        try:
            with self._reader(save_dir, folder, verify=verify) as reader:
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
            name = read_latest(save_dir, open_store(save_dir, self.config.storage))
            if name is None:
                return True  # nothing to tell: let the engine's error stand
            folder = f"{save_dir.rstrip('/')}/{name}"
        fs, inner = url_to_fs(f"{folder}/{COMPONENT}")
        return bool(fs.exists(inner))

    def _read_checkpoint(self, structure: dict[str, Any], checkpoint_dir: str) -> dict[str, Any]:
        where = f"{checkpoint_dir}/{COMPONENT}"
        try:
            model_spec = {
                k: torch.empty(shape, dtype=parse_dtype(d, where)) for k, (d, shape) in structure["model"].items()
            }
            items = _Items({STRUCTURE_KEY: "", **skeleton(structure["tree"], where)})
        except (KeyError, TypeError, ValueError) as err:
            raise CorruptCheckpointError(f"{where}: malformed structure ({err})") from err
        module = tensor_module(model_spec)
        with self._reader(os.path.dirname(checkpoint_dir), checkpoint_dir) as reader:
            result = reader.load(model=module if model_spec else None, extra={COMPONENT: items})
        skipped = set(result.report["model"].skipped) if model_spec else set()
        value = unflatten(structure["tree"], items.items, where)
        checkpoint: dict[str, Any] = value["checkpoint"]
        if structure.get("has_state_dict", True):
            others = value["state_dict_other"]
            state_dict: OrderedDict[Any, Any] = OrderedDict()
            for key in structure.get("state_dict_order", []):
                if key in model_spec and key not in skipped:
                    state_dict[key] = model_spec[key]
            for key, other in others.items():
                state_dict[key] = other
            checkpoint["state_dict"] = state_dict
        if checkpoint.get("global_step", result.iteration) != result.iteration:
            raise CheckpointLoadError(
                f"{checkpoint_dir}: global_step {checkpoint.get('global_step')} differs from the engine iteration "
                f"{result.iteration}"
            )
        return checkpoint

    # -- remove -----------------------------------------------------------------------------

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` (Lightning's ``save_top_k``), and the engine checkpoint
        it names once no pointer of this engine names it any more, in any folder this integration
        wrote pointers into, unless it is the latest."""
        path = os.fspath(path)
        with self._lock:
            for paths in self._pending.values():
                while path in paths:
                    paths.remove(path)
        try:
            pointer = read_pointer(path)
        except CkptEngineError:  # not a pointer (a FIFO, a torch.save file): nothing of ours to delete
            pointer = None
        fs, inner = url_to_fs(path)
        if fs.exists(inner) and not fs.isdir(inner):
            fs.rm_file(inner)
        if pointer is None or not same_save_dir(pointer.save_dir, self.save_dir):
            return
        self._folders.add({os.path.dirname(path)}, record=False)
        with self._lock:
            self._doomed[pointer.checkpoint] = pointer
        self._remove_doomed()

    def _remove_doomed(self) -> None:
        """Delete the engine checkpoints Lightning no longer names, except the latest one: while
        an async save is in flight, the one Lightning just replaced is still the latest, so it
        goes after the next commit."""
        with self._lock:
            doomed = list(self._doomed.values())
        if not doomed:
            return
        store = open_store(self.save_dir, self.config.storage)
        latest = read_latest(self.save_dir, store)
        named: set[str] | None = None
        for pointer in doomed:
            if pointer.checkpoint == latest:
                continue
            with self._lock:
                self._doomed.pop(pointer.checkpoint, None)
            named = self._folders.named() if named is None else named
            if pointer.checkpoint in named:
                continue
            try:
                remove_checkpoint(pointer.folder, store)
            except CheckpointInUseError as err:
                logger.warning("not removing %s: %s", pointer.folder, err)
            except FileNotFoundError:
                pass  # the engine's own retention (keep_last) removed it first
