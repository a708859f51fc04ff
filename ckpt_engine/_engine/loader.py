"""The resume side of the engine that reads: the checks before anything is read, and reading each
component of a checked checkpoint into the training objects.

:class:`Loader` is the :class:`~.resume.CheckpointReader` every :class:`~.resume.LoadSource` reads
through; where a load reads from is chosen before, once, by :class:`~.resume.ResumePlanner`
(:meth:`CheckpointEngine.load <ckpt_engine.CheckpointEngine.load>` hands the one to the other).
Every check here runs through the one consensus primitive
(:func:`~ckpt_engine._engine.consensus.agreed`), so a failure on one rank is raised on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader

from .._dcpio import dist as _dist
from .._dcpio.fast_load import load_state_dict
from .._dcpio.fast_read import FastFileSystemReader
from .._dcpio.object_read import ObjectStoreReader, reader_for
from .._dcpio.planner import EngineLoadPlanner
from .._dcpio.unsafe import refine_unsafe
from .._dcpio.watch import phase as publish_phase
from .._format.layout import CheckedCheckpoint
from .._format.names import METADATA_FILE
from .._format.read_lock import ReadLock
from .._format.verify import FileBlocks, component_blocks, manifest_for_reads
from .._storage.paths import same_folder
from .._storage.store import Store, open_store
from ..config import EngineConfig
from ..errors import (
    CheckpointLoadError,
    CkptEngineError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    RankLocalCoverageError,
    clip,
    described,
)
from ..pipeline import Pipeline
from ..report import ComponentReport, LoadReport
from ..types import LoadResult
from .collectives import watch_group
from .consensus import agreed, unwrap
from .load_guard import (
    Validated,
    check_share,
    metadata_bytes,
    missing_for_resume,
    parse_shared_metadata,
    run_checks,
)
from .rank_views import folder_view, require_one_checkpoint
from .rng import RNG_COMPONENT, absent_rng_is_allowed, ignored_rng_prefixes, prepare_rng_load
from .state import TrainingObjects, apply_component, load_template, repartitions_state

__all__ = ["Loader", "is_warm_start"]


def is_warm_start(config: EngineConfig, checkpoint: str, rule: Any) -> bool:
    """Whether a load by ``rule`` of the checkpoint folder ``checkpoint`` starts this run from
    another run's checkpoint (:attr:`~ckpt_engine.types.RemapContext.warm_start`): the
    ``load_path`` rule, of a checkpoint outside ``save_dir``. A checkpoint of ``save_dir`` named
    exactly (the integrations' resume of a named checkpoint, a run resumed from an older step of
    its own) is this run's, resumed."""
    if rule != "load_path":
        return False
    return not same_folder(checkpoint.rstrip("/").rsplit("/", 1)[0], config.save_dir)


logger = logging.getLogger("ckpt_engine")


def _iteration(trainer: dict[str, Any], where: str) -> int:
    """The iteration the ``trainer`` component holds (0 where it holds none)."""
    value = trainer.get("iteration", 0)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
        value = value.item()  # a checkpoint of the original checkpointer's kind may hold a tensor
    if type(value) is not int or value < 0:
        raise CorruptCheckpointError(
            f"{where}: the iteration is {clip(repr(value), 60)}, not a count of steps; the checkpoint was "
            "damaged or written by other code: load another checkpoint"
        )
    return value


class Loader:
    """Resumes training objects from the checkpoints of one engine's configuration."""

    def __init__(self, config: EngineConfig, pipeline: Pipeline) -> None:
        self.config = config
        self.pipeline = pipeline
        #: Bytes of data files this rank read from storage in the current load.
        self._bytes_read = 0

    # -- the checks before a read ----------------------------------------------------------

    def validate(
        self, path: str, store: Store, missing_hint: str | None = None, *, shared: bool = True, what: str = "latest"
    ) -> Validated:
        """Everything checked before any tensor is read, agreed by every rank: every rank is about
        to read the same checkpoint (:mod:`.rank_views`; ``what`` names the rule that chose it),
        the folder exists, the checkpoint is complete (docs/design.md, section 2) and, per ``verify``, its
        files match the manifest (checksums split among ranks)."""
        require_one_checkpoint(folder_view(path, store), what)
        return self._checked(path, store, missing_hint, shared)

    def validate_rank_local(self, path: str, objs: TrainingObjects, wanted: list[str]) -> Validated:
        """:meth:`validate`'s checks of this rank's own checkpoint of the local tier (each rank reads
        another folder; its step was agreed by the recovery, which compared every checksum), and
        in the same agreement whether it holds every element of ``wanted`` this rank's sharding
        needs (:class:`RankLocalCoverageError` on every rank where one rank's does not)."""
        config = self.config.model_copy(update={"verify": "sizes"})
        return self._checked(path, open_store(path), None, False, config, lambda v: self._covers(objs, v, wanted))

    def _covers(self, objs: TrainingObjects, validated: Validated, wanted: list[str]) -> None:
        """Plan (read nothing) the load of each component of a rank-local checkpoint this load
        reads: the plan raises :class:`RankLocalCoverageError` where it was saved with another
        sharding. Other problems of the plan are the read's to report."""
        for name in self._names(objs, wanted):
            metadata = validated.checked.components.get(name)
            if metadata is None or name == RNG_COMPONENT:  # absent: the read decides; RNG: this rank's own
                continue
            sd, unread = load_template(objs, name, metadata.state_dict_metadata)
            planner = self._planner(name, validated.store.join(validated.checked.path, name), objs, unread)
            try:
                planner.set_up_planner(sd, metadata, False)
                planner.create_local_plan()
            except RankLocalCoverageError:
                raise
            except Exception:  # the read plans again and reports it, typed
                continue

    def _names(self, objs: TrainingObjects, wanted: list[str]) -> list[str]:
        """The components of ``wanted`` this load reads: passed in and not in ``keys_not_to_resume``."""
        excluded = set(self.config.keys_not_to_resume)
        available = set(objs.available())
        return [n for n in wanted if n not in excluded and n in available]

    def _checked(
        self,
        path: str,
        store: Store,
        missing_hint: str | None,
        shared: bool,
        config: EngineConfig | None = None,
        then: Callable[[Validated], None] | None = None,
    ) -> Validated:
        """:meth:`validate`'s checks (and ``then``'s, on a folder of this rank's own). With several
        ranks and ``shared`` (a folder every rank sees, not a per-host local copy) rank 0 alone
        lists the folder and reads each ``.metadata`` and the manifest, and broadcasts the
        metadata's bytes, which every other rank parses: storage sees one read of each file per
        load, not one per rank. ``verify: checksums`` still splits the checksums among all ranks."""
        rank, world = _dist.rank(), _dist.world_size()
        once = shared and world > 1

        def check() -> Any:
            publish_phase("validate")
            lock = ReadLock.acquire(path, local=store.capabilities.local_files)
            try:
                if once and rank != 0:
                    held.append(lock)
                    return lock
                raw: dict[str, bytes] = {}
                validated = run_checks(config or self.config, path, store, missing_hint, raw if once else None)
                validated = dataclasses.replace(validated, lock=lock)
                if then is not None:
                    then(validated)
                held.append(lock)
                return validated, raw
            except BaseException:
                if lock is not None:
                    lock.release()
                raise

        held: list[ReadLock | None] = []
        try:
            got = agreed(check)
        except BaseException:
            for lock in held:  # this rank's checks passed, another rank's did not
                if lock is not None:
                    lock.release()
            raise
        if not once:
            return got[0]  # type: ignore[no-any-return]
        return self._shared(path, store, got[0] if rank == 0 else None, got)

    def _shared(self, path: str, store: Store, mine: Validated | None, got: Any) -> Validated:
        """:meth:`_checked` of a folder every rank sees: rank 0's checks (``mine``; ``got`` the
        rest of its outcome, on another rank its read lock) handed to every rank as the
        metadata's bytes, parsed there."""
        try:
            payload = None
            if mine is not None:
                raw = metadata_bytes(mine.checked, got[1], store)
                payload = (mine.verified, mine.reason, mine.checked.listing, raw)
            verified, reason, listing, raw = _dist.broadcast_object(payload, step="metadata")

            def rest() -> Validated:
                if mine is not None:
                    return mine
                mds = {
                    n: parse_shared_metadata(store.join(store.join(path, n), METADATA_FILE), *d) for n, d in raw.items()
                }
                validated = Validated(CheckedCheckpoint(path, mds, listing), verified, reason, store, got)
                if self.config.verify == "checksums" and verified:
                    check_share(validated)
                return validated

            return agreed(rest, step="checks (metadata)")
        except BaseException:
            lock = mine.lock if mine is not None else got
            if lock is not None:
                lock.release()
            raise

    def read_checkpoint(
        self,
        objs: TrainingObjects,
        path: str,
        wanted: list[str],
        source: Any,
        validated: Validated,
        *,
        fell_back_from: str | None = None,
        dedup_reads: str | None = None,
        local_reader: Callable[[str, Any], StorageReader] | None = None,
    ) -> LoadResult:
        checked = validated.checked
        self._bytes_read = 0
        if self.config.trust_checkpoint and _dist.rank() == 0:
            logger.warning(
                "trust_checkpoint=True: non-tensor values of %s are unpickled without weights_only, which runs "
                "any code the checkpoint holds; use it only for checkpoints you trust",
                path,
            )
        try:
            names = self._names(objs, wanted)
            _warn_of_unknown_plugin_components(self.config, [*checked.components, *objs.available()])
            digests = manifest_for_reads(path, validated.store, self.config.verify, _dist.rank() == 0)
            reports: dict[str, ComponentReport] = {}
            iteration = 0
            for name in names:
                if name not in checked.components:
                    self._absent_component(objs, path, name, tuple(checked.components), source)
                    continue
                if name == RNG_COMPONENT:
                    prepare_rng_load(objs.extra[name], checked.components[name], path, _dist.world_size())
                sd, unread = load_template(objs, name, checked.components[name].state_dict_metadata)
                template = tuple(sd.values())
                folder = validated.store.join(path, name)
                planner = self._load_component(
                    name,
                    folder,
                    sd,
                    checked.components[name],
                    self._planner(name, folder, objs, unread, warm_start=is_warm_start(self.config, path, source)),
                    validated.store,
                    dedup_reads or self.config.dedup_reads,
                    {} if digests is None else component_blocks(digests, name, folder, validated.store.join),
                    local_reader,
                )
                assert planner.report is not None
                reports[name] = planner.report
                _warn_of_unasked_state(objs, name, planner.report.unexpected)
                apply_component(objs, name, sd, planner.untouched_roots, template)
                if name == "trainer":
                    iteration = _iteration(sd, f"{folder}")
            report = LoadReport(reports)
        finally:
            if validated.lock is not None:
                validated.lock.release()  # everything is read, or the load failed
        if _dist.rank() == 0:
            how = f"verified: {self.config.verify}" if validated.verified else f"unverified: {validated.reason}"
            logger.info("loaded %s (iteration %d, %s)\n%s", path, iteration, how, report.summary())
        return LoadResult(
            iteration=iteration,
            checkpoint_path=path,
            report=report,
            source=source,
            components=tuple(reports),
            verified=validated.verified,
            fell_back_from=fell_back_from,
            bytes_read=self._bytes_read,
            bytes_by_source={"durable": self._bytes_read} if self._bytes_read else {},
        )

    def _absent_component(
        self, objs: TrainingObjects, path: str, name: str, present: tuple[str, ...], source: Any
    ) -> None:
        """A component the caller passed that the checkpoint lacks: refused where the rules say
        so (a resume from ``latest`` restores everything; ``strict``), else skipped with a warning."""
        if name == RNG_COMPONENT and absent_rng_is_allowed(objs.extra[name], path, _dist.rank()):
            return
        if source == "latest":  # rule 1 resumes everything: a gap would restart or mix iterations
            raise IncompleteCheckpointError(missing_for_resume(path, name, present))
        if name == "trainer" and objs.grad_scaler is None:
            return  # nothing to restore but the iteration: 0
        if self.config.strict:
            raise IncompleteCheckpointError(
                f"checkpoint {path} has no component {name!r} (it has: {', '.join(present)}); "
                f"add {name!r} to keys_not_to_resume, don't pass it, or set strict=False"
            )
        logger.warning("checkpoint %s has no component %r; not loaded", path, name)

    def _load_component(
        self,
        name: str,
        component_dir: str,
        sd: dict[str, Any],
        metadata: Any,
        planner: EngineLoadPlanner,
        store: Store,
        dedup_reads: str,
        blocks: dict[str, FileBlocks],
        local_reader: Callable[[str, Any], StorageReader] | None = None,
    ) -> EngineLoadPlanner:
        """Load component ``name`` into ``sd`` with ``planner``; ``blocks``: its data files'
        per-block digests, which every byte read is checked against; ``local_reader``: the reader
        of a local folder (the engine's fast reader by default)."""
        try:
            with _dist.quiet_dcp():
                reader = reader_for(component_dir, store, metadata, local_reader or FastFileSystemReader)
                if isinstance(reader, (FastFileSystemReader, ObjectStoreReader)):
                    reader.blocks = blocks
                stats = load_state_dict(
                    sd,
                    storage_reader=reader,
                    planner=planner,
                    process_group=watch_group(),
                    dedup_reads=dedup_reads,
                )
                self._bytes_read += stats.bytes_read
        except (Exception, CheckpointException) as exc:
            err, ranks = unwrap(exc)
            if isinstance(err, CkptEngineError):
                raise refine_unsafe(err, f"component {name!r} in {component_dir}") from None
            where = f" (failed on rank(s) {ranks})" if _dist.world_size() > 1 else ""
            raise CheckpointLoadError(
                f"loading component {name!r} from {component_dir} failed{where}: {described(err)}"
            ) from err
        return planner

    def _planner(
        self,
        name: str,
        component_dir: str,
        objs: TrainingObjects,
        unread: tuple[str, ...] = (),
        *,
        warm_start: bool = False,
    ) -> EngineLoadPlanner:
        """The load planner of component ``name`` of this load (its report, after the load);
        ``unread``: the keys its :func:`~.state.load_template` leaves unread; ``warm_start``: the
        load starts the run from ``load_path`` (:attr:`~ckpt_engine.types.RemapContext.warm_start`)."""
        return EngineLoadPlanner(
            component=name,
            checkpoint_dir=component_dir,
            pipeline=self.pipeline,
            strict=self.config.strict,
            strict_unexpected=self.config.strict_unexpected,
            trust_checkpoint=self.config.trust_checkpoint,
            ignore_unexpected_prefixes=("grad_scaler.",)
            if name == "trainer" and objs.grad_scaler is None
            else ignored_rng_prefixes(objs.extra[name], _dist.rank(), _dist.world_size())
            if name == RNG_COMPONENT
            else (),
            rank=_dist.rank(),
            world_size=_dist.world_size(),
            repartitions=repartitions_state(objs, name),
            unread=unread,
            warm_start=warm_start,
        )


def _warn_of_unasked_state(objs: TrainingObjects, name: str, unexpected: Sequence[str]) -> None:
    """Rank 0: an ``extra`` object's saved keys its ``state_dict()`` did not list at the load are
    not loaded, and its ``load_state_dict()`` never gets them (a dict that grew during training):
    said once per load, not only in the report (``strict_unexpected: true`` makes it an error).
    The integrations' readers, which read part of a component on purpose, say so with
    ``reads_part_of_its_state``."""
    obj = objs.extra.get(name)
    if obj is None or name == RNG_COMPONENT or not unexpected or _dist.rank() != 0:
        return
    if getattr(type(obj), "reads_part_of_its_state", False):
        return
    shown = ", ".join(unexpected[:6]) + (f" and {len(unexpected) - 6} more" if len(unexpected) > 6 else "")
    logger.warning(
        "extra %r: the checkpoint holds %d key(s) its state_dict() did not list at this load (%s): they were not "
        "loaded, and its load_state_dict() does not get them. State that grows during training (a dict filled as "
        "it goes) loads whole when kept under one key (a list of pairs), or when a fresh object's state_dict() "
        "lists the saved keys; strict_unexpected: true makes this an error",
        name,
        len(unexpected),
        shown,
    )


def _warn_of_unknown_plugin_components(config: EngineConfig, known: Sequence[str]) -> None:
    """Rank 0: a plugin whose ``components`` option names a component neither the checkpoint nor
    this load has (``"modle"``) applies to nothing there: said, since the load's own errors
    (a mismatch the plugin would have resolved) then advise enabling a plugin that is enabled."""
    if _dist.rank() != 0:
        return
    for entry in config.plugins:
        named = entry.options.get("components") if entry.enabled else None
        unknown = [c for c in named if c not in known] if isinstance(named, (list, tuple)) else []
        if unknown:
            logger.warning(
                "plugin %r: its components option names %s, which neither this checkpoint nor this load has (they "
                "have: %s); it does not apply there. Check the spelling",
                entry.name,
                ", ".join(repr(c) for c in unknown),
                ", ".join(sorted(set(known))),
            )
