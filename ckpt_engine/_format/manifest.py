"""The manifest: the file list a checkpoint is committed with, written and read.

Every checkpoint the engine commits holds ``ckpt_engine_manifest.json`` at its top level (next to
the component folders, never inside one, so each component stays a plain DCP checkpoint). It
lists every file with its size and checksum, plus the engine and torch versions, the world size,
the components and the iteration. Checkpoints without one (plain DCP, the original
checkpointer) still load; they are reported as unverified.

The engine writes it on save (:func:`write_manifest`, with the digests of :mod:`.hashing`) and finds
it on load (:func:`lookup_manifest`); checking a checkpoint against it is :mod:`.verify`'s job.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .._storage.store import VERSION_PATTERN, Store, store_for
from .._version import __version__
from ..errors import CheckpointPermissionError, CorruptCheckpointError, clip, denied
from . import bounded_json
from .layout import CheckedCheckpoint
from .names import MANIFEST_FILE, RANK_PART_PREFIX, is_part

__all__ = [
    "MANIFEST_FILE",
    "FileEntry",
    "Lineage",
    "Manifest",
    "Place",
    "parse_manifest",
]

MANIFEST_FORMAT = "ckpt-engine-manifest"
MANIFEST_VERSION = 1
#: A manifest lists a few files per component and rank; anything bigger is not one of ours.
MAX_MANIFEST_BYTES = 64 << 20
_SAFE_PART = re.compile(r"^[A-Za-z0-9_.\-]+$")
_RANK_FILE = re.compile(r"^__(\d+)_")
_HEX = re.compile(r"[0-9a-f]{1,128}")


#: How a file can have been carried over from the previous checkpoint (``incremental``).
CARRIED = ("link", "copy")


@dataclass(frozen=True)
class FileEntry:
    size: int
    #: Hex digest, or None when the manifest was written with ``save_checksums=False``.
    checksum: str | None = None
    #: ``"link"`` or ``"copy"`` when the file was carried over from the previous checkpoint
    #: (``EngineConfig.incremental``) instead of written; ``None``: written by this save.
    carried: str | None = None
    #: Unchanged, but written: carrying it over was refused (save-time bookkeeping, not stored).
    written_unchanged: bool = False
    #: The file's version when the checkpoint was committed (:meth:`.Store.versions`: a local
    #: file's inode, size, mtime and ctime; an object's version id or ETag). An incremental save
    #: carries the file over unread only while its version is still this one; ``None``: unknown.
    seen: str | None = None
    #: The file's bytes in blocks, front to back, each ``(length, hex digest)`` with the
    #: manifest's algorithm (``data_file.BlockHasher``): a load checks each block it reads.
    #: ``None``: not recorded (a manifest from before, a file DCP's own writer wrote).
    blocks: tuple[tuple[int, str], ...] | None = None


_LINEAGE_ID = re.compile(r"^[0-9a-f]{1,64}(-[0-9]{1,12})?$")
#: The most ranks a manifest may name: every rank of a job is a process, and loops over the
#: ranks of a hostile manifest stay bounded.
MAX_WORLD_SIZE = 1 << 20
#: The longest folder a lineage's place records (a path or URL; PATH_MAX is 4096).
MAX_PLACE = 4096


@dataclass(frozen=True)
class Place:
    """Where a save was made: ``save_dir`` and ``local_dir`` as rank 0 named them (absolute paths
    as spelled, or URLs) and as they resolved there (symbolic links followed). Two jobs that share
    a ``local_dir`` tell their steps apart by ``save_dir``, even where one job's ``save_dir`` is a
    copy of the other's (it carries the run's id). A folder is the same where either form is:
    another spelling of it (a symlink) or the same spelling on a host whose links differ."""

    save_dir: str
    local_dir: str
    real_save_dir: str = ""
    real_local_dir: str = ""

    def same_save_dir(self, other: Place) -> bool:
        return self.save_dir == other.save_dir or _same_real(self.real_save_dir, other.real_save_dir)

    def same_local_dir(self, other: Place) -> bool:
        return self.local_dir == other.local_dir or _same_real(self.real_local_dir, other.real_local_dir)


def _same_real(a: str, b: str) -> bool:
    return bool(a) and a == b


@dataclass(frozen=True)
class Lineage:
    """Which run and which save made a checkpoint, and the durable step it descends from: what a
    resume from the node-local tier compares with ``save_dir``'s latest (DESIGN section 12)."""

    #: The run (one per ``save_dir`` history): created by the first save into a ``save_dir``
    #: without one, adopted from ``save_dir``'s latest by every later engine.
    run_id: str
    #: The save attempt that wrote it (``<engine instance>-<count>``), the same on every rank.
    save_id: str
    #: The save id and iteration of the newest durable step committed before this save
    #: (``None``: none in this run).
    parent_save_id: str | None = None
    parent_iteration: int | None = None
    #: Where the save was made (``None``: not recorded, a save before places were).
    place: Place | None = None

    def to_doc(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "run_id": self.run_id,
            "save_id": self.save_id,
            "parent_save_id": self.parent_save_id,
            "parent_iteration": self.parent_iteration,
        }
        if self.place is not None:
            place = self.place
            doc["place"] = {
                "save_dir": place.save_dir,
                "local_dir": place.local_dir,
                "real": [place.real_save_dir, place.real_local_dir],
            }
        return doc

    @property
    def instance(self) -> str:
        """The engine instance that made the save (the save id without its count)."""
        return self.save_id.rsplit("-", 1)[0]


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
    #: Saves since the last full write whose files this one may share (``incremental``; 0: it
    #: shares none with an older checkpoint). Bounded by ``EngineConfig.full_save_every``.
    carry_chain: int = 0
    #: A rank-local checkpoint of the node-local tier (``EngineConfig.local_dir``): the rank whose
    #: state it holds (``world_size`` is then the job's). ``None``: a checkpoint of the whole job.
    rank: int | None = None
    #: The run and save that made it (``None``: a checkpoint written without a lineage, by an
    #: older engine or without ``local_dir``).
    lineage: Lineage | None = None
    #: Components holding state that differed across the ranks, saved per rank (in a rank-local
    #: checkpoint under the plain keys, each rank its own): no one rank's part stands for the job.
    per_rank: tuple[str, ...] = ()

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    @property
    def carried_bytes(self) -> int:
        """Bytes of the files carried over from the previous checkpoint (not written by this save)."""
        return sum(e.size for e in self.files.values() if e.carried is not None)

    @property
    def carried_files(self) -> int:
        """How many files were carried over from the previous checkpoint."""
        return sum(e.carried is not None for e in self.files.values())

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
            "carry_chain": self.carry_chain,
            **({} if self.rank is None else {"rank": self.rank}),
            **({} if self.lineage is None else {"lineage": self.lineage.to_doc()}),
            **({"per_rank": list(self.per_rank)} if self.per_rank else {}),
            "files": {rel: entry_doc(e) for rel, e in sorted(self.files.items())},
        }
        return json.dumps(doc, indent=1) + "\n"


def entry_doc(entry: FileEntry) -> dict[str, Any]:
    """One file's entry as JSON holds it (the manifest, digest parts, upload reports)."""
    doc: dict[str, Any] = {"size": entry.size, "checksum": entry.checksum}
    if entry.carried is not None:
        doc["carried"] = entry.carried
    if entry.seen is not None:
        doc["seen"] = entry.seen
    if entry.blocks is not None:
        doc["blocks"] = ",".join(f"{n}:{d}" for n, d in entry.blocks)  # one line: a block is 25 bytes
    return doc


def parse_blocks(doc: Any, size: int) -> tuple[tuple[int, str], ...] | None:
    """An entry's ``blocks`` as recorded (``None`` where absent): ``"length:digest,..."``;
    ``ValueError`` unless each is a positive length and a hex digest, adding up to ``size``."""
    if doc is None:
        return None
    if not isinstance(doc, str) or not doc:
        raise ValueError("blocks is not a 'length:digest,...' string")
    out = []
    for block in doc.split(","):
        n, _, digest = block.partition(":")
        if not (n.isdigit() and len(n) <= 16 and int(n) > 0 and _HEX.fullmatch(digest)):
            raise ValueError(f"a block is not 'length:digest' ({block[:40]!r})")
        out.append((int(n), digest))
    if sum(n for n, _ in out) != size:
        raise ValueError(f"the blocks add up to {sum(n for n, _ in out)} bytes, not the file's {size}")
    return tuple(out)


def new_manifest(
    iteration: int,
    world_size: int,
    components: Iterable[str],
    algorithm: str | None,
    files: Mapping[str, FileEntry],
    carry_chain: int = 0,
    rank: int | None = None,
    lineage: Lineage | None = None,
    per_rank: Iterable[str] = (),
) -> Manifest:
    import torch  # here, not at the top: reading a manifest (ckpt-engine ls) imports no torch

    return Manifest(
        iteration=iteration,
        world_size=world_size,
        components=tuple(components),
        algorithm=algorithm,
        files=dict(files),
        engine_version=__version__,
        torch_version=str(torch.__version__),
        created_unix=time.time(),
        carry_chain=carry_chain,
        rank=rank,
        lineage=lineage,
        per_rank=tuple(per_rank),
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
        doc = _bounded_doc(raw)
    except bounded_json.JSONRefused as err:
        raise CorruptCheckpointError(f"{path} is refused ({err}); the manifest is damaged") from None
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


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """A manifest's bytes from elsewhere (a peer rank's replica), parsed within fixed bounds
    (nesting, integer digits, size) and validated as :func:`lookup_manifest` validates a file;
    anything else raises :class:`CorruptCheckpointError` naming ``where``. Nothing executes."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where}: {len(raw)} bytes is larger than a manifest may be")
    try:
        doc = _bounded_doc(raw)
    except bounded_json.JSONRefused as err:
        raise CorruptCheckpointError(f"{where}: the manifest is refused: {err}") from None
    if not isinstance(doc, dict) or doc.get("format") != MANIFEST_FORMAT or doc.get("version") != MANIFEST_VERSION:
        raise CorruptCheckpointError(f"{where} is not a version {MANIFEST_VERSION} ckpt-engine manifest")
    try:
        return _manifest_from_doc(doc)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise CorruptCheckpointError(f"{where}: the manifest is malformed: {clip(str(err), 200)}") from None


def _bounded_doc(raw: bytes) -> Any:
    """A manifest's JSON within the bounds every manifest is read with: the engine writes nesting
    of at most 5, integers of at most 20 digits, no ``NaN``/``Infinity``, each key once."""
    return bounded_json.loads(raw, max_depth=8, max_int_digits=24, constants=False, unique_keys=True)


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
        iteration=_iteration(doc.get("iteration", -1)),
        world_size=_world_size(doc.get("world_size", 0)),
        components=tuple(components),
        algorithm=algorithm,
        files=files,
        engine_version=str(doc.get("engine_version", "")),
        torch_version=str(doc.get("torch_version", "")),
        created_unix=float(doc.get("created_unix", 0.0)),
        carry_chain=_chain(doc.get("carry_chain", 0)),
        rank=None if doc.get("rank") is None else _count("rank", doc["rank"]),
        lineage=_lineage(doc.get("lineage")),
        per_rank=_per_rank(doc.get("per_rank", []), set(components)),
    )


def _per_rank(doc: Any, components: set[str]) -> tuple[str, ...]:
    if not (isinstance(doc, list) and all(isinstance(c, str) and c in components for c in doc)):
        raise ValueError(f"per_rank {clip(repr(doc), 80)} is not a list of the checkpoint's components")
    return tuple(doc)


def _lineage(doc: Any) -> Lineage | None:
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise ValueError("lineage is not a mapping")
    run, save, parent = _lineage_id(doc, "run_id"), _lineage_id(doc, "save_id"), doc.get("parent_save_id")
    if run is None or save is None:
        raise ValueError("lineage lacks its run_id or save_id")
    parent_it = doc.get("parent_iteration")
    return Lineage(
        run,
        save,
        None if parent is None else _lineage_id(doc, "parent_save_id"),
        None if parent_it is None else _count("parent_iteration", parent_it),
        _place(doc.get("place")),
    )


def _place(doc: Any) -> Place | None:
    if doc is None:
        return None
    folders = [doc.get(k) for k in ("save_dir", "local_dir")] if isinstance(doc, dict) else []
    real = doc.get("real", ["", ""]) if isinstance(doc, dict) else None
    good = [f for f in folders if isinstance(f, str) and 0 < len(f) <= MAX_PLACE]
    real_ok = (
        isinstance(real, list) and len(real) == 2 and all(isinstance(r, str) and len(r) <= MAX_PLACE for r in real)
    )
    if len(good) != 2 or not real_ok:
        raise ValueError(f"lineage place {clip(repr(doc), 80)} is not a save_dir and a local_dir")
    assert isinstance(real, list)
    return Place(good[0], good[1], real[0], real[1])


def _lineage_id(doc: dict[str, Any], key: str) -> str | None:
    value = doc.get(key)
    if value is not None and not (isinstance(value, str) and _LINEAGE_ID.fullmatch(value)):
        raise ValueError(f"lineage {key} {clip(repr(value), 80)} is not an id")
    return value


def _iteration(value: Any) -> int:
    if value == -1 and type(value) is int:
        return -1  # a manifest without one (written before iterations were recorded)
    return _count("iteration", value)


def _world_size(value: Any) -> int:
    size = _count("world_size", value)
    if size > MAX_WORLD_SIZE:
        raise ValueError(f"world_size {size} is more ranks than a job has (at most {MAX_WORLD_SIZE})")
    return size


def _chain(value: Any) -> int:
    return _count("carry_chain", value)


def _count(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 31:
        raise ValueError(f"{name} is not a count (a {type(value).__name__})")
    return value


def _file_entry(rel: Any, entry: Any) -> FileEntry:
    if not _safe_rel(rel):
        raise ValueError(f"file name {rel!r} is not a plain relative path inside the checkpoint")
    size, checksum, carried, seen = entry["size"], entry.get("checksum"), entry.get("carried"), entry.get("seen")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise ValueError(f"size of {rel!r} is {size!r}")
    if checksum is not None and not (isinstance(checksum, str) and re.fullmatch(r"[0-9a-f]{1,128}", checksum)):
        raise ValueError(f"checksum of {rel!r} is {checksum!r}")
    if carried is not None and carried not in CARRIED:
        raise ValueError(f"carried of {rel!r} is not one of {CARRIED}")
    if seen is not None and not (isinstance(seen, str) and VERSION_PATTERN.fullmatch(seen)):
        raise ValueError(f"seen of {rel!r} is not a file version")
    try:
        blocks = parse_blocks(entry.get("blocks"), size)
    except ValueError as err:
        raise ValueError(f"blocks of {rel!r}: {err}") from None
    return FileEntry(size=size, checksum=checksum, carried=carried, seen=seen, blocks=blocks)


def unchanged_files(
    checkpoint_dir: str, store: Store | None = None, manifest: Manifest | None = None
) -> dict[str, FileEntry]:
    """The files of the committed checkpoint ``checkpoint_dir`` that are still what its manifest
    recorded: each one's version (:meth:`.Store.versions`, one listing) is the one recorded at
    commit. A file changed or replaced since, or one whose version was not recorded (a manifest
    from before versions were), is left out: nothing vouches for its bytes without reading them.
    ``manifest``: the checkpoint's, when the caller has read it already."""
    store = store_for(checkpoint_dir, store)
    if manifest is None:
        manifest = lookup_manifest(checkpoint_dir, store).manifest
    if manifest is None:
        return {}
    now = store.versions(checkpoint_dir)
    return {rel: e for rel, e in manifest.files.items() if e.seen is not None and now.get(rel) == e.seen}


def shard_files(files: Mapping[str, FileEntry], world_size: int) -> list[set[str]]:
    """Split files among ranks by size (largest first, to the least loaded rank); deterministic."""
    shares: list[set[str]] = [set() for _ in range(max(world_size, 1))]
    loads = [0] * len(shares)
    for rel, entry in sorted(files.items(), key=lambda kv: (-kv[1].size, kv[0])):
        r = loads.index(min(loads))
        shares[r].add(rel)
        loads[r] += entry.size
    return shares
