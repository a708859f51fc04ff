"""Engine configuration (pydantic v2).

Two layers, as in pytest and tox: the engine validates the shape of the configuration (which
plugins, their order, whether enabled); each plugin validates its own ``options``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, field_validator, model_validator

from ._config_errors import describe_validation_error, raised_config_error
from ._storage.urls import is_url, local_path
from .errors import ConfigError
from .types import STANDARD_COMPONENTS

__all__ = ["DEFAULT_PLUGINS", "EngineConfig", "PluginEntry", "StorageOptions"]

#: Plugins that are on unless the config lists them with ``enabled: false``. The original
#: checkpointer always skipped Transformer-Engine ``_extra_state``.
DEFAULT_PLUGINS: tuple[str, ...] = ("te_extra_state",)


def _toml_loads(text: str) -> Any:
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10
        import tomli as tomllib
    return tomllib.loads(text)


_COMPONENT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_\-]*$")


class _Frozen(BaseModel):
    """A configuration model that cannot be changed once made: setting a field is a
    :class:`~ckpt_engine.errors.ConfigError` (as every config error is), not pydantic's."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    def __setattr__(self, name: str, value: Any) -> None:
        raise ConfigError(
            f"{type(self).__name__} is frozen: {name!r} cannot be set on it; make a changed copy instead, "
            f"e.g. config.model_copy(update={{{name!r}: ...}})"
        )


class PluginEntry(_Frozen):
    """One plugin in :attr:`EngineConfig.plugins`; the list order is the fold order."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="Entry-point name, or a name for a `path` plugin.")
    path: str | None = Field(
        default=None,
        description="`package.module:attr` of a plugin that is not installed as an entry point.",
    )
    enabled: bool = Field(default=True, description="False keeps the plugin from being imported at all.")
    options: dict[str, Any] = Field(default_factory=dict, description="Validated by the plugin's `Options`.")

    @field_validator("path")
    @classmethod
    def _check_path(cls, v: str | None) -> str | None:
        if v is not None and not re.fullmatch(r"[\w.]+:[\w.]+", v):
            raise ValueError(f"{v!r} is not of the form 'package.module:attr'")
        return v

    @property
    def source(self) -> str:
        return self.path or self.name


def _coerce_entry(item: Any) -> Any:
    if isinstance(item, str):
        return {"name": item, "path": item} if ":" in item else {"name": item}
    return item


class StorageOptions(_Frozen):
    """How to reach a `save_dir` / `load_dir` / `load_path` given as a URL (`s3://...`, any fsspec
    filesystem); ignored for local paths. Unset credentials fall back to the standard sources
    (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`, `~/.aws`, instance roles).
    Secrets are `SecretStr`: never printed, logged or put in an error message."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    endpoint_url: str | None = Field(
        default=None, description="S3-compatible endpoint (MinIO, Ceph, a local test server); default: AWS."
    )
    region: str | None = Field(default=None, description="S3 region; default: boto's (`AWS_DEFAULT_REGION`).")
    access_key_id: SecretStr | None = Field(default=None, description="S3 access key id.")
    secret_access_key: SecretStr | None = Field(default=None, description="S3 secret access key.")
    session_token: SecretStr | None = Field(default=None, description="S3 session token (temporary credentials).")
    profile: str | None = Field(default=None, description="Profile in `~/.aws/credentials`.")
    anon: bool = Field(default=False, description="Unsigned requests (public buckets, read only).")
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="Extra keyword arguments for the fsspec filesystem (any protocol); they override the fields above.",
    )
    max_concurrency: int = Field(default=8, ge=1, le=256, description="Parallel uploads and range reads per rank.")
    part_size_mb: int = Field(
        default=64, ge=5, le=5120, description="Multipart upload part size (S3 allows 5 MiB to 5 GiB)."
    )
    retries: int = Field(default=5, ge=1, le=100, description="Attempts per request for transient errors.")
    retry_backoff_s: float = Field(
        default=0.5, ge=0, le=60, description="First wait between attempts; doubles each time, with jitter."
    )
    spool_dir: str | None = Field(
        default=None,
        description="Local folder where each rank writes its files before uploading them (object stores "
        "only; needs room for one rank's share of a checkpoint). Default: the system temp folder.",
    )
    local_dir: str | None = Field(
        default=None,
        description="Two-tier saves: commit every checkpoint to this local folder first, upload it in the "
        "background, and resume from it when its checkpoint is complete and at least as new as the "
        "object store's. Must be visible to every rank (one node, or a shared filesystem).",
    )
    local_keep_last: int = Field(
        default=1, ge=1, description="Two-tier saves: local checkpoints kept after their upload."
    )
    commit_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Background saves to an object store: how long rank 0 waits for every rank's upload.",
    )

    @field_validator("spool_dir", "local_dir")
    @classmethod
    def _local_only(cls, v: str | None) -> str | None:
        if v is not None and is_url(v):
            raise ValueError(f"{v!r} must be a local folder, not a URL")
        return os.path.expanduser(local_path(v)) if v is not None else v

    def fsspec_options(self, protocol: str) -> dict[str, Any]:
        """Keyword arguments for ``fsspec.filesystem(protocol, ...)`` (secrets included: never log them)."""
        if protocol in ("s3", "s3a"):
            from ._storage.urls import s3_options

            return s3_options(
                endpoint_url=self.endpoint_url,
                region=self.region,
                access_key_id=self.access_key_id.get_secret_value() if self.access_key_id else None,
                secret_access_key=self.secret_access_key.get_secret_value() if self.secret_access_key else None,
                session_token=self.session_token.get_secret_value() if self.session_token else None,
                profile=self.profile,
                anon=self.anon,
                extra=self.options,
            )
        return dict(self.options)


#: The descriptions of two fields of :class:`EngineConfig`, kept here for the class's length.
_CHECK_REPLICATED = (
    "Several ranks: at every save the ranks compare digests of what DCP keeps one copy of (plain tensors "
    "and parameters, non-tensor values, extras' state). A non-tensor value or an extra that differs is saved "
    "and restored per rank; a plain tensor that differs fails the save with `ReplicatedStateMismatchError` (unless "
    "`per_rank_keys` names it). Tensors above 256 KiB are hashed by 16 sampled pages (docs/reliability.md, "
    "Per-rank state). False: no check; DCP keeps the lowest rank's copy of each."
)
_PER_RANK_KEYS = (
    "fnmatch patterns of `component.key` (e.g. `model.experts.*`, `optim.state.experts.*`) saved by every rank "
    "under its own key and restored to each rank (same number of ranks only): state meant to differ across "
    "ranks without being a DTensor, such as expert weights under expert parallelism."
)


class EngineConfig(_Frozen):
    """Everything the engine needs to know, from keyword arguments, a dict or a file.

    Unknown fields are errors that name the field.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    save_dir: str = Field(
        min_length=1,
        description="Folder that receives `iter_XXXXXXXXX/` checkpoints: a path (`~/...` is in the home "
        "folder; a relative path is relative to the working directory), or a URL "
        "(`s3://bucket/run`, any fsspec filesystem; see `storage`).",
    )
    load_dir: str | None = Field(
        default=None,
        description="Folder whose `latest_checkpoint.txt` is resumed, or one checkpoint folder "
        "(`iter_*`) resumed whole (a branch from an older step); default: `save_dir`.",
    )
    load_path: str | None = Field(
        default=None,
        description="Used when there is no `latest_checkpoint.txt`: a checkpoint folder "
        "(`.../iter_000000100`), a save folder (its latest checkpoint), a `.pth` model state dict, or Hugging "
        "Face safetensors weights (a `.safetensors` file, or a folder with `model.safetensors` or shards and "
        "`model.safetensors.index.json`).",
    )
    load_training_state: bool = Field(
        default=False, description="With `load_path`: load every component, not just `model`."
    )
    only_load_scheduler_state: bool = Field(
        default=False, description="With `load_path`: load `model` and `scheduler`."
    )
    strict: bool = Field(
        default=True,
        description="A key the model expects but the checkpoint lacks, or an unresolved shape "
        "mismatch, is an error (else skipped and reported).",
    )
    strict_unexpected: bool = Field(default=False, description="Checkpoint keys that nothing reads are an error too.")
    keys_not_to_resume: tuple[str, ...] = Field(
        default=(), description="Components never loaded (`model`, `optim`, `scheduler`, `trainer`, extras)."
    )
    trust_checkpoint: bool = Field(
        default=False,
        description="Unpickle non-tensor values without `weights_only=True`. Only for trusted "
        "legacy checkpoints: it runs code from the checkpoint.",
    )
    verify: Literal["off", "sizes", "read", "checksums"] = Field(
        default="read",
        description="How a load checks a checkpoint against its manifest, beyond completeness (always "
        "checked): `read` (the default) compares every file's size before the load and checks every byte "
        "the load reads against the digest recorded at save for its block, as it reads it (ranged and "
        "shared reads included; a damaged byte is a `CorruptCheckpointError` naming the file, the byte range "
        "and the keys there); a checkpoint saved before per-block digests is checked by whole-file digest "
        "where a load reads at least half of a file, else by size (said once in the log). `checksums` also reads every "
        "file once more before the load and compares its checksum (split among ranks). `sizes`: the sizes "
        "only; `off` skips the manifest.",
    )
    allow_unverified: bool = Field(
        default=False,
        description="With `verify: checksums`, load a checkpoint whose checksums cannot be checked (no "
        "manifest, as plain DCP and the original checkpointer write them; a sizes-only or newer manifest; an "
        "unavailable algorithm), reported as unverified. False: such a load is refused.",
    )
    save_checksums: bool = Field(
        default=True,
        description="Checksum every file into the manifest: each rank hashes the bytes as it writes them "
        "(nothing is read back at the commit). False: the manifest records sizes only.",
    )
    incremental: bool = Field(
        default=False,
        description="Write only what changed: the model's frozen parameters (`requires_grad` false) and buffers "
        "are written to files of their own, and such a file whose bytes equal the previous checkpoint's file of the "
        "same name (same size and checksum in its manifest) is carried over, as a hard link (local) or a "
        "server-side copy (object store), instead of written; trained parameters and optimizer state, which change "
        "at every step, are written. Every checkpoint stays complete, loadable by plain `dcp.load`, "
        "and safe to delete in any order. Turn it on when much of the state does not change between saves "
        "(frozen weights, adapters, fine-tuning); it costs nothing measurable when everything changes. Needs "
        "`save_checksums`.",
    )
    full_save_every: int | None = Field(
        default=None,
        ge=1,
        description="With `incremental`: every N-th save writes every file anew, so a damaged shared file damages "
        "at most N checkpoints. None: carry files over for as long as they do not change.",
    )
    fallback_to_last_complete: bool = Field(
        default=False,
        description="When `latest_checkpoint.txt` is unreadable or names a missing, incomplete or corrupt "
        "checkpoint (a damaged byte found while it is read included), load the newest checkpoint that passes "
        "the checks instead of raising (logged, and reported in `LoadResult.fell_back_from`).",
    )
    keep_last: int | None = Field(
        default=None,
        ge=1,
        description="After each commit, delete all but the N newest complete checkpoints (never the one "
        "`latest` names, nor newer ones). None: delete nothing.",
    )
    keep_every: int | None = Field(
        default=None,
        ge=1,
        description="With `keep_last`: also keep every checkpoint whose iteration is a multiple of M.",
    )
    rng: bool = Field(
        default=True,
        description="Save and restore every rank's Python, NumPy, torch and CUDA random state (an `rng` component, "
        "one set of keys per rank) so a resume draws what the uninterrupted run would; a checkpoint without it loads "
        "with a warning; into another number of ranks, new ranks are seeded from rank 0's state and their rank.",
    )
    allow_overwrite: bool = Field(
        default=False,
        description="Let `save()` replace an iteration that is already committed (the old checkpoint stays "
        "loadable until the new one is committed), and let a run resumed from an older step rewrite the history: "
        "its first save older than `latest` moves the newer checkpoints into `.ckpt_engine_abandoned/` and `latest` "
        "names it. False: such a re-save is refused with CheckpointExistsError.",
    )
    thread_count: int = Field(default=1, ge=1, le=64, description="Writer threads per rank (DCP).")
    collective_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="Bound on every collective of a save or a load (several ranks): a rank that waits longer "
        "raises `CollectiveTimeoutError` naming the ranks that did not arrive and the checkpoint phase each "
        "last reported (docs/reliability.md).",
    )
    dedup_reads: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="Load: where several ranks need the same stored bytes (a replicated module, HSDP "
        "replicas, a checkpoint saved by fewer ranks), read them once, striped across those ranks, and "
        "broadcast them (gloo). `auto`: on for object stores, and for local files when the ranks span "
        "several hosts (a shared filesystem); off on one host, where the page cache serves every rank "
        "faster than a broadcast (docs/storage.md). `LoadResult.bytes_read` says what each rank read.",
    )
    sync_files: bool = Field(default=True, description="fsync checkpoint files before commit.")
    local_dir: str | None = Field(
        default=None,
        description="The node-local tier: a folder on fast node-local storage (tmpfs, local NVMe; the same path "
        "on every node, different storage on each). Every save is committed there, rank by rank, with the same "
        "hidden-folder commit, manifest and checksums as `save_dir`; only every `persist_every`-th save is also "
        "written to `save_dir`. Peer ranks on other nodes keep replicas (`peer_replicas`), and a resume takes the "
        "newest step held for every rank in any tier that belongs to `save_dir`'s run and descends from its latest "
        "step (others are set aside), reading each rank's part from its own node, a peer, or `save_dir` "
        "(docs/reliability.md, Tiers). Not with `storage.local_dir`.",
    )
    persist_every: int = Field(
        default=1,
        ge=1,
        description="With `local_dir`: a save whose iteration is a multiple of N is also committed to `save_dir` "
        "(durable); the others live in the local tier and its peer replicas only. `save(..., durable=True)` "
        "forces one, and so does a job that went back to a step older than `save_dir`'s latest with "
        "`allow_overwrite`, until one of its saves is committed there (it rewinds `latest`).",
    )
    peer_replicas: int | None = Field(
        default=None,
        ge=0,
        description="With `local_dir`: how many ranks on other nodes hold a copy of each rank's local-tier "
        "checkpoints (0: none). Files a peer already holds with the same checksum (data-parallel replicas, "
        "unchanged files of its previous copy) are linked there, not sent. Default: 1 where the job has another "
        "node, else 0; more than the other nodes can hold is an error.",
    )
    ranks_per_node: int | None = Field(
        default=None,
        ge=1,
        description="With `local_dir`: ranks that share one node (one `local_dir`, the smallest failure domain). "
        "Replicas go to the same local rank on other nodes, in other failure domains first (`failure_domain`). "
        "Default: torchrun's `LOCAL_WORLD_SIZE` (1 without it).",
    )
    failure_domain: str | None = Field(
        default=None,
        min_length=1,
        max_length=200,
        description="With `local_dir`: this rank's failure domain, a label such as a rack, a power feed or a "
        "zone (the same on every rank of a node). Replicas go to nodes of other domains first, so losing a whole "
        "domain leaves a copy (docs/reliability.md, Failure domains). Default: the `CKPT_ENGINE_FAILURE_DOMAIN` "
        "environment variable; without either, each node is a domain of its own.",
    )
    local_keep_last: int = Field(
        default=2,
        ge=1,
        description="With `local_dir`: local-tier checkpoints kept per rank folder (its own and each replica). "
        "2 keeps the previous step complete on every node while the next one replicates.",
    )
    peer_bandwidth_mb_s: float | None = Field(
        default=None,
        gt=0,
        description="With `local_dir`: cap on each rank's replication traffic in MB/s, so that it leaves the "
        "network and the CPU to training. None: as fast as the process group goes (in chunks of 16 MiB, in a "
        "background thread).",
    )
    replication_max_in_flight: int = Field(
        default=2,
        ge=1,
        description="With `local_dir` and peer replicas: how many replication rounds (one per save) a rank may have "
        "in flight, announced and not finished; each keeps its step on the rank's local disk beyond "
        "`local_keep_last`. A save past it does what `replication_when_behind` says, so a link slower than the "
        "saves bounds the tier's disk at `local_keep_last` + this many steps per rank.",
    )
    replication_when_behind: Literal["skip", "wait"] = Field(
        default="skip",
        description="With `local_dir`: what a save does when `replication_max_in_flight` rounds are in flight. "
        "`skip`: its step is not replicated (a warning; peers keep their replica of an earlier step) and training "
        "goes on at full speed; `wait`: `save()` waits until a round finishes (back-pressure: the saves slow to "
        "the link's pace).",
    )
    check_replicated: bool = Field(default=True, description=_CHECK_REPLICATED)
    per_rank_keys: tuple[str, ...] = Field(default=(), description=_PER_RANK_KEYS)
    storage: StorageOptions = Field(
        default_factory=StorageOptions,
        description="Credentials, endpoint and transfer settings for URLs; the two-tier `local_dir` (docs/storage.md).",
    )
    plugins: tuple[PluginEntry, ...] = Field(
        default=(),
        validate_default=True,  # so the default plugins are added to a config that lists none
        description="Plugins in fold order: names, `package.module:attr` strings or entries "
        f"with options. Default plugins ({', '.join(DEFAULT_PLUGINS)}) are prepended unless listed.",
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise ConfigError(f"invalid config:\n{describe_validation_error(err, type(self))}") from err

    @classmethod
    def model_validate(cls, obj: Any, *args: Any, **kwargs: Any) -> EngineConfig:
        """pydantic's ``model_validate``; an invalid config raises :class:`ConfigError`."""
        try:
            return super().model_validate(obj, *args, **kwargs)
        except ValidationError as err:
            # pydantic validates through __init__ (above) and wraps its ConfigError: unwrap it.
            raise raised_config_error(err) or ConfigError(
                f"invalid config:\n{describe_validation_error(err, cls)}"
            ) from err

    @field_validator(
        "keep_last",
        "keep_every",
        "thread_count",
        "persist_every",
        "peer_replicas",
        "ranks_per_node",
        "local_keep_last",
        "replication_max_in_flight",
        mode="before",
    )
    @classmethod
    def _no_bool_counts(cls, v: Any) -> Any:
        # pydantic takes true as 1 and "2" as 2: `keep_last: true` would silently keep one
        # checkpoint, and a quoted number in a config file is a mistake worth naming.
        if isinstance(v, bool):
            raise ValueError(f"expected a whole number, got {str(v).lower()}")
        if isinstance(v, str):
            raise ValueError(f"expected a whole number, got the string {v[:20]!r}; write it without quotes")
        return v

    @field_validator("plugins", mode="before")
    @classmethod
    def _coerce_plugins(cls, v: Any) -> Any:
        if isinstance(v, (str, Mapping)):
            v = [v]
        return [_coerce_entry(item) for item in v] if isinstance(v, (list, tuple)) else v

    @field_validator("plugins")
    @classmethod
    def _defaults_and_duplicates(cls, v: tuple[PluginEntry, ...]) -> tuple[PluginEntry, ...]:
        names = [e.name for e in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"plugin(s) {dupes} listed more than once; list each plugin once")
        missing_defaults = [PluginEntry(name=n) for n in DEFAULT_PLUGINS if n not in names]
        return (*missing_defaults, *v)

    @field_validator("local_dir")
    @classmethod
    def _local_tier_path(cls, v: str | None) -> str | None:
        if v is not None and v.startswith("file://"):
            v = local_path(v)
        return os.path.expanduser(v) if v is not None and not is_url(v) else v

    @field_validator("save_dir", "load_dir", "load_path")
    @classmethod
    def _strip_file_url(cls, v: str | None) -> str | None:
        # file:// URLs are local folders: they keep the local fast path and the rename commit.
        if v is not None and v.startswith("file://"):
            v = local_path(v)
            if not v:
                raise ValueError("'file://' names no folder")
        if v is not None and "://" in v and v.rstrip("/").count("/") < 2:
            raise ValueError(f"{v!r} names no bucket or folder; use e.g. 's3://bucket/run/checkpoints'")
        if v is not None and "://" not in v:
            return os.path.expanduser(v)  # `~/ckpt` is the home folder, as in a shell
        return v.rstrip("/") if v is not None else v

    @field_validator("keys_not_to_resume", "per_rank_keys", mode="before")
    @classmethod
    def _coerce_keys(cls, v: Any) -> Any:
        return (v,) if isinstance(v, str) else v

    @field_validator("keys_not_to_resume")
    @classmethod
    def _check_keys(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for key in v:
            if not _COMPONENT_NAME.match(key):
                raise ValueError(
                    f"{key!r} is not a component name; components are {', '.join(STANDARD_COMPONENTS)} "
                    "or the names of `extra=` components"
                )
        return v

    @model_validator(mode="after")
    def _check_combinations(self) -> EngineConfig:
        if self.load_training_state and self.only_load_scheduler_state:
            raise ValueError(
                "load_training_state and only_load_scheduler_state are both set; "
                "load_training_state already loads the scheduler: set only one"
            )
        if self.incremental and not self.save_checksums:
            raise ValueError(
                "incremental is set with save_checksums false; an incremental save compares each file's checksum "
                "with the previous manifest's: set save_checksums true (or incremental false)"
            )
        _check_local_tier(self)
        if self.keep_every is not None and self.keep_last is None:
            raise ValueError(
                "keep_every is set without keep_last; keep_every only spares checkpoints from keep_last's "
                "deletions: set keep_last too (or unset keep_every to keep everything)"
            )
        return self

    @property
    def resolved_load_dir(self) -> str:
        return self.load_dir or self.save_dir

    def enabled_plugins(self) -> tuple[PluginEntry, ...]:
        return tuple(e for e in self.plugins if e.enabled)

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> EngineConfig:
        """Read a YAML (``.yaml``/``.yml``), TOML (``.toml``) or JSON (``.json``) file.

        A TOML file may hold the fields at top level or under ``[ckpt_engine]``; YAML and JSON
        likewise under a ``ckpt_engine`` key.
        """
        p = Path(path)
        data = _read_config_file(p)
        if "ckpt_engine" in data and isinstance(data["ckpt_engine"], Mapping):
            data = data["ckpt_engine"]
        try:
            return cls.model_validate(data)
        except ConfigError as err:
            raise ConfigError(str(err).replace("invalid config:", f"invalid config in {str(p)!r}:", 1)) from err

    @classmethod
    def coerce(cls, config: EngineConfig | Mapping[str, Any] | str | os.PathLike[str]) -> EngineConfig:
        """Accept a config, a mapping of fields, or a path to a config file."""
        if isinstance(config, EngineConfig):
            return config
        if isinstance(config, Mapping):
            return cls.model_validate(dict(config))
        if isinstance(config, (str, os.PathLike)):
            return cls.from_file(config)
        raise ConfigError(
            f"config must be an EngineConfig, a mapping or a path to a YAML/TOML/JSON file, got {type(config).__name__}"
        )


def _read_config_file(p: Path) -> Mapping[str, Any]:
    """The mapping a YAML, TOML or JSON config file holds; a typed error naming the file otherwise."""
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise ConfigError(f"cannot read config file {str(p)!r}: {err.strerror or err}") from err
    suffix = p.suffix.lower()
    try:
        data: Any
        if suffix in (".yaml", ".yml"):
            import yaml

            data = yaml.safe_load(text)
        elif suffix == ".toml":
            data = _toml_loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {str(p)!r} has unknown suffix {suffix!r}; use .yaml, .yml, .toml or .json")
    except ConfigError:
        raise
    except Exception as err:
        raise ConfigError(f"cannot parse config file {str(p)!r}: {err}") from err
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {str(p)!r} must hold a mapping of fields, got {type(data).__name__}")
    return data


def _check_local_tier(config: EngineConfig) -> None:
    """The node-local tier's fields make sense together (a ``ValueError`` for pydantic otherwise)."""
    if config.local_dir is None:
        unset = [
            name
            for name, default in (
                ("persist_every", 1),
                ("peer_replicas", None),
                ("ranks_per_node", None),
                ("peer_bandwidth_mb_s", None),
                ("failure_domain", None),
            )
            if getattr(config, name) != default
        ]
        if unset:
            raise ValueError(
                f"{', '.join(unset)} set without local_dir; they configure the node-local tier: set local_dir "
                "too (or remove them)"
            )
        return
    if is_url(config.local_dir):
        raise ValueError(
            f"local_dir {config.local_dir[:100]!r} is a URL; the local tier is a folder on node-local storage "
            "(tmpfs or NVMe): give a path"
        )
    if config.storage.local_dir is not None:
        raise ValueError(
            "local_dir and storage.local_dir are both set; storage.local_dir is the two-tier copy one host (or "
            "a shared filesystem) keeps of an object store, local_dir the node-local tier with peer replicas: "
            "set only one (local_dir does both jobs on several nodes)"
        )
