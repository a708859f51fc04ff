"""A save folder's committed checkpoints as library calls: names, the latest, and retention around a protected set.

What a training integration needs to keep a folder of engine checkpoints tidy by its own rules
(a trainer's ``save_total_limit`` that keeps the best model, a callback's ``save_top_k``), with
the engine's own guarantees: a checkpoint is deleted so that a crash never leaves a half-deleted
``iter_*`` folder, the one ``latest_checkpoint.txt`` names and any newer one are never deleted,
and a failed deletion is reported, never raised, and retried by the next call.

>>> from ckpt_engine.checkpoints import apply_retention, checkpoint_name
>>> checkpoint_name(20)
'iter_000000020'
>>> result = apply_retention("runs/exp1/checkpoints", keep_last=2, protected={10})  # doctest: +SKIP
>>> result.deleted, result.failed                                                   # doctest: +SKIP
(['runs/exp1/checkpoints/iter_000000005'], [])

Every function takes ``storage`` (:class:`~ckpt_engine.config.StorageOptions`, or ``None`` for
the defaults) for a ``save_dir`` on an object store (``s3://...``), as ``EngineConfig.storage``.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from typing import TYPE_CHECKING

from .._format import retention as _retention
from .._format.layout import CheckpointInUseError
from .._format.layout import remove_checkpoint as _remove
from .._format.names import iter_dirname, parse_iteration
from .._format.pointer import list_checkpoints as _list
from .._format.pointer import read_latest
from .._format.retention import RetentionResult
from .._storage.store import open_store
from ..errors import InvalidArgumentError

if TYPE_CHECKING:
    from ..config import StorageOptions

__all__ = [
    "CheckpointInUseError",
    "RetentionResult",
    "apply_retention",
    "checkpoint_name",
    "iteration_of",
    "latest_checkpoint",
    "list_checkpoints",
    "remove_checkpoint",
]


def checkpoint_name(iteration: int) -> str:
    """The folder name of iteration ``iteration``'s checkpoint (``iter_000000020``)."""
    return iter_dirname(iteration)


def iteration_of(name: str) -> int | None:
    """The iteration of a checkpoint folder name (``iter_000000020`` -> 20); ``None`` for any other name."""
    return parse_iteration(os.path.basename(name.rstrip("/")))


def latest_checkpoint(save_dir: str, storage: StorageOptions | None = None) -> str | None:
    """The folder name ``latest_checkpoint.txt`` in ``save_dir`` names (``None``: no pointer yet).
    A pointer that names anything but one folder inside ``save_dir`` is refused."""
    return read_latest(save_dir, open_store(save_dir, storage))


def list_checkpoints(save_dir: str, storage: StorageOptions | None = None) -> list[tuple[int, str]]:
    """``(iteration, path)`` of every ``iter_*`` folder in ``save_dir``, oldest first (complete or not)."""
    return _list(save_dir, open_store(save_dir, storage))


def remove_checkpoint(path: str, storage: StorageOptions | None = None) -> None:
    """Delete the checkpoint folder ``path`` so that a crash never leaves a half-deleted one under
    its ``iter_*`` name. Raises :class:`CheckpointInUseError` while a load reads it, and
    ``FileNotFoundError`` when it is gone already."""
    _remove(path, open_store(path, storage))


def apply_retention(
    save_dir: str,
    keep_last: int,
    keep_every: int | None = None,
    *,
    protected: Collection[int] = (),
    storage: StorageOptions | None = None,
) -> RetentionResult:
    """Delete the checkpoints of ``save_dir`` that ``EngineConfig.keep_last`` / ``keep_every``
    would delete after a commit, except the iterations in ``protected`` (a trainer's best model):
    all but the ``keep_last`` newest complete checkpoints up to the latest, the multiples of
    ``keep_every`` kept too. Never deletes the latest or a newer checkpoint. Deletions that fail
    (a load reading the checkpoint, a permission) are logged and returned in ``failed``, not
    raised; the next call retries them. Run it on one rank (rank 0), after a commit."""
    for name, value in (("keep_last", keep_last), ("keep_every", 1 if keep_every is None else keep_every)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InvalidArgumentError(f"apply_retention: {name} must be an int >= 1, got {value!r}")
    store = open_store(save_dir, storage)
    return _retention.apply_retention(save_dir, keep_last, keep_every, store, in_use=frozenset(protected))
