"""The engine's typed errors.

Every error the engine raises on purpose derives from :class:`CkptEngineError`, an ordinary
``Exception`` (DCP's own ``CheckpointException`` is a ``BaseException``; the engine unwraps it).
Messages follow one template: who, what happened, what was expected, how to fix it.
"""

from __future__ import annotations

from collections.abc import Sequence


class CkptEngineError(Exception):
    """Base class of every error raised by ckpt-engine."""


class ConfigError(CkptEngineError, ValueError):
    """The engine configuration is invalid (a bad file, an impossible combination)."""


class InvalidArgumentError(CkptEngineError, ValueError):
    """A call got an argument it cannot use (a negative iteration, no ``model=`` where one is needed)."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """A call got an object of the wrong kind (a module passed as the optimizer, a scheduler
    without ``state_dict()``)."""


class SaveDirError(ConfigError):
    """``save_dir`` cannot hold checkpoints: it is a file, its name is too long, it cannot be created."""


class PluginLoadError(CkptEngineError):
    """A plugin could not be found, imported or instantiated."""


class PluginConfigError(ConfigError):
    """A plugin's options failed validation."""


class PluginConflictError(ConfigError):
    """Two enabled plugins provide the same provider hook, or two plugins share a name."""


class UsageError(CkptEngineError, ValueError):
    """A command-line mistake: a bad argument, a factory that cannot be imported, an output folder
    that is in the way. The command line prints it without a traceback and exits 2."""


class HookContractError(CkptEngineError):
    """A plugin's hook implementation returned something the hook contract does not allow."""


class ObserverError(CkptEngineError):
    """An ``on_save_done`` observer raised (its exception is the cause). Every other observer
    ran, and the save it observed is as its ``SaveResult`` says: committed, or failed on its own."""


class CheckpointNotFoundError(CkptEngineError, FileNotFoundError):
    """A checkpoint that the configuration points at does not exist."""


class NotACheckpointError(CheckpointNotFoundError):
    """A folder given as a checkpoint is something else (a save folder, its parent, an empty folder);
    the message says what it is and what was probably meant."""


class IncompleteCheckpointError(CkptEngineError):
    """A checkpoint exists but is not complete (missing ``.metadata`` or truncated data)."""


class CorruptCheckpointError(CkptEngineError):
    """A checkpoint file is unreadable, truncated or fails its integrity check."""


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint contains a pickled object the safe loader refuses to construct.

    A subclass of :class:`CorruptCheckpointError`: a crafted file is not a valid checkpoint, so
    code that handles damage (``verify``, fallback to an older checkpoint) handles it too.
    """


class UnverifiableCheckpointError(CkptEngineError):
    """``verify: checksums`` was asked for, but the checkpoint's checksums cannot be checked (no
    manifest, a sizes-only or newer one, an unavailable algorithm); ``allow_unverified`` loads it."""


class CheckpointLoadError(CkptEngineError):
    """Loading a component failed."""


class CheckpointLockedError(CheckpointLoadError, TimeoutError):
    """A checkpoint folder stayed under another process's exclusive lock longer than a load waits."""


class CheckpointDisagreementError(CheckpointLoadError):
    """The ranks of one load resolved different checkpoints, or different copies of one (a stale
    ``latest_checkpoint.txt`` on one host, host-local copies that diverged, a network
    filesystem's attribute cache); raised on every rank before anything is read."""


class RankLocalCoverageError(CheckpointLoadError):
    """A rank-local checkpoint of the node-local tier does not hold every element this rank's
    state needs (it was saved with another sharding): a resume then reads ``save_dir`` instead."""


class PartialCheckpointError(CkptEngineError):
    """A checkpoint holds only part of the tensors asked for (a rank-local checkpoint of the
    node-local tier: one rank's shards) and the command needs them whole; names the key and the
    elements it lacks. Missing elements are never filled in."""


class LoadStrictnessError(CheckpointLoadError):
    """Strict loading found unresolved problems; the message lists every one of them."""

    def __init__(
        self, component: str, missing: Sequence[str], mismatched: Sequence[str], unexpected: Sequence[str] = ()
    ) -> None:
        self.component = component
        self.missing = tuple(missing)
        self.mismatched = tuple(mismatched)
        self.unexpected = tuple(unexpected)
        parts = []
        if self.missing:
            parts.append(f"{len(self.missing)} missing key(s)")
        if self.mismatched:
            parts.append(f"{len(self.mismatched)} mismatch(es)")
        if self.unexpected:
            parts.append(f"{len(self.unexpected)} unexpected key(s)")
        lines = [f"strict load of component {component!r} failed: {', '.join(parts)}"]
        lines += [f"  missing: {k}" for k in self.missing]
        lines += [f"  mismatch: {m}" for m in self.mismatched]
        lines += [f"  unexpected: {k}" for k in self.unexpected]
        lines += strictness_fixes(component, bool(self.missing), bool(self.mismatched), bool(self.unexpected))
        super().__init__("\n".join(lines))

    def __reduce__(
        self,
    ) -> tuple[type[LoadStrictnessError], tuple[str, tuple[str, ...], tuple[str, ...], tuple[str, ...]]]:
        return (type(self), (self.component, self.missing, self.mismatched, self.unexpected))


def strictness_fixes(component: str, missing: bool, mismatched: bool, unexpected: bool) -> list[str]:
    """The ``fix:`` lines of a failed strict load: for each kind of problem, what resolves it."""
    fixes = []
    if missing:
        fixes.append(
            "fix: for the missing keys: if the checkpoint stores them under other names, map them with the rename "
            "plugin (or a remap_keys plugin; ema for net_ema.* weights); if "
            f"{component!r} should not be loaded, add it to keys_not_to_resume; to load the rest and report "
            "them, set strict: false"
        )
    if mismatched:
        fixes.append(
            "fix: for the mismatches: enable the size_mismatch plugin (policy skip, or overlap to load the shared "
            "region), or set strict: false to skip and report them"
        )
    if unexpected:
        fixes.append(
            "fix: for the unexpected keys: map them onto model keys (rename plugin), or set strict_unexpected: false"
        )
    return fixes


class CheckpointSaveError(CkptEngineError):
    """Saving a checkpoint failed; the previous ``latest`` checkpoint is untouched."""


class CheckpointExistsError(CheckpointSaveError, FileExistsError):
    """``save()`` of an iteration that is already committed, without ``allow_overwrite``."""


class UnsupportedTensorError(CheckpointSaveError, TypeError):
    """A tensor subclass in the state that the engine cannot save exactly (one that is not a
    wrapper of a single tensor of its own shape and dtype, such as torchao's ``NF4Tensor``); the
    error names the component and key. Raised at save, before anything is written."""


class SaveDirLockedError(CheckpointSaveError):
    """Another engine (in this or another process) is saving into the same ``save_dir``."""


class CheckpointPermissionError(CkptEngineError, PermissionError):
    """A checkpoint file or folder cannot be read (or written) for lack of permission."""


class CollectiveError(CkptEngineError):
    """A collective of a save or a load did not complete on every rank.

    ``committed`` says what became of the save's checkpoint where the error ends a save: ``True``
    when rank 0 had committed it before the collective failed (``latest_checkpoint.txt`` names
    it), ``False`` when it was not committed, ``None`` where this rank cannot know (ask rank 0's
    log, or look at ``latest_checkpoint.txt``)."""

    def __init__(self, message: str, *, step: str = "", missing: Sequence[int] = ()) -> None:
        super().__init__(message)
        #: The collective that was not reached (``"prepare"``, ``"write"``, ``"read"``, ...).
        self.step = step
        #: The ranks that did not arrive (empty on a rank that arrived late).
        self.missing = tuple(missing)
        self.committed: bool | None = None


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """Ranks did not all reach a collective of a save or a load within ``collective_timeout_s``.

    Raised on the ranks that waited (naming the ranks that did not arrive and the checkpoint phase
    each last published) and on a rank that arrived after the others had given up."""


class RankFailedError(CollectiveError):
    """Another rank's save or load failed on that rank alone, outside any collective (a ``write``
    hook that raised there, a bad argument on one rank), so it will not reach the collective this
    rank waits at. Raised at once on the ranks that wait there, naming the rank, its phase and its
    error (``.failed_rank``), instead of after ``collective_timeout_s``. The ranks stay in step:
    the engine's next save or load proceeds on every rank."""

    def __init__(self, message: str, *, step: str = "", failed_rank: int = -1) -> None:
        super().__init__(message, step=step, missing=(failed_rank,) if failed_rank >= 0 else ())
        #: The rank whose save or load failed on its own.
        self.failed_rank = failed_rank


class ProcessGroupError(CollectiveError):
    """A collective of a save or a load failed inside ``torch.distributed``: a peer rank's
    connection closed (it died) or it stopped answering within gloo's timeout (it was stopped),
    or the engine could not create its process group because a rank is gone. The message names
    this rank, the collective and the checkpoint phase; the job's process group is broken, so the
    job must restart (torchrun's ``--max-restarts`` does that)."""


class StorageError(CkptEngineError):
    """The storage behind a save or load directory failed (an object store unreachable after
    every retry, a request it refused); the message names the object and never a credential."""


class ReplicationError(CkptEngineError):
    """Copying a rank's local-tier checkpoint to its peer replicas failed (the local checkpoint
    itself stays committed): raised by ``CheckpointEngine.wait_replicated()``, naming the
    iteration, the ranks and the cause."""


class SnapshotChangedError(CkptEngineError):
    """A tensor of an ``overlap`` save (``pinned_staging``) was changed in place before its
    snapshot copy was confirmed: that save fails (``SaveHandle.result()`` raises a
    :class:`CheckpointSaveError` caused by this one, naming the key) and nothing is committed."""


class IntegrityError(CorruptCheckpointError):
    """A checkpoint file does not match the manifest written when it was committed (size or checksum)."""


def denied(err: BaseException, fix: str = "") -> str:
    """The reason for a refused access: an object store's own (which names what to check, e.g.
    the credentials), else ``permission denied`` plus ``fix``."""
    reason = getattr(err, "strerror", None)
    if isinstance(reason, str) and reason.startswith("access denied"):
        return reason
    return "permission denied" + (f"; {fix}" if fix else "")


def first_failure(exc: BaseException) -> tuple[BaseException, list[int]]:
    """The error behind DCP's ``CheckpointException`` (a ``BaseException`` gathering every failed
    rank's error) and the failed ranks, lowest first; any other exception comes back as is, with
    no ranks."""
    # Imported here, not at module load: importing the errors (the command line does) stays torch-free.
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        ranks = sorted(exc.failures)
        if ranks:
            err = exc.failures[ranks[0]]
            return (err[0] if isinstance(err, tuple) else err), ranks
    return exc, []


#: Most characters of a name read from a checkpoint (a key, a file name) that a message shows.
SHOWN_CHARS = 80


def clip(text: str, limit: int = SHOWN_CHARS) -> str:
    """``text`` (read from a file: a key, a path) as a message may show it: sliced *before* it is
    repr'd, so a hostile megabyte-long name costs a fixed size."""
    return repr(text[:limit]) + ("..." if len(text) > limit else "")


def described(err: BaseException) -> str:
    """``Type: message`` of an error that is not the engine's, with the notes it carries (which
    plugin's hook raised it), for the typed error that wraps it."""
    notes = getattr(err, "__notes__", None) or []
    return f"{type(err).__name__}: {err}" + "".join(f" ({clip(str(n), 200)[1:-1]})" for n in notes)


class ReplicatedStateMismatchError(CheckpointSaveError):
    """A plain tensor that several ranks save under one key differs between them: DCP would keep
    one rank's copy. The message names the component, the key and which ranks hold which value;
    ``EngineConfig.per_rank_keys`` saves such keys per rank instead."""


class PerRankStateError(CheckpointLoadError):
    """State saved per rank (it differed across ranks) loaded into a job of another size: rank
    ``r``'s copy means something only to rank ``r`` of a job of the saved size."""
