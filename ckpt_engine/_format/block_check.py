"""Checking the bytes a load reads against the per-block digests its manifest recorded at save.

The engine's writer hashes each data file in blocks as it writes it (``data_file.BlockHasher``:
a larger item's bytes in pieces of its own, runs of small items together) and the manifest
records each block's length and digest. A load (``verify: read``, the default) checks every
block it reads a byte of, hashing the bytes where they already are (the destination tensor's
memory, the archive headers read first) and reading only what it did not read itself (the rest
of a block a ranged read cut). A manifest from before blocks were recorded gives each file one
block, its whole-file digest, checked only when a load reads the whole file.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._storage.store import Store
from ..errors import CorruptCheckpointError
from .hashing import new_hasher
from .manifest import Manifest, lookup_manifest
from .names import MANIFEST_FILE

__all__ = ["FileBlocks", "check_read", "component_blocks", "has_blocks", "keys_in", "manifest_for_reads"]

#: The ``verify`` levels whose loads check every byte they read.
CHECKED_LEVELS = ("read", "checksums")

logger = logging.getLogger("ckpt_engine")


@dataclass(frozen=True)
class FileBlocks:
    """A data file's blocks: block ``i`` is bytes ``starts[i]`` to ``starts[i + 1]``."""

    path: str
    algorithm: str
    starts: tuple[int, ...]
    digests: tuple[str, ...]
    #: The one block is the whole file (a manifest without blocks): checked only when read whole.
    whole_only: bool = False

    def touched(self, spans: Iterable[tuple[int, int]]) -> list[int]:
        """The blocks holding a byte of ``spans`` (``(start, end)`` in the file), in order."""
        spans = [(a, b) for a, b in spans if b > a]
        if self.whole_only:
            return [0] if _covers(spans, self.starts[-1]) else []
        out: set[int] = set()
        for a, b in spans:
            first = max(0, bisect.bisect_right(self.starts, a) - 1)
            last = min(len(self.digests), bisect.bisect_left(self.starts, b))
            out.update(range(first, last))
        return sorted(out)


def _covers(spans: list[tuple[int, int]], size: int) -> bool:
    at = 0
    for a, b in sorted(spans):
        if a > at:
            return False
        at = max(at, b)
    return at >= size


def component_blocks(
    manifest: Manifest, component: str, folder: str, join: Callable[..., str]
) -> dict[str, FileBlocks]:
    """The blocks of every data file of ``component`` (its folder ``folder``) the manifest
    records, by the file's name in the folder; a file without blocks gets its whole-file digest."""
    out: dict[str, FileBlocks] = {}
    algorithm = manifest.algorithm
    if algorithm is None or new_hasher(algorithm) is None:
        return out
    prefix = f"{component}/"
    for rel, entry in manifest.files.items():
        name = rel[len(prefix) :]
        if not rel.startswith(prefix) or "/" in name or name == ".metadata":
            continue
        if entry.blocks is not None:
            starts = [0]
            for n, _ in entry.blocks:
                starts.append(starts[-1] + n)
            out[name] = FileBlocks(join(folder, name), algorithm, tuple(starts), tuple(d for _, d in entry.blocks))
        elif entry.checksum is not None:
            out[name] = FileBlocks(join(folder, name), algorithm, (0, entry.size), (entry.checksum,), whole_only=True)
    return out


def has_blocks(manifest: Manifest) -> bool:
    """Whether the manifest records per-block digests (else a load checks whole files only)."""
    return any(e.blocks is not None for e in manifest.files.values())


def manifest_for_reads(path: str, store: Store, level: str, say: bool) -> Manifest | None:
    """The manifest of checkpoint ``path`` that a load at ``verify`` ``level`` checks what it
    reads against (``None``: no such level, or no manifest: the pre-load checks said so). One
    from before per-block digests is said once, where ``say``."""
    if level not in CHECKED_LEVELS:
        return None
    manifest = lookup_manifest(path, store).manifest
    if manifest is not None and say and not has_blocks(manifest):
        logger.info(
            "%s was saved before per-block digests were recorded: this load checks a file's digest where it reads "
            "the whole file, else its size only",
            path,
        )
    return manifest


def _disjoint(pieces: Sequence[tuple[int, Any]]) -> tuple[list[int], list[tuple[int, memoryview]]]:
    """``pieces`` (``(file offset, bytes)``) trimmed to not overlap, sorted: their starts, and them."""
    out: list[tuple[int, memoryview]] = []
    end = -1
    for off, data in sorted(pieces, key=lambda p: p[0]):
        view = memoryview(data).cast("B") if not isinstance(data, memoryview) or data.ndim != 1 else data
        if view.itemsize != 1:
            view = view.cast("B")
        if off < end:
            view, off = view[end - off :], end
        if len(view):
            out.append((off, view))
            end = off + len(view)
    return [o for o, _ in out], out


def check_read(
    blocks: FileBlocks,
    spans: Iterable[tuple[int, int]],
    pieces: Sequence[tuple[int, Any]],
    pread: Callable[[int, int], bytes],
    keys: Callable[[int, int], list[str]],
    done: set[int] | None = None,
) -> None:
    """Check every block holding a byte of ``spans``: its bytes from ``pieces`` (``(file offset,
    bytes)`` already read) where they hold them, else ``pread(offset, n)``. A block that does not
    match raises :class:`CorruptCheckpointError` naming the file, the byte range and the keys
    stored there (``keys(start, end)``); ``done``: blocks checked already (updated)."""
    todo = [b for b in blocks.touched(spans) if done is None or b not in done]
    if not todo:
        return
    starts, parts = _disjoint(pieces)
    for b in todo:
        lo, hi = blocks.starts[b], blocks.starts[b + 1]
        hasher = new_hasher(blocks.algorithm)
        assert hasher is not None
        at = lo
        while at < hi:
            i = bisect.bisect_right(starts, at) - 1
            if i >= 0 and at < parts[i][0] + len(parts[i][1]):
                off, view = parts[i]
                n = min(hi, off + len(view)) - at
                hasher.update(view[at - off : at - off + n])
            else:
                n = min(hi, starts[i + 1] if i + 1 < len(starts) else hi) - at
                data = pread(at, n)
                if len(data) != n:
                    raise _mismatch(blocks, lo, hi, keys, f"the file ends inside it (at byte {at + len(data)})")
                hasher.update(data)
            at += n
        if hasher.hexdigest() != blocks.digests[b]:
            why = f"its {blocks.algorithm} digest differs from the one recorded at save"
            raise _mismatch(blocks, lo, hi, keys, why)
        if done is not None:
            done.add(b)


def _mismatch(
    blocks: FileBlocks, lo: int, hi: int, keys: Callable[[int, int], list[str]], why: str
) -> CorruptCheckpointError:
    held = sorted(set(keys(lo, hi)))
    what = ", ".join(repr(k) for k in held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
    return CorruptCheckpointError(
        f"{blocks.path} is damaged: bytes {lo}-{hi} (holding {what or 'no key'}) do not match {MANIFEST_FILE}: {why}. "
        "The load stopped before handing these values on; load another checkpoint (fallback_to_last_complete) or "
        "restore this file"
    )


def keys_in(storage_data: Mapping[Any, Any], rel: str) -> Callable[[int, int], list[str]]:
    """``keys(start, end)`` for :func:`check_read`: the keys DCP's ``storage_data`` stores in
    data file ``rel`` with a byte in that range."""

    def keys(lo: int, hi: int) -> list[str]:
        return [
            str(idx.fqn)
            for idx, info in storage_data.items()
            if info.relative_path == rel and info.offset < hi and info.offset + info.length > lo
        ]

    return keys
