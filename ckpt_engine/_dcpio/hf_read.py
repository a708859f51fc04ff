"""Reading Hugging Face safetensors weights through DCP: the index of a file or HF folder, and
a ``StorageReader`` over it (``load_path`` = safetensors; the resume rule is ``_engine.weights_load``).

:class:`SafetensorsReader` serves DCP metadata built from the files' headers (each tensor one
chunk at offset 0) and reads each read item's region with ``pread`` straight into the
destination tensor DCP hands it: for a DTensor / FSDP2 parameter that is the rank's local shard,
so a rank reads only its shard's bytes. A stored dtype that differs from the destination's (the
report lists it under ``cast``) is cast by one ``copy_`` from a view of the file's mapped pages,
so no buffer of the stored dtype is allocated and only the region's pages are touched.

Why not ``torch.distributed.checkpoint.HuggingFaceStorageReader`` (public in torch 2.13)?
* it takes every ``*.safetensors`` file in the folder and ignores ``model.safetensors.index.json``,
  so a shard the index names but that is missing goes unnoticed (its keys are just "missing"),
  and a stray file in the folder is read as part of the model;
* it takes a folder only, not a single ``.safetensors`` file;
* it needs the ``safetensors`` package and reads each region through ``safe_open(...)
  .get_slice()``, which materialises the slice in a new tensor and then copies it, where a
  same-dtype read here lands directly in the destination (one copy less, no second buffer);
* it trusts the headers (offsets, sizes) as they come.

The index and every header are read the way the engine reads ``.metadata``: regular files only
(a FIFO would block, ``/dev/zero`` never ends), bounded sizes, typed errors naming the file.
"""

from __future__ import annotations

import itertools
import math
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from .._format.safetensors import (
    INDEX_FILE,
    SINGLE_FILE,
    TensorEntry,
    open_regular,
    read_header,
    torch_entries,
)
from .._format.safetensors_header import read_weights_folder
from .._storage.urls import is_url
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    clip,
)

__all__ = ["SafetensorsIndex", "SafetensorsReader", "is_safetensors_path", "read_index"]


def is_safetensors_path(path: str) -> bool:
    """Whether ``load_path`` names safetensors weights: a ``.safetensors`` file, a local folder
    holding ``model.safetensors`` or ``model.safetensors.index.json``, or that index itself."""
    if path.endswith((".safetensors", INDEX_FILE)):
        return True
    if is_url(path) or not os.path.isdir(path):
        return False
    return os.path.exists(os.path.join(path, INDEX_FILE)) or os.path.exists(os.path.join(path, SINGLE_FILE))


@dataclass(frozen=True)
class SafetensorsIndex:
    """Every tensor of a safetensors file or HF folder, by name."""

    path: str
    files: tuple[str, ...]
    tensors: dict[str, TensorEntry]

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.tensors.values())


def read_index(path: str) -> SafetensorsIndex:
    """Headers of ``path`` (a file, or a folder with one file or shards plus the index), checked."""
    if is_url(path):
        raise ConfigError(
            f"load_path {path!r}: safetensors weights are read from a local file or folder; copy them there "
            "(e.g. huggingface-cli download ... --local-dir DIR) and point load_path at it"
        )
    if os.path.basename(path) == INDEX_FILE and not os.path.isdir(path):
        folder = os.path.dirname(path) or "."
        if not os.path.lexists(path):
            raise CheckpointNotFoundError(
                f"load_path {clip(path)} does not exist; point load_path at the Hugging Face folder that "
                f"should hold it ({clip(folder)}), or fix it"
            )
        return _read_folder(folder, index_first=True)  # the index describes its folder: its folder loads
    if not os.path.isdir(path):
        if not os.path.exists(path):
            raise CheckpointNotFoundError(f"load_path {path!r} does not exist; fix load_path or unset it")
        header = read_header(path)
        return SafetensorsIndex(path, (path,), header.tensors)
    return _read_folder(path)


def _read_folder(path: str, index_first: bool = False) -> SafetensorsIndex:
    """The single file (``model.safetensors``, where it exists: the file ``from_pretrained`` reads),
    or the index and every shard it names, checked; ``index_first``: the index where it exists."""
    weights = read_weights_folder(path, index_first=index_first)
    return SafetensorsIndex(path, tuple(h.path for h in weights.headers), torch_entries(weights.tensors))


def _tensor_metadata(entry: TensorEntry) -> TensorStorageMetadata:
    size = torch.Size(entry.shape)
    return TensorStorageMetadata(
        properties=TensorProperties(dtype=entry.dtype),
        size=size,
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
    )


def _pread_into(fd: int, buf: memoryview, offset: int, path: str, name: str) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n <= 0:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} is cut short at byte {offset + got} (truncated file)"
            )
        got += n


def _byte_view(t: torch.Tensor) -> memoryview:
    view: memoryview = t.reshape(-1).view(torch.uint8).numpy().data
    return view


class SafetensorsReader(StorageReader):
    """A DCP storage reader over safetensors files; reads each region straight into place."""

    def __init__(self, index: SafetensorsIndex) -> None:
        self.index = index
        #: Tensor bytes read by this rank (after ``dcp.load``).
        self.bytes_read = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        self.bytes_read = 0

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return Metadata(
            state_dict_metadata={n: _tensor_metadata(e) for n, e in self.index.tensors.items()},
            storage_data={MetadataIndex(n, torch.Size([0] * len(e.shape))): n for n, e in self.index.tensors.items()},
            storage_meta=StorageMeta(),
        )

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        return None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            by_file.setdefault(self.index.tensors[item.storage_index.fqn].file, []).append(item)
        for path, items in by_file.items():
            with open_regular(path) as f:
                mapped: mmap.mmap | None = None
                try:
                    for item in items:
                        entry = self.index.tensors[item.storage_index.fqn]
                        dest = planner.resolve_tensor(item).detach()
                        if dest.dtype == entry.dtype and dest.device.type == "cpu" and dest.is_contiguous():
                            self._read_into(f.fileno(), entry, item, dest)
                        else:
                            mapped = mapped or self._map(f, entry)
                            self._copy_from_map(mapped, entry, item, dest)
                        planner.commit_tensor(item, dest)
                finally:
                    if mapped is not None:
                        mapped.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_into(self, fd: int, entry: TensorEntry, item: ReadItem, dest: torch.Tensor) -> None:
        """Same dtype, contiguous CPU destination: ``pread`` the region's runs straight into it."""
        view = _byte_view(dest)
        pos = 0
        for offset, nbytes in _runs(entry, tuple(item.storage_offsets), tuple(item.lengths)):
            _pread_into(fd, view[pos : pos + nbytes], offset, entry.file, item.storage_index.fqn)
            pos += nbytes
        self.bytes_read += pos

    def _map(self, f: Any, entry: TensorEntry) -> mmap.mmap:
        # read_header checked every range against the file's size; a file cut short since then
        # would fault on access instead of raising, so check the size again right here
        needed = max(e.end for e in self.index.tensors.values() if e.file == entry.file)
        if os.fstat(f.fileno()).st_size < needed:
            raise CorruptCheckpointError(f"{entry.file}: the file is shorter than its header says (truncated)")
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # copy-on-write: writable, never written

    def _copy_from_map(self, mapped: mmap.mmap, entry: TensorEntry, item: ReadItem, dest: torch.Tensor) -> None:
        """A cast, or a destination that is not a contiguous CPU tensor: ``copy_`` from a view of
        the file's pages (one pass; only the region's pages are touched)."""
        numel = math.prod(item.lengths)
        if numel == 0:
            return
        full = torch.frombuffer(mapped, dtype=entry.dtype, count=math.prod(entry.shape), offset=entry.begin)
        region = full.view(entry.shape)[
            tuple(slice(o, o + n) for o, n in zip(item.storage_offsets, item.lengths, strict=True))
        ]
        dest.copy_(region)
        self.bytes_read += numel * entry.dtype.itemsize
        del full, region  # no view may outlive the map


def _runs(entry: TensorEntry, offsets: Sequence[int], lengths: Sequence[int]) -> list[tuple[int, int]]:
    """(file offset, byte count) of the contiguous runs that make up a region, in C order."""
    shape, itemsize = entry.shape, entry.dtype.itemsize
    if math.prod(lengths) == 0:
        return []
    # dims k.. are read whole; the run is dim k-1's slice (or the whole tensor when k == 0)
    k = len(shape)
    while k > 0 and offsets[k - 1] == 0 and lengths[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        return [(entry.begin, entry.nbytes)]
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    run = lengths[k - 1] * strides[k - 1] * itemsize
    outer = itertools.product(*(range(o, o + n) for o, n in zip(offsets[: k - 1], lengths[: k - 1], strict=True)))
    return [
        (
            entry.begin
            + (sum(i * s for i, s in zip(idx, strides, strict=False)) + offsets[k - 1] * strides[k - 1]) * itemsize,
            run,
        )
        for idx in outer
    ]
