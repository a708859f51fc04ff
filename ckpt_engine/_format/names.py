"""The names of the on-disk layout (docs/design.md, section 2): folders, pointer, marker and hidden files.

One place for every name the engine writes or recognises, so that the layout, the manifest,
retention, the command line and the tests agree.
"""

from __future__ import annotations

import re

#: Points at the newest committed checkpoint: ``"iter_000000005\n"``.
LATEST_FILE = "latest_checkpoint.txt"
#: DCP's metadata file of one component folder.
METADATA_FILE = ".metadata"
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
