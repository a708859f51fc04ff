"""Where a load reads from, chosen once: every place a resume may read from is asked for its newest
complete candidate in one restore order (:class:`ResumePlanner`), and the choice is a
:class:`LoadSource` that reads itself through a narrow :class:`CheckpointReader`.

The restore order (docs/design.md, section 4, and docs/storage.md) is stated once, in
:class:`ResumePlanner`'s docstring; each place runs its checks through the one consensus
primitive (:func:`~ckpt_engine._engine.consensus.agreed`), so every rank takes the same one.
A source never calls back into its chooser: what it needs to read (the checks before a read,
the per-component read) is the reader's.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch.distributed.checkpoint.storage import StorageReader

from .._dcpio import dist as _dist
from .._format.names import LATEST_FILE, parse_iteration
from .._format.pointer import list_checkpoints, read_latest, resolve_save_folder
from .._storage.paths import same_folder
from .._storage.store import Store, open_store
from .._tier.recovery import Recovered
from ..config import EngineConfig
from ..errors import CheckpointNotFoundError, CkptEngineError, ConfigError, CorruptCheckpointError
from ..pipeline import Pipeline
from ..report import LoadReport
from ..types import STANDARD_COMPONENTS, LoadResult
from .consensus import agreed
from .load_guard import Validated
from .resave import advance_latest, newest_unnamed
from .state import TrainingObjects
from .targets import SaveTarget
from .weights_load import is_safetensors_path, load_pth, load_safetensors

__all__ = [
    "CheckpointReader",
    "CheckpointSource",
    "LoadSource",
    "LocalTierSource",
    "PthSource",
    "ResumeAsk",
    "ResumePlanner",
    "ResumeTier",
    "SafetensorsSource",
    "ScratchSource",
    "components_by_rule",
]

logger = logging.getLogger("ckpt_engine")


def components_by_rule(config: EngineConfig, extra: Iterable[str], rule: str) -> list[str]:
    """The components :meth:`CheckpointEngine.load` reads by ``rule`` (docs/design.md, section 4), before
    ``keys_not_to_resume`` and what the caller passed: every one for ``latest``; for
    ``load_path`` ``model`` only, ``model`` + ``scheduler`` with ``only_load_scheduler_state``,
    every one with ``load_training_state``."""
    if rule == "latest" or config.load_training_state:
        return [*STANDARD_COMPONENTS, *extra]
    if config.only_load_scheduler_state:
        return ["model", "scheduler"]
    return ["model"]


class CheckpointReader(Protocol):
    """What choosing and reading a source needs of the engine's resume side
    (:class:`~.loader.Loader`): its configuration and plugins, the checks before any tensor is
    read (agreed by every rank), and the read of a checked checkpoint's components."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def pipeline(self) -> Pipeline: ...

    def validate(
        self, path: str, store: Store, missing_hint: str | None = None, *, shared: bool = True, what: str = "latest"
    ) -> Validated: ...

    def validate_rank_local(self, path: str, objs: TrainingObjects, wanted: list[str]) -> Validated: ...

    def read_checkpoint(
        self,
        objs: TrainingObjects,
        path: str,
        wanted: list[str],
        source: str,
        validated: Validated,
        *,
        fell_back_from: str | None = None,
        dedup_reads: str | None = None,
        local_reader: Callable[[str, Any], StorageReader] | None = None,
    ) -> LoadResult: ...


class PassedOver(Exception):
    """Raised alike on every rank by a nearer tier's source whose read found a copy it cannot use
    (a byte that fails its digest, in a copy on this node, received from a peer or resharded):
    :meth:`ResumePlanner.load` passes the nearer tiers over and goes on down the restore order.
    Never reaches the caller."""


def _passed_over(what: str, err: CorruptCheckpointError) -> PassedOver:
    return PassedOver(f"{what} failed its check while it was read ({err})")


class LoadSource(Protocol):
    """Where one load reads from, chosen once by :class:`ResumePlanner`; it reads itself into the
    training objects through ``reader`` and chooses nothing."""

    def read(self, reader: CheckpointReader, objs: TrainingObjects) -> LoadResult: ...


@dataclass(frozen=True)
class CheckpointSource:
    """A checkpoint folder that passed every check (``validated``), and the rule that chose it."""

    path: str
    wanted: list[str]
    rule: str
    validated: Validated
    fell_back_from: str | None = None
    #: Where its bytes come from (``LoadResult.bytes_by_source``): ``save_dir``, or the two-tier
    #: local copy on this host.
    tier: str = "durable"

    def read(self, reader: CheckpointReader, objs: TrainingObjects) -> LoadResult:
        try:
            result = reader.read_checkpoint(
                objs, self.path, self.wanted, self.rule, self.validated, fell_back_from=self.fell_back_from
            )
        except CorruptCheckpointError as err:  # raised on every rank: the load's checks agree
            if self.tier == "durable":
                raise
            raise _passed_over(f"the local copy {self.path}", err) from err
        if self.tier == "durable" or not result.bytes_read:
            return result
        return dataclasses.replace(result, bytes_by_source={self.tier: result.bytes_read})


@dataclass(frozen=True)
class LocalTierSource:
    """This rank's part of a step the node-local tier holds complete for every rank: on its own
    node already, or just received from a peer's replica (:func:`~ckpt_engine._tier.recovery.recover`),
    checked (and found to cover what this job's sharding needs) before it was chosen."""

    recovered: Recovered
    wanted: list[str]
    validated: Validated

    def read(self, reader: CheckpointReader, objs: TrainingObjects) -> LoadResult:
        recovered = self.recovered
        resharded = recovered.reshard  # a step of another shape: read through its byte exchange
        try:
            result = reader.read_checkpoint(
                objs,
                recovered.path,
                self.wanted,
                "latest",
                self.validated,
                dedup_reads="off",
                local_reader=None if resharded is None else resharded.reader,
            )
        except CorruptCheckpointError as err:  # raised on every rank: the load's checks agree
            # named by its iteration: a resharded folder is removed right after (the error names the file)
            how = "" if resharded is None else ", resharded,"
            raise _passed_over(f"the local tier's step {recovered.iteration}{how}", err) from err
        finally:
            if resharded is not None:
                resharded.discard()
        if resharded is not None:
            return dataclasses.replace(result, bytes_by_source=resharded.by_source())
        if recovered.source == _dist.rank():  # on its own node: everything read came from there
            by_source = {"local": result.bytes_read}
        else:  # received from a peer into this node (and what this node had of it, linked)
            by_source = {"local": recovered.bytes_linked, "peer": recovered.bytes_received}
        return dataclasses.replace(result, bytes_by_source={k: v for k, v in by_source.items() if v})


@dataclass(frozen=True)
class PthSource:
    """A ``.pth`` model state dict (``load_path``)."""

    path: str
    store: Store

    def read(self, reader: CheckpointReader, objs: TrainingObjects) -> LoadResult:
        return load_pth(objs, self.path, self.store)


@dataclass(frozen=True)
class SafetensorsSource:
    """Hugging Face safetensors weights, a file or a folder (``load_path``)."""

    path: str

    def read(self, reader: CheckpointReader, objs: TrainingObjects) -> LoadResult:
        return load_safetensors(reader.config, reader.pipeline, objs, self.path)


@dataclass(frozen=True)
class ScratchSource:
    """Nothing to resume: a fresh start."""

    load_dir: str

    def read(self, reader: CheckpointReader, objs: TrainingObjects) -> LoadResult:
        if _dist.rank() == 0:
            logger.info("no checkpoint in %s and no load_path: starting from scratch", self.load_dir)
        return LoadResult(iteration=0, checkpoint_path=None, report=LoadReport(), source="scratch")


@dataclass
class ResumeAsk:
    """What the places of one load share: the load folder, its ``latest`` (or why it could not be
    read), and the committed checkpoint ``latest`` does not name yet (asked once, when a place
    first needs it)."""

    objs: TrainingObjects
    load_dir: str
    store: Store
    wanted: list[str]
    latest: str | None = None
    latest_error: CkptEngineError | None = None
    _unnamed: list[str | None] = field(default_factory=list)

    def unnamed(self) -> str | None:
        if not self._unnamed:
            self._unnamed.append(agreed(lambda: newest_unnamed(self.load_dir, self.store, self.latest)))
        return self._unnamed[0]


class ResumeTier(Protocol):
    """A tier nearer than ``save_dir`` (the node-local tier), asked by :class:`ResumePlanner` for
    its newest complete candidate: ``None``, or a source checked (agreed by every rank) and at
    least as new as what ``save_dir`` gives."""

    def newest(self, reader: CheckpointReader, ask: ResumeAsk) -> LoadSource | None: ...


class ResumePlanner:
    """Chooses, once and alike on every rank, where a load reads from. Each place is asked for its
    newest complete candidate, in this restore order; the first that has one is read:

    1. **the two-tier local copy** (``storage.local_dir`` of an object-store ``save_dir``, when
       the load folder is ``save_dir``): its ``latest``, when at least as new as the store's and
       it passes the checks on every host;
    2. **the nearer tiers** of the tier stack, nearest first, when the load folder is
       ``save_dir`` (:meth:`ResumeTier.newest`): the node-local tier's newest step of
       ``save_dir``'s run complete across every rank's node or its peers' replicas, at least as
       new as 3 and 4, that covers what this job's sharding needs (decided with the checks,
       before anything is chosen: never after a read began);
    3. **a committed checkpoint ``latest`` does not name yet** (a save stopped between its commit
       and the pointer's move), when it passes the checks (``latest`` is repaired);
    4. **``latest``** of the load folder (or the load folder itself, where ``load_dir`` names one
       checkpoint folder: a branch from an older step);
    5. **the fallback** (``fallback_to_last_complete``): the newest checkpoint that passes the
       checks, when ``latest`` cannot be read or fails them;
    6. **``load_path``**: a ``.pth`` file, safetensors weights, a checkpoint or save folder;
    7. **nothing**: a fresh start (an explicit ``load_dir`` that does not exist is refused).

    Nothing is read into the training objects here; every collective a place runs is one every
    rank runs at the same point (places 1-3 are skipped alike when ``latest`` is unreadable).
    """

    def __init__(self, reader: CheckpointReader, target: SaveTarget, nearer: Sequence[ResumeTier] = ()) -> None:
        self.reader = reader
        #: The tiers nearer than ``save_dir``, nearest first (the tier stack's).
        self.nearer = tuple(nearer)
        self.config = reader.config
        self.save_dir = target.save_dir
        #: The folder of committed local copies of ``save_dir`` (docs/storage.md), as its storage
        #: mode's target says (the two-tier copy; ``None``: it keeps none).
        self._copy_dir = target.local_dir

    def load(self, objs: TrainingObjects) -> LoadResult:
        """Chooses this load's source and reads it. A nearer tier (places 1 and 2) whose read finds
        a copy it cannot use (:class:`PassedOver`, alike on every rank) is passed over: the choice
        goes on down the restore order without places 1 and 2, and that source's read replaces
        every component (nothing read from the passed-over tier stays in the training objects),
        with or without ``fallback_to_last_complete``: ``save_dir`` is the copy of record. So is, with
        ``fallback_to_last_complete``, a checkpoint ``latest`` chose whose read finds a damaged
        byte (:meth:`_read`)."""
        try:
            return self._read(self.choose(objs), objs)
        except PassedOver as err:
            source = self.choose(objs, nearer=False)
            if isinstance(source, ScratchSource):  # never a silent fresh start
                raise CorruptCheckpointError(
                    f"{err}, and {self.save_dir} holds no checkpoint to resume instead; remove the damaged "
                    "step from the local tier to start from scratch"
                ) from err
            if _dist.rank() == 0:
                logger.warning("%s; resuming from %s", err, self.save_dir)
            return self._read(source, objs)

    def _read(self, source: LoadSource, objs: TrainingObjects) -> LoadResult:
        """``source`` read into ``objs``. With ``fallback_to_last_complete``, a checkpoint of
        ``save_dir`` that ``latest`` chose and whose read finds a byte that does not match its
        digest (a :class:`CorruptCheckpointError`, raised on every rank alike) is passed over as one
        that fails the checks before the load is: the newest checkpoint that passes them is read,
        and its read replaces every component the damaged one's had filled."""
        refused: list[str] = []
        while True:
            try:
                return source.read(self.reader, objs)
            except CorruptCheckpointError as err:
                if not (
                    self.config.fallback_to_last_complete
                    and isinstance(source, CheckpointSource)
                    and source.rule == "latest"
                    and source.tier == "durable"
                ):
                    raise
                refused.append(source.path)
                load_dir = self.config.resolved_load_dir
                ask = ResumeAsk(objs, load_dir, open_store(load_dir, self.config.storage), source.wanted)
                source = self._fallback(ask, source.path, err, refused)

    def choose(self, objs: TrainingObjects, *, nearer: bool = True) -> LoadSource:
        """The source of this load, by the restore order of the class docstring (``nearer``: the
        nearer tiers asked too)."""
        cfg = self.config
        _check_keys_not_to_resume(cfg, objs)
        load_dir = cfg.resolved_load_dir
        ask = ResumeAsk(
            objs, load_dir, open_store(load_dir, cfg.storage), components_by_rule(cfg, objs.extra, "latest")
        )
        try:
            ask.latest = agreed(lambda: read_latest(load_dir, ask.store))
        except CkptEngineError as err:
            if not cfg.fallback_to_last_complete:
                raise
            ask.latest_error = err
        places: tuple[Callable[[ResumeAsk], LoadSource | None], ...] = (
            *((self._two_tier_copy, self._nearer_tiers) if nearer else ()),
            self._unnamed,
            self._latest,
            self._named,
            self._load_path,
        )
        for place in places:
            source = place(ask)
            if source is not None:
                return source
        return self._scratch(ask)

    # -- 1. the two-tier local copy ---------------------------------------------------------------

    def _two_tier_copy(self, ask: ResumeAsk) -> LoadSource | None:
        """The local copy to resume from, if its ``latest`` is complete and at least as new as the
        object store's on every host; ``None`` (logged) otherwise."""
        copy_dir = self._copy_dir
        if copy_dir is None or ask.latest_error is not None or not same_folder(ask.load_dir, self.save_dir):
            return None
        try:
            name = agreed(lambda: read_latest(copy_dir))
        except CkptEngineError as err:
            logger.warning("ignoring the local copy in %s: %s", copy_dir, err)
            return None
        names = _dist.all_gather_object(name, step="local copy")
        if any(n != name for n in names):  # each host decides alike, or none reads its copy
            if _dist.rank() == 0:
                shown = ", ".join(f"rank {r}: {n!r}"[:100] for r, n in enumerate(names[:8]))
                logger.warning(
                    "the ranks' local copies name different checkpoints (%s); using %s", shown, self.save_dir
                )
            return None
        if name is None:
            return None
        local_iter, remote_iter = parse_iteration(name), parse_iteration(ask.latest or "")
        if local_iter is None or (remote_iter is not None and local_iter < remote_iter):
            return None
        path = os.path.join(copy_dir, name)
        try:
            validated = self.reader.validate(path, open_store(copy_dir), shared=False, what="the local copy")
        except CkptEngineError as err:
            if _dist.rank() == 0:
                logger.warning("the local copy %s cannot be resumed (%s); using %s", name, err, self.save_dir)
            return None
        if _dist.rank() == 0:
            logger.info("resuming from the local copy %s (the object store's latest: %s)", path, ask.latest)
        return CheckpointSource(path, ask.wanted, "latest", validated, tier="local")

    # -- 2. the node-local tier ---------------------------------------------------------------------

    def _nearer_tiers(self, ask: ResumeAsk) -> LoadSource | None:
        """The first nearer tier (nearest first) with a candidate, when the load folder is
        ``save_dir`` (a tier holds this engine's own saves) and ``latest`` could be read."""
        if ask.latest_error is not None or not same_folder(ask.load_dir, self.save_dir):
            return None
        return next((found for tier in self.nearer if (found := tier.newest(self.reader, ask)) is not None), None)

    # -- 3. a committed checkpoint latest does not name yet ----------------------------------------

    def _unnamed(self, ask: ResumeAsk) -> LoadSource | None:
        """The committed checkpoint ``latest`` does not name yet (a save stopped between its
        commit and the pointer's move: :func:`.newest_unnamed`), validated as any resume is;
        ``latest`` is repaired in this engine's ``save_dir``. ``None`` (logged) when there is none
        or it does not pass the checks: the resume takes what ``latest`` names."""
        if ask.latest_error is not None:
            return None
        name = ask.unnamed()
        if name is None:
            return None
        load_dir, store, latest = ask.load_dir, ask.store, ask.latest
        path = store.join(load_dir, name)
        pointer = f"{LATEST_FILE} names {latest}" if latest is not None else f"there is no {LATEST_FILE}"
        try:
            validated = self.reader.validate(path, store)
        except CkptEngineError as err:
            if _dist.rank() == 0:
                logger.warning(
                    "%s holds a manifest but %s, and it fails the checks (%s); not resumed", path, pointer, err
                )
            return None
        if _dist.rank() == 0:
            repaired = ""
            if same_folder(load_dir, self.save_dir):
                try:
                    advance_latest(load_dir, name, store)
                    repaired = f"; {LATEST_FILE} now names it"
                except (OSError, CkptEngineError) as err:
                    repaired = f"; {LATEST_FILE} could not be repaired ({err})"
            logger.warning(
                "%s is committed (its manifest is there and it passes the checks) but %s: its save was stopped "
                "after the commit and before the pointer moved. Resuming from it%s",
                path,
                pointer,
                repaired,
            )
        return CheckpointSource(path, ask.wanted, "latest", validated)

    # -- 4 and 5. latest, or the fallback -------------------------------------------------------------

    def _latest(self, ask: ResumeAsk) -> LoadSource | None:
        """What ``latest`` names, checked; with ``fallback_to_last_complete``, the newest checkpoint
        that passes the checks when ``latest`` cannot be read or fails them."""
        latest_file = ask.store.join(ask.load_dir, LATEST_FILE)
        if ask.latest_error is not None:
            return self._fallback(ask, latest_file, ask.latest_error)
        if ask.latest is None:
            return None
        path = ask.store.join(ask.load_dir, ask.latest)
        try:
            validated = self.reader.validate(
                path,
                ask.store,
                missing_hint=f"{latest_file} names {ask.latest!r}, but {path} does not exist; restore it, or "
                "point latest_checkpoint.txt at an existing checkpoint (or set fallback_to_last_complete)",
            )
        except CkptEngineError as err:
            if not self.config.fallback_to_last_complete:
                raise
            return self._fallback(ask, path, err)
        return CheckpointSource(path, ask.wanted, "latest", validated)

    def _named(self, ask: ResumeAsk) -> LoadSource | None:
        """A ``load_dir`` that is one checkpoint folder (``iter_*``, no ``latest`` in it), checked
        and resumed whole, as ``latest`` would be: a branch from an older step. Without this it
        was a fresh start, in silence."""
        name = ask.load_dir.rstrip("/").rsplit("/", 1)[-1]
        if ask.latest is not None or same_folder(ask.load_dir, self.save_dir) or parse_iteration(name) is None:
            return None
        return CheckpointSource(ask.load_dir, ask.wanted, "latest", self.reader.validate(ask.load_dir, ask.store))

    def _fallback(self, ask: ResumeAsk, bad: str, err: CkptEngineError, refused: Sequence[str] = ()) -> LoadSource:
        """``fallback_to_last_complete``: the newest checkpoint that passes the checks (``refused``:
        those whose read found damage, left out too)."""
        candidates: list[str] = _dist.broadcast_object(
            [
                p
                for _, p in reversed(list_checkpoints(ask.load_dir, ask.store))
                if not any(same_folder(p, q) for q in (bad, *refused))
            ]
        )
        tried = []
        for path in candidates:
            try:
                validated = self.reader.validate(path, ask.store, what="fallback_to_last_complete")
            except CkptEngineError as cand_err:
                tried.append(f"{os.path.basename(path)}: {type(cand_err).__name__}")
                continue
            if _dist.rank() == 0:
                logger.warning(
                    "%s cannot be loaded (%s: %s); fell back to %s, the newest checkpoint that passes the "
                    "checks (fallback_to_last_complete=True)",
                    bad,
                    type(err).__name__,
                    err,
                    path,
                )
            return CheckpointSource(path, ask.wanted, "latest", validated, fell_back_from=bad)
        detail = f" (refused: {'; '.join(tried)})" if tried else ""
        raise type(err)(
            f"{err}; fallback_to_last_complete found no other complete checkpoint in {ask.load_dir}{detail}"
        ) from err

    # -- 6 and 7. load_path, or nothing ----------------------------------------------------------------

    def _load_path(self, ask: ResumeAsk) -> LoadSource | None:
        """``load_path`` (no ``latest`` to resume): a ``.pth`` file, safetensors weights, or a
        checkpoint folder or save folder (its latest)."""
        cfg = self.config
        if not cfg.load_path:
            return None
        lp = cfg.load_path
        lp_store = open_store(lp, cfg.storage)
        if lp.endswith(".pth"):
            return PthSource(lp, lp_store)
        if is_safetensors_path(lp):
            return SafetensorsSource(lp)
        if not agreed(lambda: lp_store.isdir(lp)):
            raise CheckpointNotFoundError(
                f"load_path {lp!r} does not exist or is not a checkpoint folder (nor a .pth file); "
                "fix load_path, or unset it to start from scratch"
            )
        lp = agreed(lambda: resolve_save_folder(cfg.load_path or "", lp_store)) or lp  # its latest
        wanted = components_by_rule(cfg, ask.objs.extra, "load_path")
        return CheckpointSource(lp, wanted, "load_path", self.reader.validate(lp, lp_store, what="load_path"))

    def _scratch(self, ask: ResumeAsk) -> LoadSource:
        cfg = self.config
        explicit = bool(cfg.load_dir) and not same_folder(cfg.load_dir or "", cfg.save_dir)
        if explicit and not agreed(lambda: ask.store.isdir(ask.load_dir)):
            raise CheckpointNotFoundError(
                f"load_dir {ask.load_dir!r} does not exist, so there is nothing to resume from; fix load_dir, or "
                "unset it to resume from save_dir (a missing checkpoint is never a silent fresh start)"
            )
        return ScratchSource(ask.load_dir)


def _check_keys_not_to_resume(config: EngineConfig, objs: TrainingObjects) -> None:
    known = {*STANDARD_COMPONENTS, *objs.extra}
    unknown = [k for k in config.keys_not_to_resume if k not in known]
    if unknown:
        raise ConfigError(
            f"keys_not_to_resume names {unknown}, which are not components of this load; components: "
            f"{', '.join(sorted(known))}. Fix the name, or pass the extra= component it refers to"
        )
