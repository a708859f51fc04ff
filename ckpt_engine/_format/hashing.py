"""Checksums of checkpoint files: the manifest's algorithm, and the one loop that reads a file to hash it.

The algorithm is ``xxh3_64`` where the ``xxhash`` package is installed, else ``crc32``. The
storage writer (which hashes bytes as it writes them), the manifest (which records and checks the
digests), the carry-over of unchanged files, the ranks' comparison of a ``.pth`` and the CRC-32
check of a ``torch.save`` archive all take their hashers here, so they agree on the algorithm and
its hex form, and every file read for its checksum is read by :func:`hash_stream`.
"""

from __future__ import annotations

import os
import stat
import zlib
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from .._storage.store import Store, store_for
from ..errors import CheckpointPermissionError, CkptEngineError, CorruptCheckpointError, denied
from .manifest import FileEntry

__all__ = ["DEFAULT_ALGORITHM", "Hasher", "hash_bytes", "hash_file", "hash_files", "hash_stream", "new_hasher"]

_xxhash: Any
try:  # xxh3_64 hashes at ~25 GB/s on one core here, zlib.crc32 at ~4 GB/s (docs/reliability.md)
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - xxhash is a dependency; tolerated for odd installs
    _xxhash = None

#: The checksum new manifests use: ``xxh3_64`` (the ``xxhash`` package), else ``crc32`` (zlib).
DEFAULT_ALGORITHM = "xxh3_64" if _xxhash is not None else "crc32"
#: Bytes read at a time while hashing a file.
_CHUNK = 8 << 20


class Hasher(Protocol):
    def update(self, data: Any, /) -> None: ...

    def hexdigest(self) -> str: ...


class _Readable(Protocol):
    def readinto(self, buffer: Any, /) -> int | None: ...


class _Crc32:
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any, /) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def new_hasher(algorithm: str) -> Hasher | None:
    """A hasher for ``algorithm``, or None if it is unknown or unavailable here."""
    if algorithm == "crc32":
        return _Crc32()
    if algorithm == "xxh3_64" and _xxhash is not None:
        h: Hasher = _xxhash.xxh3_64()
        return h
    return None


def hash_bytes(data: Any, algorithm: str) -> str | None:
    """The hex digest of ``data`` (bytes in memory) with ``algorithm``; None if it is unavailable."""
    hasher = new_hasher(algorithm)
    if hasher is None:
        return None
    hasher.update(data)
    return hasher.hexdigest()


def hash_stream(
    f: _Readable, hasher: Hasher, *, limit: int | None = None, progress: Callable[[int], None] | None = None
) -> int:
    """Feed the bytes of ``f`` from where it stands, to its end or for at most ``limit`` bytes,
    to ``hasher``; the number of bytes read (fewer than ``limit``: the file ended first)."""
    buf = bytearray(_CHUNK if limit is None else max(1, min(_CHUNK, limit)))
    view = memoryview(buf)
    done = 0
    while limit is None or done < limit:
        n = f.readinto(view if limit is None else view[: min(len(buf), limit - done)]) or 0
        if not n:
            break
        hasher.update(view[:n])
        done += n
        if progress is not None:
            progress(n)
    return done


def hash_file(
    path: str, algorithm: str | None, progress: Callable[[int], None] | None = None, store: Store | None = None
) -> FileEntry:
    """Size and checksum of one regular file or object (``algorithm`` None: the size only)."""
    store = store_for(path, store)
    try:
        size: int | None = None
        if store.capabilities.local_files:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{path} is not a regular file")
            size = st.st_size
        if algorithm is None:
            return FileEntry(size=store.size(path) if size is None else size)
        hasher = new_hasher(algorithm)
        if hasher is None:
            raise CkptEngineError(f"checksum algorithm {algorithm!r} is not available here")
        with store.open_read(path) as f:
            size = hash_stream(f, hasher, progress=progress)
        return FileEntry(size=size, checksum=hasher.hexdigest())
    except PermissionError as err:
        raise CheckpointPermissionError(f"cannot read {path}: {denied(err)}") from err


def hash_files(
    checkpoint_dir: str | os.PathLike[str],
    rels: Collection[str],
    algorithm: str | None,
    *,
    threads: int = 4,
    progress: Callable[[int], None] | None = None,
    store: Store | None = None,
) -> dict[str, FileEntry]:
    """:func:`hash_file` over ``rels`` (relative to ``checkpoint_dir``), a few files at a time."""
    root = os.fspath(checkpoint_dir)
    store = store_for(root, store)
    todo = sorted(rels)
    if not todo:
        return {}

    def one(rel: str) -> tuple[str, FileEntry]:
        return rel, hash_file(store.join(root, *rel.split("/")), algorithm, progress, store)

    if threads <= 1 or len(todo) == 1 or algorithm is None:
        return dict(one(rel) for rel in todo)
    try:
        with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="ckpt-engine-hash") as pool:
            return dict(pool.map(one, todo))
    except RuntimeError as err:
        # A background commit at interpreter exit: concurrent.futures refuses new work once
        # shutdown began ("cannot schedule new futures after interpreter shutdown").
        if "interpreter shutdown" not in str(err):
            raise
        return dict(one(rel) for rel in todo)
