"""Checkpoint integrity: the manifest written at commit, and verification against it.

Every checkpoint the engine commits holds ``ckpt_engine_manifest.json`` at its top level (next to
the component folders, never inside one, so each component stays a plain DCP checkpoint). It
lists every file with its size and checksum, plus the engine and torch versions, the world size,
the components and the iteration. Checkpoints without one (plain DCP, the original
checkpointer) still load; they are reported as unverified.

:func:`verify_checkpoint` is the public entry point (the CLI calls it); its signature is stable.
The engine uses the lower-level functions on save (:func:`hash_files`, :func:`write_manifest`)
and on load (:func:`lookup_manifest`, :func:`check_against_manifest`).
"""

from __future__ import annotations

import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .._storage.store import Store, store_for
from .._version import __version__
from ..errors import CheckpointPermissionError, CkptEngineError, CorruptCheckpointError, IntegrityError, denied
from .hashing import DEFAULT_ALGORITHM, new_hasher
from .layout import CheckedCheckpoint, check_complete
from .names import MANIFEST_FILE, RANK_PART_PREFIX, is_part, parse_iteration

__all__ = [
    "DEFAULT_ALGORITHM",
    "MANIFEST_FILE",
    "FileEntry",
    "Manifest",
    "VerifyReport",
    "verify_checkpoint",
]

VerifyLevel = Literal["sizes", "checksums"]

MANIFEST_FORMAT = "ckpt-engine-manifest"
MANIFEST_VERSION = 1
#: A manifest lists a few files per component and rank; anything bigger is not one of ours.
MAX_MANIFEST_BYTES = 64 << 20
_CHUNK = 8 << 20
_SAFE_PART = re.compile(r"^[A-Za-z0-9_.\-]+$")
_RANK_FILE = re.compile(r"^__(\d+)_")


@dataclass(frozen=True)
class FileEntry:
    size: int
    #: Hex digest, or None when the manifest was written with ``save_checksums=False``.
    checksum: str | None = None


@dataclass(frozen=True)
class Manifest:
    """The content of ``ckpt_engine_manifest.json``."""

    iteration: int
    world_size: int
    components: tuple[str, ...]
    #: Checksum algorithm of every entry, or None when none were computed.
    algorithm: str | None
    #: Relative path (``model/__0_0.distcp``) -> size and checksum.
    files: Mapping[str, FileEntry]
    engine_version: str = ""
    torch_version: str = ""
    created_unix: float = 0.0

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    def to_json(self) -> str:
        doc = {
            "format": MANIFEST_FORMAT,
            "version": MANIFEST_VERSION,
            "iteration": self.iteration,
            "world_size": self.world_size,
            "components": list(self.components),
            "engine_version": self.engine_version,
            "torch_version": self.torch_version,
            "python_version": sys.version.split()[0],
            "created_unix": self.created_unix,
            "checksum_algorithm": self.algorithm,
            "total_bytes": self.total_bytes,
            "files": {rel: {"size": e.size, "checksum": e.checksum} for rel, e in sorted(self.files.items())},
        }
        return json.dumps(doc, indent=1) + "\n"


def new_manifest(
    iteration: int, world_size: int, components: Iterable[str], algorithm: str | None, files: Mapping[str, FileEntry]
) -> Manifest:
    return Manifest(
        iteration=iteration,
        world_size=world_size,
        components=tuple(components),
        algorithm=algorithm,
        files=dict(files),
        engine_version=__version__,
        torch_version=str(torch.__version__),
        created_unix=time.time(),
    )


# -- files -------------------------------------------------------------------------------------


def _safe_rel(rel: Any) -> bool:
    if not isinstance(rel, str) or not rel or rel.startswith("/") or "\\" in rel:
        return False
    parts = rel.split("/")
    return len(parts) <= 4 and all(_SAFE_PART.match(p) and p not in (".", "..") for p in parts)


def list_files(checkpoint_dir: str | os.PathLike[str], store: Store | None = None) -> list[str]:
    """Relative paths (``/``-separated) of every regular file in a checkpoint, but the manifest
    (and the engine's per-rank upload reports)."""
    root = os.fspath(checkpoint_dir)
    return [
        rel
        for rel in store_for(root, store).list_files(root)
        if rel != MANIFEST_FILE and not rel.startswith(RANK_PART_PREFIX) and not is_part(rel)
    ]


def referenced_files(checked: CheckedCheckpoint) -> set[str]:
    """Files a checkpoint's DCP metadata needs: every ``.metadata`` and every data file it names."""
    out = set()
    for name, md in checked.components.items():
        out.add(f"{name}/.metadata")
        for info in (md.storage_data or {}).values():
            rel = getattr(info, "relative_path", None)
            if isinstance(rel, str):
                out.add(f"{name}/{rel}")
    return out


def owner_rank(rel: str, world_size: int) -> int:
    """The rank that wrote ``rel`` by DCP's naming (``__{rank}_{n}.distcp``); 0 for anything else."""
    m = _RANK_FILE.match(rel.rsplit("/", 1)[-1])
    if m is not None and int(m.group(1)) < world_size:
        return int(m.group(1))
    return 0


def hash_file(
    path: str, algorithm: str | None, progress: Callable[[int], None] | None = None, store: Store | None = None
) -> FileEntry:
    """Size and checksum of one regular file or object (``algorithm`` None: the size only)."""
    store = store_for(path, store)
    try:
        size: int | None = None
        if not store.is_object_store:
            st = os.stat(path)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(f"{path} is not a regular file")
            size = st.st_size
        if algorithm is None:
            return FileEntry(size=store.size(path) if size is None else size)
        hasher = new_hasher(algorithm)
        if hasher is None:
            raise CkptEngineError(f"checksum algorithm {algorithm!r} is not available here")
        size = 0
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        with store.open_read(path) as f:
            while n := f.readinto(buf):
                hasher.update(view[:n])
                size += n
                if progress is not None:
                    progress(n)
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


def write_manifest(checkpoint_dir: str | os.PathLike[str], manifest: Manifest, store: Store | None = None) -> None:
    """Write the manifest atomically (locally: temporary file, fsync, rename, fsync the folder; on
    an object store one PUT - there, the manifest is the checkpoint's completion marker)."""
    root = os.fspath(checkpoint_dir)
    store = store_for(root, store)
    store.write_bytes(store.join(root, MANIFEST_FILE), manifest.to_json().encode("utf-8"))


# -- reading -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class ManifestLookup:
    """A checkpoint's manifest, or why there is none usable (then the checkpoint is unverified)."""

    manifest: Manifest | None
    reason: str | None = None


def lookup_manifest(checkpoint_dir: str | os.PathLike[str], store: Store | None = None) -> ManifestLookup:
    """Read and validate ``ckpt_engine_manifest.json``. A missing one (plain DCP, the original
    checkpointer) or one of a newer format is a reason, not an error; a malformed one raises
    :class:`CorruptCheckpointError` naming the file. Parsing is plain JSON: nothing executes."""
    store = store_for(checkpoint_dir, store)
    path = store.join(os.fspath(checkpoint_dir), MANIFEST_FILE)
    raw = _read_manifest_bytes(store, path)
    if raw is None:
        return ManifestLookup(None, f"no {MANIFEST_FILE} (written by plain DCP or the original checkpointer)")
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CorruptCheckpointError(f"{path} is not valid JSON ({err}); the manifest is damaged") from err
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT:
        raise CorruptCheckpointError(f"{path} is not a ckpt-engine manifest (no format {MANIFEST_FORMAT!r})")
    version = doc.get("version")
    if not isinstance(version, int) or version < 1:
        raise CorruptCheckpointError(f"{path} has an invalid version {version!r}")
    if version > MANIFEST_VERSION:
        return ManifestLookup(
            None, f"{path} has manifest version {version}, newer than this engine reads ({MANIFEST_VERSION})"
        )
    try:
        return ManifestLookup(_manifest_from_doc(doc))
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CorruptCheckpointError(f"{path} is malformed: {err}") from err


def _read_manifest_bytes(store: Store, path: str) -> bytes | None:
    """The manifest's bytes, or None when there is none; a file that cannot be read raises."""
    try:
        raw = store.read_bytes(path, MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        return None
    except PermissionError as err:
        raise CheckpointPermissionError(f"cannot read {path}: {denied(err)}") from err
    except OSError as err:
        raise CorruptCheckpointError(f"cannot read {path}: {err.strerror or err}") from err
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{path} is larger than {MAX_MANIFEST_BYTES} bytes; not a manifest")
    return raw


def _manifest_from_doc(doc: dict[str, Any]) -> Manifest:
    """The manifest a parsed document of a known version describes; a malformed field raises
    ``KeyError``, ``TypeError``, ``ValueError`` or ``AttributeError`` naming it."""
    files_doc = doc["files"]
    if not isinstance(files_doc, dict):
        raise TypeError("'files' is not a mapping")
    files = {rel: _file_entry(rel, entry) for rel, entry in files_doc.items()}
    algorithm = doc.get("checksum_algorithm")
    if algorithm is not None and not isinstance(algorithm, str):
        raise ValueError(f"checksum_algorithm is {algorithm!r}")
    components = doc.get("components", [])
    if not isinstance(components, list) or not all(isinstance(c, str) for c in components):
        raise ValueError(f"components is {components!r}")
    return Manifest(
        iteration=int(doc.get("iteration", -1)),
        world_size=int(doc.get("world_size", 0)),
        components=tuple(components),
        algorithm=algorithm,
        files=files,
        engine_version=str(doc.get("engine_version", "")),
        torch_version=str(doc.get("torch_version", "")),
        created_unix=float(doc.get("created_unix", 0.0)),
    )


def _file_entry(rel: Any, entry: Any) -> FileEntry:
    if not _safe_rel(rel):
        raise ValueError(f"file name {rel!r} is not a plain relative path inside the checkpoint")
    size, checksum = entry["size"], entry.get("checksum")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"size of {rel!r} is {size!r}")
    if checksum is not None and not (isinstance(checksum, str) and re.fullmatch(r"[0-9a-f]{1,128}", checksum)):
        raise ValueError(f"checksum of {rel!r} is {checksum!r}")
    return FileEntry(size=size, checksum=checksum)


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
        hasher = new_hasher(manifest.algorithm) if manifest.algorithm and entry.checksum else None
        if hasher is not None:
            hasher.update(data)
            if hasher.hexdigest() != entry.checksum:
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


def shard_files(files: Mapping[str, FileEntry], world_size: int) -> list[set[str]]:
    """Split files among ranks by size (largest first, to the least loaded rank); deterministic."""
    shares: list[set[str]] = [set() for _ in range(max(world_size, 1))]
    loads = [0] * len(shares)
    for rel, entry in sorted(files.items(), key=lambda kv: (-kv[1].size, kv[0])):
        r = loads.index(min(loads))
        shares[r].add(rel)
        loads[r] += entry.size
    return shares


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
    listed = (listing if listing is not None else store.list_files(root)) if store.is_object_store else None
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
    """

    path: str
    complete: bool
    verified: bool
    unverified_reason: str | None = None
    problems: list[str] = field(default_factory=list)
    files: int = 0
    bytes: int = 0
    level: str = "checksums"

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

    Completeness (DESIGN section 2) first, then the manifest at ``level``: ``sizes`` compares
    every file's size, ``checksums`` also reads every file and compares its checksum.
    ``progress(done_bytes, total_bytes)`` is called as bytes are checked. Reads only.
    """
    path = os.fspath(path)
    if level not in ("sizes", "checksums"):
        raise ValueError(f"level must be 'sizes' or 'checksums', got {level!r}")
    store = store_for(path, store)
    problems: list[str] = []
    lookup, checked = _lookup_and_check_complete(path, store, problems)
    if lookup is None:
        return VerifyReport(path, checked is not None, False, "the manifest is unreadable", problems, level=level)
    if lookup.manifest is None and store.is_object_store:
        problems.append(
            f"{path} has no {MANIFEST_FILE}: on an object store that marker is written last, so the checkpoint "
            "is incomplete (an interrupted save) and the engine never loads it"
        )
        return VerifyReport(path, False, False, "no completion marker", problems, level=level)
    if lookup.manifest is None:
        nbytes = _metadata_bytes(checked)
        files = len(referenced_files(checked)) if checked is not None else 0
        return VerifyReport(path, checked is not None, False, lookup.reason, problems, files, nbytes, level)
    return _verify_against_manifest(path, lookup.manifest, checked, problems, level, progress, store)


def _lookup_and_check_complete(
    path: str, store: Store, problems: list[str]
) -> tuple[ManifestLookup | None, CheckedCheckpoint | None]:
    """The manifest lookup (None: unreadable) and the completeness check (None: incomplete), the
    ``.metadata`` files checked against the manifest before they are parsed; what failed goes
    to ``problems``."""
    lookup: ManifestLookup | None = None
    checked: CheckedCheckpoint | None = None
    try:
        lookup = lookup_manifest(path, store)
    except CkptEngineError as err:
        problems.append(str(err))
    try:
        checker = metadata_checker(path, lookup.manifest, store) if lookup and lookup.manifest else None
        checked = check_complete(path, store, checker)
    except CkptEngineError as err:
        problems.append(str(err))
    return lookup, checked


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
