"""Drop-in replacement for the original production ``DistributedCheckpointer``.

The original (NVIDIA Cosmos ``imaginaire`` ``DistributedCheckpointer``) saved and resumed DCP
checkpoints in the layout ckpt-engine keeps (docs/design.md, section 2). This class offers its surface,
its config fields and its callbacks, built on :class:`~ckpt_engine.CheckpointEngine`::

    checkpointer = DistributedCheckpointer(config.checkpoint, config.job, callbacks=callbacks)
    iteration = checkpointer.load(model, optimizer, scheduler, grad_scaler)
    ...
    checkpointer.save(model, optimizer, scheduler, grad_scaler, iteration)
    ...
    checkpointer.finalize()

Config objects are duck-typed: attribute access (attrs, dataclasses, ``SimpleNamespace``,
OmegaConf) or a mapping. Missing fields take the original's defaults. See
``docs/migration.md`` for the field-by-field mapping and the behaviour differences.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import torch
from torch import nn

from ._dcpio import dist as _dist
from ._engine.engine import CheckpointEngine, SaveHandle
from ._engine.state import TrainingObjects, component_state_dict
from ._format.names import iter_dirname
from ._format.pointer import read_latest
from ._markers import hookimpl
from ._storage.store import open_store
from .config import EngineConfig
from .errors import ConfigError
from .plugin_manager import installed_plugins
from .types import STANDARD_COMPONENTS, LoadResult, SaveResult

__all__ = ["ASYNC_PLUGIN", "DistributedCheckpointer", "OriginalCheckpointConfig", "build_engine_config"]

logger = logging.getLogger("ckpt_engine.compat")

#: The plugin that provides asynchronous (background) saves, used for ``dcp_async_mode_enabled``.
ASYNC_PLUGIN = "pinned_staging"


def _field(config: Any, name: str, default: Any = None) -> Any:
    """``config.name`` or ``config[name]``; ``default`` when absent (or when ``config`` is None)."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(name, default)
    return getattr(config, name, default)


def _bool_field(config: Any, name: str, where: str = "config_checkpoint") -> bool:
    value = _field(config, name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ConfigError(f"{where}.{name} must be true or false, got {value!r} ({type(value).__name__})")
    return value


@dataclass(frozen=True)
class OriginalCheckpointConfig:
    """The original checkpointer's config fields, read from a duck-typed config object."""

    load_path: str = ""
    load_training_state: bool = False
    only_load_scheduler_state: bool = False
    strict_resume: bool = False
    keys_not_to_resume: tuple[str, ...] = ()
    load_ema_to_reg: bool = False
    dcp_allow_mismatched_size: bool = False
    dcp_async_mode_enabled: bool = False
    verbose: bool = False
    #: ``save_to_object_store`` / ``load_from_object_store``: ``(bucket, credentials file)`` when enabled.
    save_to_object_store: tuple[str, str] | None = None
    load_from_object_store: tuple[str, str] | None = None

    @classmethod
    def read(cls, config_checkpoint: Any) -> OriginalCheckpointConfig:
        """Read and validate the fields; raises :class:`ConfigError` naming a bad field."""
        stores: dict[str, tuple[str, str] | None] = {}
        for store in ("save_to_object_store", "load_from_object_store"):
            section = _field(config_checkpoint, store)
            stores[store] = None
            if _bool_field(section, "enabled", f"config_checkpoint.{store}"):
                bucket, credentials = _field(section, "bucket", ""), _field(section, "credentials", "") or ""
                if not isinstance(bucket, str) or not bucket or "/" in bucket:
                    raise ConfigError(f"config_checkpoint.{store}.bucket must be a bucket name, got {bucket!r}")
                if not isinstance(credentials, (str, os.PathLike)):
                    raise ConfigError(f"config_checkpoint.{store}.credentials must be a file path, got {credentials!r}")
                stores[store] = (bucket, os.fspath(credentials))
        load_path = _field(config_checkpoint, "load_path", "")
        if load_path is None:
            load_path = ""
        if isinstance(load_path, os.PathLike):
            load_path = os.fspath(load_path)
        if not isinstance(load_path, str):
            raise ConfigError(f"config_checkpoint.load_path must be a string, got {type(load_path).__name__}")
        keys = _field(config_checkpoint, "keys_not_to_resume", ())
        if keys is None:
            keys = ()
        if isinstance(keys, str):
            keys = (keys,)
        if not isinstance(keys, (Sequence, set, frozenset)) or not all(isinstance(k, str) for k in keys):
            raise ConfigError(f"config_checkpoint.keys_not_to_resume must be a list of strings, got {keys!r}")
        invalid = [k for k in keys if k not in STANDARD_COMPONENTS]
        if invalid:
            raise ConfigError(
                f"config_checkpoint.keys_not_to_resume names {invalid}, which are not checkpoint keys; "
                f"valid keys: {', '.join(STANDARD_COMPONENTS)}"
            )
        return cls(
            load_path=load_path,
            load_training_state=_bool_field(config_checkpoint, "load_training_state"),
            only_load_scheduler_state=_bool_field(config_checkpoint, "only_load_scheduler_state"),
            strict_resume=_bool_field(config_checkpoint, "strict_resume"),
            keys_not_to_resume=tuple(dict.fromkeys(keys)),
            load_ema_to_reg=_bool_field(config_checkpoint, "load_ema_to_reg"),
            dcp_allow_mismatched_size=_bool_field(config_checkpoint, "dcp_allow_mismatched_size"),
            dcp_async_mode_enabled=_bool_field(config_checkpoint, "dcp_async_mode_enabled"),
            verbose=_bool_field(config_checkpoint, "verbose"),
            save_to_object_store=stores["save_to_object_store"],
            load_from_object_store=stores["load_from_object_store"],
        )

    @property
    def effective_load_path(self) -> str | None:
        """``load_path`` as the original used it: ``None`` when empty or ending in ``.pt``."""
        if not self.load_path or self.load_path.endswith(".pt"):
            return None
        return self.load_path


#: Keys of the original's S3 credentials file (``boto3.client`` keyword arguments) -> ``storage`` fields.
_CREDENTIAL_KEYS = {
    "aws_access_key_id": "access_key_id",
    "aws_secret_access_key": "secret_access_key",
    "aws_session_token": "session_token",
    "endpoint_url": "endpoint_url",
    "region_name": "region",
}


def storage_from_credentials(path: str) -> dict[str, Any]:
    """``EngineConfig.storage`` fields from the original's credentials file: a JSON object of
    ``boto3.client("s3", ...)`` keyword arguments. ``""``: the standard sources (``AWS_*``)."""
    if not path:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as err:
        raise ConfigError(f"cannot read the object store credentials file {path!r}: {err.strerror or err}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"the object store credentials file {path!r} is not JSON: {err.msg}") from None
    if not isinstance(doc, Mapping):
        raise ConfigError(f"the object store credentials file {path!r} must hold a JSON object")
    unknown = sorted(set(doc) - set(_CREDENTIAL_KEYS))
    if unknown:
        raise ConfigError(
            f"the object store credentials file {path!r} has unknown key(s) {unknown}; "
            f"known: {sorted(_CREDENTIAL_KEYS)}"
        )
    return {_CREDENTIAL_KEYS[k]: v for k, v in doc.items() if v not in (None, "")}


def object_store_dirname(config_job: Any, bucket: str) -> str:
    """``s3://{bucket}/{config_job.path}/checkpoints``, as in the original."""
    path = _field(config_job, "path")
    if not isinstance(path, str) or not path.strip("/"):
        raise ConfigError(
            f"config_job.path must name the run's folder in the bucket (checkpoints go to "
            f"s3://{bucket}/<path>/checkpoints), got {path!r}"
        )
    return f"s3://{bucket}/{path.strip('/')}/checkpoints"


def save_dirname_for(config_job: Any) -> str:
    """``f"{config_job.path_local}/checkpoints"``, as in the original."""
    path_local = _field(config_job, "path_local")
    if isinstance(path_local, os.PathLike):
        path_local = os.fspath(path_local)
    if not isinstance(path_local, str) or not path_local:
        raise ConfigError(
            f"config_job.path_local must be a non-empty path (checkpoints go to <path_local>/checkpoints), "
            f"got {path_local!r}"
        )
    return f"{path_local}/checkpoints"


def build_engine_config(
    config_checkpoint: Any,
    config_job: Any,
    *,
    async_saves: bool = False,
) -> EngineConfig:
    """The :class:`EngineConfig` equivalent to the original checkpointer's config.

    ``async_saves`` adds the ``pinned_staging`` plugin; :class:`DistributedCheckpointer`
    passes it only when that plugin is installed.
    """
    fields = OriginalCheckpointConfig.read(config_checkpoint)
    plugins: list[dict[str, Any]] = []
    if fields.load_ema_to_reg:
        # The plugin's default prefixes ("net." and "net_ema.") are the original's.
        plugins.append({"name": "ema", "options": {}})
    if fields.dcp_allow_mismatched_size:
        plugins.append({"name": "size_mismatch", "options": {"policy": "overlap"}})
    if async_saves:
        plugins.append({"name": ASYNC_PLUGIN})
    local = (
        save_dirname_for(config_job)
        if fields.save_to_object_store is None or fields.load_from_object_store is None
        else ""
    )
    save_dir = (
        object_store_dirname(config_job, fields.save_to_object_store[0]) if fields.save_to_object_store else local
    )
    load_dir = (
        object_store_dirname(config_job, fields.load_from_object_store[0]) if fields.load_from_object_store else local
    )
    credentials = {store[1] for store in (fields.save_to_object_store, fields.load_from_object_store) if store}
    if len(credentials) > 1:
        raise ConfigError(
            "config_checkpoint.save_to_object_store and load_from_object_store name different credentials files "
            f"({sorted(credentials)}); ckpt-engine reaches both with one set: use one file"
        )
    storage = storage_from_credentials(next(iter(credentials))) if credentials else {}
    try:
        return EngineConfig.model_validate(
            {
                "save_dir": save_dir,
                "load_dir": load_dir if load_dir != save_dir else None,
                "storage": storage,
                "load_path": fields.effective_load_path,
                "load_training_state": fields.load_training_state,
                # The original gives load_training_state precedence; EngineConfig refuses both.
                "only_load_scheduler_state": fields.only_load_scheduler_state and not fields.load_training_state,
                # The original's DCP loads skipped missing keys and logged size mismatches.
                "strict": fields.strict_resume,
                "keys_not_to_resume": fields.keys_not_to_resume,
                "plugins": plugins,
            }
        )
    except ConfigError as err:
        raise ConfigError(f"cannot translate the checkpoint config into an EngineConfig: {err}") from err


def _call(callbacks: Any, method: str, *args: Any, **kwargs: Any) -> None:
    """Call ``callbacks.method(*args, **kwargs)`` if there is such a method."""
    if callbacks is None:
        return
    fn = getattr(callbacks, method, None)
    if callable(fn):
        fn(*args, **kwargs)


def _has(callbacks: Any, method: str) -> bool:
    return callbacks is not None and callable(getattr(callbacks, method, None))


class _SaveSuccessBridge:
    """Engine plugin: ``on_save_done`` -> ``callbacks.on_save_checkpoint_success`` on success."""

    name = "compat_callbacks"

    def __init__(self, callbacks: Any) -> None:
        self.callbacks = callbacks

    @hookimpl
    def on_save_done(self, result: SaveResult) -> None:
        if result.succeeded:
            _call(
                self.callbacks,
                "on_save_checkpoint_success",
                iteration=result.iteration,
                elapsed_time=result.total_seconds,
            )


class DistributedCheckpointer:
    """The original ``DistributedCheckpointer``'s surface on top of :class:`CheckpointEngine`.

    :param config_checkpoint: the original's checkpoint config (attribute access or a mapping):
        ``load_path``, ``load_training_state``, ``only_load_scheduler_state``,
        ``strict_resume``, ``keys_not_to_resume``, ``load_ema_to_reg``,
        ``dcp_allow_mismatched_size``, ``dcp_async_mode_enabled``, ``verbose``.
    :param config_job: provides ``path_local``; checkpoints go to ``<path_local>/checkpoints``.
    :param callbacks: optional; receives the original's calls, where it has the method.
    :param disable_async: save synchronously even if ``dcp_async_mode_enabled``.
    """

    KEYS_TO_SAVE: tuple[str, ...] = STANDARD_COMPONENTS

    def __init__(
        self,
        config_checkpoint: Any,
        config_job: Any,
        callbacks: Any = None,
        disable_async: bool = False,
    ) -> None:
        self.config_checkpoint = config_checkpoint
        self.config_job = config_job
        self.callbacks = callbacks
        self.fields = OriginalCheckpointConfig.read(config_checkpoint)
        self.verbose = self.fields.verbose

        async_saves = False
        if self.fields.dcp_async_mode_enabled and not disable_async:
            if ASYNC_PLUGIN in installed_plugins():
                async_saves = True
            else:
                logger.warning(
                    "dcp_async_mode_enabled is set, but the %r plugin is not installed: checkpoints are "
                    "saved synchronously (correct, but save() blocks until the checkpoint is written)",
                    ASYNC_PLUGIN,
                )
        self.async_saves = async_saves
        if self.fields.load_path and self.fields.effective_load_path is None and _dist.rank() == 0:
            logger.info(
                "load_path %r ends in .pt: as in the original checkpointer this means training from "
                "scratch (unless %s has a latest_checkpoint.txt)",
                self.fields.load_path,
                "the load folder",
            )
        config = build_engine_config(config_checkpoint, config_job, async_saves=async_saves)
        self._save_dirname, self._load_dirname = config.save_dir, config.resolved_load_dir
        plugins = [_SaveSuccessBridge(callbacks)] if callbacks is not None else []
        self.engine = CheckpointEngine(config, plugins=plugins)
        self.last_load_result: LoadResult | None = None
        self.last_save_handle: SaveHandle | None = None

    # -- directories ------------------------------------------------------------------------

    @property
    def save_dirname(self) -> str:
        return self._save_dirname

    @property
    def load_dirname(self) -> str:
        return self._load_dirname

    # -- resume decision --------------------------------------------------------------------

    def keys_to_resume_during_load(self) -> tuple[set[str], str | None]:
        """The components a :meth:`load` would restore, and the checkpoint it would read.

        1. ``latest_checkpoint.txt`` in :attr:`load_dirname`: every key, from the folder it names.
        2. else ``load_path`` (not ending in ``.pt``): ``model``; every key with
           ``load_training_state``; ``model`` and ``scheduler`` with ``only_load_scheduler_state``.
        3. else nothing: ``(set(), None)``.

        ``keys_not_to_resume`` is removed from the set.
        """
        fields = self.fields
        latest = read_latest(self.load_dirname, open_store(self.load_dirname, self.engine.config.storage))
        keys: set[str]
        path: str | None
        if latest is not None:
            keys, path = set(self.KEYS_TO_SAVE), os.path.join(self.load_dirname, latest)
        elif fields.effective_load_path is not None:
            path = fields.effective_load_path
            if fields.load_training_state:
                keys = set(self.KEYS_TO_SAVE)
            else:
                keys = {"model"}
                if fields.only_load_scheduler_state:
                    keys.add("scheduler")
        else:
            keys, path = set(), None
        return keys - set(fields.keys_not_to_resume), path

    # -- save -------------------------------------------------------------------------------

    def save(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        scheduler: Any,
        grad_scaler: Any,
        iteration: int,
    ) -> SaveHandle:
        """Save to ``<save_dirname>/iter_{iteration:09}/``; callbacks as in the original.

        ``on_save_checkpoint_success`` is called once the checkpoint is committed (for async
        saves, from the engine's commit thread), and never for a failed save. A failed
        synchronous save raises :class:`~ckpt_engine.CheckpointSaveError` before
        ``on_save_checkpoint_end``.
        """
        callbacks = self.callbacks
        _call(callbacks, "on_save_checkpoint_start", model, iteration)
        if _has(callbacks, "on_save_checkpoint"):
            objs = TrainingObjects.from_args(model, optimizer, scheduler, grad_scaler, None)
            checkpoint_dir = os.path.join(self.save_dirname, iter_dirname(iteration))
            to_save = {
                name: (component_state_dict(objs, name, iteration), os.path.join(checkpoint_dir, name))
                for name in objs.available()
            }
            _call(callbacks, "on_save_checkpoint", model, state_dict=to_save)
        handle = self.engine.save(
            iteration, model=model, optimizer=optimizer, scheduler=scheduler, grad_scaler=grad_scaler
        )
        self.last_save_handle = handle
        _call(callbacks, "on_save_checkpoint_end", model=None, iteration=iteration)
        return handle

    # -- load -------------------------------------------------------------------------------

    def load(
        self,
        model: nn.Module | Sequence[nn.Module],
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        scheduler: Any = None,
        grad_scaler: Any = None,
    ) -> int:
        """Resume by :meth:`keys_to_resume_during_load`'s rules; returns the iteration (0: scratch).

        The full outcome, with the per-key load report, is kept in :attr:`last_load_result`.
        """
        callbacks = self.callbacks
        _call(callbacks, "on_load_checkpoint_start", model)
        result = self.engine.load(model=model, optimizer=optimizer, scheduler=scheduler, grad_scaler=grad_scaler)
        self.last_load_result = result
        if self.verbose and _dist.rank() == 0:
            logger.info(
                "resumed from %s (%s), iteration %d, components %s\n%s",
                result.checkpoint_path,
                result.source,
                result.iteration,
                list(result.components),
                result.report.summary(threshold=1 << 30),
            )
        if result.checkpoint_path is not None and _has(callbacks, "on_load_checkpoint"):
            objs = TrainingObjects.from_args(model, None, None, None, None)
            _call(callbacks, "on_load_checkpoint", model, state_dict=component_state_dict(objs, "model"))
        _call(
            callbacks,
            "on_load_checkpoint_end",
            model,
            iteration=result.iteration,
            checkpoint_path=result.checkpoint_path,
        )
        return result.iteration

    # -- lifetime ---------------------------------------------------------------------------

    def finalize(self) -> None:
        """Wait for pending saves (raising if one failed), then release the engine. Idempotent."""
        self.engine.close()

    def __enter__(self) -> DistributedCheckpointer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.engine.__exit__(exc_type, exc, tb)

    def __repr__(self) -> str:
        return f"DistributedCheckpointer(save_dirname={self.save_dirname!r}, plugins={self.engine.plugin_names})"
