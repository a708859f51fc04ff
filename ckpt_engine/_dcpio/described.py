"""Planning a load without files: the engine's real planner on a described checkpoint.

:func:`plan_component` runs ``dcp.load`` with :class:`EngineLoadPlanner`, the planner
``CheckpointEngine.load`` uses, and a storage reader that serves metadata built from a
description of the stored values and reads nothing. Everything that decides what a load does
(``remap_keys``, ``pre_load_plan``, strictness, the read items and the report) therefore runs
as in a real load; only the bytes are never read. ``ckpt_engine.testing.plan_load`` is the
public face of it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from pydantic import ValidationError
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..config import EngineConfig
from ..errors import CheckpointLoadError, CkptEngineError, ConfigError, first_failure
from ..pipeline import Pipeline
from ..plugin_manager import build_plugin_manager, split_plugins
from ..report import ComponentReport
from .dist import quiet_dcp
from .planner import EngineLoadPlanner

__all__ = ["PlannedLoad", "described_metadata", "plan_component"]

#: The ``checkpoint_dir`` of a planned report (there is no folder).
PLANNED_DIR = "<plan_load>"


@dataclass(frozen=True)
class PlannedLoad:
    report: ComponentReport
    items: list[ReadItem]


class _DescribedReader(StorageReader):
    """Serves a given ``Metadata``; ``read_data`` records the plan and reads nothing."""

    def __init__(self, metadata: Metadata) -> None:
        self.metadata = metadata
        self.items: list[ReadItem] = []

    def reset(self, checkpoint_id: Any = None) -> None:
        self.items = []

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.items += plan.items
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def _flat(stored: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in stored.items():
        if isinstance(value, Mapping):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _tensor_md(shape: Iterable[int], dtype: torch.dtype) -> TensorStorageMetadata:
    size = torch.Size(shape)
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=dtype),
        size=size,
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
    )


def _is_shape(value: Any) -> bool:
    return isinstance(value, (tuple, list, torch.Size)) and all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in value
    )


def described_metadata(stored: Mapping[str, Any]) -> Metadata:
    """DCP metadata for a checkpoint whose values are ``stored`` (see ``plan_load``)."""
    md: dict[str, TensorStorageMetadata | BytesStorageMetadata] = {}
    for key, value in _flat(stored):
        if isinstance(value, torch.Tensor):
            md[key] = _tensor_md(value.shape, value.dtype)
        elif isinstance(value, tuple) and len(value) == 2 and _is_shape(value[0]) and isinstance(value[1], torch.dtype):
            md[key] = _tensor_md(value[0], value[1])
        else:
            md[key] = BytesStorageMetadata()
    return Metadata(state_dict_metadata=md, storage_data={}, storage_meta=StorageMeta())


def _pipeline(plugins: Any, strict: bool) -> Pipeline:
    """A pipeline with ``plugins`` in the given order: objects and config entries mixed."""
    entries, objects = split_plugins(plugins)
    try:
        config = EngineConfig(save_dir=PLANNED_DIR, strict=strict, plugins=tuple(entries))
    except ValidationError as err:  # a malformed entry
        raise ConfigError(f"plan_load: invalid plugins {list(entries)!r}: {err}") from err
    return Pipeline(build_plugin_manager(config, objects))


def _planning_copy(value: Any) -> Any:
    """``value`` with fresh containers (DCP edits them in place) and every meta tensor replaced
    by a CPU tensor of its shape and dtype that owns one element (DCP would allocate meta
    tensors in full; nothing is read into them here)."""
    if isinstance(value, Mapping):
        return {k: _planning_copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_planning_copy(v) for v in value]
    if isinstance(value, torch.Tensor) and value.is_meta and type(value) is torch.Tensor:
        return torch.zeros((), dtype=value.dtype).expand(value.shape)
    return value


def plan_component(
    target: Mapping[str, Any],
    stored: Mapping[str, Any],
    *,
    plugins: Any = (),
    strict: bool = False,
    component: str = "model",
    warm_start: bool = False,
) -> PlannedLoad:
    """Plan loading ``stored`` into ``target`` (one component) without reading anything."""
    pipeline = _pipeline(plugins, strict)
    planner = EngineLoadPlanner(
        component=component, checkpoint_dir=PLANNED_DIR, pipeline=pipeline, strict=strict, warm_start=warm_start
    )
    reader = _DescribedReader(described_metadata(stored))
    state = _planning_copy(target)
    try:
        with quiet_dcp():
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as exc:
        err = first_failure(exc)[0]
        if isinstance(err, CkptEngineError):
            raise err from None
        raise CheckpointLoadError(
            f"loading component {component!r} from {PLANNED_DIR} failed: {type(err).__name__}: {err}"
        ) from err
    assert planner.report is not None
    return PlannedLoad(planner.report, reader.items)
