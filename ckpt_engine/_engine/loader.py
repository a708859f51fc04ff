"""The resume side of the engine: which checkpoint a load reads (docs/design.md, section 4), the checks
before anything is read, and reading each component into the training objects.

:class:`Loader` owns it; :meth:`CheckpointEngine.load <ckpt_engine.CheckpointEngine.load>` builds
the training objects and hands them over. The ``plan`` command and ``ckpt_engine.testing`` use
the same :func:`components_by_rule`, and every check here runs through the one consensus
primitive (:func:`~ckpt_engine._engine.consensus.agreed`), so a failure on one rank is raised on
every rank.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.storage import StorageReader

from .._dcpio import dist as _dist
from .._dcpio.fast_load import load_state_dict
from .._dcpio.fast_read import FastFileSystemReader, gc_paused
from .._dcpio.object_read import ObjectStoreReader, reader_for
from .._dcpio.planner import EngineLoadPlanner
from .._dcpio.unsafe import refine_unsafe
from .._dcpio.watch import phase as publish_phase
from .._format.layout import (
    CheckedCheckpoint,
)
from .._format.names import LATEST_FILE, METADATA_FILE
from .._format.pointer import list_checkpoints, read_latest, resolve_save_folder
from .._format.read_lock import ReadLock
from .._format.verify import FileBlocks, component_blocks, manifest_for_reads
from .._storage.store import Store, open_store
from .._storage.urls import is_url
from .._tier.lineage import durable_view
from ..config import EngineConfig
from ..errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    CkptEngineError,
    ConfigError,
    IncompleteCheckpointError,
    described,
)
from ..pipeline import Pipeline
from ..report import ComponentReport, LoadReport
from ..types import (
    STANDARD_COMPONENTS,
    LoadResult,
)
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
from .local_sources import local_tier_source, two_tier_copy
from .rank_views import folder_view, require_one_checkpoint
from .resave import advance_latest, newest_unnamed
from .rng import RNG_COMPONENT, absent_rng_is_allowed, ignored_rng_prefixes, prepare_rng_load
from .state import TrainingObjects, apply_component, component_state_dict, repartitions_state
from .weights_load import is_safetensors_path, load_pth, load_safetensors

__all__ = [
    "CheckpointSource",
    "LoadSource",
    "Loader",
    "PthSource",
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


class LoadSource(Protocol):
    """Where one load reads from, chosen once by :meth:`Loader._source`; it reads itself into the
    training objects through the loader's services."""

    def read(self, loader: Loader, objs: TrainingObjects) -> LoadResult: ...


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

    def read(self, loader: Loader, objs: TrainingObjects) -> LoadResult:
        result = loader.read_checkpoint(
            objs, self.path, self.wanted, self.rule, self.validated, fell_back_from=self.fell_back_from
        )
        if self.tier == "durable" or not result.bytes_read:
            return result
        return dataclasses.replace(result, bytes_by_source={self.tier: result.bytes_read})


@dataclass(frozen=True)
class PthSource:
    """A ``.pth`` model state dict (``load_path``)."""

    path: str
    store: Store

    def read(self, loader: Loader, objs: TrainingObjects) -> LoadResult:
        return load_pth(objs, self.path, self.store)


@dataclass(frozen=True)
class SafetensorsSource:
    """Hugging Face safetensors weights, a file or a folder (``load_path``)."""

    path: str

    def read(self, loader: Loader, objs: TrainingObjects) -> LoadResult:
        return load_safetensors(loader, objs, self.path)


@dataclass(frozen=True)
class ScratchSource:
    """Nothing to resume: a fresh start."""

    load_dir: str

    def read(self, loader: Loader, objs: TrainingObjects) -> LoadResult:
        if _dist.rank() == 0:
            logger.info("no checkpoint in %s and no load_path: starting from scratch", self.load_dir)
        return LoadResult(iteration=0, checkpoint_path=None, report=LoadReport(), source="scratch")


def _check_keys_not_to_resume(config: EngineConfig, objs: TrainingObjects) -> None:
    known = {*STANDARD_COMPONENTS, *objs.extra}
    unknown = [k for k in config.keys_not_to_resume if k not in known]
    if unknown:
        raise ConfigError(
            f"keys_not_to_resume names {unknown}, which are not components of this load; components: "
            f"{', '.join(sorted(known))}. Fix the name, or pass the extra= component it refers to"
        )


class Loader:
    """Resumes training objects from the checkpoints of one engine's configuration."""

    def __init__(self, config: EngineConfig, pipeline: Pipeline, save_dir: str) -> None:
        self.config = config
        self.pipeline = pipeline
        self.save_dir = save_dir
        #: The two-tier local copy's folder, where a resume may read first: ``storage.local_dir``
        #: of an object-store ``save_dir`` (docs/storage.md), as the configuration says.
        self._local_dir = config.storage.local_dir if is_url(save_dir) else None
        #: Bytes of data files this rank read from storage in the current load.
        self._bytes_read = 0

    def load(self, objs: TrainingObjects) -> LoadResult:
        """Resume ``objs`` by the rules of docs/design.md, section 4 (see :meth:`CheckpointEngine.load`)."""
        # No cyclic GC while loading: a load allocates millions of small objects (metadata,
        # plan entries, read items) and few cycles, and each full collection walks them all:
        # with 50 000 tensors that made the load grow faster than linearly (9 s against 25 s).
        with gc_paused():
            return self._load(objs)

    def _load(self, objs: TrainingObjects) -> LoadResult:
        _check_keys_not_to_resume(self.config, objs)
        return self._source(objs).read(self, objs)

    def _source(self, objs: TrainingObjects, *, local_tier: bool = True) -> LoadSource:
        """Where this load reads from, by the rules of docs/design.md, section 4, chosen once: a checked
        checkpoint folder (the two-tier local copy, a committed one ``latest`` does not name yet,
        ``latest``, the fallback, ``load_path``), a ``.pth`` or safetensors ``load_path``, or
        nothing (a fresh start). Nothing is read into ``objs`` here."""
        cfg = self.config
        load_dir = cfg.resolved_load_dir
        store = open_store(load_dir, cfg.storage)
        wanted_all = components_by_rule(cfg, objs.extra, "latest")
        latest_file = store.join(load_dir, LATEST_FILE)
        try:
            latest = agreed(lambda: read_latest(load_dir, store))
        except CkptEngineError as err:
            if not cfg.fallback_to_last_complete:
                raise
            return self._fallback(load_dir, store, latest_file, err, wanted_all)
        if self._local_dir is not None and load_dir == self.save_dir:
            local = two_tier_copy(self, self._local_dir, latest)
            if local is not None:
                return CheckpointSource(local.checked.path, wanted_all, "latest", local, tier="local")
        unnamed = agreed(lambda: newest_unnamed(load_dir, store, latest))
        if local_tier and cfg.local_dir is not None and _same_dir(load_dir, self.save_dir):
            tier = local_tier_source(cfg, durable_view(load_dir, store, (latest, unnamed)), wanted_all)
            if tier is not None:
                return tier
        adopted = None if unnamed is None else self._adopt(load_dir, store, latest, unnamed)
        if adopted is not None:
            return CheckpointSource(adopted.checked.path, wanted_all, "latest", adopted)
        if latest is not None:
            path = store.join(load_dir, latest)
            try:
                validated = self.validate(
                    path,
                    store,
                    missing_hint=f"{latest_file} names {latest!r}, but {path} does not exist; restore it, or "
                    "point latest_checkpoint.txt at an existing checkpoint (or set fallback_to_last_complete)",
                )
            except CkptEngineError as err:
                if not cfg.fallback_to_last_complete:
                    raise
                return self._fallback(load_dir, store, path, err, wanted_all)
            return CheckpointSource(path, wanted_all, "latest", validated)
        if cfg.load_path:
            return self._load_path_source(objs)
        if cfg.load_dir and not _same_dir(cfg.load_dir, cfg.save_dir) and not agreed(lambda: store.isdir(load_dir)):
            raise CheckpointNotFoundError(
                f"load_dir {load_dir!r} does not exist, so there is nothing to resume from; fix load_dir, or "
                "unset it to resume from save_dir (a missing checkpoint is never a silent fresh start)"
            )
        return ScratchSource(load_dir)

    def _load_path_source(self, objs: TrainingObjects) -> LoadSource:
        """``load_path`` (no ``latest`` to resume): a ``.pth`` file, safetensors weights, or a
        checkpoint folder or save folder (its latest)."""
        cfg = self.config
        lp = cfg.load_path or ""
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
        wanted = components_by_rule(cfg, objs.extra, "load_path")
        return CheckpointSource(lp, wanted, "load_path", self.validate(lp, lp_store, what="load_path"))

    def _adopt(self, load_dir: str, store: Store, latest: str | None, name: str) -> Validated | None:
        """The committed checkpoint ``name`` that ``latest`` does not name yet (a save stopped
        between its commit and the pointer's move: :func:`.newest_unnamed`), validated as any
        resume is; ``latest`` is repaired in this engine's ``save_dir``. ``None`` (logged) when it
        does not pass the checks: the resume takes what ``latest`` names."""
        path = store.join(load_dir, name)
        pointer = f"{LATEST_FILE} names {latest}" if latest is not None else f"there is no {LATEST_FILE}"
        try:
            validated = self.validate(path, store)
        except CkptEngineError as err:
            if _dist.rank() == 0:
                logger.warning(
                    "%s holds a manifest but %s, and it fails the checks (%s); not resumed", path, pointer, err
                )
            return None
        if _dist.rank() == 0:
            repaired = ""
            if _same_dir(load_dir, self.save_dir):
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
        return validated

    # -- load: validation and fallback -------------------------------------------------------

    def validate(
        self, path: str, store: Store, missing_hint: str | None = None, *, shared: bool = True, what: str = "latest"
    ) -> Validated:
        """Everything checked before any tensor is read, agreed by every rank: every rank is about
        to read the same checkpoint (:mod:`.rank_views`; ``what`` names the rule that chose it),
        the folder exists, the checkpoint is complete (docs/design.md, section 2) and, per ``verify``, its
        files match the manifest (checksums split among ranks)."""
        require_one_checkpoint(folder_view(path, store), what)
        return self._checked(path, store, missing_hint, shared)

    def durable_source(self, objs: TrainingObjects) -> LoadSource:
        """Where this load reads from without the node-local tier (``save_dir`` and the rules)."""
        return self._source(objs, local_tier=False)

    def validate_rank_local(self, path: str) -> Validated:
        """:meth:`validate`'s checks of this rank's own checkpoint of the local tier (each rank reads
        another folder; its step was agreed by the recovery, which compared every checksum)."""
        return self._checked(path, open_store(path), None, False, self.config.model_copy(update={"verify": "sizes"}))

    def _checked(
        self, path: str, store: Store, missing_hint: str | None, shared: bool, config: EngineConfig | None = None
    ) -> Validated:
        """:meth:`validate`'s checks. With several ranks and ``shared`` (a folder every rank sees,
        not a per-host local copy) rank 0 alone lists the folder and reads each ``.metadata`` and
        the manifest, and broadcasts the metadata's bytes, which every other rank parses: storage
        sees one read of each file per load, not one per rank. ``verify: checksums`` still splits
        the checksums among all ranks."""
        rank, world = _dist.rank(), _dist.world_size()
        once = shared and world > 1

        def check() -> Any:
            publish_phase("validate")
            lock = ReadLock.acquire(path, local=store.capabilities.local_files)
            try:
                if once and rank != 0:
                    return lock
                raw: dict[str, bytes] = {}
                validated = run_checks(config or self.config, path, store, missing_hint, raw if once else None)
                return dataclasses.replace(validated, lock=lock), raw
            except BaseException:
                if lock is not None:
                    lock.release()
                raise

        got = agreed(check)
        if not once:
            return got[0]  # type: ignore[no-any-return]
        mine = got[0] if rank == 0 else None
        try:
            payload = None
            if mine is not None:
                raw = metadata_bytes(mine.checked, got[1], store)
                payload = (mine.verified, mine.reason, mine.checked.listing, raw)
            verified, reason, listing, raw = _dist.broadcast_object(payload, step="metadata")

            def rest() -> Validated:
                if mine is not None:
                    return mine  # type: ignore[no-any-return]
                mds = {
                    n: parse_shared_metadata(store.join(store.join(path, n), METADATA_FILE), d) for n, d in raw.items()
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

    def _fallback(self, load_dir: str, store: Store, bad: str, err: CkptEngineError, wanted: list[str]) -> LoadSource:
        """``fallback_to_last_complete``: the newest checkpoint that passes :meth:`_validate`."""

        def same(a: str, b: str) -> bool:
            return (
                os.path.abspath(a) == os.path.abspath(b)
                if store.capabilities.local_files
                else a.rstrip("/") == b.rstrip("/")
            )

        candidates: list[str] = _dist.broadcast_object(
            [p for _, p in reversed(list_checkpoints(load_dir, store)) if not same(p, bad)]
        )
        tried = []
        for path in candidates:
            try:
                validated = self.validate(path, store, what="fallback_to_last_complete")
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
            return CheckpointSource(path, wanted, "latest", validated, fell_back_from=bad)
        detail = f" (refused: {'; '.join(tried)})" if tried else ""
        raise type(err)(
            f"{err}; fallback_to_last_complete found no other complete checkpoint in {load_dir}{detail}"
        ) from err

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
            excluded = set(self.config.keys_not_to_resume)
            available = set(objs.available())
            names = [n for n in wanted if n not in excluded and n in available]
            digests = manifest_for_reads(path, validated.store, self.config.verify, _dist.rank() == 0)
            reports: dict[str, ComponentReport] = {}
            iteration = 0
            for name in names:
                if name not in checked.components:
                    self._absent_component(objs, path, name, tuple(checked.components), source)
                    continue
                if name == RNG_COMPONENT:
                    prepare_rng_load(objs.extra[name], checked.components[name], path, _dist.world_size())
                sd = component_state_dict(objs, name, 0)
                template = tuple(sd.values())
                folder = validated.store.join(path, name)
                planner = self._load_component(
                    name,
                    folder,
                    sd,
                    checked.components[name],
                    objs,
                    validated.store,
                    dedup_reads or self.config.dedup_reads,
                    {} if digests is None else component_blocks(digests, name, folder, validated.store.join),
                    local_reader,
                )
                assert planner.report is not None
                reports[name] = planner.report
                apply_component(objs, name, sd, planner.untouched_roots, template)
                if name == "trainer":
                    iteration = int(sd.get("iteration", 0))
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
        objs: TrainingObjects,
        store: Store,
        dedup_reads: str,
        blocks: dict[str, FileBlocks],
        local_reader: Callable[[str, Any], StorageReader] | None = None,
    ) -> EngineLoadPlanner:
        """Load component ``name`` into ``sd``; ``blocks``: its data files' per-block digests,
        which every byte read is checked against; ``local_reader``: the reader of a local folder
        (the engine's fast reader by default)."""
        planner = EngineLoadPlanner(
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
        )
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


def _same_dir(a: str, b: str) -> bool:
    """Whether two configured folders are one (a fresh run's ``load_dir`` may be its ``save_dir``)."""
    return a.rstrip("/") == b.rstrip("/") or ("://" not in a and os.path.abspath(a) == os.path.abspath(b))
