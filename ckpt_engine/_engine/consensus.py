"""Every rank fails together: the one primitive the engine's save, commit and load agree with.

A rank that raises between collectives leaves the others waiting in the next one forever. So
wherever one rank's step can fail on its own (preparing a save, writing or committing it, the
checks before a load), every rank reports its outcome in one collective and then either all go
on or all raise. The error every rank raises is the lowest failing rank's own, with its type and
message (sent as the exception object; one that cannot travel is replaced by a typed
:class:`~ckpt_engine.errors.CkptEngineError` carrying its type name and message), so a user sees
the same ``IncompleteCheckpointError`` on rank 3 that rank 0 found.

With no process group (or one rank) nothing is exchanged.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .._dcpio import dist
from ..errors import CheckpointLoadError, CkptEngineError, described, first_failure

__all__ = ["Agreement", "Failure", "agree", "agreed", "portable", "unwrap"]

_T = TypeVar("_T")


def portable(err: BaseException, fallback: type[CkptEngineError]) -> BaseException:
    """``err`` itself if it survives pickling (it will be sent to the other ranks), else a
    ``fallback`` error with its type name and message."""
    try:
        back = pickle.loads(pickle.dumps(err))
    except Exception:
        back = None
    if isinstance(back, type(err)) and str(back) == str(err):
        return err
    return fallback(described(err))


@dataclass(frozen=True)
class Failure:
    rank: int
    error: BaseException
    #: ``"TypeName: message"`` of the error as the failing rank raised it.
    text: str


@dataclass(frozen=True)
class Agreement:
    """What every rank reported: each rank's payload, and the failures (lowest rank first)."""

    payloads: list[Any] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    @property
    def first(self) -> Failure | None:
        return self.failures[0] if self.failures else None


def agree(
    local_error: BaseException | None, payload: Any = None, *, fallback: type[CkptEngineError], step: str = "sync"
) -> Agreement:
    """Exchange every rank's outcome (``local_error`` or ``None``) and ``payload`` in one
    all-gather (without a payload inside a save or a load: one all-reduce of a flag, and the
    all-gather of the errors only if a rank failed); every rank gets the same
    :class:`Agreement`. A single process gets its own. Inside an engine's save or load the
    exchange is bounded by ``collective_timeout_s``; ``step`` names it in the
    :class:`~ckpt_engine.errors.CollectiveTimeoutError` a missing rank causes."""
    sent = None if local_error is None else portable(local_error, fallback)
    text = "" if local_error is None else f"{type(local_error).__name__}: {local_error}"
    world = dist.world_size()
    if world <= 1:
        return Agreement([payload], [] if sent is None else [Failure(dist.rank(), sent, text)])
    # Without a payload, a fixed-size all-reduce says whether any rank failed; only then are the
    # errors gathered (every rank knows to join that second collective).
    if payload is None and dist.any_rank(sent is not None, step=step) is False:
        return Agreement([None] * world, [])
    gathered = dist.all_gather_object((sent, text, payload), step=step)
    failures = [Failure(r, err, t) for r, (err, t, _) in enumerate(gathered) if err is not None]
    return Agreement([p for _, _, p in gathered], failures)


def agreed(fn: Callable[[], _T], *, fallback: type[CkptEngineError] = CheckpointLoadError, step: str = "checks") -> _T:
    """Run ``fn`` on every rank; if it raises on any rank, raise on every rank: a rank's own error
    where it failed, else the lowest failing rank's error (same type and message, ``found by rank
    r`` added). An error that is not a :class:`CkptEngineError` becomes ``fallback``."""
    local: BaseException | None = None
    value: Any = None
    try:
        value = fn()
    except CkptEngineError as err:
        local = err
    except Exception as err:
        local = fallback(described(err))
        local.__cause__ = err
    outcome = agree(local, fallback=fallback, step=step)
    if local is not None:
        raise local
    if outcome.first is not None:
        theirs = outcome.first.error
        if isinstance(theirs, CkptEngineError) and theirs.args and isinstance(theirs.args[0], str):
            theirs.args = (f"{theirs.args[0]} (found by rank {outcome.first.rank})", *theirs.args[1:])
        raise theirs
    return value  # type: ignore[no-any-return]


def unwrap(exc: BaseException) -> tuple[BaseException, list[int]]:
    """The error behind DCP's ``CheckpointException`` and the ranks that failed
    (:func:`~ckpt_engine.errors.first_failure`); an error raised outside DCP is this rank's."""
    err, ranks = first_failure(exc)
    return err, ranks or [dist.rank()]
