"""A checkpoint data file written front to back: hashed as it is written, handed to the disk as it is written.

The engine's storage writer (``_dcpio/fast_write.py``) writes each data file in one pass, as a sequence of
parts (archive headers, tensors' own memory, values' pickles), and the manifest needs each file's
checksum. :class:`DataFile` does both ends of that pass without reading anything twice:

* **the checksum** is computed on a helper thread while the writer writes (:class:`_BackgroundHash`),
  where the process may use a second CPU; else each megabyte is hashed right before it is
  written, while it is in the CPU's cache;
* **the blocks**: the same bytes are hashed once more in *blocks* (:class:`BlockHasher`): each
  item larger than :data:`SMALL_ITEM` in pieces of at most :data:`BLOCK_MAX` of its own, runs of
  smaller items together up to :data:`BLOCK_RUN`. The manifest records each block's length and
  digest, so a load checks exactly the blocks it reads (``_dcpio/fast_read.py``);
* **the disk** gets each finished 16 MiB of a file that will be fsynced while the next ones are
  produced (:class:`_Writeback`), so the ``fsync`` at the end waits for the last range only.
"""

from __future__ import annotations

import ctypes
import os
import queue
import sys
import threading
from typing import Any, BinaryIO

from .hashing import new_hasher

__all__ = ["BLOCK_MAX", "BLOCK_RUN", "SMALL_ITEM", "BlockHasher", "DataFile"]

#: An item at most this big is read whole by a load (with its neighbours): it shares a block.
SMALL_ITEM = 8 << 10
#: A block of small items is closed at the next item boundary once it holds this many bytes.
BLOCK_RUN = 1 << 20
#: A larger item's blocks hold at most this many bytes each (a ranged read checks whole blocks).
BLOCK_MAX = 4 << 20


class BlockHasher:
    """Digests of a file's bytes in blocks cut at item boundaries (see the module docstring).

    The writer announces each item (:meth:`item`: its offset and size) before its bytes are
    hashed; :meth:`update` may run on another thread, later, but in file order: the cuts an item
    adds all lie at or after the bytes hashed before it was announced."""

    def __init__(self, algorithm: str) -> None:
        self._algorithm = algorithm
        self._cuts: list[int] = []
        self._hasher = new_hasher(algorithm)
        self._pos = self._start = self._next = 0
        self.blocks: list[tuple[int, str]] = []

    def item(self, offset: int, nbytes: int) -> None:
        """An item of ``nbytes`` starts at ``offset`` of the file (writer's thread)."""
        cuts = self._cuts
        last = cuts[-1] if cuts else 0
        if nbytes > SMALL_ITEM:
            points = [offset, *range(offset + BLOCK_MAX, offset + nbytes, BLOCK_MAX), offset + nbytes]
        elif offset - last >= BLOCK_RUN:
            points = [offset]
        else:
            return
        for p in points:
            if p > last:
                cuts.append(p)  # one append each: the hashing thread reads the list as it grows
                last = p

    def update(self, data: Any) -> None:
        view = data if isinstance(data, memoryview) else memoryview(data)
        if view.ndim != 1 or view.itemsize != 1:
            view = view.cast("B")
        while len(view):
            cut = self._cuts[self._next] if self._next < len(self._cuts) else None
            if cut == self._pos:
                self._close()
                self._next += 1
                continue
            n = len(view) if cut is None else min(len(view), cut - self._pos)
            assert self._hasher is not None
            self._hasher.update(view[:n])
            self._pos += n
            view = view[n:]

    def _close(self) -> None:
        if self._pos > self._start:
            assert self._hasher is not None
            self.blocks.append((self._pos - self._start, self._hasher.hexdigest()))
            self._hasher = new_hasher(self._algorithm)
            self._start = self._pos

    def finish(self) -> list[tuple[int, str]]:
        """Every block's ``(length, hex digest)``, in file order (once every byte is hashed)."""
        self._close()
        return self.blocks


class _Both:
    """The file's hasher (if any) and its block hasher, fed the same bytes."""

    def __init__(self, file_hasher: Any, blocks: BlockHasher) -> None:
        self._file, self._blocks = file_hasher, blocks

    def update(self, data: Any, /) -> None:
        if self._file is not None:
            self._file.update(data)
        self._blocks.update(data)


#: The file object's buffer at most: a write at least this large reaches the kernel at once.
_BUFFER = 1 << 20

#: Bytes gathered before they go to the hashing thread together: small parts (archive headers,
#: values, small tensors) travel in batches of about this size, larger ones alone.
_HASH_BATCH = 1 << 20


def _spare_cpu() -> bool:
    """Whether this process may run on more than one CPU (a hashing thread then runs beside the
    writes instead of taking turns with them)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except AttributeError:  # pragma: no cover - not Linux
        return (os.cpu_count() or 1) > 1


class _BackgroundHash:
    """Hashes a file's bytes on a helper thread, in the order they are written, while the writer
    writes them.

    Both the hash (``xxhash``, ``zlib.crc32``) and the write release the GIL on large buffers, so
    with a second CPU the checksum costs the save nothing but the hand-over: one queue entry per
    megabyte or per large part. The parts are views of the tensors' memory (or small copies)
    that the caller keeps unchanged until the save returns, as it does for the write itself."""

    def __init__(self, hasher: Any) -> None:
        self._hasher = hasher
        self._queue: queue.SimpleQueue[list[Any] | None] = queue.SimpleQueue()
        self._small: list[Any] = []
        self._small_bytes = 0
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(target=self._run, name="ckpt-hash", daemon=True)
        self._thread.start()

    def add(self, data: Any, nbytes: int) -> None:
        if nbytes >= _HASH_BATCH:
            self._flush_small()
            self._queue.put([data])
            return
        self._small.append(data)
        self._small_bytes += nbytes
        if self._small_bytes >= _HASH_BATCH:
            self._flush_small()

    def _flush_small(self) -> None:
        if self._small:  # one buffer: one hash call, without the GIL, on the helper thread
            self._queue.put([self._small[0] if len(self._small) == 1 else b"".join(self._small)])
            self._small, self._small_bytes = [], 0

    def _run(self) -> None:
        update = self._hasher.update
        try:
            while (batch := self._queue.get()) is not None:
                for data in batch:
                    update(data)
        except BaseException as err:  # handed to the writer by finish()
            self._error = err
            while self._queue.get() is not None:  # drain: finish() puts the last entry
                pass

    def finish(self) -> None:
        """Wait until everything added is hashed; raises what the hashing raised."""
        if self._thread is None:
            return
        self._flush_small()
        self._queue.put(None)
        self._thread.join()
        self._thread = None
        if self._error is not None:
            raise self._error


#: Bytes written between two hand-overs of a file's finished range to the disk (16 per 256 MiB).
_WRITEBACK_BYTES = 16 << 20
#: ``<linux/fs.h>``: wait for writeback already under way, write the range, wait for it.
_WRITE_AND_WAIT = 1 | 2 | 4


def _load_sync_file_range() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - a libc without it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _load_sync_file_range()
#: Early writeback on (``benchmarks/write_path_bench.py`` turns it off to measure what it gains).
WRITEBACK = True


class _Writeback:
    """Writes a file's finished ranges to its device on a helper thread while later ones are
    produced, so that the ``fsync`` that follows the file waits only for its last range.

    Each range goes out with ``sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)``: the kernel
    writes it as data integrity writeback (``WB_SYNC_ALL``, synchronous requests, as ``fsync``
    issues them) and the call returns when the device has it. It makes nothing durable by
    itself (no metadata, no cache flush): the ``fsync`` after the file stays the call that does,
    and raises as before. A filesystem that refuses the call (``EINVAL``, ``ESPIPE``) or has no
    writeback (tmpfs: the call returns at once) costs a call per range."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._queue: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self._handed = 0
        self._thread: threading.Thread | None = None
        self._off = False

    def wrote(self, end: int) -> None:
        """The file's first ``end`` bytes are written (to the kernel)."""
        if self._off or end - self._handed < _WRITEBACK_BYTES:
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ckpt-writeback", daemon=True)
            self._thread.start()
        self._queue.put((self._handed, end - self._handed))
        self._handed = end

    def _run(self) -> None:
        call = _sync_file_range
        while (job := self._queue.get()) is not None:
            if not self._off and call(self._fd, job[0], job[1], _WRITE_AND_WAIT) != 0:
                self._off = True  # refused here: the fsync that follows writes everything

    def finish(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None


class DataFile:
    """A file written sequentially, tracking its offset and hashing what it writes (on a helper
    thread where a second CPU is there: :class:`_BackgroundHash`; else each megabyte is hashed
    right before it is written, while it is in the CPU's cache)."""

    def __init__(
        self,
        f: BinaryIO,
        algorithm: str | None,
        durable: bool = False,
        *,
        hashed_by_caller: bool = False,
        blocks: str | None = None,
        hash_at_write: bool = False,
    ) -> None:
        """``f``: the file, opened for writing (buffered by at most 1 MiB) and closed with this
        object; ``durable``: it will be fsynced once written (:meth:`sync`); ``hashed_by_caller``:
        the caller updates :attr:`hasher` with every part before it writes it (it needs the
        digest so far as it goes), so :meth:`write` only writes; ``blocks``: the algorithm of
        the per-block digests (:meth:`item` announces each item; :meth:`blocks` returns them);
        ``hash_at_write``: the caller refills a part's memory once :meth:`write` returns (staging
        windows), so each part is hashed before that, never on the helper thread."""
        self.f = f
        self.pos = 0
        self.hasher = new_hasher(algorithm) if algorithm is not None else None
        self._blocks = BlockHasher(blocks) if blocks is not None and new_hasher(blocks) is not None else None
        own = None if hashed_by_caller else self.hasher
        self._hashing: Any = own if self._blocks is None else _Both(own, self._blocks)
        behind = self._hashing is not None and _SPARE_CPU and not hash_at_write
        self._behind = _BackgroundHash(self._hashing) if behind else None
        self._writeback = _Writeback(self.f.fileno()) if durable and WRITEBACK and _sync_file_range else None

    def write(self, data: Any) -> None:
        view = data if type(data) is bytes else memoryview(data).cast("B")
        nbytes = len(view)
        if self._behind is not None:
            self._behind.add(view, nbytes)
            self.f.write(view)
        elif self._hashing is not None and nbytes > _HASH_BATCH:
            for start in range(0, nbytes, _HASH_BATCH):
                chunk = view[start : start + _HASH_BATCH]
                self._hashing.update(chunk)
                self.f.write(chunk)
        else:
            if self._hashing is not None:
                self._hashing.update(view)
            self.f.write(view)
        self.pos += nbytes
        if self._writeback is not None and nbytes >= _BUFFER:  # a large write is in the kernel's hands
            self._writeback.wrote(self.pos)

    def item(self, nbytes: int) -> None:
        """An item of ``nbytes`` is written next (where its blocks start and end)."""
        if self._blocks is not None:
            self._blocks.item(self.pos, nbytes)

    def digest(self) -> str | None:
        if self._behind is not None:
            self._behind.finish()
        return None if self.hasher is None else self.hasher.hexdigest()

    def blocks(self) -> list[tuple[int, str]] | None:
        """Each block's ``(length, hex digest)`` once everything is written (``None``: not hashed)."""
        if self._blocks is None:
            return None
        if self._behind is not None:
            self._behind.finish()
        return self._blocks.finish()

    def sync(self, fsync: bool) -> None:
        """Flush what was written and, where ``fsync``, make it durable."""
        self.f.flush()
        if self._writeback is not None:
            self._writeback.finish()
        if fsync:
            os.fsync(self.f.fileno())

    def __enter__(self) -> DataFile:
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if self._writeback is not None:
                self._writeback.finish()
            if self._behind is not None:
                self._behind.finish()
        finally:
            self.f.close()


_SPARE_CPU = _spare_cpu()
