"""Does a component's DCP metadata describe data that exists?

A ``.metadata`` can be internally consistent as a pickle and still lie about the data: a chunk
that covers half of its tensor (the other half would keep the destination's old values, or a
converter's uninitialised memory), a chunk outside the tensor's shape, two chunks over the same
elements, a chunk with no storage entry, or a tensor of ``[2**25, 8]`` whose only storage entry
is a few kilobytes. :func:`check_chunk_coverage` refuses all of these before anything is
allocated or read; :func:`~ckpt_engine.layout.check_complete` then checks that every byte range
the storage entries name exists in its data file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex, TensorStorageMetadata

from .errors import CorruptCheckpointError

__all__ = ["check_chunk_coverage"]

#: Pairwise overlap checks beyond this many chunks of one tensor use the sorted sweep only.
_MAX_PAIRS = 1 << 22


def check_chunk_coverage(md: Metadata, path: str | os.PathLike[str]) -> None:
    """Raise :class:`CorruptCheckpointError` naming ``path`` (the ``.metadata`` file) and the key
    unless, for every tensor, its chunks lie inside its shape, do not overlap and cover it
    exactly, and every chunk (and every non-tensor value) has a storage entry whose length can
    hold its bytes. Reads nothing but ``md``."""
    where = os.fspath(path)
    storage: dict[Any, Any] = dict(md.storage_data or {})
    for fqn, item in (md.state_dict_metadata or {}).items():
        if isinstance(item, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                raise CorruptCheckpointError(f"{where}: value {fqn!r} has no storage entry; its data is absent")
            continue
        if not isinstance(item, TensorStorageMetadata):
            raise CorruptCheckpointError(f"{where}: key {fqn!r} has metadata of type {type(item).__name__}")
        _check_tensor(where, fqn, item, storage)


def _check_tensor(where: str, fqn: str, item: TensorStorageMetadata, storage: dict[Any, Any]) -> None:
    shape = tuple(int(s) for s in item.size)
    if any(s < 0 for s in shape):
        raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has a negative size {list(shape)}")
    itemsize = item.properties.dtype.itemsize
    total = math.prod(shape)
    covered = 0
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for chunk in item.chunks:
        offsets, sizes = tuple(int(o) for o in chunk.offsets), tuple(int(s) for s in chunk.sizes)
        box = f"chunk at {list(offsets)} of size {list(sizes)}"
        if len(offsets) != len(shape) or len(sizes) != len(shape):
            raise CorruptCheckpointError(f"{where}: tensor {fqn!r} of shape {list(shape)} has a {box}")
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True)):
            raise CorruptCheckpointError(
                f"{where}: tensor {fqn!r} of shape {list(shape)} has a {box}, which lies outside it"
            )
        numel = math.prod(sizes)
        if numel == 0:
            continue
        info = storage.get(MetadataIndex(fqn, offsets))
        if info is None:
            raise CorruptCheckpointError(f"{where}: tensor {fqn!r}: the {box} has no storage entry; its data is absent")
        length = int(getattr(info, "length", 0))
        if not getattr(info, "transform_descriptors", None) and length < numel * itemsize:
            raise CorruptCheckpointError(
                f"{where}: tensor {fqn!r}: the {box} needs {numel * itemsize} bytes of "
                f"{item.properties.dtype}, but its storage entry holds {length}"
            )
        covered += numel
        boxes.append((offsets, sizes))
    _check_no_overlap(where, fqn, shape, boxes)
    if covered != total:
        raise CorruptCheckpointError(
            f"{where}: the chunks of tensor {fqn!r} cover {covered} of its {total} elements "
            f"(shape {list(shape)}); the rest of its data is absent"
        )


def _check_no_overlap(
    where: str, fqn: str, shape: Sequence[int], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> None:
    """Two chunks overlap when their ranges intersect in every dimension. Sorted by the first
    dimension, a chunk need only be compared with the following ones that start before it ends."""
    if not shape:
        if len(boxes) > 1:
            raise CorruptCheckpointError(f"{where}: scalar tensor {fqn!r} has {len(boxes)} chunks")
        return
    boxes = sorted(boxes)
    pairs = 0
    for i, (oa, sa) in enumerate(boxes):
        for ob, sb in boxes[i + 1 :]:
            if ob[0] >= oa[0] + sa[0]:
                break
            pairs += 1
            if pairs > _MAX_PAIRS:
                raise CorruptCheckpointError(f"{where}: tensor {fqn!r} has too many overlapping chunks to check")
            if all(b < a + la and a < b + lb for a, la, b, lb in zip(oa, sa, ob, sb, strict=True)):
                raise CorruptCheckpointError(
                    f"{where}: tensor {fqn!r} has overlapping chunks at {list(oa)} (size {list(sa)}) "
                    f"and {list(ob)} (size {list(sb)})"
                )
