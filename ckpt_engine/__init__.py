"""ckpt-engine: sharded DCP checkpoints for PyTorch training, extended through pluggy hooks.

>>> from ckpt_engine import CheckpointEngine, EngineConfig
>>> engine = CheckpointEngine(EngineConfig(save_dir="runs/exp1/checkpoints"))  # doctest: +SKIP
"""

from ._engine.engine import CheckpointEngine, SaveHandle
from ._engine.rng import RngWorldSizeError
from ._markers import PROJECT_NAME, hookimpl
from ._version import __version__
from .config import EngineConfig, PluginEntry, StorageOptions
from .errors import (
    ArgumentTypeError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CheckpointSaveError,
    CkptEngineError,
    CollectiveTimeoutError,
    ConfigError,
    CorruptCheckpointError,
    HookContractError,
    IncompleteCheckpointError,
    IntegrityError,
    InvalidArgumentError,
    LoadStrictnessError,
    NotACheckpointError,
    PluginConfigError,
    PluginConflictError,
    PluginLoadError,
    SaveDirError,
    SaveDirLockedError,
    StorageError,
    UnsafeCheckpointError,
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

__all__ = [
    "PROJECT_NAME",
    "ArgumentTypeError",
    "CheckpointEngine",
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "CheckpointSaveError",
    "CkptEngineError",
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
    "PlanEntry",
    "PluginConfigError",
    "PluginConflictError",
    "PluginEntry",
    "PluginLoadError",
    "RemapContext",
    "RngWorldSizeError",
    "SaveContext",
    "SaveDirError",
    "SaveDirLockedError",
    "SaveHandle",
    "SaveResult",
    "StagedState",
    "StorageError",
    "StorageOptions",
    "UnsafeCheckpointError",
    "ValueSpec",
    "WriteContext",
    "WriteResult",
    "__version__",
    "hookimpl",
]
