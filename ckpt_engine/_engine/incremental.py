"""Which committed checkpoint an incremental save (``EngineConfig.incremental``) carries
unchanged files over from, and when it must write everything instead.

The previous checkpoint is the one ``latest_checkpoint.txt`` names when the save starts: the last
one this engine committed, or at the first save the one the job resumed from. Its manifest is the
only source of the sizes and checksums a file is compared with; a checkpoint without a usable
manifest, or with another checksum algorithm, is not carried over from (the save writes every
file, laid out for the next one). Every ``full_save_every`` saves, one writes every file anew, so
that a damaged shared file damages a bounded number of checkpoints.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .._format.manifest import lookup_manifest, unchanged_files
from .._format.pointer import read_latest
from .._storage.store import Store
from ..config import EngineConfig
from ..errors import CkptEngineError
from ..staging import memory_key
from ..types import CarryOver
from .targets import SaveTarget

__all__ = ["CarryBase", "carry_base", "carry_base_in", "stable_keys"]

logger = logging.getLogger("ckpt_engine")


@dataclass(frozen=True)
class CarryBase:
    """What one save may carry over: the previous checkpoint, its files, and how."""

    #: The previous checkpoint's folder (or URL); ``None``: write everything.
    folder: str | None
    algorithm: str
    method: Literal["link", "copy"]
    store: Store
    #: ``rel`` (``model/__0_0.distcp``) -> (size, checksum), from the previous manifest.
    files: Mapping[str, tuple[int, str]] = field(default_factory=dict)
    #: ``rel`` -> its version at commit, where the previous manifest recorded one.
    seen: Mapping[str, str] = field(default_factory=dict)
    #: What this save's manifest records (see ``Manifest.carry_chain``).
    chain: int = 0

    def for_component(self, name: str, stable: frozenset[str] = frozenset()) -> CarryOver:
        prefix = name + "/"
        files = {rel[len(prefix) :]: entry for rel, entry in self.files.items() if rel.startswith(prefix)}
        seen = {rel[len(prefix) :]: version for rel, version in self.seen.items() if rel.startswith(prefix)}
        previous = None if self.folder is None else self.store.join(self.folder, name)
        return CarryOver(
            previous=previous, files=files, algorithm=self.algorithm, method=self.method, stable=stable, seen=seen
        )


def stable_keys(
    modules: Sequence[nn.Module], state_dict: Mapping[str, Any], key_map: Mapping[str, str]
) -> frozenset[str]:
    """The storage keys of the model component worth comparing with the previous checkpoint:
    its frozen parameters (``requires_grad`` false) and its buffers, found by the memory they
    hold (a state dict's tensors are views of them; for a DTensor, of its local shard)."""
    quiet = {memory_key(p) for m in modules for p in m.parameters() if not p.requires_grad}
    quiet |= {memory_key(b) for m in modules for b in m.buffers()}
    if not quiet:
        return frozenset()
    return frozenset(
        key_map.get(k, k) for k, v in state_dict.items() if isinstance(v, torch.Tensor) and memory_key(v) in quiet
    )


def carry_base(target: SaveTarget, config: EngineConfig, algorithm: str, iteration: int) -> CarryBase:
    """The carry-over base of the save of ``iteration`` into ``target`` (every rank decides the
    same from the same committed files; a base that cannot be read means a full write)."""
    root, store, method = _where(target)
    return carry_base_in(root, store, method, config, algorithm, iteration)


def carry_base_in(
    root: str, store: Store, method: Literal["link", "copy"], config: EngineConfig, algorithm: str, iteration: int
) -> CarryBase:
    """The carry-over base of the save of ``iteration``: the checkpoint ``latest_checkpoint.txt``
    in ``root`` names (a save folder, or a rank's folder of the local tier), carried ``method``."""
    none = CarryBase(folder=None, algorithm=algorithm, method=method, store=store)
    try:
        name = read_latest(root, store)
        if name is None:
            return none
        folder = store.join(root, name)
        found = lookup_manifest(folder, store)
    except (OSError, CkptEngineError) as err:
        logger.warning(
            "iteration %d writes every file: the previous checkpoint in %s is unreadable (%s)", iteration, root, err
        )
        return none
    manifest = found.manifest
    if manifest is None:
        logger.info("iteration %d writes every file: %s has no usable manifest (%s)", iteration, folder, found.reason)
        return none
    if manifest.algorithm != algorithm:
        logger.info(
            "iteration %d writes every file: %s was checksummed with %s, this engine uses %s",
            iteration,
            folder,
            manifest.algorithm,
            algorithm,
        )
        return none
    chain = manifest.carry_chain + 1
    every = config.full_save_every
    if every is not None and chain >= every:
        logger.info("iteration %d writes every file (full_save_every=%d)", iteration, every)
        return none
    entries = manifest.files
    if method == "copy":  # no bytes to compare here: only objects still as committed are copied
        entries = unchanged_files(folder, store, manifest)
        changed = sorted(rel for rel in manifest.files if rel not in entries)
        if changed:
            logger.warning(
                "iteration %d writes %d file(s) of %s anew: changed since that checkpoint was committed, or "
                "committed without a recorded version (%s%s)",
                iteration,
                len(changed),
                folder,
                ", ".join(changed[:3]),
                ", ..." if len(changed) > 3 else "",
            )
    files = {rel: (e.size, e.checksum) for rel, e in entries.items() if e.checksum is not None}
    seen = {rel: e.seen for rel, e in entries.items() if e.checksum is not None and e.seen is not None}
    return CarryBase(
        folder=folder, algorithm=algorithm, method=method, store=store, files=files, seen=seen, chain=chain
    )


def _where(target: SaveTarget) -> tuple[str, Store, Literal["link", "copy"]]:
    """The folder whose ``latest`` a save carries over from, its store, and how files are
    carried: hard links between local checkpoints, server-side copies in an object store."""
    local = target.local_dir  # two tier: the local copies are committed first, and linked
    if local is not None:
        from .._storage.store import open_store

        return local, open_store(local), "link"
    if not target.store.capabilities.hard_links:  # server-side copies (docs/storage.md)
        return target.save_dir, target.store, "copy"
    return target.save_dir, target.store, "link"
