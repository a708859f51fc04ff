"""The names of the on-disk layout (docs/design.md, section 2): folders, pointer, marker and hidden files,
and the storage keys of per-rank state.

One place for every name the engine writes or recognises, so that the layout, the manifest,
retention, the command line and the tests agree.

Per-rank state: an item DCP keeps one copy of (a plain tensor, a non-tensor value) that differs
across ranks is saved by every rank under ``<key>@rank<r>`` (the save's key map renames it; DCP's
dedup then has nothing to merge). A load whose storage key is absent but whose per-rank copies
are present reads ``<key>@rank<this rank>`` (:func:`resolve_per_rank`), provided the checkpoint
holds one copy per rank of this job; other ranks' copies count as read, not as unexpected keys.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from typing import Protocol

from ..errors import PerRankStateError, clip

#: Points at the newest committed checkpoint: ``"iter_000000005\n"``.
LATEST_FILE = "latest_checkpoint.txt"
#: DCP's metadata file of one component folder.
METADATA_FILE = ".metadata"
#: The engine's compact index of that ``.metadata`` (written beside it at save; a load reads it in
#: its place where it describes exactly those bytes; DCP ignores it).
METADATA_INDEX_FILE = ".metadata_index"
#: The engine's manifest at the top of a checkpoint folder (sizes, checksums; on an object store
#: also the completion marker).
MANIFEST_FILE = "ckpt_engine_manifest.json"
#: Per-rank upload reports of a background save to an object store (``.ckpt_engine_rank_00001.json``);
#: engine bookkeeping, never part of the checkpoint's content.
RANK_PART_PREFIX = ".ckpt_engine_rank_"
#: File-name prefix of a digest part (inside a component folder of an uncommitted checkpoint).
PART_PREFIX = ".ckpt_engine_part_"
LATEST_FILE = "latest_checkpoint.txt"
_ITER_RE = re.compile(r"^iter_(\d{9,})$")
PARTIAL_SUFFIX = ".partial"
DELETING_SUFFIX = ".deleting"
#: Hidden lock file, used only where the filesystem refuses to lock the folder itself (NFS).
LOCK_FILE = ".ckpt_engine.lock"
#: In ``StorageMeta.modules`` of a rank-local checkpoint's ``.metadata`` (the node-local tier): it
#: holds one rank's shards, so its chunks need not cover each tensor (a load checks what it reads).
RANK_LOCAL_MARK = "ckpt_engine:rank_local"
LEFTOVER_RE = re.compile(r"^\.(iter_\d{9,})(\.partial|\.deleting|\.replaced\.\d+)$")
#: Suffix of the prefix an object-store re-save uploads to before it replaces the committed copy.
REPLACING_SUFFIX = ".replacing"
_REPLACING_RE = re.compile(r"^\.(iter_\d{9,})\.replacing$")


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:09}"


def partial_dirname(iteration: int) -> str:
    return f".{iter_dirname(iteration)}{PARTIAL_SUFFIX}"


def replacing_dirname(iteration: int) -> str:
    return f".{iter_dirname(iteration)}{REPLACING_SUFFIX}"


def replaced_name(name: str) -> str | None:
    """The ``iter_*`` name a ``.iter_*.replacing`` prefix replaces, or ``None``."""
    m = _REPLACING_RE.match(name)
    return m.group(1) if m else None


def parse_iteration(name: str) -> int | None:
    m = _ITER_RE.match(name)
    return int(m.group(1)) if m else None


def is_part(rel: str) -> bool:
    """Whether ``rel`` (a path inside a checkpoint) is a digest part, engine bookkeeping."""
    return rel.rsplit("/", 1)[-1].startswith(PART_PREFIX)


_RANK_DIR = re.compile(r"^rank_(\d{5,9})$")


def rank_dirname(rank: int) -> str:
    """The folder of rank ``rank``'s checkpoints in the node-local tier (``local_dir``)."""
    return f"rank_{rank:05d}"


def parse_rank_dirname(name: str) -> int | None:
    """The rank a ``rank_*`` folder name of the node-local tier stands for, else ``None``."""
    match = _RANK_DIR.match(name)
    return int(match.group(1)) if match else None


#: What follows a storage key saved per rank, before the rank: ``loader.position@rank1``.
RANK_MARK = "@rank"


class LoadSide(Protocol):
    """What a load planner tells :func:`resolve_per_rank` of its component."""

    component: str
    checkpoint_dir: str
    rank: int
    world_size: int
    #: The component's object re-partitions state saved per rank by a job of another size.
    repartitions: bool


def per_rank_key(key: str, rank: int) -> str:
    """The storage key of rank ``rank``'s copy of ``key``."""
    return f"{key}{RANK_MARK}{rank}"


def split_per_rank(key: str) -> tuple[str, int] | None:
    """``(key, rank)`` of a per-rank storage key; ``None`` for any other key."""
    base, mark, number = key.rpartition(RANK_MARK)
    if not mark or not base or not number.isdigit():
        return None
    return base, int(number)


def per_rank_copies(saved_keys: Iterable[str]) -> dict[str, set[int]]:
    """Each key saved per rank, with the ranks that saved a copy of it."""
    copies: dict[str, set[int]] = {}
    for key in saved_keys:
        if RANK_MARK in key and (parsed := split_per_rank(key)) is not None:
            copies.setdefault(parsed[0], set()).add(parsed[1])
    return copies


def resolve_per_rank(
    key_map: Mapping[str, str],
    saved_keys: Collection[str],
    planner: LoadSide,
) -> tuple[Mapping[str, str], set[str]]:
    """``key_map`` (destination -> storage key) with every storage key saved per rank replaced by
    this rank's copy, and the storage keys of all those copies (read or deliberately not: none is
    unexpected).

    A checkpoint whose copies are not exactly one per rank of this job raises
    :class:`PerRankStateError` naming the planner's component and checkpoint folder, unless
    the planner's ``repartitions`` (the object re-partitions its own state): then rank ``r``
    reads the copy of the ``r % n``-th saving rank.
    """
    copies = per_rank_copies(saved_keys)
    if not copies:
        return key_map, set()
    rank, world_size, component = planner.rank, planner.world_size, planner.component
    resolved = dict(key_map)
    claimed: set[str] = set()
    for dest, storage in key_map.items():
        ranks = copies.get(storage)
        if ranks is None or storage in saved_keys:
            continue
        if ranks == set(range(world_size)):
            resolved[dest] = per_rank_key(storage, rank)
        elif planner.repartitions:
            ordered = sorted(ranks)
            resolved[dest] = per_rank_key(storage, ordered[rank % len(ordered)])
        else:
            n = len(ranks)
            raise PerRankStateError(
                f"{planner.checkpoint_dir}: component {component!r} holds key {clip(storage)} saved per rank by {n} "
                f"rank(s) (its value differed across ranks at save), but this job has {world_size} rank(s): rank r's "
                f"copy only means something to rank r of a job of {n}. Resume with {n} ranks, add {component!r} to "
                "keys_not_to_resume to start it fresh, or, for an extra whose object re-partitions its own state, "
                "give its class repartitions_state = True (docs/reliability.md, Per-rank state)"
            )
        claimed.update(per_rank_key(storage, r) for r in ranks)
    return resolved, claimed
