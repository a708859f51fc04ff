"""What a rank-local checkpoint (one rank's part of a model, as the node-local tier keeps it) holds:
which rank, how many elements of each tensor, and the region a read of a tensor it holds only
part of lacks, which is refused, never filled in.

DCP records a tensor's global shape and the chunks it stores; a rank-local checkpoint's chunks are
one rank's shards, so they need not cover the shape (``.metadata`` says so with the rank-local mark,
:func:`~ckpt_engine._format.metadata_read.is_rank_local`). Every command that reads one says it is
a part (:class:`Part`), and a read that needs a whole tensor of it raises
:class:`~ckpt_engine.errors.PartialCheckpointError` naming the key and the missing elements.
Torch-free.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .._format.manifest import lookup_manifest
from .._format.names import METADATA_FILE, parse_rank_dirname, rank_dirname
from .._storage.urls import is_url, local_path
from ..errors import CkptEngineError, PartialCheckpointError, clip
from .keys import KeyInfo

__all__ = [
    "Part",
    "checkpoint_of",
    "missing_region",
    "other_parts",
    "part_of",
    "partial_read_error",
    "rank_of",
    "require_not_per_rank",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]

#: Most cells of the grid the chunks cut a tensor into that :func:`missing_region` walks (a crafted
#: layout could ask for more; the error then gives the counts without a region).
_MAX_CELLS = 1 << 20


def checkpoint_of(path: str) -> tuple[str, str]:
    """The folder holding component folder ``path`` (the checkpoint, whose manifest describes the
    component) and the component's name; ``("", name)`` for a URL at a bucket's root."""
    if is_url(path):
        head, _, name = path.rstrip("/").rpartition("/")
        return ("" if head.endswith(":/") or "://" not in head else head), name
    return os.path.split(os.path.abspath(local_path(path)))


def rank_of(path: str) -> tuple[int | None, int | None, bool]:
    """The rank whose part the component folder ``path`` holds, the job's world size, and whether
    the component was saved per rank: as its checkpoint's manifest records them (``per_rank``),
    else the rank of the node-local tier's folder (``rank_<r>``) it lies in; ``None`` where
    neither says."""
    checkpoint, component = checkpoint_of(path)
    try:
        manifest = lookup_manifest(checkpoint).manifest if checkpoint else None
    except (CkptEngineError, OSError):  # a damaged manifest: verify reports it; the folder may still say
        manifest = None
    if manifest is not None and manifest.rank is not None:
        return manifest.rank, manifest.world_size, component in manifest.per_rank
    for name in reversed(path.replace("\\", "/").split("/")):
        rank = parse_rank_dirname(name)
        if rank is not None:
            return rank, None, False
    return None, None, False


@dataclass(frozen=True)
class Part:
    """A component that is one rank's part: its rank (from its folder) and the elements it holds."""

    path: str
    rank: int | None
    #: The job's ranks, where its manifest records them.
    world_size: int | None
    #: Elements of its tensors it holds, and of the tensors whole.
    held: int
    total: int
    #: The tensors it holds only part of, in metadata order.
    partial: tuple[str, ...]
    #: Whether its manifest lists the component as saved per rank (``Manifest.per_rank``).
    per_rank: bool = False

    @property
    def whole(self) -> bool:
        """Whether it holds every element of every tensor (a replicated model's rank-local copy)."""
        return not self.partial

    @property
    def who(self) -> str:
        of = f" (of {self.world_size} ranks)" if self.world_size is not None else ""
        return f"rank {self.rank}'s part{of}" if self.rank is not None else "one rank's part"

    def describe(self) -> str:
        where = f"{self.who} of a rank-local checkpoint (the node-local tier)"
        if self.whole:
            return f"{where}; it holds every element of its tensors"
        return (
            f"{where}, not the whole: it holds {self.held:,} of the {self.total:,} elements of its tensors, "
            f"{len(self.partial)} of them only in part"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "held": self.held,
            "total": self.total,
            "partial_keys": list(self.partial),
        }


def require_not_per_rank(part: Part) -> None:
    """Raise :class:`~ckpt_engine.errors.PartialCheckpointError` where ``part``'s checkpoint
    records its component as saved per rank (``Manifest.per_rank``: its value differed across the
    ranks): one rank's copy is not the job's."""
    if part.per_rank:
        component = os.path.basename(part.path.rstrip("/"))
        raise PartialCheckpointError(
            f"{part.path}: component {component!r} is {part.who}, and holds state that differed across the "
            "ranks (saved per rank): this rank's copy is not the job's. Convert save_dir's checkpoint of this "
            "step, which keeps every rank's copy"
        )


def other_parts(part: Part) -> Iterator[tuple[int, str]]:
    """The other ranks' parts of ``part``'s component in the same tier folder (``rank_<r>/iter_X``
    beside its own), where this node holds them: ``(rank, component folder)``."""
    if part.rank is None or not part.world_size:
        return
    component = os.path.basename(part.path.rstrip("/"))
    checkpoint = os.path.dirname(part.path.rstrip("/"))
    tier, name = os.path.dirname(os.path.dirname(checkpoint)), os.path.basename(checkpoint)
    try:  # the rank folders there are (a manifest's world_size is no bound on the work)
        ranks = sorted(r for n in os.listdir(tier) if (r := parse_rank_dirname(n)) is not None)
    except OSError:
        return
    for rank in ranks:
        folder = os.path.join(tier, rank_dirname(rank), name, component)
        if rank != part.rank and rank < part.world_size and os.path.isfile(os.path.join(folder, METADATA_FILE)):
            yield rank, folder


def part_of(path: str, rank_local: bool, infos: Mapping[str, KeyInfo]) -> Part | None:
    """The :class:`Part` component ``path`` is when its ``.metadata`` is marked rank-local or it
    holds part of a tensor; ``None`` for a component that holds its tensors whole."""
    tensors = [i for i in infos.values() if i.is_tensor]
    partial = tuple(i.key for i in tensors if i.held is not None)
    if not rank_local and not partial:
        return None
    held = sum(i.numel if i.held is None else i.held for i in tensors)
    rank, world_size, per_rank = rank_of(path)
    return Part(path, rank, world_size, held, sum(i.numel for i in tensors), partial, per_rank)


def missing_region(shape: Sequence[int], boxes: Iterable[Box]) -> Box | None:
    """A box of ``shape`` that none of ``boxes`` (disjoint, inside it) covers, the first in
    row-major order of the grid their edges cut; ``None`` when they cover it, or when the grid is
    larger than a bounded walk."""
    shape = tuple(shape)
    filled = [(tuple(o), tuple(s)) for o, s in boxes if math.prod(s)]
    if math.prod(shape) == 0:
        return None
    lines = [sorted({0, d, *(o[i] for o, _ in filled), *(o[i] + s[i] for o, s in filled)}) for i, d in enumerate(shape)]
    if math.prod(len(ln) - 1 for ln in lines) > _MAX_CELLS:
        return None
    index = [{v: i for i, v in enumerate(ln)} for ln in lines]
    covered: set[tuple[int, ...]] = set()
    for off, sz in filled:
        spans = [range(ix[o], ix[o + s]) for ix, o, s in zip(index, off, sz, strict=True)]
        covered.update(itertools.product(*spans))
    for cell in itertools.product(*(range(len(ln) - 1) for ln in lines)):
        if cell not in covered:
            lo = tuple(ln[c] for ln, c in zip(lines, cell, strict=True))
            return lo, tuple(ln[c + 1] - ln[c] for ln, c in zip(lines, cell, strict=True))
    return None


def _region_text(region: Box) -> str:
    off, size = region
    if not off:
        return "its one element"
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(off, size, strict=True)) + "]"


def partial_read_error(
    path: str, info: KeyInfo, boxes: Iterable[Box], part: Part | None, count: int = 1
) -> PartialCheckpointError:
    """The error for a read that needs tensor ``info`` whole from ``path``, which holds only the
    chunks ``boxes`` of it: the key, the elements held and the first region missing (``count``:
    tensors of the read held only in part, this one the first)."""
    region = missing_region(info.shape, boxes)
    lacks = f"elements {_region_text(region)} (and any others not held)" if region is not None else "the rest"
    what = f"it is {part.who}, a rank-local checkpoint" if part is not None else "its chunks do not cover it"
    if count > 1:
        what += f"; {count - 1} more of the tensors asked for are held only in part"
    return PartialCheckpointError(
        f"{path}: tensor {clip(info.key)} of shape {list(info.shape)}: the checkpoint holds {info.held or 0:,} of "
        f"its {info.numel:,} elements ({what}); it lacks {lacks}, which are never filled in. Read the whole "
        "model from a checkpoint every rank saved into (save_dir: `ckpt-engine ls SAVE_DIR --local-dir LOCAL_DIR` "
        "says which iterations are durable there)"
    )
