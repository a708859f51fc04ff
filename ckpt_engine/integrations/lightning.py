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
``latest_checkpoint.txt``; any other pointer loads the checkpoint it names. Importing this
module also makes ``LightningModule.load_from_checkpoint`` (and ``LightningDataModule``'s) read
those paths through the engine (:func:`install_load_from_checkpoint`).

It runs under a single-device strategy, under DDP (``strategy="ddp"``) and under
``ModelParallelStrategy`` (FSDP2, DTensor): when Lightning connects the IO to its strategy,
while the ``Trainer`` is built, the strategy is made to save and load through the IO on every
rank (an engine save is collective; Lightning would call a ``CheckpointIO`` on rank 0 alone), and
any other strategy is refused there (``_lightning_strategies``). ``docs/integrations.md``
describes the mapping and its limits.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.strategies import Strategy

from .. import hookimpl
from .._dcpio import dist as _dist
from .._storage.paths import same_folder
from .._storage.urls import is_url
from ..checkpoints import CheckpointInUseError, latest_checkpoint, remove_checkpoint
from ..config import EngineConfig
from ..errors import ArgumentTypeError, CheckpointExistsError, CheckpointSaveError, CkptEngineError
from ..types import SaveResult
from ._lightning_read import (
    COMPONENT,
    MAX_STRUCTURE_DEPTH,
    CheckpointReader,
    Items,
    parse_structure,
)
from ._lightning_strategies import Connection, IOCalls, UnsupportedStrategyError, connect, install
from ._lightning_write import split_checkpoint
from ._pointers import (
    ITER_NAME,
    LAST_ALIAS,
    POINTER_FOLDERS_FILE,
    POINTER_FORMAT,
    NotALightningCheckpointError,
    Pointer,
    PointerFolders,
    PointerMismatchError,
    pointer_body,
    read_pointer,
    url_to_fs,
    write_file,
)
from ._state_tree import differing_keys, fingerprint_checkpoint

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
    "engine_checkpoint_dict",
    "install_load_from_checkpoint",
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


#: The attributes of an ``EngineCheckpointIO`` that belong to the running process (not pickled).
_RUNTIME_STATE = (
    "_engine",
    "_lock",
    "_pending",
    "_saved",
    "_committed",
    "_pointer_errors",
    "_doomed",
    "_folders",
    "_fingerprints",
    "_save_ids",
    "_ids",
    "_resumed",
)


class _SaveIds:
    """Ids for new saves, the same on every rank (a save's structure is saved once, not per rank,
    and its pointers name it): rank 0's random id, drawn at the first save, and a count."""

    def __init__(self) -> None:
        self.base: str | None = None
        self.count = 0

    def next(self) -> str:
        """The next id (collective at the first call: every rank calls it alike)."""
        if self.base is None:
            self.base = _dist.broadcast_object(uuid.uuid4().hex, step="lightning: the id of a save")
        self.count += 1
        return f"{self.base}-{self.count}"


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
        #: How the IO runs under the strategy Lightning connected it to (none: called directly).
        self._connection: Connection | None = None
        self._engine: Any
        self._lock: threading.Lock
        self._pending: dict[int, list[str]]
        self._saved: set[int]
        self._committed: set[int]
        self._pointer_errors: list[str]
        self._doomed: dict[str, Pointer]
        self._folders: PointerFolders
        self._fingerprints: dict[int, dict[str, str]]
        self._save_ids: dict[int, str]
        self._ids: _SaveIds
        self._resumed: tuple[int, str | None] | None
        self._reset_runtime()

    def __getstate__(self) -> dict[str, Any]:
        """What pickles (``torch.save(trainer)``, a copied ``Trainer``): the configuration and the
        strategy connection; not the lock, the engine or the saves in flight, which belong to
        this process (a copy creates its own engine at its first save)."""
        state = self.__dict__.copy()
        for runtime in _RUNTIME_STATE:
            state.pop(runtime, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._engine = None
        self._lock = threading.Lock()
        #: iteration -> Lightning paths whose pointer waits for that iteration's commit (rank 0).
        self._pending = {}
        #: Iterations this object saved (or is saving) and those committed: Lightning saves one
        #: step under several names (a top-k file, then ``last.ckpt``); the engine writes it once.
        #: The same on every rank, so that every rank makes the same call to the collective save:
        #: a background save that failed stays in it (the engine raises its failure on every rank),
        #: so that no rank's commit thread makes it save again a step the other ranks skip.
        self._saved = set()
        self._committed = set()
        self._pointer_errors = []
        #: Engine checkpoints whose last pointer Lightning removed, to delete once not the latest.
        self._doomed = {}
        self._folders = PointerFolders(self.save_dir)
        #: step -> digests of the state saved at that step, and the id of its save (in its pointers).
        self._fingerprints = {}
        self._save_ids = {}
        self._ids = _SaveIds()
        #: The global step (and save id) of the checkpoint of this save folder the fit resumed.
        self._resumed = None

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
            from .. import CheckpointEngine

            self._engine = CheckpointEngine(self.config, plugins=[*self._plugins, _CommitObserver(self)])
            if self._resumed is not None:  # its node-local tier's saves go on from that step
                self._engine.resumed_from(self._resumed[0])
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
        fingerprint = fingerprint_checkpoint(checkpoint, self._bookkeeping_callbacks())
        if self._resaves_the_resumed_step(step, target, rank, fingerprint):
            return
        with self._lock:
            again = step in self._saved
            changed = differing_keys(self._fingerprints.get(step, {}), fingerprint) if again else []
        if again and agree(bool(changed)):  # every rank decides alike
            self._replace_step(step, target, changed)
        new_id = None if step in self._saved else self._ids.next()  # only this thread adds to _saved
        with self._lock:
            again, committed = step in self._saved, step in self._committed
            if not committed and rank == 0:
                self._pending.setdefault(step, []).append(target)
            self._saved.add(step)
            if new_id is not None:
                self._fingerprints[step] = fingerprint
                self._save_ids[step] = new_id
            save_id = self._save_ids[step]
        if again:  # the same step under another name: point at the one engine checkpoint
            if committed and rank == 0:
                self._write_pointers(step, [target])
            return
        try:
            model, items = split_checkpoint(checkpoint, save_id)
            self.engine.save(step, model=model, extra={COMPONENT: Items(items)})
        except BaseException:
            with self._lock:
                self._pending.pop(step, None)
                self._saved.discard(step)
                self._fingerprints.pop(step, None)
            raise

    def _bookkeeping_callbacks(self) -> frozenset[str]:
        """The ``state_key``\\ s of the trainer's ``ModelCheckpoint`` callbacks (connected to a
        strategy with a module on a trainer): their state changes between the names of one save."""
        module = self._connection.strategy.lightning_module if self._connection is not None else None
        try:
            trainer = module.trainer if module is not None else None
        except RuntimeError:  # a module on no trainer
            trainer = None
        return frozenset(cb.state_key for cb in trainer.checkpoint_callbacks) if trainer is not None else frozenset()

    def _resaves_the_resumed_step(self, step: int, target: str, rank: int, fingerprint: dict[str, str]) -> bool:
        """Whether this save is of the global step the fit resumed from this save folder, not saved
        since: Lightning's ``ModelCheckpoint`` does not keep which step it saved last, so a fit
        resumed mid-accumulation (``accumulate_grad_batches``) saves that step again after its first
        micro-batch. The committed checkpoint is that step as the run saved it (a resume from it
        trains as the uninterrupted run); ``target`` is pointed at it (every rank decides alike)."""
        with self._lock:
            resumed = self._resumed
            if resumed is None or resumed[0] != step or step in self._saved:
                return False
            self._saved.add(step)
            self._committed.add(step)
            self._fingerprints[step] = fingerprint  # its other names, saved next, point at it too
            if resumed[1] is not None:
                self._save_ids[step] = resumed[1]
        logger.info("%s: global step %d is the step this fit resumed from; it names that checkpoint", target, step)
        if rank == 0:
            self._write_pointers(step, [target])
        return True

    def _replace_step(self, step: int, target: str, changed: list[str]) -> None:
        """A save of ``step``, already saved, with another state (``changed``: the keys that
        differ): refused with :class:`~ckpt_engine.CheckpointExistsError` unless ``allow_overwrite``
        lets it replace the checkpoint (whose earlier pointers then refuse to load it)."""
        name = f"iter_{step:09}"
        if not self.config.allow_overwrite:
            raise CheckpointExistsError(
                f"{target}: global step {step} is already saved as {self.save_dir}/{name} with another state (it "
                f"differs in {', '.join(changed[:8])}); EngineCheckpointIO keeps one checkpoint per global_step. "
                "Save after the next training step, or set allow_overwrite: true in the engine config to replace "
                f"{name} (the pointers saved before then refuse to load it)"
            )
        logger.warning(
            "%s: global step %d saved again with another state (%s); replacing %s",
            target,
            step,
            ", ".join(changed[:8]),
            name,
        )
        if self._engine is not None:
            self._engine.wait()  # the first save commits (and writes its pointers) before it is replaced
        with self._lock:
            self._saved.discard(step)
            self._committed.discard(step)

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
        with self._lock:
            save_id = self._save_ids.get(iteration)
        folders = {os.path.dirname(p) for p in paths}
        try:
            self._folders.add(folders)
        except (CkptEngineError, OSError) as err:
            logger.error("cannot record the pointer folders %s in %s: %s", sorted(folders), self.save_dir, err)
            with self._lock:
                self._pointer_errors.append(f"{self._folders.record}: {err}")
        jobs = [(p, False) for p in paths] + [(os.path.join(d, LAST_ALIAS), True) for d in folders]
        for p, latest in jobs:
            try:
                more = {"save_id": save_id, "latest": True} if latest else {"save_id": save_id}
                write_file(p, pointer_body(p, self.save_dir, iteration, **more))
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
        checkpoint = reader.read(os.fspath(path), like)
        step = checkpoint.get("global_step")
        folder, save_id = reader.last_read or ("", None)
        tier = self.config.local_dir  # a step the resume took from the node-local tier is the run's too
        ours = same_folder(os.path.dirname(folder.rstrip("/")), self.save_dir) or bool(
            tier and os.path.realpath(folder).startswith(os.path.join(os.path.realpath(tier), ""))
        )
        with self._lock:
            self._resumed = (step, save_id) if ours and isinstance(step, int) else None
        if self._resumed is not None and self._engine is not None:
            self._engine.resumed_from(self._resumed[0])
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
        if pointer is None or not same_folder(pointer.save_dir, self.save_dir):
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
        latest = latest_checkpoint(self.save_dir, self.config.storage)
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
                remove_checkpoint(pointer.folder, self.config.storage)
            except CheckpointInUseError as err:
                logger.warning("not removing %s: %s", pointer.folder, err)
            except FileNotFoundError:
                pass  # the engine's own retention (keep_last) removed it first


def _on_connect(strategy: Strategy, checkpoint_io: CheckpointIO) -> None:
    if isinstance(checkpoint_io, EngineCheckpointIO):
        checkpoint_io._connect(strategy)


install(_on_connect)


# -- LightningModule.load_from_checkpoint ------------------------------------------------------


def engine_checkpoint_dict(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The checkpoint dict at ``path`` when it is this integration's (a pointer file, an engine
    checkpoint folder ``iter_*`` or a save folder), read through an engine that only loads, with
    the default configuration for the checkpoint's own save folder (verified, values read
    ``weights_only``); ``None`` for anything else (a ``torch.save`` checkpoint, a missing path)."""
    where = os.fspath(path)
    fs, inner = url_to_fs(where)
    if not fs.exists(inner):
        return None
    if fs.isdir(inner):
        trimmed = where.rstrip("/")
        save_dir = os.path.dirname(trimmed) if ITER_NAME.match(os.path.basename(trimmed)) else trimmed
    else:
        try:
            pointer = read_pointer(where)
        except NotALightningCheckpointError:
            return None
        if pointer is None:
            return None
        save_dir = pointer.moved_dir or pointer.save_dir
        save_dir = (
            CheckpointReader(EngineConfig(save_dir=save_dir), (), save_dir, allow_foreign_pointers=True)
            .locate(pointer)
            .save_dir
        )
    reader = CheckpointReader(EngineConfig(save_dir=save_dir), (), save_dir, allow_foreign_pointers=False)
    return reader.read(where)


def _engine_aware(load: Callable[..., Any]) -> Callable[..., Any]:
    """Lightning's ``load_from_checkpoint`` (``load``), which also takes this integration's paths:
    Lightning ``torch.load``-s the path it is given and never asks a ``CheckpointIO``, so the
    checkpoint dict is read through the engine here and handed to it as an in-memory
    ``torch.save`` file (its documented file-like argument)."""

    @functools.wraps(load)
    def load_from_checkpoint(cls: type, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(checkpoint_path, (str, os.PathLike)) and not os.fspath(checkpoint_path).startswith("http"):
            checkpoint = engine_checkpoint_dict(checkpoint_path)
            if checkpoint is not None:
                buffer = io.BytesIO()
                torch.save(checkpoint, buffer)
                del checkpoint
                buffer.seek(0)
                checkpoint_path = buffer
        return load(cls, checkpoint_path, *args, **kwargs)

    load_from_checkpoint.__ckpt_engine_original__ = load  # type: ignore[attr-defined]
    return load_from_checkpoint


def install_load_from_checkpoint() -> None:
    """Make ``LightningModule.load_from_checkpoint`` and ``LightningDataModule.load_from_checkpoint``
    load this integration's pointer files and checkpoint folders (any other path: as Lightning
    does). Installing again replaces the wrapper (a reloaded module)."""
    for owner in (LightningModule, LightningDataModule):
        current = owner.__dict__["load_from_checkpoint"]
        method = current.method  # Lightning's restricted classmethod keeps the function here
        method = getattr(method, "__ckpt_engine_original__", method)
        setattr(owner, "load_from_checkpoint", type(current)(_engine_aware(method)))  # noqa: B010


install_load_from_checkpoint()
