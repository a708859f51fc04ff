"""A DCP ``FileSystemWriter`` that writes tensor items without ``torch.save``.

DCP's writer calls ``torch.save`` once per tensor item: about 150-270 microseconds of pickling
and zip bookkeeping per item, a CRC32 pass over every byte (``torch.save`` computes one per
record) and a copy through the zip writer. :class:`FastFileSystemWriter` writes the same
``.distcp`` files, item by item in the same ``torch.save`` archive format
(:func:`~ckpt_engine._dcpio.torch_private.tensor_archive`), but emits each dense tensor's bytes
straight from its memory between a precomputed header and trailer. The on-disk result is what
DCP writes with ``torch.serialization.set_crc32_options(False)``: plain ``dcp.load`` and
``torch.load`` read it, and so does every ckpt-engine reader.

Items it does not handle the same way go through ``torch.save`` exactly as DCP does: non-tensor
values (DCP's own pickled bytes), sparse, quantized or subclass tensors, dtypes outside
:data:`~ckpt_engine._dcpio.torch_private.ARCHIVE_DTYPES`. Stream transforms (``_extensions``) are not
handled here: with ``_extensions`` (or the safetensors serialization format) every item goes
through DCP's own path.
"""

from __future__ import annotations

import heapq
import io
import os
import pickle
import threading
import weakref
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._format.digests import write_part
from .._format.hashing import new_hasher
from .._format.metadata import remember_metadata
from .fast_read import gc_paused
from .torch_private import storage_info
from .torch_save_archive import tensor_archive

__all__ = ["FastFileSystemWriter"]

#: Metadata objects already made compact (``fast_save.compact_metadata``), by id.
_COMPACT: weakref.WeakValueDictionary[int, Metadata] = weakref.WeakValueDictionary()


_SUFFIX = ".distcp"
_BUFFER = 1 << 20


def _item_nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize


def _buckets(count: int, items: list[WriteItem]) -> list[list[WriteItem]]:
    """Split items over ``count`` files like DCP: values round-robin, tensors largest first onto
    the least-loaded file."""
    if count <= 1:
        return [list(items)]
    buckets: list[list[WriteItem]] = [[] for _ in range(count)]
    values = [i for i in items if i.type == WriteItemType.BYTE_IO]
    tensors = sorted((i for i in items if i.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True)
    for n, item in enumerate(values):
        buckets[n % count].append(item)
    heap = [(0, n) for n in range(count)]
    for item in tensors:
        load, n = heapq.heappop(heap)
        buckets[n].append(item)
        heapq.heappush(heap, (load + _item_nbytes(item), n))
    return buckets


def _dense(tensor: torch.Tensor) -> torch.Tensor | None:
    """A contiguous CPU tensor with the same values, or ``None`` if torch.save must write it."""
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or tensor.is_quantized:
        return None
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return tensor.resolve_conj().resolve_neg().contiguous()


class _Output:
    """A file written sequentially, tracking its offset and hashing what it writes."""

    def __init__(self, path: str, algorithm: str | None) -> None:
        self.f = open(path, "wb", buffering=_BUFFER)  # noqa: SIM115 - closed in write_file
        self.pos = 0
        self.hasher = new_hasher(algorithm) if algorithm is not None else None

    def write(self, data: Any) -> None:
        if self.hasher is not None:
            self.hasher.update(data)
        n = self.f.write(data)
        self.pos += n if n is not None else len(memoryview(data).cast("B"))

    def digest(self) -> str | None:
        return None if self.hasher is None else self.hasher.hexdigest()


class FastFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose tensor items skip ``torch.save`` (same files, same format)."""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if getattr(self.transforms, "extensions", ()) or self.serialization_format != SerializationFormat.TORCH_SAVE:
            return super().write_data(plan, planner)  # stream transforms, safetensors: DCP's own path
        self._checksum = getattr(planner, "checksum", None)  # for finish(): the same algorithm
        with gc_paused():
            return self._write_all(plan, planner)

    def _write_all(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: str = plan.storage_data.prefix  # a _StoragePrefix from prepare_global_plan
        if self.single_file_per_rank:
            files = [(f"{prefix}{n}{_SUFFIX}", b) for n, b in enumerate(_buckets(self.thread_count, plan.items))]
        else:
            files = [(f"{prefix}{n}{_SUFFIX}", [item]) for n, item in enumerate(plan.items)]
        results: list[list[WriteResult]] = [[] for _ in files]
        algorithm: str | None = getattr(planner, "checksum", None)
        digests: dict[str, tuple[int, str | None]] = {}
        errors: list[BaseException] = []
        pending = list(range(len(files)))
        lock = threading.Lock()

        def worker() -> None:
            while True:
                with lock:
                    if not pending or errors:
                        return
                    n = pending.pop(0)
                try:
                    results[n], digests[files[n][0]] = self._write_file(files[n][0], files[n][1], planner, algorithm)
                except BaseException as err:
                    with lock:
                        errors.append(err)
                    return

        threads = [threading.Thread(target=worker, name=f"ckpt-write-{n}") for n in range(1, self.thread_count)]
        for t in threads:
            t.start()
        worker()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        if algorithm is not None:  # this rank's part of the manifest: hashed as written, never read back
            write_part(os.fspath(self.path), prefix, algorithm, digests)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for rs in results for r in rs])
        return fut

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, algorithm: str | None
    ) -> tuple[list[WriteResult], tuple[int, str | None]]:
        out = _Output(os.path.join(os.fspath(self.path), name), algorithm)
        results: list[WriteResult] = []
        try:
            # values first, then tensors, as DCP orders them
            for item in [i for i in items if i.type == WriteItemType.BYTE_IO]:
                data = planner.resolve_data(item)
                assert isinstance(data, io.BytesIO)
                offset = out.pos
                out.write(data.getbuffer())
                results.append(self._result(item, name, offset, out.pos - offset))
            for item in [i for i in items if i.type != WriteItemType.BYTE_IO]:
                tensor = planner.resolve_data(item)
                assert isinstance(tensor, torch.Tensor)
                offset = out.pos
                self._write_tensor(out, tensor.detach())
                results.append(self._result(item, name, offset, out.pos - offset))
            out.f.flush()
            if self.sync_files:
                os.fsync(out.f.fileno())
        finally:
            out.f.close()
        return results, (out.pos, out.digest())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's ``finish`` (``.metadata.tmp``, fsync, rename), with the metadata made compact,
        hashed as it is written (a part of its own) and remembered for the commit check."""
        if getattr(self.transforms, "extensions", ()) or self.serialization_format != SerializationFormat.TORCH_SAVE:
            super().finish(metadata, results)
            return
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        from .fast_save import compact_metadata

        if _COMPACT.get(id(metadata)) is not metadata:
            compact_metadata(metadata)
            _COMPACT[id(metadata)] = metadata
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        data = pickle.dumps(metadata, protocol=pickle.DEFAULT_PROTOCOL)
        folder = os.fspath(self.path)
        final, tmp = os.path.join(folder, ".metadata"), os.path.join(folder, ".metadata.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            if self.sync_files:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        algorithm = getattr(self, "_checksum", None)
        hasher = new_hasher(algorithm) if algorithm is not None else None
        if hasher is not None:
            hasher.update(data)
            write_part(folder, "metadata", algorithm, {".metadata": (len(data), hasher.hexdigest())})
        remember_metadata(folder, metadata)

    @staticmethod
    def _write_tensor(out: _Output, tensor: torch.Tensor) -> None:
        dense = _dense(tensor)
        parts = None if dense is None else tensor_archive(dense.dtype, tuple(dense.shape))
        if dense is None or parts is None:
            # what DCP does for every item: torch.save of a compact CPU copy
            cpu = tensor.cpu()
            if cpu.untyped_storage().size() != cpu.numel() * cpu.itemsize:
                cpu = cpu.clone()
            buf = io.BytesIO()
            torch.save(cpu, buf)
            out.write(buf.getbuffer())
            return
        out.write(parts.head)
        if parts.nbytes:
            out.write(dense.reshape(-1).view(torch.uint8).numpy().data)
        out.write(parts.tail)

    @staticmethod
    def _result(item: WriteItem, name: str, offset: int, length: int) -> WriteResult:
        return WriteResult(index=item.index, size_in_bytes=length, storage_data=storage_info(name, offset, length))
