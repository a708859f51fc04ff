"""The keys of a checkpoint component as the commands show them, without torch: dtype by torch's
name, shape, shards and stored bytes; key filters; batches of bounded bytes; short value text.

Every format the command line reads (DCP folders, safetensors files and folders, ``torch.save``
files) describes its keys as :class:`KeyInfo` records; only reading values needs torch.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = [
    "DEFAULT_BUDGET",
    "KeyInfo",
    "Unreadable",
    "ValueReader",
    "batches",
    "key_infos",
    "match_keys",
    "prefix_of",
    "refused_value",
    "summarize_value",
]

#: Default bytes of tensor data read per batch (a single larger tensor is read on its own).
DEFAULT_BUDGET = 64 << 20


@dataclass(frozen=True)
class KeyInfo:
    """One storage key of a component: a tensor's dtype (torch's name) and shape, or a value."""

    key: str
    is_tensor: bool
    #: torch's name of the dtype (``float32``); ``-`` for a non-tensor value.
    dtype_name: str = "-"
    #: Bytes per element (0 for a non-tensor value).
    itemsize: int = 0
    shape: tuple[int, ...] = ()
    #: Chunks the tensor is stored in (one per saved shard); 1 for a non-tensor value.
    shards: int = 1
    #: Bytes the key occupies in the data files.
    stored_bytes: int = 0
    #: Elements of the tensor its chunks hold when that is fewer than all (a rank-local
    #: checkpoint of the node-local tier: one rank's shards); ``None`` when it holds every element.
    held: int | None = None

    @property
    def numel(self) -> int:
        return _volume(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the full tensor in memory (0 for a non-tensor value)."""
        return self.numel * self.itemsize if self.is_tensor else 0

    @property
    def dtype(self) -> torch.dtype | None:
        """The torch dtype (imports torch: for readers of values only)."""
        if not self.is_tensor:
            return None
        import torch

        found = getattr(torch, self.dtype_name, None)
        assert isinstance(found, torch.dtype), self.dtype_name
        return found

    def spec(self) -> str:
        return f"{self.dtype_name}{list(self.shape)}" if self.is_tensor else "<value>"


def key_infos(md: Metadata) -> dict[str, KeyInfo]:
    """Every key of a component's metadata, in metadata order (DCP's records or the torch-free
    stand-ins of :func:`~ckpt_engine._format.metadata_types.records_without_dcp`)."""
    stored: dict[str, int] = {}
    for index, info in (md.storage_data or {}).items():
        stored[index.fqn] = stored.get(index.fqn, 0) + int(getattr(info, "length", 0))
    out: dict[str, KeyInfo] = {}
    items: dict[str, Any] = md.state_dict_metadata  # DCP's records, or the stand-ins
    for key, item in items.items():
        chunks = getattr(item, "chunks", None)
        if chunks is None:  # BytesStorageMetadata
            out[key] = KeyInfo(key=key, is_tensor=False, stored_bytes=stored.get(key, 0))
            continue
        dtype = item.properties.dtype
        shape = tuple(item.size)
        held = sum(_volume(c.sizes) for c in chunks)  # the chunks are disjoint (validate_metadata)
        out[key] = KeyInfo(
            key=key,
            is_tensor=True,
            dtype_name=str(dtype).removeprefix("torch."),
            itemsize=int(dtype.itemsize),
            shape=shape,
            shards=len(chunks),
            stored_bytes=stored.get(key, 0),
            held=held if held != _volume(shape) else None,
        )
    return out


def _volume(sizes: Sequence[int]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def match_keys(keys: Iterable[str], patterns: Sequence[str]) -> list[str]:
    """Keys matching any of the ``fnmatch`` ``patterns`` (all keys when there are none)."""
    if not patterns:
        return list(keys)
    return [k for k in keys if any(fnmatch.fnmatchcase(k, p) for p in patterns)]


def prefix_of(key: str) -> str:
    return key.split(".", 1)[0]


class ValueReader(Protocol):
    """What ``convert`` reads from: a component's keys and their values, a bounded batch at a time
    (``reader.ComponentReader`` for a DCP folder; ``sources.BatchedSource`` for the other formats)."""

    keys: dict[str, KeyInfo]

    def iter_values(self, keys: Sequence[str], budget: int = ...) -> Iterator[tuple[str, Any]]: ...


def batches(keys: Sequence[str], infos: dict[str, KeyInfo], budget: int) -> Iterator[list[str]]:
    """Consecutive groups of ``keys`` whose tensors total at most ``budget`` bytes (or one tensor)."""
    batch: list[str] = []
    size = 0
    for key in keys:
        n = infos[key].nbytes
        if batch and size + n > budget:
            yield batch
            batch, size = [], 0
        batch.append(key)
        size += n
    if batch:
        yield batch


# -- values ---------------------------------------------------------------------------------


_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


@dataclass(frozen=True)
class Unreadable:
    """A non-tensor value that ``weights_only=True`` unpickling refuses (it needs arbitrary code),
    or that a damaged data file does not hold."""

    #: What refused it, short: the global the unpickler refused (``_io.BytesIO``), or an error line.
    reason: str
    #: Whether ``--trust`` (``weights_only=False``) would read it; false for a damaged file.
    needs_trust: bool = True

    def __str__(self) -> str:
        if self.needs_trust:
            return f"<not readable with weights_only: {self.reason}; --trust reads it>"
        return f"<unreadable: {self.reason}>"


def refused_value(err: BaseException) -> Unreadable:
    """The short placeholder for a value ``weights_only`` refused: torch's message is paragraphs
    long, with terminal escape codes; what matters is the global it refused."""
    text = _ANSI_RE.sub("", str(err))
    found = _GLOBAL_RE.search(text)
    if found:
        return Unreadable(found.group(1))
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(err).__name__)
    return Unreadable(first[:80])


def summarize_value(value: Any, limit: int = 60) -> str:
    """A value as one short line: a tensor by dtype and shape, anything else by its ``repr``."""
    if isinstance(value, Unreadable):
        return str(value)
    torch = sys.modules.get("torch")  # a tensor exists only where torch was imported
    if torch is not None and isinstance(value, torch.Tensor):
        return f"tensor {str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
