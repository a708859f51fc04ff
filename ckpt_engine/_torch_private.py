"""The one place where the engine relies on torch behaviour that is not public API.

``tests/test_torch_private.py`` pins every item here, so a torch upgrade that changes one fails
loudly in CI instead of silently mis-loading checkpoints.

* ``DTensor.__create_chunk_list__``: the protocol method DCP itself calls to learn which global
  region a rank's shard covers (``torch/distributed/checkpoint/planner_helpers.py``). No public
  function returns a DTensor shard's global offsets.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor


def local_chunks(tensor: torch.Tensor) -> list[ChunkStorageMetadata]:
    """The chunks of the global tensor that this rank holds, in global coordinates."""
    if isinstance(tensor, DTensor):
        if tensor.device_mesh.get_coordinate() is None:
            return []  # this rank is outside the tensor's mesh: it holds nothing
        chunks: list[ChunkStorageMetadata] = tensor.__create_chunk_list__()  # type: ignore[no-untyped-call]
        return chunks
    return [ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.size())]
