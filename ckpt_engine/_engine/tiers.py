"""The tiers a save is committed to and a resume reads from: the :class:`Tier` protocol, its two
implementations' shared commit steps, the durable tier, and the ordered :class:`TierStack`.

The durable tier (:class:`DurableTier`) is ``save_dir`` through its :class:`~.targets.SaveTarget`
(a local folder, an object store, or the two-tier copy of one); the node-local tier is
:class:`~.local_tier.LocalTier`. The stack says which tiers a save goes to (``persist_every``)
and in which order a resume asks them; the saver, the committer and the engine walk the stack
and never ask whether a tier exists.

The commit protocol of the durable tier (:func:`run_commit`): what committing *means* (a rename,
a completion marker) is the :class:`~.targets.SaveTarget`'s; this is the order of the steps and
the ranks' agreement around them, the same for every target (docs/reliability.md, docs/storage.md):

1. wait for every component's write (a failure waits for the others before anything is removed);
2. where needed, each rank sizes and checksums the files it wrote (from the digests its writer
   left, so no file is read again) and publishes them through the target (an object store: its
   upload), and the ranks bring those entries to rank 0: through one collective in a synchronous
   save, through the target's reports where no collective may run (the commit thread);
3. rank 0 commits through the target;
4. in a synchronous save, a last agreement: every rank leaves knowing whether the commit held,
   and none runs ahead of it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from torch.distributed.checkpoint.api import CheckpointException

from .._dcpio import dist as _dist
from .._dcpio.coordination import RANK_LOCAL
from .._dcpio.planner import EngineSavePlanner
from .._dcpio.watch import phase as publish_phase
from .._format.digests import carried_copies, written_entries
from .._format.layout import SaveDirLock, cleanup_leftovers
from .._format.manifest import FileEntry, Lineage, list_files, owner_rank
from .._format.names import parse_iteration
from .._format.pointer import read_latest
from ..config import EngineConfig
from ..errors import CheckpointSaveError, CkptEngineError, CollectiveError
from ..pipeline import Pipeline
from ..types import CarriedBy, StagedState, WriteContext, WriteResult
from .collectives import watch_group
from .consensus import agree, gated, unwrap
from .incremental import CarryBase, carry_base
from .resave import refuse_resave
from .resume import CheckpointReader, LoadSource, ResumeAsk
from .targets import SavePaths, SaveTarget

__all__ = [
    "CommitPhase",
    "DurableTier",
    "Outcomes",
    "Tier",
    "TierSave",
    "TierStack",
    "WriteInputs",
    "run_commit",
    "wait_writes",
]

logger = logging.getLogger("ckpt_engine")

Outcomes = list[WriteResult | Future[WriteResult]]
#: The after-commit step a tier begins with a save (the node-local tier's replication round),
#: resolved with the committed manifest (or ``None``) once that save's commit in the tier ended.
Round = Future[Any] | None


@dataclass
class CommitPhase:
    """What the commit of a save found (filled in as it goes)."""

    error: BaseException | None = None
    nbytes: int = 0
    #: Bytes carried over from the previous checkpoint instead of written, and how.
    reused: int = 0
    carried_by: CarriedBy = "off"
    write_end: float = 0.0

    def plus(self, other: CommitPhase) -> CommitPhase:
        """This commit and ``other`` (a save's local-tier commit) as one outcome: the first error,
        the bytes of both, the later end of the writes."""
        ways = {self.carried_by, other.carried_by} - {"off"}
        return CommitPhase(
            error=self.error or other.error,
            nbytes=self.nbytes + other.nbytes,
            reused=self.reused + other.reused,
            carried_by=next((w for w in ("link", "copy", "write") if w in ways), "off"),
            write_end=max(self.write_end, other.write_end),
        )


def run_commit(
    target: SaveTarget,
    pipeline: Pipeline,
    paths: SavePaths,
    components: tuple[str, ...],
    outcomes: Sequence[Any],
    *,
    collective: bool,
    algorithm: str | None,
) -> CommitPhase:
    """Wait for ``outcomes`` (``WriteResult`` or futures of one), then commit ``paths`` through
    ``target``. ``collective``: every rank calls this at the same point (synchronous saves) and
    the ranks agree; otherwise (the commit thread of background writes) no collective runs."""
    phase = CommitPhase()
    if collective:
        publish_phase("commit")
    wait_writes(pipeline, outcomes, phase)
    world = _dist.world_size()
    entries: dict[str, FileEntry] = {}
    if target.ranks_publish_files or (collective and world > 1):
        entries = _gather_entries(target, paths, phase, collective=collective, algorithm=algorithm)
        if isinstance(phase.error, CollectiveError):
            _say_committed(phase.error, False, paths)
            return phase
    if phase.error is None and _dist.rank() == 0:
        try:
            t_manifest = time.perf_counter()
            covered = target.commit(paths, components, algorithm, entries, world)
            logger.debug(
                "manifest of iteration %d: %.1f MB covered in %.3fs",
                paths.iteration,
                covered / 1e6,
                time.perf_counter() - t_manifest,
            )
        except Exception as err:
            phase.error = err
    if collective and world > 1:
        # Doubles as the barrier that keeps ranks from running ahead of the commit.
        try:
            committed = agree(phase.error, fallback=CheckpointSaveError, step="committed").first
        except CollectiveError as err:
            # Rank 0 knows whether it committed; another rank cannot tell from here.
            _say_committed(err, phase.error is None if _dist.rank() == 0 else None, paths)
            phase.error = err
            return phase
        if phase.error is None and committed is not None:
            phase.error = CheckpointSaveError(f"rank {committed.rank} failed to commit: {committed.text}")
    return phase


def _say_committed(err: CollectiveError, committed: bool | None, paths: SavePaths) -> None:
    """Record on ``err`` (and in its message) what became of the checkpoint of ``paths``."""
    err.committed = committed
    if committed is None:
        what = (
            f"whether iteration {paths.iteration} was committed is known to rank 0 only: "
            "latest_checkpoint.txt names it if it was"
        )
    elif committed:
        what = f"iteration {paths.iteration} was committed at {paths.final} before that (latest names it)"
    else:
        what = f"iteration {paths.iteration} was not committed (latest_checkpoint.txt is unchanged)"
    if err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}; {what}", *err.args[1:])


def wait_writes(pipeline: Pipeline, outcomes: Sequence[Any], phase: CommitPhase) -> None:
    """Wait for every write of ``outcomes``; their bytes, or the first failure, into ``phase``."""
    try:
        results = [pipeline.check_write_result(o.result() if isinstance(o, Future) else o) for o in outcomes]
        phase.nbytes = sum(r.bytes_written for r in results)
        phase.reused = sum(r.bytes_reused for r in results)
        ways = {r.carried_by for r in results} - {"off"}
        phase.carried_by = next((w for w in ("link", "copy", "write") if w in ways), "off")
    except (Exception, CheckpointException) as exc:
        phase.error = unwrap(exc)[0]
        # The other components' writes may still be running: let them end before the failed
        # save's folder is removed (bounded by the write provider's own timeout).
        concurrent.futures.wait([o for o in outcomes if isinstance(o, Future)])
    phase.write_end = time.perf_counter()


def _gather_entries(
    target: SaveTarget, paths: SavePaths, phase: CommitPhase, *, collective: bool, algorithm: str | None
) -> dict[str, FileEntry]:
    """Each rank's written files (sized and checksummed) published through the target, brought
    to rank 0; a failure on any rank lands in ``phase.error`` on every rank that learns of it."""
    rank, world = _dist.rank(), _dist.world_size()
    entries: dict[str, FileEntry] = {}
    if phase.error is None:
        try:
            mine = [rel for rel in list_files(paths.partial) if owner_rank(rel, world) == rank]
            copies = [rel for rel in carried_copies(paths.partial, algorithm) if owner_rank(rel, world) == rank]
            entries = written_entries(paths.partial, [*mine, *copies], algorithm)
            target.publish_files(paths, mine, {rel: entries[rel].size for rel in copies})
        except Exception as err:
            phase.error = err
    if world == 1:
        return entries
    if collective:
        try:
            wrote = agree(phase.error, entries, fallback=CheckpointSaveError, step="commit")
        except CollectiveError as err:
            phase.error = err
            return {}
        if phase.error is None and wrote.first is not None:
            phase.error = CheckpointSaveError(f"rank {wrote.first.rank} failed to write its files: {wrote.first.text}")
        return {rel: entry for part in wrote.payloads for rel, entry in part.items()}
    try:
        return target.exchange_reports(paths, entries, phase.error)
    except Exception as err:
        phase.error = phase.error or err
        return entries


# -- the tiers ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WriteInputs:
    """What one save hands the write of every tier it goes to (each takes what it needs)."""

    pipeline: Pipeline
    staged: StagedState
    #: The durable tier's key maps (per-rank state under rank keys), and the node-local tier's
    #: (every item under its own key: each rank writes a checkpoint of its own).
    key_maps: dict[str, dict[str, str]]
    local_maps: dict[str, dict[str, str]]
    #: The components whose state differed across the ranks (saved per rank).
    per_rank: tuple[str, ...]
    #: The model's frozen keys (``incremental``).
    stable: frozenset[str]
    #: The background check of a staged copy's plain tensors: a write in any tier commits only
    #: once every rank agreed on it (:func:`gate_on_check`).
    checked: Future[None] | None
    plan_prefix: str
    #: The manifest's checksum algorithm (``None``: ``save_checksums`` is off).
    checksum: str | None


def gate_on_check(outcomes: Outcomes, checked: Future[None] | None) -> Outcomes:
    """``outcomes`` with one of them (the first still running, else the first) settled only once
    ``checked`` passed, and failed where it failed: every tier's commit waits for every rank's
    write, so no tier commits a save whose plain tensors differ across the ranks (the check's
    verdict is the same on every rank)."""
    if checked is None or not outcomes:
        return outcomes
    at = next((i for i, o in enumerate(outcomes) if isinstance(o, Future)), 0)
    first = outcomes[at]
    if not isinstance(first, Future):
        done: Future[WriteResult] = Future()
        done.set_result(first)
        first = done
    return [*outcomes[:at], gated(first, checked), *outcomes[at + 1 :]]


def component_context(
    config: EngineConfig,
    paths: SavePaths,
    name: str,
    planner: EngineSavePlanner,
    staged_copy: bool,
    carry: CarryBase | None,
    stable: frozenset[str],
    process_group: Any,
) -> WriteContext:
    """The :class:`WriteContext` every tier hands the ``write`` provider for component ``name`` of
    a save into ``paths``: with ``carry`` (``incremental``), what it may carry over, the model's
    ``stable`` keys included. A rank-local write (``process_group`` is ``RANK_LOCAL``: the
    node-local tier) runs no collective, so it carries no ``collective_timeout_s``."""
    rank_local = process_group is RANK_LOCAL
    return WriteContext(
        component=name,
        iteration=paths.iteration,
        path=os.path.join(paths.partial, name),
        rank=_dist.rank(),
        world_size=_dist.world_size(),
        planner=planner,
        staged_copy=staged_copy,
        thread_count=config.thread_count,
        sync_files=config.sync_files,
        process_group=process_group,
        collective_timeout_s=None if rank_local else config.collective_timeout_s,
        carry_over=None if carry is None else carry.for_component(name, stable if name == "model" else frozenset()),
        rank_local=rank_local,
    )


class Tier(Protocol):
    """One tier of the :class:`TierStack`: a place every save it is chosen for is committed to,
    and that a resume may read from.

    The save side, for one save of iteration ``X``, in this order on every rank (the saver and the
    committer call it; a step's collectives are run by every rank at the same point):

    1. ``paths(X)`` on the caller's thread: where this rank writes. No I/O, no collective.
    2. ``prepare(paths)`` on the caller's thread, before staging: locks, the leftovers of a crash,
       a committed ``X`` refused (``allow_overwrite``), the partial folder cleared. No collective:
       the saver's ``prepare`` agreement that follows fails the save on every rank where one
       rank's prepare raised.
    3. ``begin(X)`` on the caller's thread, once every rank prepared: the after-commit step this
       save starts, as a :data:`Round` to resolve after the commit (the node-local tier: at its
       first save the lineage, one broadcast, and the node check, one broadcast and two
       all-gathers; then the save's replication round; the durable tier: none, no collective).
    4. ``write(paths, inputs)`` on the caller's thread: each component handed to the ``write``
       provider; returns the paths (with what an incremental save carries over) and the outcomes
       (results, or futures the provider resolves on its own threads). The durable tier runs DCP's
       collective save per component; the node-local tier writes rank-local checkpoints, no
       collective. A write that fails raises (the durable tier), or is reported by ``commit``
       (the node-local tier).
    5. ``commit(paths, components, outcomes, round, collective=...)``: wait for the outcomes,
       commit, resolve ``round``. ``collective=True`` on the caller's thread, every rank at the
       same point (the durable tier: one all-gather of the files and one of the outcome; the
       node-local tier: one agreement on the writes and one on the commit); ``collective=False``
       on the engine's commit thread, where no collective runs. Never raises: the error is the
       returned :class:`CommitPhase`'s.
    6. ``finish(paths, cleanup=True)`` after a failed save: what it staged is removed.
    7. ``durable_committed(paths)`` after the durable tier committed: the saves that follow in
       this tier descend from that one (the node-local tier's lineage).

    Around the saves: ``lineage()`` (what the manifests of the next save record), ``wait(timeout)``
    (its after-commit work so far; the node-local tier's replication) and ``close()`` (that work
    bounded by ``collective_timeout_s``, then its locks released), on the caller's thread.

    The resume side: ``newest(reader, ask)``, on every rank on the caller's thread of ``load()``,
    in the :class:`~.resume.ResumePlanner`'s restore order: the tier's newest complete candidate,
    checked and agreed by every rank, or ``None`` alike on every rank. The node-local tier's
    (:meth:`~.local_tier.LocalTier.newest`) runs the recovery's collectives (one all-gather of the
    holdings, one agreement per check and per transfer round) and the checks' one agreement, or,
    where no step of this job's shape is complete, the resharding recovery's (one all-gather of the
    holdings, one broadcast per old rank's part); a resharded step's read exchanges bytes between
    ranks per component and, where a received block fails its digest, raises
    :class:`~.resume.PassedOver` on every rank, and the planner goes on without the nearer tiers; the
    durable tier's candidates are the planner's own places for its save folder (the two-tier copy,
    a committed checkpoint ``latest`` does not name yet, ``latest``, the fallback), asked after the
    nearer tiers'. Once a load read a step, ``resumed(iteration)`` on every rank (no I/O, no
    collective): the saves that follow go on from it (the node-local tier records that fork at its
    next first save, and replaces its own copies of the future it abandoned).
    """

    #: What :attr:`SaveResult.tier <ckpt_engine.types.SaveResult.tier>` calls a save that ends here.
    name: str

    def paths(self, iteration: int) -> SavePaths: ...

    def prepare(self, paths: SavePaths) -> None: ...

    def begin(self, iteration: int) -> Round: ...

    def write(self, paths: SavePaths, inputs: WriteInputs) -> tuple[SavePaths, Outcomes]: ...

    def commit(
        self, paths: SavePaths, components: tuple[str, ...], outcomes: Outcomes, round_: Round, *, collective: bool
    ) -> CommitPhase: ...

    def finish(self, paths: SavePaths, *, cleanup: bool) -> None: ...

    def durable_committed(self, paths: SavePaths) -> None: ...

    def lineage(self) -> Lineage | None: ...

    def wait(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...

    def newest(self, reader: CheckpointReader, ask: ResumeAsk) -> LoadSource | None: ...

    def resumed(self, iteration: int) -> None: ...


class DurableTier:
    """``save_dir``: the durable tier, through the storage mode's :class:`~.targets.SaveTarget`
    chosen once (a local folder, an object store, or the two-tier copy of one). Rank 0 holds the
    save folder's lock from its first save until :meth:`close`."""

    name = "durable"

    def __init__(self, config: EngineConfig, pipeline: Pipeline, target: SaveTarget, checksum: str | None) -> None:
        self.config = config
        self.pipeline = pipeline
        self.target = target
        #: The manifest's checksum algorithm (``None``: ``save_checksums`` is off, sizes only).
        self.checksum = checksum
        #: Held by rank 0 from the first save until close(): a second engine saving into the
        #: same folder gets SaveDirLockedError instead of interleaving checkpoints. (An object
        #: store has no lock: the local staging folder is what is locked there.)
        self.lock = SaveDirLock(target.staging_root)

    def paths(self, iteration: int) -> SavePaths:
        return self.target.paths(iteration)

    def prepare(self, paths: SavePaths) -> None:
        """Rank 0 refuses a committed iteration (``allow_overwrite``), takes the lock (the first
        save also clears what a crash left) and lets the target clear this iteration's
        leftovers; the other ranks clear what only they can see."""
        rank, world = _dist.rank(), _dist.world_size()
        if rank != 0:
            self.target.clear_own_files(paths, rank, world)
            return
        refuse_resave(paths.iteration, self.target.resave_targets(paths), self.config.allow_overwrite)
        os.makedirs(self.target.staging_root, exist_ok=True)
        if self.lock.acquire():
            for line in cleanup_leftovers(self.target.staging_root):
                logger.warning("%s", line)
        self.target.clear_for_save(paths)

    def begin(self, iteration: int) -> Round:
        return None

    def write(self, paths: SavePaths, inputs: WriteInputs) -> tuple[SavePaths, Outcomes]:
        """Each component through DCP's collective save (with what it may carry over, where
        ``incremental``); the live state (no staged copy) is written before this returns."""
        carry = None
        if self.config.incremental and inputs.checksum is not None:
            carry = carry_base(self.target, self.config, inputs.checksum, paths.iteration)
            paths = dataclasses.replace(paths, carry_chain=carry.chain, carry_from=carry.folder)
        staged = inputs.staged
        outcomes: Outcomes = []
        for name in staged.components:
            planner = EngineSavePlanner(
                inputs.key_maps[name], cache_key=inputs.plan_prefix + name, checksum=inputs.checksum
            )
            ctx = component_context(
                self.config, paths, name, planner, staged.is_copy, carry, inputs.stable, watch_group()
            )
            out = inputs.pipeline.write(ctx, staged.components[name])
            if isinstance(out, Future) and not staged.is_copy:
                out = out.result()  # the live state: must be written before save() returns
            outcomes.append(out)
        return paths, gate_on_check(outcomes, inputs.checked)

    def commit(
        self, paths: SavePaths, components: tuple[str, ...], outcomes: Outcomes, round_: Round, *, collective: bool
    ) -> CommitPhase:
        """:func:`run_commit` through the target (what follows it, ``after_commit``, is the
        committer's: a two-tier upload may continue in the background)."""
        return run_commit(
            self.target, self.pipeline, paths, components, outcomes, collective=collective, algorithm=self.checksum
        )

    def finish(self, paths: SavePaths, *, cleanup: bool) -> None:
        """Nothing here: the target cleans up when the save's outcome is reported."""

    def durable_committed(self, paths: SavePaths) -> None:
        """Nothing to record: this is the durable tier."""

    def lineage(self) -> Lineage | None:
        return None

    def wait(self, timeout: float | None = None) -> None:
        """Nothing runs after a commit here that ``SaveHandle.result()`` does not wait for."""

    def close(self) -> None:
        self.lock.release()

    def newest(self, reader: CheckpointReader, ask: ResumeAsk) -> LoadSource | None:
        """``None``: the candidates of ``save_dir`` are the planner's own places (its two-tier copy,
        a committed checkpoint ``latest`` does not name yet, ``latest``, the fallback), asked
        after the nearer tiers'."""
        return None

    def resumed(self, iteration: int) -> None:
        """Nothing here: ``save_dir``'s own rules (``allow_overwrite``) govern its re-saves."""

    def latest_past(self, step: int) -> bool:
        """Whether ``save_dir``'s ``latest`` names an iteration past ``step`` that this engine has
        not committed (collective: rank 0, which makes the commits, reads ``latest`` and decides;
        a ``latest`` that cannot be read names nothing)."""
        found = False
        if _dist.rank() == 0:
            try:
                name = read_latest(self.config.save_dir, self.target.store)
            except CkptEngineError:
                name = None
            iteration = parse_iteration(name) if name else None
            found = iteration is not None and iteration > step and iteration not in self.target.committed
        past: bool = _dist.broadcast_object(found, step="tiers: save_dir's latest")
        return past


@dataclass
class TierSave:
    """One save's part in one tier: where this rank writes, its writes, the after-commit round."""

    tier: Tier
    paths: SavePaths
    outcomes: Outcomes = field(default_factory=list)
    round: Round = None


class TierStack:
    """The ordered tiers of one engine: the durable tier (``save_dir``), and before it the nearer
    tiers (the node-local tier, where one is configured; none otherwise). A stack of one tier
    is just a stack: nothing outside it asks whether a tier exists.

    The persist policy: every save goes to every nearer tier; it also goes to the durable tier
    when the stack has no nearer tier, when its iteration is a multiple of ``persist_every``, when
    ``save(durable=True)`` forces it, or while a job that went back to an older step with
    ``allow_overwrite`` has not rewound ``save_dir``'s ``latest`` yet (:meth:`saves`, every rank
    alike: rank 0 reads ``latest``). The durable tier is written first and committed last:
    a save that reaches the durable tier is committed in every tier, or it failed.

    The restore order (:class:`~.resume.ResumePlanner`, which states each place's rule): the
    durable tier's two-tier local copy, then the nearer tiers nearest first, then the durable
    tier's save folder (a committed checkpoint ``latest`` does not name yet, ``latest``, the
    fallback), then ``load_path``, then nothing.
    """

    def __init__(self, durable: DurableTier, nearer: Sequence[Tier], *, persist_every: int) -> None:
        self.durable = durable
        #: The tiers nearer than the durable one, nearest first.
        self.nearer = tuple(nearer)
        self.persist_every = persist_every
        #: With ``allow_overwrite``: the step a load resumed, until ``save_dir``'s ``latest`` is
        #: known not to name a step past it that this engine did not commit (:meth:`_rewinds`).
        self._behind: int | None = None

    def saves(self, iteration: int, *, durable: bool) -> list[TierSave]:
        """Where the save of ``iteration`` goes, in write order (``durable``: forced)."""
        persist = durable or not self.nearer or iteration % self.persist_every == 0 or self._rewinds()
        durable_part = [TierSave(self.durable, self.durable.paths(iteration))] if persist else []
        return durable_part + [TierSave(tier, tier.paths(iteration)) for tier in self.nearer]

    def _rewinds(self) -> bool:
        """Whether a save the policy leaves to the nearer tiers must go to ``save_dir`` too (every
        rank alike: rank 0 reads ``latest``). It must after a load went back to a step older than
        ``save_dir``'s ``latest``, with ``allow_overwrite``, until a save of this engine is
        committed there: saved to the nearer tiers only, ``latest`` would still name the history
        the job left, which the next resume takes; committed there, it rewinds ``latest``
        (:func:`~.resave.move_latest`), and the nearer tiers' saves descend from it."""
        if self._behind is None:
            return False
        if self.durable.latest_past(self._behind):
            return True  # until a save of this engine is committed there (a failed one does not count)
        self._behind = None
        return False

    def lineage(self) -> Lineage | None:
        """What the manifests of the save about to be committed record (the nearest tier's)."""
        return next((found for tier in self.nearer if (found := tier.lineage()) is not None), None)

    def durable_committed(self, paths: SavePaths) -> None:
        for tier in self.nearer:
            tier.durable_committed(paths)

    def resumed(self, iteration: int) -> None:
        """A load read step ``iteration``: every tier's saves go on from it."""
        for tier in (self.durable, *self.nearer):
            tier.resumed(iteration)
        if self.nearer and self.durable.config.allow_overwrite:
            self._behind = iteration

    def wait(self, timeout: float | None = None) -> None:
        """Every tier's after-commit work so far (the node-local tier's replication rounds)."""
        for tier in self.nearer:
            tier.wait(timeout)

    def close(self) -> None:
        """Each tier's after-commit work bounded, then its locks released: nearest first, the
        durable tier's lock last, whatever fails before it."""
        try:
            for tier in self.nearer:
                tier.close()
        finally:
            self.durable.close()
