"""ckpt-engine: sharded DCP checkpoints for PyTorch training, extended through pluggy hooks.

>>> from ckpt_engine import CheckpointEngine, EngineConfig
>>> engine = CheckpointEngine(EngineConfig(save_dir="runs/exp1/checkpoints"))  # doctest: +SKIP

The public names resolve lazily (PEP 562): ``import ckpt_engine`` imports neither torch nor
``torch.distributed.checkpoint``, so the command line and ``ckpt_engine.__version__`` start in a
fraction of a second; the first use of a name (``ckpt_engine.CheckpointEngine``, ``from
ckpt_engine import EngineConfig``) imports the submodule that defines it. Every class keeps the
module that defines it as its ``__module__`` (``ckpt_engine.errors.ConfigError``), so pickles are
unchanged. ``tests/project/test_import_cost.py`` pins what ``import ckpt_engine`` may import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._markers import PROJECT_NAME, hookimpl
from ._version import __version__

if TYPE_CHECKING:  # what mypy and IDEs see; at run time __getattr__ imports these on first use
    from ._engine.engine import CheckpointEngine, SaveHandle
    from ._engine.rng import RngWorldSizeError
    from .config import EngineConfig, PluginEntry, StorageOptions
    from .errors import (
        ArgumentTypeError,
        CheckpointDisagreementError,
        CheckpointExistsError,
        CheckpointLoadError,
        CheckpointLockedError,
        CheckpointNotFoundError,
        CheckpointPermissionError,
        CheckpointSaveError,
        CkptEngineError,
        CollectiveError,
        CollectiveTimeoutError,
        ConfigError,
        CorruptCheckpointError,
        HookContractError,
        IncompleteCheckpointError,
        IntegrityError,
        InvalidArgumentError,
        LoadStrictnessError,
        NotACheckpointError,
        ObserverError,
        PartialCheckpointError,
        PerRankStateError,
        PluginConfigError,
        PluginConflictError,
        PluginLoadError,
        ProcessGroupError,
        RankFailedError,
        RankLocalCoverageError,
        ReplicatedStateMismatchError,
        ReplicationError,
        SaveDirError,
        SaveDirLockedError,
        SnapshotChangedError,
        StorageError,
        UnsafeCheckpointError,
        UnsupportedTensorError,
        UnverifiableCheckpointError,
    )
    from .report import ComponentReport, LoadReport
    from .types import (
        Decision,
        LoadContext,
        LoadResult,
        PlanEntry,
        RemapContext,
        SaveContext,
        SaveResult,
        StagedState,
        ValueSpec,
        WriteContext,
        WriteResult,
    )


#: Where each lazily resolved public name is defined: submodule (relative to this package) -> names.
_SUBMODULES: dict[str, tuple[str, ...]] = {
    "._engine.engine": ("CheckpointEngine", "SaveHandle"),
    "._engine.rng": ("RngWorldSizeError",),
    ".config": ("EngineConfig", "PluginEntry", "StorageOptions"),
    ".errors": (
        "ArgumentTypeError",
        "CheckpointDisagreementError",
        "CheckpointExistsError",
        "CheckpointLoadError",
        "CheckpointLockedError",
        "CheckpointNotFoundError",
        "CheckpointPermissionError",
        "CheckpointSaveError",
        "CkptEngineError",
        "CollectiveError",
        "CollectiveTimeoutError",
        "ConfigError",
        "CorruptCheckpointError",
        "HookContractError",
        "IncompleteCheckpointError",
        "IntegrityError",
        "InvalidArgumentError",
        "LoadStrictnessError",
        "NotACheckpointError",
        "ObserverError",
        "PartialCheckpointError",
        "PerRankStateError",
        "PluginConfigError",
        "PluginConflictError",
        "PluginLoadError",
        "ProcessGroupError",
        "RankFailedError",
        "RankLocalCoverageError",
        "ReplicatedStateMismatchError",
        "ReplicationError",
        "SnapshotChangedError",
        "SaveDirError",
        "SaveDirLockedError",
        "StorageError",
        "UnsafeCheckpointError",
        "UnsupportedTensorError",
        "UnverifiableCheckpointError",
    ),
    ".report": ("ComponentReport", "LoadReport"),
    ".types": (
        "Decision",
        "LoadContext",
        "LoadResult",
        "PlanEntry",
        "RemapContext",
        "SaveContext",
        "SaveResult",
        "StagedState",
        "ValueSpec",
        "WriteContext",
        "WriteResult",
    ),
}
_LAZY: dict[str, str] = {name: module for module, names in _SUBMODULES.items() for name in names}

__all__ = [
    "PROJECT_NAME",
    "ArgumentTypeError",
    "CheckpointDisagreementError",
    "CheckpointEngine",
    "CheckpointExistsError",
    "CheckpointLoadError",
    "CheckpointLockedError",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "CheckpointSaveError",
    "CkptEngineError",
    "CollectiveError",
    "CollectiveTimeoutError",
    "ComponentReport",
    "ConfigError",
    "CorruptCheckpointError",
    "Decision",
    "EngineConfig",
    "HookContractError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "InvalidArgumentError",
    "LoadContext",
    "LoadReport",
    "LoadResult",
    "LoadStrictnessError",
    "NotACheckpointError",
    "ObserverError",
    "PartialCheckpointError",
    "PerRankStateError",
    "PlanEntry",
    "PluginConfigError",
    "PluginConflictError",
    "PluginEntry",
    "PluginLoadError",
    "ProcessGroupError",
    "RankFailedError",
    "RankLocalCoverageError",
    "RemapContext",
    "ReplicatedStateMismatchError",
    "ReplicationError",
    "RngWorldSizeError",
    "SaveContext",
    "SaveDirError",
    "SaveDirLockedError",
    "SaveHandle",
    "SaveResult",
    "SnapshotChangedError",
    "StagedState",
    "StorageError",
    "StorageOptions",
    "UnsafeCheckpointError",
    "UnsupportedTensorError",
    "UnverifiableCheckpointError",
    "ValueSpec",
    "WriteContext",
    "WriteResult",
    "__version__",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    """Import the submodule that defines ``name`` on first use (PEP 562) and cache the value."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups are ordinary attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
