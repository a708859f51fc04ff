"""Every rank of a load reads one checkpoint: what each rank resolved, compared before any byte is read.

Each rank resolves the checkpoint it loads on its own: it reads ``latest_checkpoint.txt``, lists
the folder, follows ``load_path``. Ranks that see different files under one path (a stale
``latest`` on one host, host-local copies that diverged, a network filesystem's attribute cache)
would each load their own checkpoint, or, where rank 0 reads the ``.metadata`` for everyone and
``dedup_reads`` shares the data, a mix of two, and report one iteration. So before anything is
read, :func:`require_one_checkpoint` exchanges every rank's :class:`CheckpointView` in one
all-gather and raises :class:`~ckpt_engine.errors.CheckpointDisagreementError` on every rank when
they differ, naming which ranks saw what.

What a view compares is what the checkpoint holds, not where it lies, so that host-local copies
of one checkpoint agree:

* a checkpoint folder with a manifest with checksums: its iteration and a digest of its file
  list (each file's name, size and checksum; not the files' versions, which differ between
  copies);
* any other checkpoint folder (plain DCP, the original checkpointer, ``save_checksums: false``):
  its name and a digest of every component's ``.metadata`` bytes (which name the save);
* a ``.pth`` file: a digest of its bytes (every rank reads all of them anyway);
* safetensors weights: a digest of every file's size and header (names, dtypes, shapes,
  offsets). Comparing the values too would make every rank read every byte, where each reads
  only its share; two exports with equal layouts and different values are not told apart.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .._dcpio import dist as _dist
from .._dcpio.hf_read import SafetensorsIndex
from .._format.hashing import DEFAULT_ALGORITHM, hash_stream, new_hasher
from .._format.manifest import lookup_manifest
from .._format.metadata import MAX_METADATA_BYTES
from .._format.names import METADATA_FILE, parse_iteration
from .._storage.store import Store
from ..errors import CheckpointDisagreementError, CkptEngineError

__all__ = ["CheckpointView", "file_view", "folder_view", "require_one_checkpoint", "safetensors_view"]

#: Rank groups and characters of each shown in a disagreement (the message stays bounded).
_GROUPS_SHOWN = 4
_NAME_CHARS = 80


@dataclass(frozen=True)
class CheckpointView:
    """What one rank is about to load."""

    #: The checkpoint folder's (or file's) name, as this rank resolved it.
    name: str
    #: The iteration its manifest records (else the one its name says), or ``None``.
    iteration: int | None
    #: ``"manifest <hex>"``, ``"metadata <hex>"``, ``"file <hex>"``, ``"safetensors <hex>"``,
    #: or ``"unreadable (<error type>)"``: what its content digest was taken of, and the digest.
    content: str

    def describe(self) -> str:
        it = "" if self.iteration is None else f" (iteration {self.iteration})"
        return f"{self.name[:_NAME_CHARS]}{it}, {self.content}"


def _digest(parts: list[bytes]) -> str:
    hasher = new_hasher(DEFAULT_ALGORITHM)
    assert hasher is not None  # the default algorithm is always available
    for part in parts:
        hasher.update(len(part).to_bytes(8, "little"))
        hasher.update(part)
    return hasher.hexdigest()


def _name(path: str) -> str:
    return os.path.basename(path.rstrip("/")) or path


def folder_view(path: str, store: Store) -> CheckpointView:
    """The view of the checkpoint folder ``path``; never raises (an unreadable checkpoint is a
    view too: the checks that follow report what is wrong with it)."""
    name = _name(path)
    try:
        manifest = lookup_manifest(path, store).manifest
        if manifest is not None and manifest.algorithm is not None:
            listing = sorted((rel, e.size, e.checksum) for rel, e in manifest.files.items())
            body = json.dumps([manifest.algorithm, listing]).encode()
            return CheckpointView(name, manifest.iteration, f"manifest {_digest([body])}")
        parts = []
        for entry, is_dir in store.list_dir(path):
            md = store.join(store.join(path, entry), METADATA_FILE)
            if is_dir and store.exists(md):
                parts += [entry.encode(), store.read_bytes(md, MAX_METADATA_BYTES)]
        return CheckpointView(name, parse_iteration(name), f"metadata {_digest(parts)}")
    except (OSError, CkptEngineError) as err:
        return CheckpointView(name, parse_iteration(name), f"unreadable ({type(err).__name__})")


def file_view(path: str, store: Store) -> CheckpointView:
    """The view of a single-file checkpoint (``.pth``): a digest of all its bytes."""
    hasher = new_hasher(DEFAULT_ALGORITHM)
    assert hasher is not None
    try:
        with store.open_read(path) as f:
            hash_stream(f, hasher)
    except (OSError, CkptEngineError) as err:
        return CheckpointView(_name(path), None, f"unreadable ({type(err).__name__})")
    return CheckpointView(_name(path), None, f"file {hasher.hexdigest()}")


def safetensors_view(index: SafetensorsIndex) -> CheckpointView:
    """The view of safetensors weights: each file's name and size, and every tensor's name,
    dtype, shape and place, as the headers give them (no tensor data is read)."""
    try:
        sizes = [f"{os.path.basename(f)}:{os.path.getsize(f)}" for f in sorted(index.files)]
    except OSError as err:
        return CheckpointView(_name(index.path), None, f"unreadable ({type(err).__name__})")
    layout = sorted(
        (name, os.path.basename(e.file), str(e.dtype), list(e.shape), e.begin, e.end)
        for name, e in index.tensors.items()
    )
    body = json.dumps([sizes, layout]).encode()
    return CheckpointView(_name(index.path), None, f"safetensors {_digest([body])}")


def require_one_checkpoint(view: CheckpointView, what: str) -> None:
    """Every rank passes the view of what it is about to load (``what``: ``latest``,
    ``load_path``, ...); raise :class:`CheckpointDisagreementError` on every rank unless all are
    equal. One all-gather of a few hundred bytes per rank; nothing with one process."""
    if _dist.world_size() <= 1:
        return
    views: list[CheckpointView] = _dist.all_gather_object(view, step="checkpoint agreement")
    if all(v == views[0] for v in views):
        return
    groups: dict[CheckpointView, list[int]] = {}
    for rank, v in enumerate(views):
        groups.setdefault(v, []).append(rank)
    shown = [f"{_ranks(ranks)} {'sees' if len(ranks) == 1 else 'see'} {v.describe()}" for v, ranks in groups.items()]
    more = f"; and {len(shown) - _GROUPS_SHOWN} more" if len(shown) > _GROUPS_SHOWN else ""
    raise CheckpointDisagreementError(
        f"the ranks resolved different checkpoints for {what}: {'; '.join(shown[:_GROUPS_SHOWN])}{more}. Nothing "
        "was read. Every rank must see the same checkpoint: look for a stale latest_checkpoint.txt or a diverged "
        "host-local copy on the hosts named, or a network filesystem caching old attributes (mount it with "
        "actimeo=0 or lookupcache=positive); then resume again"
    )


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    head = ", ".join(str(r) for r in ranks[:8])
    return f"ranks {head}{', ...' if len(ranks) > 8 else ''} ({len(ranks)})"
