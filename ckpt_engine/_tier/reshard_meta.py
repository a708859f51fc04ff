"""The global view of a step saved as rank-local parts: their ``.metadata`` combined into one, each
chunk and value once, and a value that differs across the parts kept per rank.

A rank-local part (the node-local tier) holds every item its rank held, under the keys of the
state dict: a module replicated on every rank, the optimizer's step counts and hyper-parameters
are in every part, with the same bytes (a rank-local write is deterministic, so equal state gives
equal bytes). A value that is not the same on every rank (a sampler's position, an extra's
per-rank counter) is in every part too, under one key, where ``save_dir``'s checkpoint holds one
copy per rank (``key@rank<r>``, docs/design.md, "per-rank state"). So each part's server sends
the digest of every value of its part (:func:`item_digests`), and :func:`merge_metadata` keeps a
value whose digests agree once, from the lowest old rank, and one whose digests differ per rank,
under the per-rank keys ``save_dir`` would have used: the load then treats it as it treats
``save_dir``'s (restored per rank on the same world size; on another, a typed error unless the
object re-partitions itself). A plain tensor held by several parts is taken from the lowest old
rank: the save refuses plain tensors that differ across ranks (``ReplicatedStateMismatchError``)
unless ``per_rank_keys`` names them, which this cannot tell apart: with ``per_rank_keys`` set the
engine does not reshard from the tier (the resume reads ``save_dir``).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)

from .._dcpio.torch_private import storage_info
from .._format.hashing import hash_bytes
from .._format.names import RANK_LOCAL_MARK, per_rank_key
from ..errors import CorruptCheckpointError

__all__ = ["DIGESTED_BYTES", "item_digests", "merge_metadata"]

#: Values up to this size are digested by their server: two parts that hold one under the same key
#: are compared.
DIGESTED_BYTES = 1 << 16

#: ``(fqn, chunk offsets or None for a value)``.
ItemKey = tuple[str, tuple[int, ...] | None]


def item_digests(folder: str, md: Metadata, algorithm: str) -> list[list[Any]]:
    """``[fqn, offsets or None, digest]`` of every non-tensor value of the component ``folder``
    (with ``.metadata`` ``md``) of at most :data:`DIGESTED_BYTES`: its stored bytes hashed with
    ``algorithm``. (A tensor's archive names its storage by an id that differs between ranks; a
    value's archive is the same for the same value.)"""
    out: list[list[Any]] = []
    fds: dict[str, int] = {}
    try:
        for index, info in md.storage_data.items():
            if info.length > DIGESTED_BYTES or not isinstance(
                md.state_dict_metadata.get(index.fqn), BytesStorageMetadata
            ):
                continue
            if info.relative_path not in fds:
                fds[info.relative_path] = os.open(os.path.join(folder, info.relative_path), os.O_RDONLY)
            digest = hash_bytes(os.pread(fds[info.relative_path], info.length, info.offset), algorithm)
            assert digest is not None
            offsets = None if index.offset is None else [int(o) for o in index.offset]
            out.append([index.fqn, offsets, digest])
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


def _differing(parts: dict[int, Metadata], digests: dict[int, list[list[Any]]]) -> set[str]:
    """The keys of the items two parts hold with different bytes (empty chunks aside: a shard of
    no elements is never read)."""
    empty = {
        (fqn, tuple(c.offsets))
        for md in parts.values()
        for fqn, meta in md.state_dict_metadata.items()
        if isinstance(meta, TensorStorageMetadata)
        for c in meta.chunks
        if torch.Size(c.sizes).numel() == 0
    }
    first: dict[ItemKey, str] = {}
    out = set()
    for owner in sorted(digests):
        for fqn, offsets, digest in digests[owner]:
            key = (fqn, None if offsets is None else tuple(offsets))
            if key not in empty and first.setdefault(key, digest) != digest:
                out.add(fqn)
    return out


def merge_metadata(
    parts: dict[int, Metadata], digests: dict[int, list[list[Any]]]
) -> tuple[Metadata, dict[str, tuple[int, str]]]:
    """The ``.metadata`` of a global checkpoint made of the old ranks' rank-local ``parts``, and its
    data files' names: new name -> (old rank, the file's name in its part). Every chunk of every
    tensor is taken once (from the lowest old rank holding it; an empty one only if the tensor is
    empty), every value from the lowest old rank holding it; an item whose ``digests`` differ
    between parts is kept per rank (see the module)."""
    differ = _differing(parts, digests)
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Any] = {}
    planner: dict[str, Any] = {}
    names: dict[str, tuple[int, str]] = {}
    for owner in sorted(parts):
        md = parts[owner]
        planner.update({k: v for k, v in (md.planner_data or {}).items() if k not in planner})
        for fqn, meta in md.state_dict_metadata.items():
            key = per_rank_key(fqn, owner) if fqn in differ else fqn
            have = state.get(key)
            if isinstance(meta, BytesStorageMetadata):
                if have is None:
                    state[key] = meta
                    storage[MetadataIndex(key)] = _renamed(md.storage_data[MetadataIndex(fqn)], owner, names)
                elif not isinstance(have, BytesStorageMetadata):
                    raise CorruptCheckpointError(
                        f"{fqn!r} is a tensor in an old rank's part, a value in rank {owner}'s"
                    )
                continue
            if have is None:
                have = state[key] = TensorStorageMetadata(meta.properties, meta.size, [])
            elif not isinstance(have, TensorStorageMetadata) or (have.size, have.properties.dtype) != (
                meta.size,
                meta.properties.dtype,
            ):
                raise CorruptCheckpointError(f"{fqn!r} has another shape or type in rank {owner}'s part")
            _add_chunks(fqn, key, have, meta, md, owner, storage, names)
    storage_meta = StorageMeta(modules=[m for m in _modules(parts) if m != RANK_LOCAL_MARK])
    return Metadata(state, planner or None, storage, storage_meta), names


def _add_chunks(
    fqn: str,
    key: str,
    have: TensorStorageMetadata,
    meta: TensorStorageMetadata,
    md: Metadata,
    owner: int,
    storage: dict[MetadataIndex, Any],
    names: dict[str, tuple[int, str]],
) -> None:
    taken = {tuple(c.offsets) for c in have.chunks}
    empty_tensor = torch.Size(meta.size).numel() == 0
    for chunk in meta.chunks:
        if tuple(chunk.offsets) in taken or (torch.Size(chunk.sizes).numel() == 0 and not empty_tensor):
            continue
        taken.add(tuple(chunk.offsets))
        have.chunks.append(chunk)
        info = md.storage_data[MetadataIndex(fqn, chunk.offsets)]
        storage[MetadataIndex(key, chunk.offsets, len(have.chunks) - 1)] = _renamed(info, owner, names)


def _renamed(info: Any, owner: int, names: dict[str, tuple[int, str]]) -> Any:
    new = f"p{owner:05d}_{info.relative_path}"
    names[new] = (owner, info.relative_path)
    return storage_info(new, info.offset, info.length, info.transform_descriptors)


def _modules(parts: dict[int, Metadata]) -> list[str]:
    first = parts[min(parts)].storage_meta
    return list(getattr(first, "modules", None) or [])
