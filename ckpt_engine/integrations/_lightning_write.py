"""A Lightning checkpoint dict as what the engine saves: the model module (the state dict's
tensors) and the ``lightning`` component's items, with the structure JSON that
:mod:`._lightning_read` reads back."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from .._format import bounded_json
from ..errors import ArgumentTypeError
from ._lightning_read import MAX_STRUCTURE_DEPTH, STRUCTURE_KEY
from ._pointers import POINTER_FORMAT
from ._state_tree import dtype_name, flatten, tensor_module

__all__ = ["split_checkpoint"]


def split_checkpoint(checkpoint: Mapping[str, Any], save_id: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The model module (the state dict's tensors) and the ``lightning`` component's items.

    Under DDP and ``ModelParallelStrategy`` every rank gives its own checkpoint dict (so all
    ranks fail together on a bad one). What several ranks give under one key (the replicated
    model and optimizer of DDP, the loops, the structure) the engine writes once, from the
    lowest rank that gives it (``dedup_save_to_lowest_rank``), as Lightning's would; what
    differs by rank (a callback's state) is saved per rank, and each rank resumes its own
    (docs/reliability.md, Per-rank state). DTensors are written as each rank's shard."""
    rest = dict(checkpoint)
    state_dict = rest.pop("state_dict", None)
    state_dict = state_dict if isinstance(state_dict, Mapping) else {}
    tensors = {k: v for k, v in state_dict.items() if isinstance(k, str) and isinstance(v, torch.Tensor)}
    others = {k: v for k, v in state_dict.items() if k not in tensors}
    encoded: str | None = None
    try:  # a dict nested past the recursion limit fails in flatten or in json.dumps
        tree, items = flatten({"checkpoint": rest, "state_dict_other": others}, frozenset({STRUCTURE_KEY}))
        structure = {
            "format": POINTER_FORMAT,
            "version": 1,
            "save_id": save_id,
            "has_state_dict": "state_dict" in checkpoint,
            "state_dict_order": [k if isinstance(k, str) else None for k in state_dict],
            "model": {k: [dtype_name(v.dtype), list(v.shape)] for k, v in tensors.items()},
            "tree": tree,
        }
        encoded = json.dumps(structure, separators=(",", ":"))
    except RecursionError:
        pass
    if encoded is None or bounded_json.nesting(encoded.encode()) > MAX_STRUCTURE_DEPTH:
        raise ArgumentTypeError(
            f"the checkpoint dict nests deeper than EngineCheckpointIO stores (about {MAX_STRUCTURE_DEPTH // 3} "
            "levels of dicts and lists); flatten the deep part in on_save_checkpoint"
        )
    items[STRUCTURE_KEY] = encoded
    return tensor_module(tensors), items
