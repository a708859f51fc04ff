"""Helpers for ``stage`` providers that copy a snapshot in the background.

A provider that lets training run while it copies must notice an in-place edit of a tensor it has
not copied yet. torch counts in-place edits per tensor (the version counter autograd uses), but
exposes the count only as a private attribute; :func:`tensor_version` reads it through the
engine's one seam to private torch behaviour, which the engine's tests pin. :func:`memory_key`
tells which tensors are one memory (a state dict's entry and the parameter it aliases, a tie);
the engine's load planner uses it for tied weights.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ._dcpio.torch_private import tensor_version

__all__ = ["TensorKey", "local_tensor", "memory_key", "tensor_version"]

#: Identifies the memory of a tensor: (data pointer, shape, stride, dtype, device).
TensorKey = tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype, torch.device]


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a DTensor's local shard (the memory this rank holds)."""
    if not isinstance(tensor, DTensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def memory_key(tensor: torch.Tensor) -> TensorKey:
    """What identifies the memory ``tensor`` (a DTensor: its local shard) views: two tensors with
    equal keys are the same elements (an empty tensor's data pointer says nothing)."""
    local = local_tensor(tensor) if isinstance(tensor, DTensor) else tensor
    # ``torch.Size`` is a tuple: equal to and hashed as the plain one, without the copy.
    return (local.data_ptr(), local.shape, local.stride(), local.dtype, local.device)
