"""Resume rule for Hugging Face safetensors weights (``load_path`` = a file or an HF folder).

The load goes through ``dcp.load`` with the engine's own :class:`EngineLoadPlanner`, so
``remap_keys`` / ``pre_load_plan`` plugins (``rename``, ``size_mismatch``, ``te_extra_state``),
strictness and the report are those of any other load; only the storage reader
(:class:`~ckpt_engine._dcpio.hf_read.SafetensorsReader`) differs. ``model`` only, iteration 0,
as for a ``.pth`` file.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .._dcpio import dist as _dist
from .._dcpio.hf_read import SafetensorsReader, is_safetensors_path, read_index
from .._dcpio.planner import EngineLoadPlanner
from ..errors import CheckpointLoadError, CkptEngineError, ConfigError, first_failure
from ..report import LoadReport
from ..types import LoadResult
from .consensus import agreed
from .rank_views import require_one_checkpoint, safetensors_view
from .state import TrainingObjects, apply_component, component_state_dict

if TYPE_CHECKING:
    from .loader import Loader

__all__ = ["is_safetensors_path", "load_safetensors"]

logger = logging.getLogger("ckpt_engine")


def load_safetensors(engine: Loader, objs: TrainingObjects, path: str) -> LoadResult:
    """Resume rule for safetensors weights: ``model`` only, iteration 0, through the engine's planner."""
    if not objs.modules:
        raise ConfigError(f"load_path {path!r} holds model weights (safetensors): pass model= to load()")
    if "model" in engine.config.keys_not_to_resume:
        logger.info("load_path %s: model is in keys_not_to_resume; nothing loaded", path)
        return LoadResult(iteration=0, checkpoint_path=path, report=LoadReport(), source="safetensors")
    index = agreed(lambda: read_index(path))
    require_one_checkpoint(safetensors_view(index), "load_path")
    cfg = engine.config
    sd = component_state_dict(objs, "model")
    planner = EngineLoadPlanner(
        component="model",
        checkpoint_dir=path,
        pipeline=engine.pipeline,
        strict=cfg.strict,
        strict_unexpected=cfg.strict_unexpected,
        rank=_dist.rank(),
        world_size=_dist.world_size(),
    )
    reader = SafetensorsReader(index)
    try:
        with _dist.quiet_dcp():
            dcp.load(sd, storage_reader=reader, planner=planner)
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
