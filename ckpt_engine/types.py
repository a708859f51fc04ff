"""Value types passed through hooks.

Inputs and outputs are frozen, keyword-only dataclasses: a plugin cannot change another plugin's
input, and new fields never break existing plugins.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.planner import SavePlanner

    from .report import LoadReport

__all__ = [
    "CarriedBy",
    "CarryOver",
    "Decision",
    "LoadContext",
    "LoadResult",
    "PendingSnapshot",
    "PlanEntry",
    "RemapContext",
    "SaveContext",
    "SaveResult",
    "StagedState",
    "ValueSpec",
    "WriteContext",
    "WriteResult",
]

#: How an incremental save carried unchanged files over (:attr:`SaveResult.carried_by`).
CarriedBy = Literal["off", "link", "copy", "write"]

#: The standard components, in save and load order.
STANDARD_COMPONENTS: tuple[str, ...] = ("model", "optim", "scheduler", "trainer")


class Decision(str, enum.Enum):
    """What the planner will do with one destination key."""

    LOAD = "load"
    """Read the storage key into the destination (cast to the destination dtype if they differ)."""
    OVERLAP = "overlap"
    """Read only the region both shapes share (index 0 up to the smaller extent per dimension)."""
    SKIP = "skip"
    """Read nothing; the destination keeps its current value. Requires a reason."""
    MISSING = "missing"
    """Unresolved: the storage key is not in the checkpoint."""
    MISMATCH = "mismatch"
    """Unresolved: stored and destination shapes (or tensor-ness) differ."""

    @property
    def resolved(self) -> bool:
        return self in (Decision.LOAD, Decision.OVERLAP, Decision.SKIP)


@dataclass(frozen=True, slots=True, kw_only=True)
class ValueSpec:
    """Shape and type of one value, on either side of a load.

    ``shape`` is the *global* shape (a DTensor's full shape, not its local shard).
    """

    is_tensor: bool
    shape: tuple[int, ...] | None = None
    dtype: torch.dtype | None = None
    type_name: str = ""

    def __str__(self) -> str:
        if self.is_tensor:
            dtype = str(self.dtype).removeprefix("torch.")
            return f"{dtype}{list(self.shape or ())}"
        return f"<{self.type_name or 'object'}>"


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanEntry:
    """One destination key of a component being loaded, as ``pre_load_plan`` sees it.

    ``dest_key`` is the flattened key in the live state dict, ``storage_key`` the key it reads
    from (after ``remap_keys``), ``stored`` the checkpoint's metadata for it (``None`` when the
    checkpoint lacks it). Plugins return changed copies through :meth:`skip`, :meth:`overlap`
    and :meth:`load`; the identity fields must not change.
    """

    dest_key: str
    storage_key: str
    target: ValueSpec
    stored: ValueSpec | None
    decision: Decision
    reason: str = ""
    decided_by: str | None = None

    @property
    def shape_mismatch(self) -> bool:
        s = self.stored
        if s is None:
            return False
        if s.is_tensor != self.target.is_tensor:
            return True
        return s.is_tensor and s.shape != self.target.shape

    @property
    def dtype_mismatch(self) -> bool:
        s = self.stored
        return bool(s and s.is_tensor and self.target.is_tensor and s.dtype != self.target.dtype)

    def skip(self, reason: str) -> PlanEntry:
        """Read nothing into this key; it keeps its current value."""
        if not reason:
            raise ValueError(f"skipping {self.dest_key!r} needs a reason")
        return dataclasses.replace(self, decision=Decision.SKIP, reason=reason)

    def overlap(self, reason: str = "") -> PlanEntry:
        """Read the region both shapes share; the rest of the destination keeps its values."""
        return dataclasses.replace(self, decision=Decision.OVERLAP, reason=reason)

    def load(self, reason: str = "") -> PlanEntry:
        """Read the whole stored value (only valid when the shapes agree)."""
        return dataclasses.replace(self, decision=Decision.LOAD, reason=reason)

    def same_identity(self, other: PlanEntry) -> bool:
        return (
            self.dest_key == other.dest_key
            and self.storage_key == other.storage_key
            and self.target == other.target
            and self.stored == other.stored
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RemapContext:
    """Input of ``remap_keys``."""

    component: str
    direction: Literal["save", "load"]
    #: Keys present in the checkpoint (load only; ``None`` on save).
    storage_keys: frozenset[str] | None
    checkpoint_path: str
    rank: int
    world_size: int
    #: ``True`` when the load starts this run from another checkpoint (``load_path``: a checkpoint
    #: or save folder outside ``save_dir``, safetensors weights); ``False`` when it resumes the run
    #: (the load folder's ``latest``, a tier's copy, a checkpoint of ``save_dir`` named exactly, as
    #: the integrations' resume of a named checkpoint), and on save. A remap meant for a warm start (EMA weights into
    #: the regular ones, a pretrained model's keys renamed) applies only then: a resume restores
    #: the state as it was saved.
    #:
    #: .. versionadded:: 0.6
    warm_start: bool = False
    #: Lines for this component's load report (``ComponentReport.notes``); add them with :meth:`note`.
    notes: list[str] = field(default_factory=list, compare=False, repr=False)

    def note(self, message: str) -> None:
        """Add a line to the load report (on save, to the log), e.g. a rename rule that matched nothing.

        The engine prefixes it with the plugin's name. Give the same notes on every rank.

        .. versionadded:: 0.2
        """
        self.notes.append(message)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadContext:
    """Input of ``pre_load_plan``."""

    component: str
    checkpoint_path: str
    strict: bool
    rank: int
    world_size: int
    #: Every key in the checkpoint's component (after no remapping: the raw storage keys).
    storage_keys: frozenset[str]


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveContext:
    """Input of ``stage``."""

    iteration: int
    checkpoint_path: str
    components: tuple[str, ...]
    rank: int
    world_size: int
    #: The optimizers passed to ``save()`` (a stager that copies in the background guards their
    #: ``step()`` with a step pre-hook). Do not step or mutate them.
    optimizers: tuple[torch.optim.Optimizer, ...] = ()


class PendingSnapshot(Protocol):
    """A point-in-time copy still being taken after ``save()`` returned (see ``StagedState.snapshot``)."""

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy is complete; raise the error that failed it, or ``TimeoutError``."""
        ...

    @property
    def step_wait_seconds(self) -> float:
        """Seconds the training loop waited for the copy after ``save()`` returned (so far)."""
        ...

    @property
    def copy_seconds(self) -> float:
        """Seconds the background copy took (0 until it is complete)."""
        ...


@dataclass(frozen=True, slots=True, kw_only=True)
class StagedState:
    """Output of ``stage``: the state to write, per component.

    ``is_copy`` tells whether the state is a host copy owned by the stager (safe to write after
    ``save()`` returns) or the live state itself (then the write must finish before ``save()``
    returns, which the engine enforces). ``completion``, when set, completes when the copy is
    done; the engine waits for it before ``save()`` returns. ``snapshot``, when set, is a copy
    that continues after ``save()`` returns (``pinned_staging`` with ``overlap``): the engine does
    not wait for it; ``SaveHandle.wait_staged()`` does, and the stager must not let a write read
    the copy before it is complete.
    """

    components: Mapping[str, dict[str, Any]]
    is_copy: bool
    completion: Future[None] | None = None
    snapshot: PendingSnapshot | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class CarryOver:
    """What an incremental save (``EngineConfig.incremental``) may carry over, for one component:
    the files of the last committed checkpoint, as its manifest lists them.

    A write provider that honours it lays the component's items out in files that stay the same
    from save to save, and carries over (instead of writing) each file whose bytes would equal
    the previous checkpoint's file of the same name, as its size and checksum say; one that
    ignores it writes everything, which is always correct."""

    #: The previous checkpoint's folder of this component (a local path for ``method="link"``,
    #: a URL for ``"copy"``), or ``None`` when there is nothing to carry over (the first save,
    #: or a full write): the files are still laid out for the next save.
    previous: str | None
    #: File name inside ``previous`` -> (size, checksum), from the previous checkpoint's manifest.
    files: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    #: The manifest's checksum algorithm (that of this save too).
    algorithm: str = ""
    #: How a file is carried over: a hard link (local) or a server-side copy (object store).
    method: Literal["link", "copy"] = "link"
    #: Storage keys expected not to change (the model's frozen parameters and its buffers): the
    #: items worth comparing. A hint only: what is carried over is decided by the bytes.
    stable: frozenset[str] = frozenset()
    #: File name inside ``previous`` -> its version when that checkpoint was committed, where its
    #: manifest recorded one (a local file's inode, size, mtime and ctime). A file whose version
    #: is another now changed since its commit, or cannot be vouched for unread: it is carried
    #: over only if its bytes, read again, still have the recorded checksum.
    seen: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteContext:
    """Input of ``write``: where and how to persist one component."""

    component: str
    iteration: int
    #: Local folder that receives this component's DCP files (inside the uncommitted checkpoint;
    #: for an object-store ``save_dir``, inside the local spool the engine uploads at commit).
    path: str
    rank: int
    world_size: int
    #: The save planner to hand to DCP: it applies ``remap_keys`` and replica de-duplication.
    planner: SavePlanner
    #: Whether the live state was staged into a copy (see :class:`StagedState`).
    staged_copy: bool
    thread_count: int = 1
    sync_files: bool = True
    process_group: Any = None
    #: The engine's ``collective_timeout_s``: a provider whose own processes run collectives
    #: bounds them by it (:class:`ckpt_engine.storage.CollectiveWatch`).
    collective_timeout_s: float | None = None
    #: Set when ``EngineConfig.incremental`` is on: what this write may carry over.
    carry_over: CarryOver | None = None
    #: A write of the node-local tier (``EngineConfig.local_dir``): this rank writes every item
    #: it holds, replicated or not, with a ``.metadata`` of its own, and runs no collective at
    #: all (``process_group`` is :data:`ckpt_engine.storage.RANK_LOCAL`; ``path`` is in this
    #: rank's own folder). A provider that cannot write so declares it (see
    #: :class:`ckpt_engine.lifecycle.WritesRankLocal`).
    rank_local: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteResult:
    """Output of ``write`` (directly, or through a ``Future``)."""

    component: str
    #: Bytes written now (files carried over not counted).
    bytes_written: int
    seconds: float
    #: Bytes of files carried over from the previous checkpoint (``WriteContext.carry_over``).
    bytes_reused: int = 0
    #: How: see :attr:`SaveResult.carried_by`.
    carried_by: CarriedBy = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class SaveResult:
    """The record of one save, given to ``on_save_done`` and returned by ``SaveHandle.result()``."""

    iteration: int
    path: str
    succeeded: bool
    error: BaseException | None = None
    components: tuple[str, ...] = ()
    #: Bytes this rank wrote for the checkpoint (files carried over not counted).
    bytes_written: int = 0
    #: Bytes of this rank's files carried over from the previous checkpoint instead of written
    #: (``EngineConfig.incremental``): hard-linked, or copied inside the object store.
    bytes_reused: int = 0
    #: How unchanged files were carried over: ``"off"`` (``incremental`` off, or nothing to carry
    #: over from), ``"link"`` (hard links), ``"copy"`` (server-side copies), ``"write"`` (carrying
    #: over was refused, e.g. links across devices, so unchanged files were written: see the log).
    carried_by: CarriedBy = "off"
    #: Seconds ``save()`` blocked the caller.
    blocked_seconds: float = 0.0
    staging_seconds: float = 0.0
    write_seconds: float = 0.0
    #: Seconds from the ``save()`` call until committed (or failed).
    total_seconds: float = 0.0
    #: Seconds the training loop waited for this save after ``save()`` returned: in the
    #: optimizer's step pre-hook (or ``wait_staged()``) until the background copy was complete
    #: (``pinned_staging`` with ``overlap``; 0 otherwise).
    step_wait_seconds: float = 0.0
    #: Seconds the background copy of parameters and optimizer state took after ``save()``
    #: returned (``overlap`` only; a copy made inside ``save()`` is part of ``staging_seconds``).
    background_copy_seconds: float = 0.0
    #: Where this save was committed: ``"durable"`` (``save_dir``; with a local tier, there too),
    #: or ``"local"`` (only the node-local tier and its peer replicas: ``EngineConfig.local_dir``,
    #: a save between two ``persist_every`` iterations). ``path`` is then this rank's local folder.
    tier: Literal["durable", "local"] = "durable"

    @property
    def loop_wait_seconds(self) -> float:
        """Seconds the training loop waited for this save in all: ``save()`` plus the step hook."""
        return self.blocked_seconds + self.step_wait_seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """What ``CheckpointEngine.load`` did."""

    iteration: int
    checkpoint_path: str | None
    report: LoadReport
    #: Which resume rule applied: ``latest``, ``load_path``, ``pth``, ``safetensors`` or ``scratch``.
    source: Literal["latest", "load_path", "pth", "safetensors", "scratch"] = "scratch"
    components: tuple[str, ...] = field(default_factory=tuple)
    #: Whether the checkpoint's manifest existed and every file matched it at the configured
    #: ``verify`` level before anything was loaded (False for checkpoints without a manifest,
    #: ``verify="off"``, a ``.pth`` file or a fresh start).
    verified: bool = False
    #: With ``fallback_to_last_complete``: the checkpoint ``latest_checkpoint.txt`` named (or the
    #: pointer file itself, when unreadable) that was refused in favour of ``checkpoint_path``.
    fell_back_from: str | None = None
    #: Bytes of data files this rank read from storage (with ``dedup_reads``, its share of what
    #: several ranks need; the rest came by broadcast). 0 for a ``.pth``, safetensors or fresh start.
    bytes_read: int = 0
    #: Bytes this rank took from each source: ``"local"`` (its node-local tier, or the two-tier
    #: local copy), ``"peer"`` (a replica another rank sent over the process group, checksummed on
    #: arrival: the bytes of the files received) and ``"durable"`` (``save_dir`` or ``load_path``);
    #: sources it took nothing from are left out. What was read from storage counts as
    #: :attr:`bytes_read` does (archive headers read ahead included).
    bytes_by_source: Mapping[str, int] = field(default_factory=dict)
