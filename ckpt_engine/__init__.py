"""ckpt-engine: sharded DCP checkpoints for PyTorch training, extended through pluggy hooks.

>>> from ckpt_engine import CheckpointEngine, EngineConfig
>>> engine = CheckpointEngine(EngineConfig(save_dir="runs/exp1/checkpoints"))  # doctest: +SKIP
"""

from ._markers import PROJECT_NAME, hookimpl
from .config import EngineConfig, PluginEntry, StorageOptions
from .engine import CheckpointEngine, SaveHandle
from .errors import (
    CheckpointExistsError,
    CheckpointLoadError,
    CheckpointNotFoundError,
    CheckpointPermissionError,
    CheckpointSaveError,
    CkptEngineError,
    ConfigError,
    CorruptCheckpointError,
    HookContractError,
    IncompleteCheckpointError,
    IntegrityError,
    LoadStrictnessError,
    PluginConfigError,
    PluginConflictError,
    PluginLoadError,
    SaveDirLockedError,
    StorageError,
    UnsafeCheckpointError,
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

__version__ = "0.1.0"

__all__ = [
    "PROJECT_NAME",
    "CheckpointEngine",
    "CheckpointExistsError",
    "CheckpointLoadError",
    "CheckpointNotFoundError",
    "CheckpointPermissionError",
    "CheckpointSaveError",
    "CkptEngineError",
    "ComponentReport",
    "ConfigError",
    "CorruptCheckpointError",
    "Decision",
    "EngineConfig",
    "HookContractError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "LoadContext",
    "LoadReport",
    "LoadResult",
    "LoadStrictnessError",
    "PlanEntry",
    "PluginConfigError",
    "PluginConflictError",
    "PluginEntry",
    "PluginLoadError",
    "RemapContext",
    "SaveContext",
    "SaveDirLockedError",
    "SaveHandle",
    "SaveResult",
    "StagedState",
    "StorageError",
    "StorageOptions",
    "UnsafeCheckpointError",
    "UnverifiableCheckpointError",
    "ValueSpec",
    "WriteContext",
    "WriteResult",
    "__version__",
    "hookimpl",
]
