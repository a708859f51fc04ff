"""Resume rule 3 (DESIGN section 4): ``load_path`` is a ``.pth`` file, a plain ``torch.save``d model state dict.

Read with ``weights_only=True`` (nothing in the file runs), loaded non-strict, plain tensors
distributed into DTensor parameters where the model is sharded; ``model`` only, iteration 0.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from .._dcpio import dist as _dist
from .._storage.store import Store
from ..errors import CheckpointLoadError, CheckpointNotFoundError, InvalidArgumentError
from ..report import ComponentReport, LoadReport, SkipRecord
from ..types import LoadResult
from .rank_views import file_view, require_one_checkpoint
from .state import TrainingObjects, component_state_dict

__all__ = ["load_pth"]

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
