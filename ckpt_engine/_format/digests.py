"""Checksums computed while writing: per-writer digest parts, merged at commit.

The engine's storage writer hashes every byte of a data file as it writes it and, when a
component's files are written, leaves a small *part* next to them
(``model/.ckpt_engine_part__0_.json``: each file's size and digest). At commit, each rank takes
the entries of the files it wrote from the parts (in the sync case they travel in the commit's
all-gather), and rank 0 merges them into the manifest; only a file no part covers (written by
another storage writer, or a part that disagrees with the file's size) is read again to hash it.
Rank 0 removes the parts before the manifest is written, so a committed checkpoint holds exactly
the files it always did.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from . import bounded_json
from .hashing import hash_files
from .manifest import CARRIED, MAX_MANIFEST_BYTES, FileEntry, entry_doc, parse_blocks
from .names import PART_PREFIX, is_part

__all__ = [
    "PART_PREFIX",
    "carried_copies",
    "is_part",
    "read_parts",
    "remove_parts",
    "report_blocks",
    "write_part",
    "written_entries",
]


def write_part(
    folder: str,
    name: str,
    algorithm: str | None,
    files: dict[str, tuple[int, str | None]],
    carried: Mapping[str, str] | None = None,
    blocks: Mapping[str, Sequence[tuple[int, str]]] | None = None,
) -> None:
    """Record ``files`` (file name in ``folder`` -> size, hex digest) as part ``name``;
    ``carried``: the files carried over from the previous checkpoint, and how (``"link"``,
    ``"copy"``; ``"write"``: it could have been, but was written); ``blocks``: each file's
    per-block ``(length, digest)`` (what a load checks the bytes it reads against)."""
    carried, blocks = carried or {}, blocks or {}

    def entry(f: str, s: int, c: str | None) -> FileEntry:
        cut = blocks.get(f)
        return FileEntry(size=s, checksum=c, carried=carried.get(f), blocks=None if cut is None else tuple(cut))

    doc = {"algorithm": algorithm, "files": {f: entry_doc(entry(f, s, c)) for f, (s, c) in files.items()}}
    path = os.path.join(folder, f"{PART_PREFIX}{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f)
    os.replace(path + ".tmp", path)


def read_parts(root: str, algorithm: str | None) -> dict[str, FileEntry]:
    """Every part under the checkpoint folder ``root`` (one level of component folders) whose
    algorithm is ``algorithm``, as ``rel -> FileEntry``; entries whose file does not have the
    recorded size are left out (they are hashed again)."""
    out: dict[str, FileEntry] = {}
    for comp, part in _parts(root):
        try:
            with open(os.path.join(root, comp, part), "rb") as f:
                doc: Any = bounded_json.loads(f.read(MAX_MANIFEST_BYTES + 1), max_depth=8, max_int_digits=24)
        except (OSError, ValueError):  # bounded_json.JSONRefused is a ValueError
            continue
        if not isinstance(doc, dict) or doc.get("algorithm") != algorithm or not isinstance(doc.get("files"), dict):
            continue
        for name, entry in doc["files"].items():
            if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
                continue
            if entry.get("carried") == "copy" and isinstance(entry.get("checksum"), str):
                # Not written here: the upload copies it inside the object store.
                out[f"{comp}/{name}"] = FileEntry(
                    size=entry["size"], checksum=entry["checksum"], carried="copy", blocks=report_blocks(entry)
                )
                continue
            try:
                size = os.stat(os.path.join(root, comp, name)).st_size
            except OSError:
                continue
            checksum, carried = entry.get("checksum"), entry.get("carried")
            if size == entry["size"] and (checksum is None or isinstance(checksum, str)):
                out[f"{comp}/{name}"] = FileEntry(
                    size=size,
                    checksum=checksum if algorithm is not None else None,
                    carried=carried if carried in CARRIED else None,
                    written_unchanged=carried == "write",
                    blocks=report_blocks(entry) if algorithm is not None else None,
                )
    return out


def report_blocks(entry: dict[str, Any]) -> tuple[tuple[int, str], ...] | None:
    """A part entry's per-block digests, or ``None`` (none recorded, or malformed: then a load
    checks that file as a manifest without blocks allows)."""
    try:
        return parse_blocks(entry.get("blocks"), entry["size"])
    except ValueError:
        return None


def remove_parts(root: str) -> None:
    for comp, part in _parts(root):
        try:
            os.remove(os.path.join(root, comp, part))
        except FileNotFoundError:
            continue


def _parts(root: str) -> Iterable[tuple[str, str]]:
    try:
        comps = [e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except OSError:
        return []
    found = []
    for comp in comps:
        try:
            found += [(comp, e.name) for e in os.scandir(os.path.join(root, comp)) if e.name.startswith(PART_PREFIX)]
        except OSError:
            continue
    return found


def carried_copies(root: str, algorithm: str | None) -> list[str]:
    """Files of the checkpoint folder ``root`` its parts record as carried over by a copy inside
    the object store (there is no local file: the upload copies the previous checkpoint's)."""
    return sorted(rel for rel, e in read_parts(root, algorithm).items() if e.carried == "copy")


def written_entries(root: str, rels: Iterable[str], algorithm: str | None) -> dict[str, Any]:
    """``integrity.FileEntry`` of each of ``rels`` under ``root``: from the parts where they cover
    a file (its bytes were hashed as they were written), else hashed now."""
    wanted = set(rels)
    parts = read_parts(root, algorithm) if wanted else {}
    out: dict[str, Any] = {rel: entry for rel, entry in parts.items() if rel in wanted}
    out.update(hash_files(root, wanted - set(out), algorithm))
    return out
