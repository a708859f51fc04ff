"""What a checkpoint holds, key by key (dtype, shape, shards, bytes, small values) with totals per
component and per top-level prefix: what ``ckpt-engine inspect`` prints, computed as data.

Torch-free for every format (keys from metadata and headers, plain values decoded without
``pickle``); a value only ``torch.load`` reads (a tensor stored as a value, an object of another
class, a compressed item) imports torch for that value alone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .keys import KeyInfo, Unreadable, match_keys, prefix_of, summarize_value
from .parts import Part
from .sources import open_component
from .target import Target
from .verification import verify_target

__all__ = ["CheckpointContents", "ComponentContents", "PrefixTotals", "read_contents"]

#: Non-tensor values up to this many stored bytes are read and shown.
SMALL_VALUE_BYTES = 65536


@dataclass
class PrefixTotals:
    """Keys, tensor elements and stored bytes under one top-level prefix."""

    keys: int = 0
    numel: int = 0
    bytes: int = 0


@dataclass
class ComponentContents:
    """The keys of one component that matched, in metadata order, and the small values read."""

    name: str
    path: str
    infos: list[KeyInfo]
    #: key -> value (or :class:`Unreadable`) of the small non-tensor values read.
    values: dict[str, Any]
    #: What the component holds when it is one rank's part (a rank-local checkpoint), else ``None``.
    part: Part | None = None

    @property
    def tensors(self) -> list[KeyInfo]:
        return [i for i in self.infos if i.is_tensor]

    @property
    def numel(self) -> int:
        return sum(i.numel for i in self.tensors)

    @property
    def bytes(self) -> int:
        return sum(i.stored_bytes for i in self.infos)

    @property
    def prefixes(self) -> dict[str, PrefixTotals]:
        """Totals per top-level prefix, in order of first appearance."""
        out: dict[str, PrefixTotals] = {}
        for i in self.infos:
            agg = out.setdefault(prefix_of(i.key), PrefixTotals())
            agg.keys += 1
            agg.numel += i.numel if i.is_tensor else 0
            agg.bytes += i.stored_bytes
        return out

    def to_json(self) -> dict[str, Any]:
        tensors = self.tensors
        return {
            "path": self.path,
            "keys": [self._key_json(i) for i in self.infos],
            "tensors": len(tensors),
            "values": len(self.infos) - len(tensors),
            "numel": self.numel,
            "bytes": self.bytes,
            "prefixes": {p: {"keys": a.keys, "numel": a.numel, "bytes": a.bytes} for p, a in self.prefixes.items()},
            **({"part": self.part.to_json()} if self.part is not None else {}),
        }

    def _key_json(self, i: KeyInfo) -> dict[str, Any]:
        return {
            "key": i.key,
            "kind": "tensor" if i.is_tensor else "value",
            "dtype": i.dtype_name if i.is_tensor else None,
            "shape": list(i.shape) if i.is_tensor else None,
            "shards": i.shards,
            **({"held": i.held} if i.held is not None else {}),
            "bytes": i.stored_bytes,
            **({"value": summarize_value(self.values[i.key], 200)} if i.key in self.values else {}),
        }


@dataclass
class CheckpointContents:
    """Every component of a resolved checkpoint, and what a sizes check of it found."""

    target: Target
    complete: bool
    problems: list[str] = field(default_factory=list)
    components: list[ComponentContents] = field(default_factory=list)
    #: From the manifest: the files' bytes, and those an incremental save carried over from the
    #: previous checkpoint instead of writing them (0 without a manifest).
    total_bytes: int = 0
    reused_bytes: int = 0
    reused_files: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.target.checkpoint,
            "format": self.target.kind,
            "complete": self.complete,
            "bytes": self.total_bytes,
            "written_bytes": self.total_bytes - self.reused_bytes,
            "reused_bytes": self.reused_bytes,
            "components": {c.name: c.to_json() for c in self.components},
        }


def read_contents(
    target: Target, keys: Sequence[str] = (), *, read_values: bool = True, trust: bool = False
) -> CheckpointContents:
    """The keys of ``target`` matching the globs ``keys`` (all when empty); with ``read_values``
    the small non-tensor values too (a damaged data file makes them :class:`Unreadable`, the
    metadata is still shown). Checks sizes against the manifest, never checksums."""
    report = verify_target(target, "sizes")
    contents = CheckpointContents(
        target,
        report.complete,
        list(report.problems),
        total_bytes=report.bytes,
        reused_bytes=report.reused_bytes,
        reused_files=report.reused_files,
    )
    for name in target.components:
        contents.components.append(_component_contents(target, name, keys, read_values, trust))
    return contents


def _component_contents(
    target: Target, name: str, patterns: Sequence[str], read_values: bool, trust: bool
) -> ComponentContents:
    source = open_component(target, name, trust)
    keys = match_keys(source.keys, patterns)
    values: dict[str, Any] = {}
    small = [k for k in keys if not source.keys[k].is_tensor and source.keys[k].stored_bytes <= SMALL_VALUE_BYTES]
    if small and read_values:
        try:
            values = source.small_values(small)
        except Exception as err:  # a damaged or crafted data file: still show the metadata
            values = dict.fromkeys(small, Unreadable(_first_line(err), needs_trust=False))
    return ComponentContents(name, target.components[name], [source.keys[k] for k in keys], values, source.part)


def _first_line(err: BaseException) -> str:
    text = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    return text if len(text) <= 120 else text[:117] + "..."
