"""The save side of the engine: preparing a save (state dicts, ``remap_keys``, clearing, ``stage``,
the ranks' agreement) and its writes, into each tier of the engine's tier stack it goes to.

:class:`Saver` owns it; :meth:`CheckpointEngine.save <ckpt_engine.CheckpointEngine.save>` checks
its arguments, builds the training objects and hands them over. Which tiers a save goes to is the
:class:`~ckpt_engine._engine.tiers.TierStack`'s persist policy; each tier prepares and writes its
part (:class:`~ckpt_engine._engine.tiers.Tier`). The commit of what was written, and the one
builder of every outcome's :class:`~ckpt_engine.types.SaveResult`, are the
:class:`~ckpt_engine._engine.committer.SaveCommitter`'s.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from .._dcpio import dist as _dist
from .._dcpio.fast_save import drop_plan_caches
from .._dcpio.planner import flat_keys
from .._dcpio.watch import phase as publish_phase
from .._format.layout import cleanup_leftovers, disk_full_hint, find_leftovers
from ..config import EngineConfig
from ..errors import (
    CheckpointExistsError,
    CheckpointSaveError,
    CkptEngineError,
    CollectiveError,
    ReplicatedStateMismatchError,
    SaveDirLockedError,
    UnsupportedTensorError,
    described,
)
from ..pipeline import Pipeline
from ..types import RemapContext, SaveContext
from .committer import SaveClock, SaveCommitter, SaveWrites
from .consensus import (
    LaterTensorCheck,
    LocalDigests,
    Part,
    agree,
    differences,
    digests,
    per_rank_maps,
    plain_keys,
    shares_memory,
    unwrap,
    without_broadcast_buffers,
)
from .incremental import stable_keys
from .pending import SaveHandle, SaveQueue
from .state import TrainingObjects, component_state_dict, plain_tensors
from .targets import SavePaths
from .tiers import TierStack, WriteInputs

__all__ = ["Saver"]

logger = logging.getLogger("ckpt_engine")


class Saver:
    """Saves training objects into the checkpoints of one engine's configuration and target."""

    def __init__(
        self,
        config: EngineConfig,
        pipeline: Pipeline,
        tiers: TierStack,
        queue: SaveQueue,
        *,
        plan_prefix: str,
        checksum: str | None,
    ) -> None:
        self.config = config
        self.pipeline = pipeline
        #: The tiers a save goes to (the persist policy), each preparing and writing its part.
        self.tiers = tiers
        #: The storage mode of the durable tier, chosen once: its staging folder and lock.
        self.target = tiers.durable.target
        #: The saves in flight: their handles, the commit thread, failures nobody asked about.
        self.queue = queue
        #: Names the save-plan caches (``fast_save``) of this saver: one per component.
        self.plan_prefix = plan_prefix
        #: The manifest's checksum algorithm (``None``: ``save_checksums`` is off, sizes only).
        self.checksum = checksum
        #: Commits what this saver wrote, in each tier, and reports every outcome.
        self.committer = SaveCommitter(config, pipeline, tiers, queue, checksum)
        #: The background check of staged copies' plain tensors (made at the first such save).
        self._later: LaterTensorCheck | None = None

    def remove_leftovers_at_start(self) -> None:
        """Rank 0 removes the hidden folders a crashed save or deletion left in ``save_dir``.

        Only under the save_dir lock (taken briefly), so the folders of another engine that is
        saving there right now are never touched. Where there is nothing to remove, nothing is
        opened or written: an engine that only loads leaves the folder as it found it.
        """
        if _dist.initialized():
            rank = _dist.rank()
        else:  # constructed before init_process_group: torchrun's RANK still says who is rank 0
            try:
                rank = int(os.environ.get("RANK", "0"))
            except ValueError:
                rank = 0
        if rank != 0:
            return
        leftovers = find_leftovers(self.target.staging_root)
        if not leftovers:
            return
        holder = self.tiers.durable.lock.try_hold_briefly()
        if holder is None:
            logger.info(
                "%s holds %d leftover temporary folder(s), but another engine holds its lock (or it cannot "
                "be locked); leaving them",
                self.target.staging_root,
                len(leftovers),
            )
            return
        try:
            for line in cleanup_leftovers(self.target.staging_root, leftovers):
                logger.warning("%s", line)
        finally:
            holder.release()

    def close(self) -> None:
        """Drop this saver's plan caches (after every save ended; the tiers release their locks)."""
        drop_plan_caches(self.plan_prefix)
        if self._later is not None:
            self._later.close()

    # -- one save ---------------------------------------------------------------------------

    def save(self, iteration: int, objs: TrainingObjects, *, durable: bool = False) -> SaveHandle:
        """Save ``objs`` as ``iteration`` (see :meth:`CheckpointEngine.save`): prepare, write,
        then commit now or hand the save to the commit thread. With a local tier, every save is
        committed there and ``durable`` ones (``persist_every``, or forced) also to ``save_dir``:
        the tier stack's persist policy."""
        # One save in flight (more only where the stage provider says so): never re-stage while
        # a write may still read the buffers.
        self.queue.wait(keep=self.queue.may_keep(iteration, self.pipeline.max_saves_in_flight()), raise_errors=False)

        clock = SaveClock(time.perf_counter())
        writes = SaveWrites(self.tiers.saves(iteration, durable=durable))
        paths = writes.main.paths
        components = tuple(objs.available())
        try:
            staged, maps, stable, checked = self._prepare(objs, paths, writes, components, clock)
            for part in writes.saves:
                part.round = part.tier.begin(iteration)
        except Exception as err:
            failure = self._failed_before_write(paths, writes, components, err, clock)
            if failure is err:
                raise
            raise failure from err
        try:
            # Components whose storage keys the ranks' check renamed (none where no check ran: one map).
            per_rank = () if maps[0] is maps[1] else tuple(sorted(n for n, m in maps[0].items() if m != maps[1].get(n)))
            inputs = WriteInputs(
                self.pipeline, staged, maps[0], maps[1], per_rank, stable, checked, self.plan_prefix, self.checksum
            )
            self._write(writes, components, inputs, clock)
            clock.snapshot = staged.snapshot
            clock.blocked = time.perf_counter() - clock.t0
            return self.committer.hand_off(writes, components, clock)
        finally:
            if self._later is not None:
                self._later.release()  # the staged copy's check runs once save() is done

    def _prepare(
        self, objs: TrainingObjects, paths: SavePaths, writes: SaveWrites, components: tuple[str, ...], clock: SaveClock
    ) -> tuple[Any, tuple[dict[str, dict[str, str]], dict[str, dict[str, str]]], frozenset[str], Future[None] | None]:
        """Build state dicts, run ``remap_keys`` and ``stage``; every rank agrees on success and,
        with several ranks, on what DCP keeps one copy of (``consensus.digests``). Returns the
        staged state, the key maps of ``save_dir`` (per-rank state under rank keys) and of the
        local tier, the model's stable keys (``incremental``), and the background tensor check."""
        rank, world = _dist.rank(), _dist.world_size()
        staged: Any = None
        key_maps: dict[str, dict[str, str]] = {}
        stable: frozenset[str] = frozenset()
        staging = 0.0
        checking = world > 1 and self.config.check_replicated
        check: LocalDigests | None = None
        later: tuple[Any, LocalDigests | None, Any] | None = None
        try:
            publish_phase("prepare")
            state = {
                name: plain_tensors(name, component_state_dict(objs, name, paths.iteration)) for name in components
            }
            publish_phase("remap_keys")
            for name, sd in state.items():
                ctx = RemapContext(
                    component=name,
                    direction="save",
                    storage_keys=None,
                    checkpoint_path=paths.final,
                    rank=rank,
                    world_size=world,
                )
                key_maps[name] = self.pipeline.remap_keys(ctx, flat_keys(sd))
            if self.config.incremental and "model" in state:
                stable = stable_keys(objs.modules, state["model"], key_maps["model"])
            digested = without_broadcast_buffers(state, objs.modules, self.config.per_rank_keys)  # DDP: rank 0's
            if world > 1 and (checking or self.config.per_rank_keys):
                part: Part = "values" if checking else "none"
                check = digests(digested, key_maps, paths.iteration, self.config.per_rank_keys, part)
            for tier_save in writes.saves:  # the durable tier first: the rank-0 clearing, the lock
                tier_save.tier.prepare(tier_save.paths)
            t_stage = time.perf_counter()
            publish_phase("stage")
            ctx_stage = SaveContext(
                iteration=paths.iteration,
                checkpoint_path=paths.final,
                components=components,
                rank=rank,
                world_size=world,
                optimizers=tuple(objs.optimizers),
            )
            staged = self.pipeline.stage(ctx_stage, state)
            if staged.completion is not None:
                staged.completion.result()
            staging = time.perf_counter() - t_stage
            if checking and check is not None:
                check, later = self._tensor_digests(digested, staged, key_maps, check, paths.iteration)
        except Exception as exc:
            if world == 1:
                raise
            local_err: Exception | None = exc
        else:
            local_err = None
        # Consensus (also the barrier after rank 0 cleared the partial folder): a failure on
        # one rank fails the save on all ranks before anyone enters DCP's collectives.
        # With the check on, every rank's digests travel in the same all-gather (one collective).
        payload = (check.sent if check is not None else {}) if checking else None
        outcome = agree(local_err, payload, fallback=CheckpointSaveError, step="prepare")
        failed = outcome.first
        if failed is not None:
            # The same message on every rank; the failing rank keeps its traceback as the cause.
            raise CheckpointSaveError(
                f"rank {failed.rank} failed while preparing the save: {failed.text}"
            ) from local_err
        clock.staging = staging
        saved_maps = key_maps
        if check is not None:
            found = differences(check, outcome.payloads) if checking else []
            saved_maps = per_rank_maps(check, found, key_maps, rank)  # the same verdict on every rank
        checked = self._start_later(later, key_maps, paths.iteration)  # every tier's commit waits for it
        return staged, (saved_maps, key_maps), stable, checked

    def _start_later(
        self, later: tuple[Any, LocalDigests | None, Any] | None, key_maps: dict[str, dict[str, str]], iteration: int
    ) -> Future[None] | None:
        """The background check of a staged copy's plain tensors (``later`` is the same on every
        rank: the stager's ``is_copy``), which the commit will wait for."""
        if later is None:
            return None
        if self._later is None:
            self._later = LaterTensorCheck(self.config.collective_timeout_s)
        maps = (key_maps, plain_keys(later[2]))
        return self._later.start(later[0], maps, iteration, self.config.per_rank_keys, later[1])

    def _tensor_digests(
        self, state: Any, staged: Any, key_maps: dict[str, dict[str, str]], check: LocalDigests, iteration: int
    ) -> tuple[LocalDigests, tuple[Any, LocalDigests | None, Any] | None]:
        """The plain tensors' digests: with the values' now (live state), or for the background
        check of a staged copy (``(staged, None)``: hashed from the copy there; with digests: a
        copy refilled in windows, never whole, or one still being taken (``overlap``: only its
        owner may wait for it), so hashed from the live state now)."""
        patterns = self.config.per_rank_keys
        if not staged.is_copy:
            return check.plus(digests(state, key_maps, iteration, patterns, "tensors")), None
        if staged.snapshot is not None or shares_memory(staged.components):
            return check, (staged, digests(state, key_maps, iteration, patterns, "tensors"), state)
        return check, (staged, None, state)

    def _failed_before_write(
        self, paths: SavePaths, writes: SaveWrites, components: tuple[str, ...], err: Exception, clock: SaveClock
    ) -> Exception:
        """Report a save that failed before any write, and return the error ``save()`` raises:
        refusals and timeouts as they are, anything else as a :class:`CheckpointSaveError`."""
        writes.abandon(cleanup=False)
        self.committer.report(paths, writes, components, clock, err, cleanup=False)
        if isinstance(err, CollectiveError):
            err.committed = False
        if isinstance(
            err,
            (
                SaveDirLockedError,
                CheckpointExistsError,
                CollectiveError,
                UnsupportedTensorError,
                ReplicatedStateMismatchError,
            ),
        ):
            return err
        detail = str(err) if isinstance(err, CkptEngineError) else described(err)
        return CheckpointSaveError(f"saving iteration {paths.iteration} to {paths.final} failed: {detail}")

    def _write(self, writes: SaveWrites, components: tuple[str, ...], inputs: WriteInputs, clock: SaveClock) -> None:
        """Each tier's writes of the save (the durable tier's first, where the save goes there);
        the live state (no staged copy) is written before this returns. A failure is reported and
        raised on every rank (a rank-local write's on its own rank, by the commit)."""
        clock.write_start = time.perf_counter()
        try:
            for part in writes.saves:
                part.paths, part.outcomes = part.tier.write(part.paths, inputs)
        except (Exception, CheckpointException) as exc:
            cause, ranks = unwrap(exc)
            writes.abandon(cleanup=True)
            failure = self._failed_write(writes.main.paths, writes, components, cause, ranks, clock)
            if isinstance(cause, CollectiveError):
                cause.committed = False
                raise cause from None
            raise failure from cause

    def _failed_write(
        self,
        paths: SavePaths,
        writes: SaveWrites,
        components: tuple[str, ...],
        err: BaseException,
        ranks: list[int],
        clock: SaveClock,
    ) -> CheckpointSaveError:
        """Report a failed write and return the error to raise."""
        hint = disk_full_hint(os.path.dirname(paths.partial), err)  # before the partial folder frees its space
        self.committer.report(paths, writes, components, clock, err, cleanup=True)
        where = f" on rank(s) {ranks}" if _dist.world_size() > 1 else ""
        return CheckpointSaveError(
            f"saving iteration {paths.iteration} to {paths.final} failed{where}: {described(err)}{hint}; "
            "the previous checkpoint is untouched"
        )
