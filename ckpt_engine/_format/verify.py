"""Verification against the manifest: a checkpoint's files before a load (sizes, checksums,
completeness), and the bytes a load reads, block by block.

:func:`verify_checkpoint` is the public entry point (the CLI and ``ckpt_engine.integrity`` call
it); its signature is stable. The loader uses the lower-level checks: :func:`metadata_checker`
(each ``.metadata`` checked before it is parsed) and :func:`check_against_manifest`.

Block by block (the last section): the engine's writer hashes each data file in blocks as it
writes it (``data_file.BlockHasher``:
a larger item's bytes in pieces of its own, runs of small items together) and the manifest
records each block's length and digest. A load (``verify: read``, the default) checks every
block it reads a byte of, hashing the bytes where they already are (the destination tensor's
memory, the archive headers read first) and reading only what it did not read itself (the rest
of a block a ranged read cut). A manifest from before blocks were recorded gives each file one
block, its whole-file digest, checked (by reading all of the file once before the load reads
it) only where a load reads at least half of the file.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import os
import stat
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .._storage.store import Store, store_for
from ..errors import CheckpointPermissionError, CkptEngineError, CorruptCheckpointError, IntegrityError, denied
from .hashing import hash_bytes, hash_file, new_hasher
from .layout import CheckedCheckpoint, check_complete
from .manifest import (
    FileEntry,
    Manifest,
    ManifestLookup,
    lookup_manifest,
    referenced_files,
)
from .names import MANIFEST_FILE, parse_iteration

__all__ = [
    "FileBlocks",
    "VerifyLevel",
    "VerifyReport",
    "check_digest",
    "check_read",
    "component_blocks",
    "has_blocks",
    "keys_in",
    "manifest_for_reads",
    "verify_checkpoint",
    "whole_files_to_check",
]

VerifyLevel = Literal["sizes", "checksums"]


def metadata_checker(
    checkpoint_dir: str, manifest: Manifest, store: Store | None = None
) -> Callable[[str, bytes], None]:
    """A ``check_metadata_bytes`` for :func:`~ckpt_engine._format.layout.check_complete`: each ``.metadata``
    must have the size and checksum the manifest records, checked before the file is parsed."""
    store = store_for(checkpoint_dir, store)
    root = store.join(os.fspath(checkpoint_dir), "")

    def check(path: str, data: bytes) -> None:
        rel = path[len(root) :] if path.startswith(root) else path
        entry = manifest.files.get(rel)
        if entry is None:
            return  # not in the manifest: check_against_manifest reports that
        if len(data) != entry.size:
            raise IntegrityError(f"{path} is {len(data)} bytes, but {MANIFEST_FILE} records {entry.size}")
        digest = hash_bytes(data, manifest.algorithm) if manifest.algorithm and entry.checksum else None
        if digest is not None and digest != entry.checksum:
            raise IntegrityError(
                f"{path} does not match the checksum in {MANIFEST_FILE}: the file is damaged; nothing was parsed"
            )

    return check


def iteration_problem(path: str, manifest: Manifest) -> str | None:
    """Why the checkpoint folder ``path`` is not the checkpoint its manifest describes (the
    iteration in its name differs), or ``None``."""
    named = parse_iteration(os.path.basename(path.rstrip("/")))
    if named is None or manifest.iteration == named:
        return None
    return (
        f"{path} is named for iteration {named}, but its {MANIFEST_FILE} is of iteration {manifest.iteration}: it "
        "is another checkpoint under this name (a symlink to, or a copy of, another run's folder?)"
    )


@dataclass(frozen=True)
class ManifestCheck:
    problems: list[str]
    #: Whether the checks at the requested level could all be done (else ``reason`` says why not).
    complete_check: bool
    reason: str | None = None
    files: int = 0
    bytes: int = 0


def check_against_manifest(
    checkpoint_dir: str | os.PathLike[str],
    manifest: Manifest,
    level: VerifyLevel,
    *,
    referenced: Collection[str] = (),
    checksum_only: Collection[str] | None = None,
    progress: Callable[[int, int], None] | None = None,
    store: Store | None = None,
    listing: Mapping[str, int] | None = None,
) -> ManifestCheck:
    """Compare the files on disk with ``manifest``: every listed file exists with its size, and
    with ``level="checksums"`` its checksum (only for ``checksum_only`` where given: a rank's
    share). Every file in ``referenced`` (what DCP metadata needs) must be listed. Returns one
    problem line per damaged file, each naming it; raises only :class:`CheckpointPermissionError`
    (a file that cannot be read at all). On an object store the sizes come from one listing of
    the prefix: ``listing`` (e.g. :attr:`CheckedCheckpoint.listing`), else a new one."""
    root = os.fspath(checkpoint_dir)
    store = store_for(root, store)
    problems = [
        f"{store.join(root, rel)} is needed by DCP metadata but not listed in {MANIFEST_FILE}"
        for rel in sorted(set(referenced) - set(manifest.files))
    ]
    # One listing instead of a request per object on an object store (``listing``: one just taken).
    listed = (listing if listing is not None else store.list_files(root)) if store.capabilities.listing_first else None
    sized_ok = [
        rel for rel in sorted(manifest.files) if _size_ok(store, root, rel, manifest.files[rel], listed, problems)
    ]
    nfiles, total = len(manifest.files), manifest.total_bytes
    if level == "sizes":
        if progress is not None:
            progress(total, total)
        return ManifestCheck(problems, True, files=nfiles, bytes=total)
    reason = _checksums_unavailable(manifest, sized_ok)
    if reason is not None or manifest.algorithm is None:
        return ManifestCheck(problems, False, reason, nfiles, total)
    todo = [r for r in sized_ok if checksum_only is None or r in checksum_only]
    problems += _checksum_problems(store, root, manifest, manifest.algorithm, todo, progress)
    if progress is not None and not todo:
        progress(0, 0)
    return ManifestCheck(problems, True, files=nfiles, bytes=total)


def _size_ok(
    store: Store, root: str, rel: str, entry: FileEntry, listed: Mapping[str, int] | None, problems: list[str]
) -> bool:
    """Whether ``rel`` is a regular file of the size the manifest records (else why not goes to
    ``problems``); sizes come from ``listed`` on an object store, else from ``os.stat``."""
    path = store.join(root, *rel.split("/"))
    try:
        if listed is None:
            st = os.stat(path)
            regular, size = stat.S_ISREG(st.st_mode), st.st_size
        elif rel in listed:
            regular, size = True, listed[rel]
        else:
            raise FileNotFoundError(path)
    except FileNotFoundError:
        problems.append(f"{path} is missing ({MANIFEST_FILE} lists it with {entry.size} bytes)")
        return False
    except PermissionError as err:
        raise CheckpointPermissionError(f"cannot stat {path}: {denied(err)}") from err
    if not regular:
        problems.append(f"{path} is not a regular file")
    elif size != entry.size:
        problems.append(f"{path} has {size} bytes, {MANIFEST_FILE} says {entry.size}: truncated or overwritten")
    else:
        return True
    return False


def _checksums_unavailable(manifest: Manifest, sized_ok: list[str]) -> str | None:
    """Why the checksums of ``sized_ok`` cannot be compared here, or None."""
    if manifest.algorithm is None or any(manifest.files[r].checksum is None for r in sized_ok):
        return "the manifest holds sizes only (saved with save_checksums=False)"
    if new_hasher(manifest.algorithm) is None:
        hint = " (pip install xxhash)" if manifest.algorithm.startswith("xxh") else ""
        return f"checksum algorithm {manifest.algorithm!r} is not available here{hint}"
    return None


def _checksum_problems(
    store: Store,
    root: str,
    manifest: Manifest,
    algorithm: str,
    todo: list[str],
    progress: Callable[[int, int], None] | None,
) -> list[str]:
    """Hash every file of ``todo`` with ``algorithm`` (the manifest's) and compare with the
    manifest: one problem line per damaged file."""
    problems: list[str] = []
    todo_bytes = sum(manifest.files[r].size for r in todo)
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        if progress is not None:
            progress(done, todo_bytes)

    for rel in todo:  # one file at a time: progress stays monotonic, and reads stay sequential
        path = store.join(root, *rel.split("/"))
        try:
            got = hash_file(path, algorithm, tick, store)
        except CheckpointPermissionError:
            raise  # not a mismatch: the caller cannot read the checkpoint at all
        except CkptEngineError as err:
            problems.append(str(err))
            continue
        except OSError as err:
            problems.append(f"cannot read {path}: {err.strerror or err}")
            continue
        want = manifest.files[rel]
        if got.size != want.size:
            problems.append(f"{path} changed size while being checked ({got.size} != {want.size} bytes)")
        elif got.checksum != want.checksum:
            problems.append(
                f"{path}: {algorithm} checksum {got.checksum} != {want.checksum} in {MANIFEST_FILE}: "
                "the file is corrupt"
            )
    return problems


# -- public verification -----------------------------------------------------------------------


@dataclass(frozen=True)
class VerifyReport:
    """What :func:`verify_checkpoint` found.

    ``complete``: every component has ``.metadata`` and every byte range it names exists.
    ``verified``: a manifest existed and every file matched it at ``level``; when False,
    ``unverified_reason`` says why (no manifest, incomplete, a problem found, ...).
    ``problems``: one line per problem, each naming the file; empty when all is well.
    ``files`` / ``bytes``: files and bytes covered (the manifest's, else the DCP metadata's).
    ``corrupt``: the checkpoint cannot be checked for completeness because a file it has is
    damaged (a ``.metadata`` failing its checksum, a crafted one), not because one is missing.
    ``reused_bytes`` / ``reused_files``: what the manifest says an incremental save carried over
    from the previous checkpoint instead of writing it (0 without a manifest).
    """

    path: str
    complete: bool
    verified: bool
    unverified_reason: str | None = None
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    level: str = "checksums"
    corrupt: bool = False
    reused_bytes: int = 0
    reused_files: int = 0

    @property
    def ok(self) -> bool:
        """Complete and without problems (a checkpoint without a manifest can be ok, unverified)."""
        return self.complete and not self.problems


def verify_checkpoint(
    path: str,
    level: VerifyLevel = "checksums",
    progress: Callable[[int, int], None] | None = None,
    store: Store | None = None,
) -> VerifyReport:
    """Check the checkpoint folder ``path`` fully; never raises for a damaged checkpoint.

    Completeness (docs/design.md, section 2) first, then the manifest at ``level``: ``sizes`` compares
    every file's size, ``checksums`` also reads every file and compares its checksum.
    ``progress(done_bytes, total_bytes)`` is called as bytes are checked. Reads only.
    """
    path = os.fspath(path)
    if level not in ("sizes", "checksums"):
        raise ValueError(f"level must be 'sizes' or 'checksums', got {level!r}")
    store = store_for(path, store)
    problems: list[str] = []
    lookup, checked, corrupt = _lookup_and_check_complete(path, store, problems)
    report = _report(path, store, lookup, checked, problems, level, progress)
    return dataclasses.replace(report, corrupt=corrupt) if corrupt else report


def _report(
    path: str,
    store: Store,
    lookup: ManifestLookup | None,
    checked: CheckedCheckpoint | None,
    problems: list[str],
    level: VerifyLevel,
    progress: Callable[[int, int], None] | None,
) -> VerifyReport:
    if lookup is None:
        return VerifyReport(path, checked is not None, False, "the manifest is unreadable", problems, level=level)
    if lookup.manifest is None and not store.capabilities.commit_by_rename:
        problems.append(
            f"{path} has no {MANIFEST_FILE}: on an object store that marker is written last, so the checkpoint "
            "is incomplete (an interrupted save) and the engine never loads it"
        )
        return VerifyReport(path, False, False, "no completion marker", problems, level=level)
    if lookup.manifest is None:
        nbytes = _metadata_bytes(checked)
        files = len(referenced_files(checked)) if checked is not None else 0
        return VerifyReport(path, checked is not None, False, lookup.reason, problems, files, nbytes, level)
    manifest = lookup.manifest
    report = _verify_against_manifest(path, manifest, checked, problems, level, progress, store)
    return dataclasses.replace(report, reused_bytes=manifest.carried_bytes, reused_files=manifest.carried_files)


def _lookup_and_check_complete(
    path: str, store: Store, problems: list[str]
) -> tuple[ManifestLookup | None, CheckedCheckpoint | None, bool]:
    """The manifest lookup (None: unreadable), the completeness check (None: incomplete), the
    ``.metadata`` files checked against the manifest before they are parsed, and whether a
    failure was damage (a corrupt file) rather than absence; what failed goes to ``problems``."""
    lookup: ManifestLookup | None = None
    checked: CheckedCheckpoint | None = None
    corrupt = False
    try:
        lookup = lookup_manifest(path, store)
    except CkptEngineError as err:
        problems.append(str(err))
        corrupt = isinstance(err, CorruptCheckpointError)
    try:
        checker = metadata_checker(path, lookup.manifest, store) if lookup and lookup.manifest else None
        checked = check_complete(path, store, checker)
    except CkptEngineError as err:
        problems.append(str(err))
        corrupt = corrupt or isinstance(err, CorruptCheckpointError)
    return lookup, checked, corrupt


def _verify_against_manifest(
    path: str,
    manifest: Manifest,
    checked: CheckedCheckpoint | None,
    problems: list[str],
    level: VerifyLevel,
    progress: Callable[[int, int], None] | None,
    store: Store,
) -> VerifyReport:
    try:
        result = check_against_manifest(
            path,
            manifest,
            level,
            referenced=referenced_files(checked) if checked is not None else (),
            progress=progress,
            store=store,
            listing=checked.listing if checked is not None else None,
        )
    except CkptEngineError as err:  # permission denied
        problems.append(str(err))
        return VerifyReport(path, checked is not None, False, "a file could not be read", problems, level=level)
    problems += result.problems
    mismatch = iteration_problem(path, manifest)
    if mismatch is not None:
        problems.append(mismatch)
    reason = result.reason
    if problems:
        reason = f"{len(problems)} problem(s) found"
    elif checked is None:
        reason = "incomplete"
    verified = checked is not None and not problems and result.complete_check
    return VerifyReport(path, checked is not None, verified, reason, problems, result.files, result.bytes, level)


def _metadata_bytes(checked: CheckedCheckpoint | None) -> int:
    if checked is None:
        return 0
    return sum(int(info.length) for md in checked.components.values() for info in (md.storage_data or {}).values())


# -- the bytes a load reads, checked block by block ---------------------------------------------

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
    #: The one block is the whole file (a manifest without blocks): checked only where a load
    #: reads at least half of it (``FastFileSystemReader``), or a read covers all of it.
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


def whole_files_to_check(
    blocks: Mapping[str, FileBlocks], items: Iterable[tuple[str, int, int]]
) -> list[tuple[str, FileBlocks]]:
    """The data files with a whole-file digest only (a manifest from before per-block digests)
    that a load of ``items`` (``(file, offset, length)``) checks whole before it reads any of
    them: those it reads at least half of. A file's items go several ways (values, direct reads,
    DCP's path, reads shared between ranks) and an optimizer's load skips most of its
    hyper-parameters, so no one read holds a whole file; a resharded load's small slice of a large
    file is checked by its size only."""
    spans: dict[str, list[tuple[int, int]]] = {}
    for rel, offset, length in items:
        b = blocks.get(rel)
        if b is not None and b.whole_only:
            spans.setdefault(rel, []).append((offset, offset + length))
    return [(rel, blocks[rel]) for rel, s in spans.items() if 2 * _covered(s) >= blocks[rel].starts[-1]]


def _covered(spans: list[tuple[int, int]]) -> int:
    """How many bytes the ``spans`` (``(start, end)``) cover, overlaps counted once."""
    total, at = 0, 0
    for a, b in sorted(spans):
        total += max(0, b - max(a, at))
        at = max(at, b)
    return total


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
            "at least half of the file (reading all of it once more), else its size only",
            path,
        )
    return manifest


#: The most :func:`check_read` reads at once of a block's bytes not in memory: one ``pread`` of a
#: whole file of several GiB (a whole-file digest) allocated all of it, and Linux returns at most
#: 2 GiB - 4 KiB from one call, which read as a file that ends early.
_GAP_READ = 8 << 20


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
            else:  # not in memory: read, at most _GAP_READ at a time (a whole-file digest's block is the file)
                n = min(hi, starts[i + 1] if i + 1 < len(starts) else hi, at + _GAP_READ) - at
                data = pread(at, n)
                if len(data) != n:
                    raise _mismatch(blocks, lo, hi, keys, f"the file ends inside it (at byte {at + len(data)})")
                hasher.update(data)
            at += n
        check_digest(blocks, b, hasher, keys)
        if done is not None:
            done.add(b)


def check_digest(blocks: FileBlocks, b: int, hasher: Any, keys: Callable[[int, int], list[str]]) -> None:
    """Raise :class:`CorruptCheckpointError` unless ``hasher``, fed every byte of block ``b``,
    has the digest recorded for it (for a reader that hashes a block as it reads it)."""
    if hasher.hexdigest() != blocks.digests[b]:
        why = f"its {blocks.algorithm} digest differs from the one recorded at save"
        raise _mismatch(blocks, blocks.starts[b], blocks.starts[b + 1], keys, why)


def _mismatch(
    blocks: FileBlocks, lo: int, hi: int, keys: Callable[[int, int], list[str]], why: str
) -> CorruptCheckpointError:
    held = sorted(set(keys(lo, hi)))
    what = ", ".join(repr(k) for k in held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
    return CorruptCheckpointError(
        f"{blocks.path} is damaged: bytes {lo}-{hi} (holding {what or 'no key'}) do not match {MANIFEST_FILE}: {why}. "
        "The load stopped there, but values it read before may already be in the training objects: do not "
        "train on them. Load another checkpoint (with fallback_to_last_complete a resume goes on to the newest "
        "one that loads) or restore this file"
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
