"""A DCP ``FileSystemWriter`` that writes tensor items without ``torch.save``.

DCP's writer calls ``torch.save`` once per tensor item: about 150-270 microseconds of pickling
and zip bookkeeping per item, a CRC32 pass over every byte (``torch.save`` computes one per
record) and a copy through the zip writer. :class:`FastFileSystemWriter` writes the same
``.distcp`` files, item by item in the same ``torch.save`` archive format
(:func:`~ckpt_engine._dcpio.archive_write.tensor_archive`), but emits each dense tensor's bytes
straight from its memory between a precomputed header and trailer. The on-disk result is what
DCP writes with ``torch.serialization.set_crc32_options(False)``: plain ``dcp.load`` and
``torch.load`` read it, and so does every ckpt-engine reader.

With a :class:`~ckpt_engine.types.CarryOver` (``EngineConfig.incremental``), the items are laid
out in files that stay the same from save to save, and a file whose bytes equal the previous
checkpoint's file of that name is carried over instead of written (:mod:`.carry`).

Items it does not handle the same way go through ``torch.save`` exactly as DCP does: non-tensor
values (DCP's own pickled bytes), sparse, quantized or subclass tensors, dtypes outside
:data:`~ckpt_engine._dcpio.archive_write.ARCHIVE_DTYPES`. Stream transforms (``_extensions``) are not
handled here: with ``_extensions`` (or the safetensors serialization format) every item goes
through DCP's own path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import heapq
import io
import logging
import os
import threading
from pathlib import PurePath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import SerializationFormat
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .._format.data_file import BlockHasher, DataFile
from .._format.digests import write_part
from .._format.hashing import hash_bytes, new_hasher
from .._format.metadata import remember_metadata
from .._format.metadata_index import encode_index
from .._format.names import METADATA_FILE, METADATA_INDEX_FILE, RANK_LOCAL_MARK
from ..types import CarriedBy, CarryOver
from ..types import WriteResult as ComponentWritten
from .archive_write import tensor_archive
from .carry import CarriedFile, create_new, group_items, link_file
from .fast_read import gc_paused
from .torch_private import pickle_metadata, storage_info

__all__ = ["FastFileSystemWriter", "MetadataFile", "write_result"]

logger = logging.getLogger("ckpt_engine")

#: Metadata objects already made compact (``fast_save.compact_metadata``), by id.


_SUFFIX = ".distcp"
#: A file written: its size, digest and per-block digests (``None``: not hashed).
_Written = tuple[int, str | None, list[tuple[int, str]] | None]
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


#: ``"storage_meta"`` as protocol 4 pickles a key of ``Metadata``'s state (SHORT_BINUNICODE).
_STORAGE_META_KEY = b"\x8c\x0cstorage_meta"


@dataclasses.dataclass(frozen=True)
class MetadataFile:
    """The bytes of a ``.metadata`` file as written, and the ``storage_meta`` they hold.

    ``storage_meta`` is the last entry but one of the pickled ``Metadata``'s state (``version``
    follows), so everything before its key is the same for any ``storage_meta``. A save with
    the same plan and write results differs only there: the writer's ``save_id`` (a fresh UUID)
    and the checkpoint folder (``.iter_000000200.partial`` and the like: the same length every
    save). :meth:`patched` rewrites those strings in place when each keeps its encoded length,
    so the file is what pickling the ``Metadata`` again would give, for the cost of a copy.
    """

    data: bytes
    storage_meta: StorageMeta | None

    def patched(self, storage_meta: StorageMeta | None) -> bytes | None:
        """The bytes with ``storage_meta`` in place of :attr:`storage_meta`; ``None`` when that
        is not a rewrite of equal-length strings found once each after the key."""
        pairs = _changed_strings(self.storage_meta, storage_meta)
        at = self.data.rfind(_STORAGE_META_KEY)
        if pairs is None or at < 0 or self.data.find(_STORAGE_META_KEY) != at:
            return None
        tail = bytearray(self.data[at:])
        for old, new in pairs:
            a, b = old.encode(), new.encode()
            if len(a) != len(b) or len(a) > 255:  # SHORT_BINUNICODE: one length byte
                return None
            needle = b"\x8c" + bytes([len(a)]) + a
            first = tail.find(needle)
            if first < 0 or tail.find(needle, first + 1) >= 0:
                return None
            tail[first + 2 : first + 2 + len(a)] = b
        return self.data[:at] + bytes(tail)


def _changed_strings(old: StorageMeta | None, new: StorageMeta | None) -> list[tuple[str, str]] | None:
    """The strings that differ between two ``StorageMeta`` s of the same shape (the checkpoint
    id's path parts or string, the save id), or ``None`` when anything else differs."""
    if not (isinstance(old, StorageMeta) and isinstance(new, StorageMeta)):
        return None
    if old.load_id is not None or new.load_id is not None or old.modules != new.modules:
        return None
    a, b = old.checkpoint_id, new.checkpoint_id
    if type(a) is not type(b):
        return None
    if isinstance(a, PurePath) and isinstance(b, PurePath):
        strings = list(zip(a.parts, b.parts, strict=False)) if len(a.parts) == len(b.parts) else None
    elif isinstance(a, str) and isinstance(b, str):
        strings = [(a, b)]
    else:
        strings = [] if a is None else None
    if strings is None or type(old.save_id) is not type(new.save_id) or not isinstance(old.save_id, (str, type(None))):
        return None
    if isinstance(old.save_id, str) and isinstance(new.save_id, str):
        strings.append((old.save_id, new.save_id))
    # pickle writes a string it meets twice once, then refers back to it (a path's parts are
    # interned): rewriting that one copy would change both places, and a fresh pickle of the new
    # one would refer back where the old wrote the string. Either way: not a patch.
    olds = [x for x, _ in strings] + list(old.modules)
    news = [y for _, y in strings] + list(new.modules)
    changed = [(x, y) for x, y in strings if x != y]
    if any(olds.count(x) > 1 or news.count(y) > 1 for x, y in changed):
        return None
    return changed


class FastFileSystemWriter(FileSystemWriter):
    """``FileSystemWriter`` whose tensor items skip ``torch.save`` (same files, same format).

    ``carry_over``: lay the items out for incremental saves and carry unchanged files over."""

    #: A subclass that must write the items in the order its plan gives them (staging windows)
    #: sets this: an incremental layout then keeps that order.
    keep_item_order = False
    #: A subclass whose items' memory is refilled as soon as they are written (staging windows)
    #: sets this: each part is then hashed before its write returns, never later on a helper
    #: thread that would hash the next window's bytes instead of the ones on disk.
    reuses_item_memory = False

    def __init__(
        self, *args: Any, carry_over: CarryOver | None = None, rank_local: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.carry_over = carry_over
        #: A rank-local checkpoint (the node-local tier): its ``.metadata`` says so
        #: (:data:`~ckpt_engine._format.names.RANK_LOCAL_MARK` in ``storage_meta.modules``).
        self.rank_local = rank_local
        #: File name -> how it was carried over in the last write (``"link"``, ``"copy"``, or
        #: ``"write"``: it could have been, but carrying over was refused) and its size.
        self.carried: dict[str, tuple[CarriedBy, int]] = {}
        #: Bytes of this rank's files in the last write (carried over ones included); ``None``
        #: when DCP's own writer ran (stream transforms, safetensors).
        self.bytes_out: int | None = None
        #: Names of the last write's stable files (the ones compared with the previous checkpoint).
        self._stable: set[str] = set()
        #: The ``.metadata`` the last ``finish`` wrote (on the coordinator; ``None`` before, or
        #: when DCP's own ``finish`` ran).
        self.last_metadata: MetadataFile | None = None

    def storage_meta(self) -> StorageMeta | None:
        meta = super().storage_meta()
        if self.rank_local and meta is not None:
            meta.modules = [RANK_LOCAL_MARK]
        return meta

    def _own_encoding(self) -> bool:
        """Whether this writer encodes the items and ``.metadata`` itself: not with stream
        transforms (zstd and the like) or another serialisation format, which DCP's own code writes."""
        return (
            not getattr(self.transforms, "extensions", ())
            and self.serialization_format == SerializationFormat.TORCH_SAVE
        )

    def carried_summary(self) -> tuple[int, CarriedBy]:
        """The last write's bytes carried over, and how: ``"off"`` (nothing could be),
        ``"link"`` / ``"copy"``, or ``"write"`` (unchanged files, but carrying over was refused)."""
        reused = sum(n for how, n in self.carried.values() if how != "write")
        if reused:
            return reused, next(how for how, _ in self.carried.values() if how != "write")
        return 0, "write" if self.carried else "off"

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if not self._own_encoding():
            return super().write_data(plan, planner)  # stream transforms, safetensors: DCP's own path
        self._checksum = getattr(planner, "checksum", None)  # for finish(): the same algorithm
        with gc_paused():
            return self._write_all(plan, planner)

    def _write_all(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: str = plan.storage_data.prefix  # a _StoragePrefix from prepare_global_plan
        self.carried = {}
        self._stable = set()
        if self.carry_over is not None:
            groups = group_items(
                plan.items,
                _item_nbytes,
                self.carry_over.stable,
                lambda items: _buckets(self.thread_count, items),
                keep_order=self.keep_item_order,
            )
            files = [(f"{prefix}{n}{_SUFFIX}", g.items) for n, g in enumerate(groups)]
            self._stable = {name for (name, _), g in zip(files, groups, strict=True) if g.stable}
        elif self.single_file_per_rank:
            files = [(f"{prefix}{n}{_SUFFIX}", b) for n, b in enumerate(_buckets(self.thread_count, plan.items))]
        else:
            files = [(f"{prefix}{n}{_SUFFIX}", [item]) for n, item in enumerate(plan.items)]
        results: list[list[WriteResult]] = [[] for _ in files]
        algorithm: str | None = getattr(planner, "checksum", None)
        digests: dict[str, tuple[int, str | None]] = {}
        blocks: dict[str, list[tuple[int, str]]] = {}
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
                    name = files[n][0]
                    results[n], (size, digest, cut) = self._write_file(name, files[n][1], planner, algorithm)
                    digests[name] = (size, digest)
                    if cut is not None:
                        blocks[name] = cut
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
        self.bytes_out = sum(size for size, _ in digests.values())
        if algorithm is not None:  # this rank's part of the manifest: hashed as written, never read back
            carried = {name: how for name, (how, _) in self.carried.items()}
            write_part(os.fspath(self.path), prefix, algorithm, digests, carried, blocks)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for rs in results for r in rs])
        return fut

    def _write_file(
        self, name: str, items: list[WriteItem], planner: SavePlanner, algorithm: str | None
    ) -> tuple[list[WriteResult], _Written]:
        """Write the file ``name`` of ``items``: their results, and the file's size, digest and
        per-block digests (what a load checks the bytes it reads against)."""
        if name in self._stable and self.carry_over is not None and algorithm == self.carry_over.algorithm:
            return self._carry_or_write(name, items, planner)
        results: list[WriteResult] = []
        # A rank-local checkpoint's archives get serialization ids derived from the content (the
        # digest so far, hashed once either way): equal state gives equal bytes, which a peer
        # holding the same shards (a data-parallel replica) links instead of receiving.
        path = os.path.join(os.fspath(self.path), name)
        with DataFile(
            create_new(path),
            algorithm,
            self.sync_files,
            hashed_by_caller=self.rank_local,
            blocks=algorithm,
            hash_at_write=self.reuses_item_memory,
        ) as out:
            hasher = out.hasher if self.rank_local else None
            for item in _dcp_order(items):
                offset = out.pos
                parts = _encode(planner.resolve_data(item), hasher)
                out.item(sum(memoryview(p).nbytes for p in parts))
                for part in parts:
                    out.write(part)
                results.append(self._result(item, name, offset, out.pos - offset))
            out.sync(self.sync_files)
        return results, (out.pos, out.digest(), out.blocks())

    def _carry_or_write(
        self, name: str, items: list[WriteItem], planner: SavePlanner
    ) -> tuple[list[WriteResult], _Written]:
        """The file ``name`` of an incremental save: its bytes are built and hashed first; equal
        to the previous checkpoint's file of that name (size and checksum), it is carried over,
        else written (with the digest just computed: every byte is hashed once).

        Each tensor's archive gets a serialization id derived from the bytes before it (the
        digest so far), not a fresh one: the same content gives the same file at every save."""
        carry = self.carry_over
        assert carry is not None
        hasher = new_hasher(carry.algorithm)
        assert hasher is not None
        encoded: list[tuple[WriteItem, list[Any]]] = []
        sizes: list[int] = []
        for item in _dcp_order(items):
            parts = _encode(planner.resolve_data(item), hasher)
            encoded.append((item, parts))
            sizes.append(sum(memoryview(p).nbytes for p in parts))
        digest, size = hasher.hexdigest(), sum(sizes)
        path = os.path.join(os.fspath(self.path), name)
        previous = carry.files.get(name) if carry.previous is not None else None
        if previous is not None and (size, digest) == tuple(previous):
            assert carry.previous is not None
            expected = CarriedFile(size, digest, carry.algorithm, carry.seen.get(name))
            reason = None if carry.method == "copy" else link_file(os.path.join(carry.previous, name), path, expected)
            if reason is None:  # "copy": the upload copies it inside the object store
                self.carried[name] = (carry.method, size)
                results, offset = [], 0
                cut = BlockHasher(carry.algorithm)  # the blocks its manifest entry records again
                for (item, parts), n in zip(encoded, sizes, strict=True):
                    results.append(self._result(item, name, offset, n))
                    cut.item(offset, n)
                    for part in parts:
                        cut.update(part)
                    offset += n
                return results, (size, digest, cut.finish())
            logger.warning("%s is unchanged but was written, not carried over: %s", path, reason)
            self.carried[name] = ("write", size)
        results = []
        with DataFile(
            create_new(path), None, self.sync_files, blocks=carry.algorithm, hash_at_write=self.reuses_item_memory
        ) as out:
            for item, parts in encoded:
                offset = out.pos
                out.item(sum(memoryview(p).nbytes for p in parts))
                for part in parts:
                    out.write(part)
                results.append(self._result(item, name, offset, out.pos - offset))
            out.sync(self.sync_files)
        return results, (out.pos, digest, out.blocks())

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's ``finish`` (``.metadata.tmp``, fsync, rename), with the metadata made compact,
        hashed as it is written (a part of its own) and remembered for the commit check."""
        self.last_metadata = None
        if not self._own_encoding():
            super().finish(metadata, results)
            return
        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

        from .fast_save import compact_metadata

        compact_metadata(metadata)  # once per Metadata: a planned one already is
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_data = {wr.index: wr.storage_data for rs in results for wr in rs}
        metadata.storage_meta = self.storage_meta()
        self._publish(metadata, pickle_metadata(metadata))  # pickle.dumps's bytes, faster

    def finish_reused(self, metadata: Metadata, previous: MetadataFile) -> bool:
        """``finish`` for a save whose ``metadata`` and write results are those ``previous`` was
        written for (a cached plan, every rank's results equal): ``previous``'s bytes with this
        save's ``storage_meta``, instead of pickling the whole ``Metadata`` again (1.2 s for
        the 19 MB of 1,024 ranks x 200 tensors). ``False`` (nothing written) where the bytes
        cannot be patched; the caller then runs ``finish``."""
        if not self._own_encoding():
            return False
        storage_meta = self.storage_meta()
        data = previous.patched(storage_meta)
        if data is None:
            return False
        metadata.storage_meta = storage_meta
        self._publish(metadata, data)
        return True

    def _publish(self, metadata: Metadata, data: bytes) -> None:
        """Write ``.metadata`` and its compact index (each: temporary file, fsync, rename), their
        digest part, and remember the metadata."""
        self.last_metadata = MetadataFile(data, metadata.storage_meta)
        folder = os.fspath(self.path)
        files = {METADATA_FILE: data}
        index = encode_index(metadata, data)
        if index is not None:
            files[METADATA_INDEX_FILE] = index
        for name, content in files.items():
            final, tmp = os.path.join(folder, name), os.path.join(folder, f"{name}.tmp")
            with open(tmp, "wb") as f:
                f.write(content)
                if self.sync_files:
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        algorithm = getattr(self, "_checksum", None)
        if algorithm is not None and new_hasher(algorithm) is not None:
            write_part(folder, "metadata", algorithm, {n: (len(b), hash_bytes(b, algorithm)) for n, b in files.items()})
        remember_metadata(folder, metadata)

    @staticmethod
    def _result(item: WriteItem, name: str, offset: int, length: int) -> WriteResult:
        return WriteResult(index=item.index, size_in_bytes=length, storage_data=storage_info(name, offset, length))


def _dcp_order(items: list[WriteItem]) -> list[WriteItem]:
    """A file's items in the order DCP writes them: the values first, then the tensors."""
    return [i for i in items if i.type == WriteItemType.BYTE_IO] + [i for i in items if i.type != WriteItemType.BYTE_IO]


def _encode(data: Any, hasher: Any = None) -> list[Any]:
    """The buffers an item's bytes in the file are made of: a value's pickle, or a tensor's
    (:func:`_tensor_parts`); with ``hasher``, hashed into it as they are made."""
    if not isinstance(data, io.BytesIO):
        assert isinstance(data, torch.Tensor)
        return _tensor_parts(data.detach(), hasher)
    if hasher is not None:
        hasher.update(data.getbuffer())
    return [data.getbuffer()]


#: Tensors up to this size are copied into a ``bytes`` object to be written; larger ones are
#: written from their own memory.
_COPY_MAX = 64 << 10


def _body(dense: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor: a copy for a small one (a memory copy costs about a
    fifth of building a NumPy view of a tensor of a few bytes), a view of its memory otherwise."""
    nbytes = dense.numel() * dense.element_size()
    if nbytes <= _COPY_MAX:
        return ctypes.string_at(dense.data_ptr(), nbytes)
    return dense.reshape(-1).view(torch.uint8).numpy().data


def _tensor_parts(tensor: torch.Tensor, hasher: Any = None) -> list[Any]:
    """A tensor item's bytes: the archive's header, the tensor's own memory and its trailer, or
    (what DCP does for every item) ``torch.save`` of a compact CPU copy.

    With ``hasher``, the bytes are hashed into it as they are made, and the archive's
    serialization id is the digest of everything before it instead of a fresh one, so equal
    content gives equal bytes (what an incremental save compares)."""
    dense = _dense(tensor)
    parts = None if dense is None else tensor_archive(dense.dtype, tuple(dense.shape), b"" if hasher else None)
    if dense is None or parts is None:
        cpu = tensor.cpu()
        if cpu.untyped_storage().size() != cpu.numel() * cpu.itemsize:
            cpu = cpu.clone()
        buf = io.BytesIO()
        torch.save(cpu, buf)
        if hasher is not None:
            hasher.update(buf.getbuffer())
        return [buf.getbuffer()]
    body = [_body(dense)] if parts.nbytes else []
    if hasher is None:
        return [parts.head, *body, parts.tail]
    for part in (parts.head, *body):
        hasher.update(part)
    serial = f"{int(hasher.hexdigest(), 16):040d}"[-40:].encode()
    archive = tensor_archive(dense.dtype, tuple(dense.shape), serial)
    assert archive is not None
    hasher.update(archive.tail)
    return [archive.head, *body, archive.tail]


def write_result(component: str, total_bytes: int, writer: Any, seconds: float) -> ComponentWritten:
    """The ``write`` hook's result for a component ``writer`` saved: this rank's bytes written
    (files it carried over not counted) and carried over. ``total_bytes``, the save's total as
    DCP counts it, serves where the writer cannot tell its own (DCP's own writer ran)."""
    own = writer.bytes_out if isinstance(writer, FastFileSystemWriter) else None
    reused: int = 0
    how: CarriedBy = "off"
    if own is not None:
        reused, how = writer.carried_summary()
    return ComponentWritten(
        component=component,
        bytes_written=(own if own is not None else total_bytes) - reused,
        seconds=seconds,
        bytes_reused=reused,
        carried_by=how,
    )
