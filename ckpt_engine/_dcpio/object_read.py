"""A DCP ``StorageReader`` for checkpoints in an object store (any :class:`~ckpt_engine._storage.store.FsspecStore`).

Nothing is downloaded whole. Each read item is fetched with HTTP range requests:

* an item this rank needs whole, or mostly (a load into the same sharding), is fetched as its
  stored byte range; adjacent items of a file share one request of up to ``part_size`` bytes.
  A tensor's bytes are copied from the response straight into the destination (the archive's
  headers are parsed, as the local reader does); anything else (non-tensor values, casts,
  non-contiguous boxes) is decoded as DCP decodes it (``torch.load(weights_only=True)``);
* a large tensor item this rank needs less than half of (a resharded load) costs two small
  requests for the archive's headers, then exactly the bytes of the rows it needs, in
  ``part_size`` pieces copied straight into the destination.

Requests run ``max_concurrency`` at a time, in batches of at most ``max_concurrency x part_size``
bytes, which bounds the memory a load holds in flight. Decoding errors are the local reader's
typed errors, naming the object.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint import StorageReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._format.metadata import _read_error, read_metadata
from .._format.names import METADATA_FILE
from .._format.verify import FileBlocks, check_read, keys_in, whole_files_to_check
from .._storage.store import FsspecStore, Store
from ..errors import CheckpointLoadError, CkptEngineError, CorruptCheckpointError
from .fast_read import _byte_view, gc_paused
from .torch_save_archive import PREFETCH, ArchiveItem, SavedTensorLayout, contiguous_region, parse_torch_save_tensor_at

__all__ = ["ObjectStoreReader", "fill_item", "mostly_unneeded", "reader_for"]


def reader_for(
    path: str, store: Store, metadata: Metadata | None, local: Callable[[str, Metadata | None], StorageReader]
) -> StorageReader:
    """The DCP reader of the component folder ``path``: ``local(path, metadata)`` where the store
    holds local files, an :class:`ObjectStoreReader` (ranged, parallel requests) otherwise."""
    if store.capabilities.local_files:
        return local(path, metadata)
    assert isinstance(store, FsspecStore), store  # the one store of remote files
    return ObjectStoreReader(path, store, metadata)


#: Tensor items at least this big, of which a rank needs less than :data:`_RANGED_FRACTION`, are
#: read by ranges (headers first, then only the needed rows).
_RANGED_MIN = 1 << 20
_RANGED_FRACTION = 0.5
#: Adjacent items closer than this are fetched by one request.
_COALESCE_GAP = 1 << 20


@dataclass
class _Piece:
    """``end - start`` bytes of ``path``; when fetched, ``sink(data)`` consumes them."""

    path: str
    start: int
    end: int
    sink: Callable[[bytes], None]


def _narrow(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset != 0 or length != tensor.size(dim):
            tensor = tensor.narrow(dim, offset, length)
    return tensor


class ObjectStoreReader(StorageReader):
    """Reads the DCP checkpoint at ``url`` (one component folder) through ``store``."""

    def __init__(self, url: str, store: FsspecStore, metadata: Metadata | None = None) -> None:
        super().__init__()
        self.path = url.rstrip("/")
        self.store = store
        self._metadata = metadata
        self.storage_data: dict[Any, Any] = {}
        self.load_id = ""
        #: Bytes fetched by the last :meth:`read_data` (for tests and benchmarks).
        self.bytes_fetched = 0
        #: The per-block digests of the data files, by file name (``verify: read``; see
        #: :mod:`ckpt_engine._format.verify`): every byte fetched from them is checked.
        self.blocks: Mapping[str, FileBlocks] = {}
        self._whole_checked: set[str] = set()

    # -- StorageReader protocol -------------------------------------------------------------

    def reset(self, checkpoint_id: Any = None) -> None:
        if checkpoint_id is not None:
            self.path = str(checkpoint_id).rstrip("/")

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return "://" in str(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self._metadata if self._metadata is not None else read_metadata(self.path, self.store)
        self._metadata = md
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = dict(metadata.storage_data or {})

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @property
    def checkpoint_id(self) -> str:
        return self.path

    # -- reading ------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with gc_paused():
            self.bytes_fetched = 0
            self.check_whole_files(plan.items)
            by_item: dict[tuple[str, int, int], list[ReadItem]] = {}
            for req in plan.items:
                info = self.storage_data[req.storage_index]
                rel = info.relative_path
                if not isinstance(rel, str) or not rel or "/" in rel or "\\" in rel or rel.startswith("."):
                    raise CorruptCheckpointError(
                        f"{self.store.join(self.path, METADATA_FILE)} names data file {rel!r} outside its folder; "
                        "refusing to read it (the metadata may have been tampered with)"
                    )
                if info.transform_descriptors:
                    raise CheckpointLoadError(
                        f"{self.store.join(self.path, info.relative_path)}: {req.storage_index.fqn!r} is stored with "
                        f"the stream transforms {list(info.transform_descriptors)} (e.g. zstd), which the object "
                        "store reader does not decode; copy the checkpoint to a local folder to load it"
                    )
                by_item.setdefault((info.relative_path, int(info.offset), int(info.length)), []).append(req)
            ranged = {k: v for k, v in by_item.items() if k[2] >= _RANGED_MIN and self._mostly_unneeded(v)}
            whole = {k: v for k, v in by_item.items() if k not in ranged}
            whole.update(self._read_ranged(ranged, planner))
            self._read_whole(whole, planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _mostly_unneeded(self, reqs: list[ReadItem]) -> bool:
        return mostly_unneeded(self._metadata, reqs)

    @property
    def bytes_read(self) -> int:
        """Bytes the last :meth:`read_data` fetched."""
        return self.bytes_fetched

    def read_stored(self, ranges: list[tuple[str, int, int]], out: memoryview) -> None:
        """The stored bytes of ``ranges`` (``(data file, offset, length)``), one after the other,
        into ``out``: adjacent ranges of a file fetched together, in requests of at most
        ``part_size`` bytes, ``max_concurrency`` at a time."""
        merged: list[tuple[str, int, int]] = []
        for rel, offset, length in ranges:
            if merged and merged[-1][0] == rel and merged[-1][1] + merged[-1][2] == offset:
                merged[-1] = (rel, merged[-1][1], merged[-1][2] + length)
            else:
                merged.append((rel, offset, length))
        pieces, at = [], 0
        for rel, offset, length in merged:
            url = self._url(rel)
            for off in range(0, length, self.store.part_size):
                n = min(self.store.part_size, length - off)

                def put(data: bytes, o: int = at + off) -> None:
                    out[o : o + len(data)] = data

                pieces.append(_Piece(url, offset + off, offset + off + n, put))
            at += length
        self._fetch(pieces)
        at = 0
        for rel, offset, length in ranges:
            self._check(rel, [(offset, offset + length)], [(offset, out[at : at + length])])
            at += length

    def _url(self, rel: str) -> str:
        return self.store.join(self.path, rel)

    def check_whole_files(self, items: list[ReadItem]) -> None:
        """Check, by fetching each once, the objects with a whole-file digest only that a load of
        ``items`` reads at least half of (:func:`~.._format.verify.whole_files_to_check`), before
        any item is read; an object checked once is not checked again by this reader."""
        if any(b.whole_only for b in self.blocks.values()):
            infos = [
                (i.relative_path, int(i.offset), int(i.length))
                for i in map(self.storage_data.get, (r.storage_index for r in items))
                if i is not None
            ]
            for rel, b in whole_files_to_check(self.blocks, infos):
                if rel not in self._whole_checked:
                    self._check(rel, [(0, b.starts[-1])], [], whole=True)
                    self._whole_checked.add(rel)

    def _check(
        self, rel: str, spans: list[tuple[int, int]], pieces: list[tuple[int, Any]], *, whole: bool = False
    ) -> None:
        """Check the blocks of ``rel`` holding ``spans`` (fetched: ``pieces``; the rest of a block
        is fetched now) against their digests, where the manifest records them per block (a
        whole-file digest only with ``whole``: :meth:`check_whole_files`)."""
        blocks = self.blocks.get(rel)
        if blocks is None or blocks.whole_only != whole:
            return
        url = self._url(rel)

        def fetch(offset: int, n: int) -> bytes:
            self.bytes_fetched += n
            return self.store.read_range(url, offset, offset + n)

        check_read(blocks, spans, pieces, fetch, keys_in(self.storage_data, rel))

    def _fetch(self, pieces: list[_Piece]) -> None:
        """Fetch ``pieces`` in batches of at most ``max_concurrency x part_size`` bytes."""
        budget = self.store.max_concurrency * self.store.part_size
        batch: list[_Piece] = []
        held = 0
        for piece in [*pieces, None]:
            if piece is not None and (not batch or held + piece.end - piece.start <= budget):
                batch.append(piece)
                held += piece.end - piece.start
                continue
            if batch:
                datas = self.store.read_ranges([(p.path, p.start, p.end) for p in batch])
                for p, data in zip(batch, datas, strict=True):
                    if len(data) != p.end - p.start:
                        raise CheckpointLoadError(
                            f"{p.path} is truncated: bytes {p.start}-{p.end} asked for, {len(data)} returned"
                        )
                    self.bytes_fetched += len(data)
                    p.sink(data)
            if piece is not None:
                batch, held = [piece], piece.end - piece.start

    def _read_ranged(
        self, items: dict[tuple[str, int, int], list[ReadItem]], planner: LoadPlanner
    ) -> dict[tuple[str, int, int], list[ReadItem]]:
        """Read large tensor items by range; returns the requests that must be read whole."""
        heads: dict[tuple[str, int, int], list[bytes]] = {k: [b"", b""] for k in items}
        pieces = []
        for key in items:
            rel, base, length = key
            url = self._url(rel)

            def keep(i: int, k: tuple[str, int, int] = key) -> Callable[[bytes], None]:
                return lambda data: heads[k].__setitem__(i, data)

            pieces.append(_Piece(url, base, base + PREFETCH, keep(0)))
            pieces.append(_Piece(url, base + length - PREFETCH, base + length, keep(1)))
        self._fetch(pieces)

        fallback: dict[tuple[str, int, int], list[ReadItem]] = {}
        reads: list[_Piece] = []
        commits: list[tuple[ReadItem, torch.Tensor]] = []
        checks: list[tuple[str, list[tuple[int, int]], list[tuple[int, Any]]]] = []
        for key, reqs in items.items():
            rel, base, length = key
            url = self._url(rel)
            head, tail = heads[key]

            def read(offset: int, n: int, url: str = url, base: int = base) -> bytes:
                return self.store.read_range(url, base + offset, base + offset + n)

            layout = parse_torch_save_tensor_at(ArchiveItem(head, tail, length, read).pread, length)
            for req in reqs:
                target = planner.resolve_tensor(req).detach()
                region = _direct_region(layout, req, target)
                if region is None or layout is None:
                    fallback.setdefault(key, []).append(req)
                    continue
                first, count = region
                esize = target.element_size()
                start = base + layout.data_offset + first * esize
                view = _byte_view(target) if count else memoryview(b"")
                step = self.store.part_size
                for off in range(0, count * esize, step):
                    n = min(step, count * esize - off)

                    def put(data: bytes, v: memoryview = view, o: int = off) -> None:
                        v[o : o + len(data)] = data

                    reads.append(_Piece(url, start + off, start + off + n, put))
                commits.append((req, target))
                tail_at, end = base + length - PREFETCH, start + count * esize
                spans = [(base, base + PREFETCH), (start, end), (tail_at, base + length)]
                checks.append((rel, spans, _held(view, start, end, (base, head), (tail_at, tail))))
        self._fetch(reads)
        for rel, spans, held in checks:
            self._check(rel, spans, held)
        for req, target in commits:
            planner.commit_tensor(req, target)
        return fallback

    def _read_whole(self, items: dict[tuple[str, int, int], list[ReadItem]], planner: LoadPlanner) -> None:
        """Fetch ``items`` as their stored byte ranges (adjacent ones together) and fill the requests."""

        def fill(key: tuple[str, int, int], data: memoryview) -> None:
            fill_item(planner, items[key], data, self._url(key[0]))

        pieces = []
        for group in _coalesce(sorted(items), self.store.part_size):
            rel, start = group[0][0], group[0][1]
            end = max(k[1] + k[2] for k in group)

            def sink(data: bytes, group: list[tuple[str, int, int]] = group, start: int = start) -> None:
                view = memoryview(data)
                self._check(group[0][0], [(k[1], k[1] + k[2]) for k in group], [(start, view)])
                for key in group:
                    fill(key, view[key[1] - start : key[1] - start + key[2]])

            pieces.append(_Piece(self._url(rel), start, end, sink))
        self._fetch(pieces)


def _held(
    view: memoryview, start: int, end: int, head: tuple[int, bytes], tail: tuple[int, bytes]
) -> list[tuple[int, Any]]:
    """What a ranged read holds of its archive, by offset: the data read into the tensor
    (``view``, bytes ``start`` to ``end``), and the archive's head and tail up to it. A block is
    hashed from the bytes that went into the tensor, never from another request's copy of them
    (the head's first 4 KiB overlap the data of a read that starts there)."""
    (base, h), (tail_at, t) = head, tail
    return [
        (start, view),
        (base, memoryview(h)[: max(0, start - base)]),
        (max(end, tail_at), memoryview(t)[max(0, end - tail_at) :]),
    ]


def _coalesce(keys: list[tuple[str, int, int]], limit: int) -> list[list[tuple[str, int, int]]]:
    """Group sorted ``(file, offset, length)`` items into runs one request can fetch: same file,
    gaps under :data:`_COALESCE_GAP`, at most ``limit`` bytes (a larger item is a run of its own)."""
    groups: list[list[tuple[str, int, int]]] = []
    for key in keys:
        if groups:
            last = groups[-1]
            start, end = last[0][1], max(k[1] + k[2] for k in last)
            if key[0] == last[0][0] and 0 <= key[1] - end < _COALESCE_GAP and key[1] + key[2] - start <= limit:
                last.append(key)
                continue
        groups.append([key])
    return groups


def _direct_region(layout: SavedTensorLayout | None, req: ReadItem, target: torch.Tensor) -> tuple[int, int] | None:
    """``(first element, count)`` to read straight into ``target``, or None if it must be decoded."""
    if (
        layout is None
        or type(target) is not torch.Tensor
        or target.device.type != "cpu"
        or target.layout != torch.strided
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
        or target.dtype != layout.dtype
        or tuple(target.shape) != tuple(req.lengths)
    ):
        return None
    region = contiguous_region(layout.size, req.storage_offsets, req.lengths)
    if region is None or math.prod(req.lengths) != region[1]:
        return None
    return region


def mostly_unneeded(metadata: Metadata | None, reqs: list[ReadItem]) -> bool:
    """Whether ``reqs`` (all of one stored item) are tensor boxes covering under half of the stored chunk."""
    if metadata is None or not all(r.type == LoadItemType.TENSOR for r in reqs):
        return False
    md = metadata.state_dict_metadata.get(reqs[0].storage_index.fqn)
    chunks = getattr(md, "chunks", None) or []
    offsets = reqs[0].storage_index.offset
    chunk = next((c for c in chunks if offsets is not None and tuple(c.offsets) == tuple(offsets)), None)
    if chunk is None:
        return False
    needed = sum(math.prod(r.lengths) for r in reqs)
    return bool(needed < _RANGED_FRACTION * math.prod(chunk.sizes))


def fill_item(planner: LoadPlanner, reqs: list[ReadItem], data: memoryview, where: str) -> None:
    """Fill the requests ``reqs`` of one stored item from its bytes ``data`` (read from ``where``,
    named by errors): a tensor's bytes are copied straight into the destination where the
    layout allows, anything else is decoded as DCP decodes it."""
    try:
        layout: SavedTensorLayout | None = None
        if any(r.type == LoadItemType.TENSOR for r in reqs):
            layout = parse_torch_save_tensor_at(lambda off, n: bytes(data[off : off + n]), len(data))
        for req in reqs:
            if req.type == LoadItemType.BYTE_IO:
                planner.load_bytes(req, io.BytesIO(data))
                continue
            target = planner.resolve_tensor(req).detach()
            region = _direct_region(layout, req, target)
            if region is not None and layout is not None:
                first, count = region
                start = layout.data_offset + first * target.element_size()
                if count:
                    _byte_view(target)[:] = data[start : start + count * target.element_size()]
            else:
                stored = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                tensor = _narrow(stored, req.storage_offsets, req.lengths)
                if target.size() != tensor.size():
                    raise CheckpointLoadError(
                        f"{where}: {req.storage_index.fqn!r} has a stored chunk of shape "
                        f"{list(tensor.size())}, the destination {list(target.size())}"
                    )
                target.copy_(tensor)
            planner.commit_tensor(req, target)
    except CkptEngineError:
        raise
    except Exception as err:
        mapped = _read_error(where, reqs, err)
        if mapped is err:
            raise
        raise mapped from err
