"""Paths and text for the command line: local or object-store paths as the commands print and
test them, a save folder's interrupted saves, sizes and tables. No torch: ``ckpt-engine ls``
uses these without importing DCP."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence

from .._format.names import METADATA_FILE, parse_iteration
from .._storage.store import is_url, open_store

__all__ = [
    "disk_usage",
    "exists",
    "human_bytes",
    "is_component_dir",
    "isdir",
    "isfile",
    "normalize",
    "shared_once_usage",
    "shown",
    "table",
    "uncommitted_dirs",
]


#: Characters a terminal acts on instead of showing: C0 and C1 controls (ESC, BEL, CR, newline,
#: ...), DEL, the line and paragraph separators, and the bidirectional overrides and isolates.
_UNSHOWN = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_UNSHOWN_BUT_NEWLINE = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def shown(text: str, *, lines: bool = False) -> str:
    """``text`` read from a file (a key, a file name) as a terminal may show it: every character a
    terminal would act on escaped as ``repr`` writes it (ESC as ``\\x1b``); ``lines`` keeps
    newlines (a printed block of lines whose names were escaped already)."""
    pattern = _UNSHOWN_BUT_NEWLINE if lines else _UNSHOWN
    return pattern.sub(lambda m: repr(m.group())[1:-1], text)


def normalize(path: str) -> str:
    """A path as the commands print it: normalised locally, a URL without its trailing slash.
    URLs use the standard credentials (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``, ...)."""
    return path.rstrip("/") if is_url(path) else os.path.normpath(path)


def exists(path: str) -> bool:
    return open_store(path).exists(path)


def isdir(path: str) -> bool:
    return open_store(path).isdir(path)


def isfile(path: str) -> bool:
    return os.path.isfile(path) if not is_url(path) else open_store(path).exists(path) and not isdir(path)


def is_component_dir(path: str) -> bool:
    return isfile(os.path.join(path, METADATA_FILE))


def shared_once_usage(path: str) -> int:
    """Bytes the files under local folder ``path`` use, a file with several links (checkpoints
    sharing it: ``incremental`` saves) counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                st = os.stat(os.path.join(root, name), follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def disk_usage(path: str) -> tuple[int, int]:
    """``(bytes, files)`` under ``path``."""
    if is_url(path):
        sizes = open_store(path).list_files(path)
        return sum(sizes.values()), len(sizes)
    total = files = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.stat(os.path.join(root, name)).st_size
            except OSError:
                continue
            files += 1
    return total, files


def uncommitted_dirs(save_dir: str) -> list[tuple[int, str]]:
    """``(iteration, path)`` of leftover ``.iter_*.partial`` folders (interrupted saves; an object
    store has none: an interrupted save there is an ``iter_*`` prefix without its marker)."""
    if is_url(save_dir):
        return []
    out = []
    try:
        entries = list(os.scandir(save_dir))
    except OSError:
        return []
    for e in entries:
        if e.name.startswith(".iter_") and e.name.endswith(".partial") and e.is_dir():
            it = parse_iteration(e.name[1 : -len(".partial")])
            if it is not None:
                out.append((it, e.path))
    return sorted(out)


def human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{int(size)} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def table(rows: Sequence[Sequence[str]], header: Sequence[str], right: Iterable[int] = ()) -> list[str]:
    """Rows as aligned text columns; columns in ``right`` are right-aligned."""
    right = set(right)
    cols = list(zip(*([list(header), *[list(r) for r in rows]]), strict=True)) if rows else [[h] for h in header]
    widths = [max(len(c) for c in col) for col in cols]
    out = []
    for row in [header, *rows]:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
    return out
