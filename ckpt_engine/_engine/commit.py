"""The commit protocol of one save: wait for its writes, gather the ranks' files, commit, agree.

What committing *means* (a rename, a completion marker) is the :class:`~.targets.SaveTarget`'s;
this module is the order of the steps and the ranks' agreement around them, the same for every
target (docs/reliability.md, docs/storage.md):

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
import logging
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from torch.distributed.checkpoint.api import CheckpointException

from .._dcpio import dist as _dist
from .._dcpio.watch import phase as publish_phase
from .._format.digests import carried_copies, written_entries
from .._format.manifest import FileEntry, list_files, owner_rank
from ..errors import CheckpointSaveError, CollectiveError
from ..pipeline import Pipeline
from ..types import CarriedBy
from .consensus import agree, unwrap
from .targets import SavePaths, SaveTarget

__all__ = ["CommitPhase", "run_commit", "wait_writes"]

logger = logging.getLogger("ckpt_engine")


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
