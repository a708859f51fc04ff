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
``latest_checkpoint.txt``; any other pointer loads the checkpoint it names.

It runs under a single-device strategy, under DDP (``strategy="ddp"``) and under
``ModelParallelStrategy`` (FSDP2, DTensor): when Lightning connects the IO to its strategy,
while the ``Trainer`` is built, the strategy is made to save and load through the IO on every
rank (an engine save is collective; Lightning would call a ``CheckpointIO`` on rank 0 alone), and
any other strategy is refused there (``_lightning_strategies``). ``docs/integrations.md``
describes the mapping and its limits.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.strategies import Strategy

from .._format import bounded_json
from .._format.layout import CheckpointInUseError, remove_checkpoint
from .._format.pointer import read_latest
from .._markers import hookimpl
from .._storage.store import open_store
from .._storage.urls import is_url
from ..config import EngineConfig
from ..errors import ArgumentTypeError, CheckpointSaveError, CkptEngineError
from ..types import SaveResult
from ._lightning_read import (
    COMPONENT,
    MAX_STRUCTURE_DEPTH,
    STRUCTURE_KEY,
    CheckpointReader,
    Items,
    parse_structure,
)
from ._lightning_strategies import Connection, IOCalls, UnsupportedStrategyError, connect, install
from ._pointers import (
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
from ._state_tree import dtype_name, flatten, tensor_module

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


class _CommitObserver:
    """An engine plugin: writes the pointer files of a save once the engine has committed it."""

    name = "lightning_pointers"

    def __init__(self, io: EngineCheckpointIO) -> None:
        self._io = io

    @hookimpl
    def on_save_done(self, result: SaveResult) -> None:
        self._io._save_done(result)


def _world() -> tuple[int, int]:
    """``(global rank, world size)`` of the default process group; ``(0, 1)`` without one."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _alone(flag: bool) -> bool:
    return flag


class EngineCheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O through a :class:`~ckpt_engine.CheckpointEngine`.

    ``config`` is what :class:`~ckpt_engine.CheckpointEngine` takes (an :class:`EngineConfig`, a
    mapping or a config file path); ``plugins`` are plugin objects registered besides the
    configured ones. The engine is created at the first save and closed by ``teardown()`` (the
    end of ``fit``), which waits for pending async saves. A pointer file is trusted only as far as
    it checks out: it must name a checkpoint of this engine's ``save_dir`` (another run's only with
    ``allow_foreign_pointers=True``, and then with a warning naming both), holding the iteration
    it claims.

    Under DDP and ``ModelParallelStrategy`` every rank saves and loads (the strategy calls the IO
    on every rank); global rank 0 writes the pointer files and removes what Lightning no longer
    keeps. Any other strategy with several processes is refused when the ``Trainer`` is built.
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
        #: How the IO runs under the strategy Lightning connected it to (none: called directly).
        self._connection: Connection | None = None
        self._lock = threading.Lock()
        #: iteration -> Lightning paths whose pointer waits for that iteration's commit (rank 0).
        self._pending: dict[int, list[str]] = {}
        #: Iterations this object saved (or is saving) and those committed: Lightning saves one
        #: step under several names (a top-k file, then ``last.ckpt``); the engine writes it once.
        #: The same on every rank, so that every rank makes the same call to the collective save:
        #: a background save that failed stays in it (the engine raises its failure on every rank),
        #: so that no rank's commit thread makes it save again a step the other ranks skip.
        self._saved: set[int] = set()
        self._committed: set[int] = set()
        self._pointer_errors: list[str] = []
        #: Engine checkpoints whose last pointer Lightning removed, to delete once not the latest.
        self._doomed: dict[str, Pointer] = {}
        self._folders = PointerFolders(self.save_dir)

    # -- the engine and the strategy --------------------------------------------------------

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

    def _connect(self, strategy: Strategy) -> None:
        """Lightning connected this IO to ``strategy`` (the ``Trainer`` is being built): run under
        it, or raise :class:`UnsupportedStrategyError` naming the fix."""
        self._connection = connect(strategy, IOCalls(save=self._save, load=self._load, teardown=self.teardown))

    def _check_world(self, what: str) -> None:
        if self._connection is not None and self._connection.collective:
            return
        world = _world()[1]
        if world > 1:
            raise UnsupportedStrategyError(
                f"EngineCheckpointIO cannot {what} from one rank of a job of {world} processes: every engine save "
                "and load is collective over all ranks. Give it to the Trainer (plugins=[io]) with strategy='ddp' or "
                "ModelParallelStrategy, which call it on every rank (docs/integrations.md)"
            )

    # -- save -------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as engine checkpoint ``iter_{global_step:09}``; the pointer at
        ``path`` is written once it is committed (at once for a synchronous save)."""
        self._check_world("save")
        self._save(checkpoint, path, storage_options, _alone)

    def _save(self, checkpoint: dict[str, Any], path: Any, storage_options: Any, agree: Callable[[bool], bool]) -> None:
        """One save, on every rank of the job alike; ``agree(flag)``: ``flag`` on any rank."""
        if storage_options is not None:
            raise ArgumentTypeError(
                "EngineCheckpointIO takes no storage_options: storage is configured in the engine config "
                "(save_dir, storage); remove storage_options from trainer.save_checkpoint()"
            )
        with self._lock:
            failed = bool(self._pointer_errors)
        if agree(failed):  # every rank stops here, not only global rank 0, which holds the errors
            self._raise_pointer_errors()
            raise CheckpointSaveError(
                "global rank 0 could not write the Lightning pointer file of a checkpoint the engine committed (its "
                f"error names the file); resume with ckpt_path='last' or with the checkpoint folder in {self.save_dir}"
            )
        if not isinstance(checkpoint, Mapping):
            raise ArgumentTypeError(f"checkpoint must be a dict, got {type(checkpoint).__name__}")
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ArgumentTypeError(
                f"the checkpoint's 'global_step' is {step!r}; EngineCheckpointIO names engine checkpoints by it "
                "and needs a non-negative int"
            )
        rank = _world()[0]
        target = os.fspath(path)
        with self._lock:
            again, committed = step in self._saved, step in self._committed
            if not committed and rank == 0:
                self._pending.setdefault(step, []).append(target)
            self._saved.add(step)
        if again:  # the same step under another name: point at the one engine checkpoint
            if committed and rank == 0:
                self._write_pointers(step, [target])
            return
        model, items = self._split(checkpoint)
        try:
            self.engine.save(step, model=model, extra={COMPONENT: Items(items)})
        except BaseException:
            with self._lock:
                self._pending.pop(step, None)
                self._saved.discard(step)
            raise

    def _split(self, checkpoint: Mapping[str, Any]) -> tuple[torch.nn.Module, dict[str, Any]]:
        """The model module (the state dict's tensors) and the ``lightning`` component's items.

        Under DDP and ``ModelParallelStrategy`` every rank gives its own checkpoint dict (so all
        ranks fail together on a bad one). What several ranks give under one key (the replicated
        model and optimizer of DDP, the loops, the structure) the engine writes once, from the
        lowest rank that gives it (``dedup_save_to_lowest_rank``): the checkpoint holds global
        rank 0's values, as Lightning's would. DTensors are written as each rank's shard."""
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
        self._check_world("load")
        return self._load(path, None)

    def _load(self, path: Any, like: Mapping[str, Any] | None) -> dict[str, Any]:
        """The load on every rank alike; ``like``: live tensors to read into (a sharded model's)."""
        if self._engine is not None:
            self._engine.wait()  # a pending async save of this run commits before anything is read
        reader = CheckpointReader(
            self.config, self._plugins, self.save_dir, allow_foreign_pointers=self.allow_foreign_pointers
        )
        return reader.read(os.fspath(path), like)

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


def _on_connect(strategy: Strategy, io: CheckpointIO) -> None:
    if isinstance(io, EngineCheckpointIO):
        io._connect(strategy)


install(_on_connect)
