"""The reads of a resharding recovery: the byte ranges a rank's load needs from the old ranks'
parts, read by the one rank that serves each part and sent to the rank that needs them, checked
block by block on arrival, never unpickled.

A resharded load (:mod:`.reshard`) reads a folder of this rank's own, ``<local_dir>/.ckpt_engine_reshard/rank_<r>/``,
whose data files stand for the old ranks' files: a hard link where this node holds the part (read
from this node's disk, ``local``), else a sparse file of the same size into which only the ranges
this rank reads are written (``peer``). :class:`TierReader` is the engine's fast reader of that
folder; before it reads, every rank takes part in one exchange per component (:meth:`Exchange.fetch`):

1. each rank lists the byte ranges its plan reads from parts its node lacks, widened to whole
   blocks of the part's manifest (a block is the unit its digests check), and one all-gather
   gives every rank every request;
2. for each distance ``d = 1 .. world - 1``, rank ``r`` streams to rank ``r + d`` what it serves
   of that rank's requests while it receives from rank ``r - d`` (each part is served by one
   rank, :func:`~.reshard.assign_servers`), in chunks of at most :data:`~.transfer.CHUNK_BYTES`
   through :func:`~.transfer.exchange_bytes`; both sides know every size in advance;
3. every block received is hashed and compared with the part's manifest before the read that
   follows uses it; a block that does not match is a :class:`~ckpt_engine.errors.CorruptCheckpointError`
   naming the part, raised on every rank by the load's agreement.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from .._dcpio import dist as _dist
from .._dcpio.fast_read import FastFileSystemReader
from .._dcpio.watch import active_watch, c10d_failure
from .._format.hashing import new_hasher
from .._format.layout import remove_tree
from .._format.verify import FileBlocks
from ..errors import CorruptCheckpointError
from . import transfer
from .transfer import exchange_bytes

__all__ = ["Exchange", "PartFile", "TierReader"]

logger = logging.getLogger("ckpt_engine")

#: ``(start, end)`` of a file.
Span = tuple[int, int]


@dataclass(frozen=True)
class PartFile:
    """One data file of an old rank's part, as the resharded folder names it."""

    owner: int
    #: The file in the old rank's checkpoint folder (``component/name``).
    rel: str
    size: int
    #: Block boundaries (``starts[-1] == size``) and the digest of each block.
    starts: tuple[int, ...]
    digests: tuple[str, ...]
    #: Where the file is on this node (``None``: not held here; read from its server).
    held_at: str | None = None

    def widen(self, start: int, end: int) -> Span:
        """``(start, end)`` widened to the blocks that hold it."""
        first = max(0, bisect.bisect_right(self.starts, start) - 1)
        last = min(len(self.starts) - 1, bisect.bisect_left(self.starts, end))
        return self.starts[first], self.starts[last]


@dataclass
class Exchange:
    """The exchange of one resharded load on this rank (see the module docstring)."""

    #: The resharded folder's data files by their path there (``component/name``).
    files: dict[str, PartFile]
    #: Old rank -> the rank that serves its part.
    servers: dict[int, int]
    folder: str
    algorithm: str
    sync: bool
    bytes_local: int = 0
    bytes_received: int = 0
    bytes_sent: int = 0
    _bad: list[str] = field(default_factory=list)

    def reader(self, path: str, metadata: Any) -> TierReader:
        """The storage reader of component folder ``path`` of the resharded folder."""
        return TierReader(path, metadata, self, os.path.basename(path.rstrip(os.sep)))

    def discard(self) -> None:
        """Remove this rank's resharded folder (the load is over, read or failed)."""
        root = os.path.dirname(self.folder)
        try:
            if os.path.lexists(root):
                remove_tree(root)
        except OSError:
            logger.warning("local tier: could not remove %s", root, exc_info=True)

    def by_source(self) -> dict[str, int]:
        """``LoadResult.bytes_by_source`` of this rank: its node's copies, bytes from peers."""
        return {k: v for k, v in (("local", self.bytes_local), ("peer", self.bytes_received)) if v}

    def fetch(self, component: str, reads: Iterable[tuple[str, int, int]]) -> None:
        """Every rank, before reading ``component``: the ranges ``reads`` (``(name, offset, length)``
        in the component folder) that this node lacks received into the resharded folder, and
        this rank's share of every other rank's served (see the module docstring)."""
        wanted: dict[str, list[Span]] = {}
        for name, offset, length in reads:
            part = self.files[f"{component}/{name}"]
            if length == 0:  # nothing to read (an empty value's item)
                continue
            if part.held_at is not None:
                self.bytes_local += length
            else:
                wanted.setdefault(f"{component}/{name}", []).append(part.widen(offset, offset + length))
        mine = sorted((rel, _merge(spans)) for rel, spans in wanted.items())
        watch = active_watch()
        step = f"local tier: resharded reads of {component}"
        requests: list[list[tuple[str, list[Span]]]] = _dist.all_gather_object(mine, step=step)
        rank, world = _dist.rank(), len(requests)
        group = watch.group if watch is not None else None
        try:
            for d in range(1, world):
                to, frm = (rank + d) % world, (rank - d) % world
                out = [(rel, s) for rel, spans in requests[to] if self._serves(rel) for s in spans]
                inc = [(rel, s) for rel, spans in mine if self.servers[self.files[rel].owner] == frm for s in spans]
                self._stream(group, to, out, frm, inc)
        except Exception as err:
            if watch is not None and c10d_failure(err):
                raise watch.broken(step, err) from err
            raise
        if self._bad:
            raise CorruptCheckpointError(
                f"the local tier's copies sent to rank {rank} do not match their manifests: {'; '.join(self._bad[:3])}"
                " (a damaged copy on its node); resume from save_dir (unset local_dir) or remove the damaged folder"
            )

    def _serves(self, rel: str) -> bool:
        return self.servers[self.files[rel].owner] == _dist.rank()

    def _stream(self, group: Any, to: int, out: list[tuple[str, Span]], frm: int, inc: list[tuple[str, Span]]) -> None:
        chunk = transfer.CHUNK_BYTES
        sends = _pieces(sum(b - a for _, (a, b) in out), chunk)
        recvs = _pieces(sum(b - a for _, (a, b) in inc), chunk)
        reader = _SpanReader(self.files, out)
        writer = _SpanWriter(self, inc)
        try:
            for n in range(max(len(sends), len(recvs))):
                data = reader.read(sends[n]) if n < len(sends) else b""
                got = exchange_bytes(
                    group, to if n < len(sends) else None, data, frm if n < len(recvs) else None, chunk
                )
                self.bytes_sent += len(data)
                if got is not None:
                    writer.take(memoryview(got))
                    self.bytes_received += len(got)
        finally:
            reader.close()
            writer.close()


def _merge(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _pieces(total: int, chunk: int) -> list[int]:
    return [min(chunk, total - start) for start in range(0, total, chunk)]


class _SpanReader:
    """The server's side: the spans it sends one peer, read from its node's files in order. A
    file it cannot read sends zeros (the stream stays in step; the receiver's checks refuse them)."""

    def __init__(self, files: dict[str, PartFile], spans: Sequence[tuple[str, Span]]) -> None:
        self._files = files
        self._spans = list(spans)
        self._at = 0
        self._done = 0  # bytes of the current span already read
        self._fds: dict[str, int] = {}

    def read(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            rel, (a, b) = self._spans[self._at]
            take = min(n - len(out), b - a - self._done)
            out += self._pread(rel, a + self._done, take)
            self._done += take
            if self._done == b - a:
                self._at, self._done = self._at + 1, 0
        return bytes(out)

    def _pread(self, rel: str, offset: int, n: int) -> bytes:
        try:
            if rel not in self._fds:
                path = self._files[rel].held_at
                assert path is not None, rel
                self._fds[rel] = os.open(path, os.O_RDONLY)
            data = os.pread(self._fds[rel], n, offset)
        except OSError:
            data = b""
        return data + bytes(n - len(data))

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _SpanWriter:
    """The receiver's side: bytes written at their offsets into the sparse files of the resharded
    folder, each block hashed as it completes and compared with its digest."""

    def __init__(self, exchange: Exchange, spans: Sequence[tuple[str, Span]]) -> None:
        self._ex = exchange
        self._spans = list(spans)
        self._at = 0
        self._pos = spans[0][1][0] if spans else 0
        self._hasher: Any = None
        self._fds: dict[str, int] = {}

    def take(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            rel, (_, end) = self._spans[self._at]
            part = self._ex.files[rel]
            assert part.held_at is None, rel  # never written into a file of the tier itself
            block = bisect.bisect_right(part.starts, self._pos) - 1
            block_end = min(part.starts[block + 1], end)
            n = min(len(view) - done, block_end - self._pos)
            piece = view[done : done + n]
            if self._hasher is None:
                self._hasher = new_hasher(self._ex.algorithm)
            self._hasher.update(piece)
            os.pwrite(self._fd(rel), piece, self._pos)
            self._pos += n
            done += n
            if self._pos == part.starts[block + 1]:
                if self._hasher.hexdigest() != part.digests[block]:
                    self._ex._bad.append(f"{rel} of rank {part.owner}, bytes {part.starts[block]}-{self._pos}")
                self._hasher = None
            if self._pos == end:
                self._at += 1
                self._pos = self._spans[self._at][1][0] if self._at < len(self._spans) else 0

    def _fd(self, rel: str) -> int:
        if rel not in self._fds:
            self._fds[rel] = os.open(os.path.join(self._ex.folder, *rel.split("/")), os.O_WRONLY)
        return self._fds[rel]

    def close(self) -> None:
        for fd in self._fds.values():
            if self._ex.sync:
                os.fsync(fd)
            os.close(fd)
        self._fds.clear()


class TierReader(FastFileSystemReader):
    """The engine's fast reader of one component of the resharded folder, which first takes part
    in the component's exchange (:meth:`Exchange.fetch`)."""

    def __init__(self, path: str, metadata: Any, exchange: Exchange, component: str) -> None:
        self._exchange = exchange  # before the base class's __init__, which sets ``blocks``
        self._component = component
        super().__init__(path, metadata)

    @property
    def blocks(self) -> Mapping[str, FileBlocks]:
        return self._named_blocks

    @blocks.setter
    def blocks(self, blocks: Mapping[str, FileBlocks]) -> None:
        """The loader's blocks of this component's stand-in files, each named by the old rank's
        file it stands for (the stand-in folder is removed after the load: a damaged part's error
        must name the file there is to restore)."""
        named = {}
        for name, b in blocks.items():
            part = self._exchange.files.get(f"{self._component}/{name}")
            where = None if part is None else f"{part.held_at or part.rel} (rank {part.owner}'s {part.rel})"
            named[name] = b if where is None else dataclasses.replace(b, path=where)
        self._named_blocks = named

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        infos = [self.storage_data[item.storage_index] for item in plan.items]
        self._exchange.fetch(self._component, ((i.relative_path, i.offset, i.length) for i in infos))
        return super().read_data(plan, planner)
