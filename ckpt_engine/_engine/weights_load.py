"""Resume rule 3 (docs/design.md, section 4): model weights from a file ``load_path`` names, ``model`` only,
iteration 0.

* A ``.pth`` file, a plain ``torch.save``d model state dict (:func:`load_pth`): read with
  ``weights_only=True`` (nothing in the file runs), loaded non-strict, plain tensors distributed
  into DTensor parameters where the model is sharded.
* Hugging Face safetensors weights, a file or an HF folder (:func:`load_safetensors`): through
  the engine's DCP load (:func:`~ckpt_engine._dcpio.fast_load.load_state_dict`, each rank
  planning alone, its collectives bounded) with the engine's own :class:`EngineLoadPlanner`,
  so ``remap_keys`` / ``pre_load_plan`` plugins (``rename``, ``size_mismatch``, ``te_extra_state``), strictness and
  the report are those of any other load; only the storage reader
  (:class:`~ckpt_engine._dcpio.hf_read.SafetensorsReader`) differs.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from .._dcpio import dist as _dist
from .._dcpio.fast_load import load_state_dict
from .._dcpio.hf_read import SafetensorsReader, is_safetensors_path, read_index
from .._dcpio.planner import EngineLoadPlanner
from .._storage.store import Store
from ..config import EngineConfig
from ..errors import (
    CheckpointLoadError,
    CheckpointNotFoundError,
    CkptEngineError,
    ConfigError,
    InvalidArgumentError,
    first_failure,
)
from ..pipeline import Pipeline
from ..report import ComponentReport, LoadReport, SkipRecord
from ..types import LoadResult
from .collectives import watch_group
from .consensus import agreed
from .rank_views import file_view, require_one_checkpoint, safetensors_view
from .state import TrainingObjects, apply_component, component_state_dict

__all__ = ["is_safetensors_path", "load_pth", "load_safetensors"]

logger = logging.getLogger("ckpt_engine")


def load_pth(objs: TrainingObjects, path: str, store: Store) -> LoadResult:
    """Resume rule 3: ``model`` from the plain ``torch.save``d state dict ``path``, read with
    ``weights_only=True``, non-strict, plain tensors distributed into DTensor parameters."""
    require_one_checkpoint(file_view(path, store), "load_path")
    if not store.exists(path) or store.isdir(path):
        raise CheckpointNotFoundError(f"load_path {path!r} does not exist; fix load_path or unset it")
    if not objs.modules:
        raise InvalidArgumentError("a .pth load_path loads a model: pass model=")
    try:
        source: Any = path if store.capabilities.local_files else io.BytesIO(store.read_bytes(path))
        loaded = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as err:
        raise CheckpointLoadError(f"cannot load {path} as a model state dict with weights_only=True: {err}") from err
    if isinstance(loaded, Mapping) and "model" in loaded and isinstance(loaded["model"], Mapping):
        loaded = loaded["model"]
    if not isinstance(loaded, Mapping):
        raise CheckpointLoadError(f"{path} holds a {type(loaded).__name__}, not a model state dict")
    target = component_state_dict(objs, "model")
    converted: dict[str, Any] = {}
    loaded_keys, skipped = [], {}
    for key, value in loaded.items():
        live = target.get(key)
        if live is None:
            continue
        if isinstance(value, torch.Tensor) and isinstance(live, torch.Tensor) and value.shape != live.shape:
            skipped[key] = SkipRecord(reason=f"shape {list(value.shape)} != target {list(live.shape)}")
            continue
        if isinstance(live, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = distribute_tensor(value.to(live.dtype), live.device_mesh, live.placements)
        converted[key] = value
        loaded_keys.append(key)
    for module in objs.modules:
        set_model_state_dict(module, converted, options=StateDictOptions(strict=False))
    report = LoadReport(
        {
            "model": ComponentReport(
                component="model",
                checkpoint_dir=path,
                loaded=tuple(loaded_keys),
                missing=tuple(sorted(set(target) - set(loaded))),
                unexpected=tuple(sorted(set(loaded) - set(target))),
                skipped=skipped,
            )
        }
    )
    if _dist.rank() == 0:
        logger.info("loaded model weights from %s (non-strict)\n%s", path, report.summary())
    return LoadResult(iteration=0, checkpoint_path=path, report=report, source="pth", components=("model",))


# -- Hugging Face safetensors --------------------------------------------------------------------


def load_safetensors(cfg: EngineConfig, pipeline: Pipeline, objs: TrainingObjects, path: str) -> LoadResult:
    """Resume rule for safetensors weights: ``model`` only, iteration 0, through the engine's planner."""
    if not objs.modules:
        raise ConfigError(f"load_path {path!r} holds model weights (safetensors): pass model= to load()")
    if "model" in cfg.keys_not_to_resume:
        logger.info("load_path %s: model is in keys_not_to_resume; nothing loaded", path)
        return LoadResult(iteration=0, checkpoint_path=path, report=LoadReport(), source="safetensors")
    index = agreed(lambda: read_index(path))
    require_one_checkpoint(safetensors_view(index), "load_path")
    sd = component_state_dict(objs, "model")
    planner = EngineLoadPlanner(
        component="model",
        checkpoint_dir=path,
        pipeline=pipeline,
        strict=cfg.strict,
        strict_unexpected=cfg.strict_unexpected,
        rank=_dist.rank(),
        world_size=_dist.world_size(),
        warm_start=True,
    )
    reader = SafetensorsReader(index)
    try:
        with _dist.quiet_dcp():
            # Each rank plans alone, as in every engine load: bounded, and checked that the
            # ranks that read the same stored keys planned them alike.
            load_state_dict(sd, storage_reader=reader, planner=planner, process_group=watch_group())
    except (Exception, CheckpointException) as exc:
        err, ranks = first_failure(exc)
        if isinstance(err, CkptEngineError):
            raise err from None
        where = f" (failed on rank(s) {ranks})" if _dist.world_size() > 1 else ""
        raise CheckpointLoadError(
            f"loading safetensors weights from {path} failed{where}: {type(err).__name__}: {err}"
        ) from err
    assert planner.report is not None
    apply_component(objs, "model", sd, planner.untouched_roots)
    report = LoadReport({"model": planner.report})
    if _dist.rank() == 0:
        logger.info(
            "loaded model weights from %s (safetensors, %d file(s); rank 0 read %d of %d tensor bytes)\n%s",
            path,
            len(index.files),
            reader.bytes_read,
            index.total_bytes,
            report.summary(),
        )
    return LoadResult(iteration=0, checkpoint_path=path, report=report, source="safetensors", components=("model",))
