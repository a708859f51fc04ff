"""A DCP ``FileSystemReader`` that reads tensor bytes straight into the destination tensors.

DCP's own read path calls ``torch.load`` on every tensor item, which allocates a temporary
tensor, and then copies it into the destination: two passes over the data, a peak of one extra
item's size, and about 130-300 microseconds of unpickling per item. For the common case, an
uncompressed item without stream transforms read into a contiguous CPU destination of the same
dtype, the whole stored chunk or a contiguous range of it, :class:`FastFileSystemReader` locates
the tensor's data record inside the item's ``torch.save`` archive
(:func:`~ckpt_engine._dcpio.torch_private.parse_torch_save_tensor`) and ``preadv``-s it into the
destination's memory. Every other read item (non-tensor values, transforms such as zstd, casts,
non-contiguous destinations, DTensor sub-chunks that are not row ranges, an archive the parser
does not recognise) goes through DCP's unchanged path. The result is bit-identical either way:
both copy the stored bytes into a destination of the stored dtype. Non-tensor values are handed
to the planner as DCP's path hands them (each item's archive bytes), but read with one ``pread``
per run of small items: DCP seeks and reads each one (an optimizer's hyper-parameters are about
eleven values per parameter).

With ``verify: read`` every byte read is checked against its block's digest: a file's small
items window by window before they are handed on (:func:`~.torch_save_archive.windows`, which
also bounds the memory they hold), a large read piece by piece as it is read (:func:`_read_checked`).
"""

from __future__ import annotations

import bisect
import collections
import contextlib
import copy
import ctypes
import dataclasses
import gc
import io
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .._format.hashing import new_hasher
from .._format.metadata import SafeFileSystemReader, _read_error
from .._format.verify import FileBlocks, check_digest, check_read, keys_in, whole_files_to_check
from ..errors import CheckpointLoadError, CkptEngineError
from .torch_save_archive import (
    ArchiveItem,
    LayoutCache,
    SavedTensorLayout,
    contiguous_region,
    read_small_items,
    windows,
)

__all__ = ["FastFileSystemReader"]

#: Large reads are split over threads only when there are at least this many bytes.
_PARALLEL_MIN_BYTES = 64 << 20
#: A tensor's read of more than 1.5 times this is cut into parts of about this size (each cut where
#: a block starts) for the threads to share: a 1 GiB embedding or moment was read by one thread.
_PART = 32 << 20
#: A large read is hashed in pieces of this size, each right after it is read, while it is in the
#: core's cache: hashing a 4 MiB block after reading all of it costs 2.4x as much CPU here (xxh3 of
#: 256 MiB: 22 ms against 9, each piece read with ``preadv`` from the page cache).
_HASH_PIECE = 256 << 10


def _copy_small(target: torch.Tensor, data: bytes) -> None:
    """Copy ``data`` into the memory of ``target``, a contiguous CPU tensor of exactly that many
    bytes (checked: the copy never writes past the tensor nor reads past ``data``). A memory
    copy, about 4x cheaper than going through a NumPy view for a tensor of a few bytes."""
    if len(data) != target.numel() * target.element_size() or not target.is_contiguous() or target.is_cuda:
        raise ValueError("internal error: a direct copy into a tensor of another size")
    ctypes.memmove(target.data_ptr(), data, len(data))


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes."""
    return tensor.reshape(-1).view(torch.uint8).numpy().data.cast("B")


def _readinto(fd: int, buf: memoryview, offset: int) -> bool:
    """Fill ``buf`` from ``fd`` at ``offset``; ``False`` on a short read (a truncated file) or an
    I/O error: the item then goes through the base reader, which reports the error as a typed
    engine error naming the file."""
    done = 0
    while done < len(buf):
        try:
            n = os.preadv(fd, [buf[done:]], offset + done)
        except OSError:
            return False
        if n <= 0:
            return False
        done += n
    return True


@dataclasses.dataclass(eq=False)
class _Read:
    """One large read: ``nbytes`` at ``offset`` of the file into ``target``'s memory; ``item``:
    the archive it is part of (its headers, read first) at file offset ``base``.

    ``view`` (the target's bytes) is taken where the read is planned, on the loader's thread:
    taking it is four torch calls, each of which lets go of the GIL and takes it back, and on the
    read threads those hand-overs cost a 1 GiB verified load 14 ms (two threads, this machine)."""

    req: ReadItem
    target: torch.Tensor
    offset: int
    nbytes: int
    item: ArchiveItem | None = None
    base: int = 0
    view: memoryview = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.view = _byte_view(self.target)

    def parts(self, size: int, starts: Sequence[int] | None) -> list[_Read]:
        """This read cut into consecutive reads of about ``size`` bytes or more (or itself), for
        the threads to share one large tensor; with ``starts`` (the file's block starts) each cut
        is at one, so that every block is hashed whole by one thread."""
        end = self.offset + self.nbytes
        cuts: list[int] = []
        at = self.offset + size
        while at < end - size // 2:
            if starts is not None:
                k = bisect.bisect_left(starts, at)
                if k == len(starts) or starts[k] >= end - size // 2:
                    break
                at = starts[k]
            cuts.append(at)
            at += size
        if not cuts:
            return [self]
        out: list[_Read] = []
        lo = self.offset
        for hi in [*cuts, end]:
            part = copy.copy(self)  # the same request, target and archive: not __init__, which takes a new view
            part.offset, part.nbytes = lo, hi - lo
            part.view = self.view[lo - self.offset : hi - self.offset]
            out.append(part)
            lo = hi
        return out


def _read_checked(fd: int, r: _Read, blocks: FileBlocks, keys: Callable[[int, int], list[str]]) -> bool:
    """:func:`_readinto` of ``r`` block by block, each block hashed as it is read (in pieces of
    :data:`_HASH_PIECE`, each while it is in the core's cache) and checked against its digest
    once it is whole; ``False`` on a short read or an I/O error. The loop runs once per piece on
    two threads that share the GIL between their system calls, so it calls ``preadv`` itself
    (:func:`_readinto` only finishes a short read)."""
    view, base = r.view, r.offset
    end = base + r.nbytes
    at = base
    starts, preadv = blocks.starts, os.preadv
    try:
        for b in blocks.touched(((base, end),)):
            lo, hi = starts[b], starts[b + 1]
            hasher = new_hasher(blocks.algorithm)
            assert hasher is not None  # component_blocks gives no blocks for an algorithm not here
            update = hasher.update
            if lo < at:  # the archive's header, before the data
                update(_stored(fd, r, lo, at))
            stop = min(hi, end)
            while at < stop:
                piece = view[at - base : min(stop, at + _HASH_PIECE) - base]
                got = preadv(fd, (piece,), at)
                if got != len(piece) and (got <= 0 or not _readinto(fd, piece[got:], at + got)):
                    return False
                update(piece)
                at += len(piece)
            if hi > stop:  # the archive's tail, after the data
                update(_stored(fd, r, stop, hi))
            check_digest(blocks, b, hasher, keys)
    except OSError:
        return False
    return at >= end or _readinto(fd, view[at - base :], at)  # past the recorded blocks: sizes say


def _unread_headers(r: _Read, blocks: FileBlocks) -> list[tuple[int, int]]:
    """The bytes of ``r``'s archive its layout was parsed from (the head and tail read up front)
    that lie in a block ``r``'s data does not touch: a read of some rows of a large tensor. They
    decide where the data is read from, so their blocks are checked before it is read."""
    item = r.item
    if item is None:
        return []
    starts = blocks.starts
    first = bisect.bisect_right(starts, r.offset) - 1
    last = bisect.bisect_right(starts, r.offset + r.nbytes - 1) - 1
    ends = ((r.base, r.base + len(item.head)), (r.base + item.tail_start, r.base + item.length))
    return [
        (lo, hi)
        for lo, hi in ends
        if bisect.bisect_right(starts, lo) - 1 < first or bisect.bisect_right(starts, hi - 1) - 1 > last
    ]


def _stored(fd: int, r: _Read, start: int, end: int) -> bytes:
    """Bytes ``start`` to ``end`` of the file around ``r``'s data: inside its archive through
    :meth:`ArchiveItem.pread` (the head or tail read up front where they hold them), else read
    (a short read leaves the digest wrong)."""
    item = r.item
    if item is not None and r.base <= start and end <= r.base + item.length:
        return item.pread(start - r.base, end - start)
    return os.pread(fd, end - start, start)


def _pread(fd: int) -> Callable[[int, int], bytes]:
    return lambda offset, n: os.pread(fd, n, offset)


class _Shares:
    """One file's reads (each ``(read, part)``) shared by ``count`` threads: each thread starts on
    its own contiguous share of the file, of about equal bytes, and takes its reads one at a time;
    a thread done with its share takes the last read left of another's (:meth:`take`).

    So a thread that stalls (a page slow to arrive from a network filesystem, a vCPU the host
    deschedules) holds up no read but its current one; with fixed shares the load waited for the
    stalled thread's whole share. The shares start contiguous for a cold cache: two sequential
    streams far apart (reads taken in turn from one front were 3-8 % slower cold on disk). On this
    machine, hot or cold, stealing moved no mean beyond the spread (``reader_ab_bench.py``)."""

    def __init__(self, units: list[tuple[_Read, _Read]], count: int) -> None:
        self.count = count
        self._shares: list[collections.deque[tuple[_Read, _Read]]] = [collections.deque() for _ in range(count)]
        total, acc = sum(part.nbytes for _, part in units), 0
        for unit in units:
            self._shares[min(count - 1, acc * count // total)].append(unit)
            acc += unit[1].nbytes

    def take(self, k: int) -> tuple[_Read, _Read] | None:
        """Thread ``k``'s next read, or ``None`` when none is left (a deque's pops are atomic)."""
        try:
            return self._shares[k].popleft()
        except IndexError:
            pass
        for other in self._shares[k + 1 :] + self._shares[:k]:
            try:
                return other.pop()
            except IndexError:
                continue
        return None

    def clear(self) -> None:
        for share in self._shares:
            share.clear()


def _run_reads(
    fd: int, reads: list[_Read], threads: int, blocks: FileBlocks | None = None, keys: Any = None
) -> list[_Read]:
    """Do the reads (offset order), on up to ``threads`` threads when there is enough to share
    (:class:`_Shares`; a large tensor's read cut into parts, :meth:`_Read.parts`); returns the
    reads that came back short (a truncated file), in offset order. With ``blocks`` (recorded
    per block), each block is checked as it is read."""

    def one(r: _Read) -> bool:
        if blocks is not None and not blocks.whole_only:
            return _read_checked(fd, r, blocks, keys)
        return _readinto(fd, r.view, r.offset)

    if threads <= 1 or sum(r.nbytes for r in reads) < _PARALLEL_MIN_BYTES:
        return [r for r in reads if not one(r)]
    starts = None if blocks is None or blocks.whole_only else blocks.starts
    units = [(r, part) for r in reads for part in r.parts(_PART, starts)]
    if len(units) < 2:
        return [r for r in reads if not one(r)]
    shares = _Shares(units, min(threads, len(units)))
    failed: dict[int, _Read] = {}

    def run(k: int) -> None:
        while (got := shares.take(k)) is not None:
            r, part = got
            try:
                ok = one(part)
            except BaseException:
                shares.clear()  # a damaged block: the other threads stop after their current read
                raise
            if not ok:
                failed[id(r)] = r

    with ThreadPoolExecutor(shares.count, thread_name_prefix="ckpt-read") as pool:
        for done in [pool.submit(run, k) for k in range(shares.count)]:
            done.result()
    return sorted(failed.values(), key=lambda r: r.offset)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside: a save or a load allocates few cycles but many
    objects, and a full collection walks every object of a big state dict (about 40% of a load
    and 30% of a save with 10k small tensors). Also a decorator (``@gc_paused()``)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@dataclasses.dataclass
class FastReadStats:
    """What the last :meth:`FastFileSystemReader.read_data` did (for tests and benchmarks)."""

    direct: int = 0
    #: Non-tensor values read by the direct path (their archive bytes with one ``pread`` per run).
    values: int = 0
    fallback: int = 0
    direct_bytes: int = 0
    #: Bytes read from the data files: archive headers and tensor data of the direct path, whole
    #: items of DCP's path.
    bytes_read: int = 0


class FastFileSystemReader(SafeFileSystemReader):
    """:class:`SafeFileSystemReader` plus the direct tensor read path described above."""

    def __init__(self, path: str | os.PathLike[str], metadata: Any = None, *, direct: bool | None = None) -> None:
        super().__init__(path, metadata)
        #: ``False`` sends every item through DCP's own path; by default the direct path is on
        #: unless the environment variable ``CKPT_ENGINE_DIRECT_READ`` is ``0``.
        self.direct = os.environ.get("CKPT_ENGINE_DIRECT_READ", "1") != "0" if direct is None else direct
        #: Threads for large reads (``CKPT_ENGINE_READ_THREADS``; default: up to 4, one per CPU).
        self.threads = int(os.environ.get("CKPT_ENGINE_READ_THREADS", "0")) or min(4, os.cpu_count() or 1)
        self.stats = FastReadStats()
        #: Archive layouts seen by this reader (see :class:`LayoutCache`).
        self.layouts = LayoutCache()
        #: The per-block digests of this component's data files, by file name (the loader sets
        #: them: ``verify: read``); every byte read from a file named here is checked.
        self.blocks: Mapping[str, FileBlocks] = {}
        self._whole_checked: set[str] = set()

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        with gc_paused():
            return self._read_data(plan, planner)

    def _read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.stats = FastReadStats()
        self.check_whole_files(plan.items)
        slow: list[ReadItem] = []
        per_file: dict[str, list[tuple[Any, ReadItem]]] = {}
        values: dict[str, list[tuple[Any, ReadItem]]] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if not self.direct or info.transform_descriptors:
                slow.append(req)
            elif req.type == LoadItemType.TENSOR:
                per_file.setdefault(info.relative_path, []).append((info, req))
            else:
                values.setdefault(info.relative_path, []).append((info, req))
        for relative_path, entries in values.items():
            slow += self._read_values(relative_path, entries, planner)
        for relative_path, entries in per_file.items():
            entries.sort(key=lambda e: e[0].offset)  # sequential reads
            try:
                fd = os.open(os.path.join(os.fspath(self.path), relative_path), os.O_RDONLY)
            except OSError:  # DCP's path raises (and the base reader reports) the error
                slow += [req for _, req in entries]
                continue
            try:
                slow += self._read_file(fd, relative_path, entries, planner)
            except CkptEngineError:
                raise
            except Exception as err:
                # A damaged archive can fail its parse in any way: the blocks say whether it is damaged.
                self._check_spans(fd, relative_path, [(info.offset, info.offset + info.length) for info, _ in entries])
                mapped = _read_error(os.path.join(os.fspath(self.path), relative_path), [r for _, r in entries], err)
                if mapped is err:
                    raise
                raise mapped from err
            finally:
                os.close(fd)
        self._check_items(slow)  # DCP's path reads them: checked first, by reading them once more
        self.stats.fallback = len(slow)
        # DCP's path reads each item it is asked for whole (one slice of the file per item)
        self.stats.bytes_read += sum(
            int(length) for length in {(i.relative_path, i.offset): i.length for i in map(self._info, slow)}.values()
        )
        if slow:
            return super().read_data(dataclasses.replace(plan, items=slow), planner)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(
        self, fd: int, rel: str, entries: list[tuple[Any, ReadItem]], planner: LoadPlanner
    ) -> list[ReadItem]:
        """Read the tensor items ``entries`` of data file ``rel`` (open as ``fd``) by the direct
        path, checked against the file's blocks before any is committed; returns the items
        left to DCP's path."""
        slow: list[ReadItem] = []
        if hasattr(os, "posix_fadvise"):
            # Ask for the whole span these items cover up front: the archive headers are parsed
            # before any data is read; on a cold cache those small reads would each wait.
            first = entries[0][0].offset
            end = max(info.offset + info.length for info, _ in entries)
            os.posix_fadvise(fd, first, end - first, os.POSIX_FADV_WILLNEED)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        blocks = self._blocks(rel)  # the small items are read, checked and handed on window by window
        checked: set[int] = set()  # blocks checked so far
        reads: list[_Read] = []
        for window in windows(entries, None if blocks is None else blocks.starts):
            layouts: dict[int, tuple[ArchiveItem, SavedTensorLayout | None]] = {}
            ready: list[tuple[ReadItem, torch.Tensor]] = []
            queued = len(reads)
            small = read_small_items(fd, sorted({(info.offset, info.length) for info, _ in window}))
            for info, req in window:
                if not self._plan_direct(fd, info, req, planner, layouts, ready, reads, small):
                    slow.append(req)
            self.stats.bytes_read += sum(it.prefetched for it, _ in layouts.values())
            if blocks is not None:
                self._check_direct(fd, rel, blocks, small, layouts, [req for req, _ in ready], reads[queued:], checked)
            self._commit(planner, ready)
        failed = _run_reads(fd, reads, self.threads, blocks, keys_in(self.storage_data, rel))
        slow += [r.req for r in failed]
        done_reads = [r for r in reads if r not in failed]
        self.stats.bytes_read += sum(r.nbytes for r in done_reads)
        self._commit(planner, [(r.req, r.target) for r in done_reads])
        return slow

    def _commit(self, planner: LoadPlanner, done: list[tuple[ReadItem, torch.Tensor]]) -> None:
        """Hand the tensors read (and checked) on to the planner."""
        for req, target in done:
            planner.commit_tensor(req, target)
            self.stats.direct += 1
            self.stats.direct_bytes += target.numel() * target.element_size()

    def _check_direct(
        self,
        fd: int,
        rel: str,
        blocks: FileBlocks,
        small: dict[int, bytes],
        layouts: dict[int, tuple[ArchiveItem, SavedTensorLayout | None]],
        whole: list[ReadItem],
        reads: list[_Read],
        checked: set[int],
    ) -> None:
        """Check what the direct path read of ``rel`` that :func:`_run_reads` does not check as it
        reads: the items copied whole (``whole``) and the archive headers the layouts of ``reads``
        were parsed from, where a read's data misses their blocks (:func:`_unread_headers`).
        ``checked``: the blocks checked already (updated)."""
        spans = [(i.offset, i.offset + i.length) for i in map(self._info, whole)]
        spans += [span for r in reads for span in _unread_headers(r, blocks)]
        pieces: list[tuple[int, Any]] = list(small.items())
        pieces += [(offset, it.head) for offset, (it, _) in layouts.items()]
        pieces += [(offset + it.tail_start, it.tail) for offset, (it, _) in layouts.items() if not it.whole]
        check_read(blocks, spans, pieces, _pread(fd), keys_in(self.storage_data, rel), checked)

    def _blocks(self, rel: str) -> FileBlocks | None:
        """``rel``'s per-block digests, which the reads check as they go (``None`` for a
        whole-file digest: :meth:`check_whole_files` checks those before anything is read)."""
        blocks = self.blocks.get(rel)
        return None if blocks is None or blocks.whole_only else blocks

    def check_whole_files(self, items: list[ReadItem]) -> None:
        """Check, by reading each once, the files with a whole-file digest only that a load of
        ``items`` reads at least half of (:func:`~.._format.verify.whole_files_to_check`), before
        any item is read; a file checked once is not checked again by this reader."""
        if any(b.whole_only for b in self.blocks.values()):
            infos = [(i.relative_path, i.offset, i.length) for i in map(self._info, items)]
            todo = [(rel, b) for rel, b in whole_files_to_check(self.blocks, infos) if rel not in self._whole_checked]
            self._check_files([(rel, b, [(0, b.starts[-1])]) for rel, b in todo])
            self._whole_checked.update(rel for rel, _ in todo)

    def _check_spans(self, fd: int, rel: str, spans: list[tuple[int, int]]) -> None:
        """Check the blocks of ``rel`` holding ``spans`` by reading them (where it has blocks)."""
        blocks = self._blocks(rel)
        if blocks is not None:
            check_read(blocks, spans, [], _pread(fd), keys_in(self.storage_data, rel))

    def _check_items(self, items: list[ReadItem]) -> None:
        """Check the blocks holding ``items`` (left to DCP's path) by reading them once more."""
        per_file: dict[str, list[tuple[int, int]]] = {}
        for info in map(self._info, items):
            per_file.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length))
        self._check_files([(rel, b, spans) for rel, spans in per_file.items() if (b := self._blocks(rel)) is not None])

    def _check_files(self, files: list[tuple[str, FileBlocks, list[tuple[int, int]]]]) -> None:
        """Check the blocks holding each file's spans by reading them."""
        for rel, blocks, spans in files:
            with contextlib.suppress(OSError):  # one that cannot be opened: DCP's path reports it
                fd = os.open(os.path.join(os.fspath(self.path), rel), os.O_RDONLY)
                try:
                    check_read(blocks, spans, [], _pread(fd), keys_in(self.storage_data, rel))
                finally:
                    os.close(fd)

    def _read_values(self, rel: str, entries: list[tuple[Any, ReadItem]], planner: LoadPlanner) -> list[ReadItem]:
        """Hand the non-tensor values of data file ``rel`` to ``planner.load_bytes`` as DCP's path does
        (each item's archive bytes), read with one ``pread`` per run of small items, not one per item;
        returns the items left to DCP's path (large ones; all when the file cannot be opened)."""
        try:
            fd = os.open(os.path.join(os.fspath(self.path), rel), os.O_RDONLY)
        except OSError:
            return [req for _, req in entries]
        try:
            small = read_small_items(fd, sorted({(info.offset, info.length) for info, _ in entries}))
            spans = [(o, o + len(d)) for o, d in small.items()]
            blocks = self._blocks(rel)
            if blocks is not None:  # before anything is unpickled
                check_read(blocks, spans, list(small.items()), _pread(fd), keys_in(self.storage_data, rel))
        finally:
            os.close(fd)
        left: list[ReadItem] = []
        read: set[int] = set()
        for info, req in entries:
            data = small.get(info.offset)
            if data is None or len(data) != info.length:
                left.append(req)
                continue
            try:  # naming_errors' handling, without a context manager a value
                planner.load_bytes(req, io.BytesIO(data))
            except Exception:
                with self.naming_errors(rel, [req]):
                    raise
            read.add(info.offset)
        self.stats.values += len(entries) - len(left)
        self.stats.bytes_read += sum(len(small[offset]) for offset in read)
        return left

    def _info(self, req: ReadItem) -> Any:
        return self.storage_data[req.storage_index]

    @property
    def bytes_read(self) -> int:
        """Bytes of data files the last :meth:`read_data` read."""
        return self.stats.bytes_read

    def read_stored(self, ranges: list[tuple[str, int, int]], out: memoryview) -> None:
        """The stored bytes of ``ranges`` (``(data file, offset, length)``), one after the other, into ``out``."""
        fds: dict[str, int] = {}
        try:
            at = 0
            for rel, offset, length in ranges:
                path = os.path.join(os.fspath(self.path), rel)
                if rel not in fds:
                    try:
                        fds[rel] = os.open(path, os.O_RDONLY)
                    except OSError as err:
                        raise CheckpointLoadError(f"cannot read {path}: {err.strerror or err}") from err
                if not _readinto(fds[rel], out[at : at + length], offset):
                    raise CheckpointLoadError(
                        f"cannot read bytes {offset}-{offset + length} of {path}: the file is truncated or unreadable"
                    )
                blocks = self._blocks(rel)  # a whole-file digest: checked before (check_whole_files)
                if blocks is not None:
                    pieces = [(offset, out[at : at + length])]
                    check_read(
                        blocks, [(offset, offset + length)], pieces, _pread(fds[rel]), keys_in(self.storage_data, rel)
                    )
                at += length
        finally:
            for fd in fds.values():
                os.close(fd)

    def _plan_direct(
        self,
        fd: int,
        info: Any,
        req: ReadItem,
        planner: LoadPlanner,
        layouts: dict[int, tuple[ArchiveItem, SavedTensorLayout | None]],
        ready: list[tuple[ReadItem, torch.Tensor]],
        reads: list[_Read],
        small: dict[int, bytes],
    ) -> bool:
        """Check one read item; copy a small one now (``ready``), queue a large one (``reads``)."""
        target = planner.resolve_tensor(req).detach()
        if (
            type(target) is not torch.Tensor
            or not target.is_cpu
            or target.layout != torch.strided
            or not target.is_contiguous()
            or target.is_conj()
            or target.is_neg()
            or target.shape != req.lengths  # two torch.Size
        ):
            return False
        cached = layouts.get(info.offset)
        if cached is None:
            item = ArchiveItem.from_fd(fd, info.offset, info.length, small.get(info.offset))
            cached = layouts[info.offset] = (item, self.layouts.layout(item))
        item, layout = cached
        if layout is None or layout.dtype != target.dtype:
            return False
        region = contiguous_region(layout.size, req.storage_offsets, req.lengths)
        if region is None:
            return False
        first, count = region
        nbytes = count * target.element_size()
        start = layout.data_offset + first * target.element_size()
        if nbytes and item.whole:
            data = item.head[start : start + nbytes]
            if len(data) != nbytes:  # the archive names data past its end: DCP's path reports it
                return False
            _copy_small(target, data)
        elif nbytes:
            reads.append(_Read(req, target, info.offset + start, nbytes, item, info.offset))
            return True
        ready.append((req, target))
        return True
