"""One component of any format the command line reads, as keys and values: a DCP folder, a
safetensors file or Hugging Face folder, or a ``torch.save`` file.

Every source lists its keys without torch (:class:`~.keys.KeyInfo`) and shows small plain values
without torch where it can (``small_values``: what ``ckpt-engine inspect`` prints). ``read`` gives
full values as torch objects, and imports torch: tensors assembled from a DCP checkpoint's shards
(``reader.ComponentReader``), cut from a safetensors file's bytes, or rebuilt from a ``torch.save``
file's storage records; nothing is unpickled, except with ``trust`` for what only ``torch.load``
reads.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, BinaryIO, Protocol

from .._format.layout import check_component_files
from .._format.metadata_read import is_rank_local, read_metadata
from .._format.metadata_types import PlainDtype, Size, records_without_dcp
from .._format.names import METADATA_FILE
from .._format.safe_pickle import Opaque, TensorRef
from .._format.safetensors_header import CODE_DTYPE_NAMES, read_weights_folder
from .._storage.fscheck import open_regular, require_regular_file
from .._storage.store import open_store
from ..errors import CorruptCheckpointError, UsageError, clip
from .keys import DEFAULT_BUDGET, KeyInfo, Unreadable, batches, key_infos
from .parts import Part, part_of
from .pt_file import decode_value, flatten, read_pt_file
from .target import Target

if TYPE_CHECKING:
    from .reader import ComponentReader

__all__ = [
    "BatchedSource",
    "ComponentSource",
    "DcpSource",
    "SafetensorsSource",
    "TorchFileSource",
    "open_component",
]


class ComponentSource(Protocol):
    """What ``inspect``, ``verify`` and ``diff`` need of one component."""

    path: str
    keys: dict[str, KeyInfo]
    #: What the component holds when it is one rank's part (a rank-local checkpoint), else ``None``.
    part: Part | None

    @property
    def stored(self) -> dict[str, bytes]:
        """The stored bytes of the non-tensor values of the last :meth:`read` (compared first)."""
        ...

    def small_values(self, keys: Sequence[str]) -> dict[str, Any]:
        """Non-tensor values to show, read without torch where they are plain."""
        ...

    def read(self, keys: Sequence[str]) -> dict[str, Any]:
        """Full values of ``keys`` as torch objects (imports torch)."""
        ...


def open_component(target: Target, name: str, trust: bool = False) -> ComponentSource:
    """The source of component ``name`` of ``target``."""
    path = target.components[name]
    if target.kind in ("safetensors", "hf"):
        return SafetensorsSource(path)
    if target.kind == "torch":
        return TorchFileSource(path, trust)
    return DcpSource(path, trust)


class BatchedSource:
    """A safetensors or ``torch.save`` source read as ``convert`` reads a DCP component: values in
    batches of at most ``budget`` tensor bytes (or one larger tensor), so memory stays bounded."""

    part: Part | None = None  # these formats store whole tensors

    def __init__(self, source: SafetensorsSource | TorchFileSource) -> None:
        self.source = source
        self.keys = source.keys

    def require_whole(self, keys: Sequence[str]) -> None:
        """Nothing to refuse: every tensor of these formats is whole."""

    def iter_values(self, keys: Sequence[str], budget: int = DEFAULT_BUDGET) -> Iterator[tuple[str, Any]]:
        for batch in batches(keys, self.keys, budget):
            values = self.source.read(batch)
            for key in batch:
                yield key, values.pop(key, Unreadable("not readable", needs_trust=False))


class DcpSource:
    """A DCP component folder: its keys from ``.metadata`` read into torch-free records, its plain
    values decoded without torch; tensors and other values through ``reader.ComponentReader``."""

    def __init__(self, path: str, trust: bool = False) -> None:
        self.path, self.trust = path, trust
        store = open_store(path)
        if store.capabilities.local_files:
            require_regular_file(os.path.join(path, METADATA_FILE), "DCP metadata")
        with records_without_dcp():
            metadata = read_metadata(path, store)
        # Every tensor covered exactly by chunks whose bytes exist, before anything is read.
        check_component_files(path, metadata, store)
        self.keys = key_infos(metadata)
        self.part = part_of(path, is_rank_local(metadata), self.keys)
        self._values = {
            index.fqn: info for index, info in (metadata.storage_data or {}).items() if index.offset is None
        }
        self._reader: ComponentReader | None = None

    @property
    def reader(self) -> ComponentReader:
        if self._reader is None:
            from .reader import ComponentReader

            self._reader = ComponentReader(self.path, self.trust)
        return self._reader

    @property
    def stored(self) -> dict[str, bytes]:
        return self._reader.stored if self._reader is not None else {}

    def read(self, keys: Sequence[str]) -> dict[str, Any]:
        return self.reader.read(keys)  # refuses a tensor held only in part, naming what it lacks

    def small_values(self, keys: Sequence[str]) -> dict[str, Any]:
        # Compressed values (transforms) are DCP's reader's to undo.
        plain = [k for k in keys if k in self._values and not self._values[k].transform_descriptors]
        out: dict[str, Any] = {}
        for key, data in zip(plain, self._stored_bytes(plain), strict=True):
            ok, value = decode_value(data)
            if ok:
                out[key] = value
        rest = [k for k in keys if k not in out]
        if rest:  # a tensor value, an object weights_only judges, a compressed value: torch reads them
            out.update(self.reader.read(rest))
        return out

    def _stored_bytes(self, keys: Sequence[str]) -> list[bytes]:
        """The stored bytes of the values ``keys``: each data file opened once locally; on an
        object store, several range requests at a time."""
        store = open_store(self.path)
        infos = [self._values[k] for k in keys]
        spans = [(store.join(self.path, i.relative_path), i.offset, i.offset + i.length) for i in infos]
        if not store.capabilities.local_files:
            with ThreadPoolExecutor(min(16, max(len(spans), 1)), thread_name_prefix="ckpt-inspect") as pool:
                return list(pool.map(lambda span: store.read_range(*span), spans))
        out: list[bytes] = []
        files: dict[str, BinaryIO] = {}
        try:
            for path, start, end in spans:
                f = files.get(path) or files.setdefault(path, open_regular(path, "a DCP data file"))
                f.seek(start)
                out.append(f.read(end - start))
        finally:
            for f in files.values():
                f.close()
        return out


class SafetensorsSource:
    """A safetensors file or Hugging Face folder: keys from the headers, tensors cut from the files."""

    part: Part | None = None  # the format stores whole tensors

    def __init__(self, path: str) -> None:
        self.path = path
        self.folder = read_weights_folder(path)
        self.keys = {
            name: KeyInfo(
                key=name,
                is_tensor=True,
                dtype_name=e.dtype_name,
                itemsize=CODE_DTYPE_NAMES[e.code][1],
                shape=e.shape,
                stored_bytes=e.nbytes,
            )
            for name, e in self.folder.tensors.items()
        }

    @property
    def stored(self) -> dict[str, bytes]:
        return {}

    def small_values(self, keys: Sequence[str]) -> dict[str, Any]:
        return {}  # tensors only

    def read(self, keys: Sequence[str]) -> dict[str, Any]:
        import torch

        out: dict[str, Any] = {}
        for key in keys:
            entry = self.folder.tensors[key]
            dtype = getattr(torch, entry.dtype_name)
            data = _pread(entry.file, entry.begin, entry.nbytes)
            flat = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
            out[key] = flat.reshape(entry.shape)
        return out


class TorchFileSource:
    """A ``torch.save`` file: keys and plain values from its ``data.pkl`` (never unpickled), tensors
    rebuilt from their storage records; objects of other classes need ``trust`` (``torch.load``)."""

    part: Part | None = None  # the format stores whole tensors

    def __init__(self, path: str, trust: bool = False) -> None:
        self.path, self.trust = path, trust
        self.pt = read_pt_file(path)
        self.keys = self.pt.keys
        self._trusted: dict[str, Any] | None = None

    @property
    def stored(self) -> dict[str, bytes]:
        return {}

    def small_values(self, keys: Sequence[str]) -> dict[str, Any]:
        values = {k: self.pt.values[k] for k in keys if k in self.pt.values}
        opaque = [k for k, v in values.items() if _holds_opaque(v)]
        if opaque and self.trust:
            values.update(self._trusted_values(opaque))
        else:
            values.update({k: Unreadable(_opaque_name(values[k])) for k in opaque})
        return values

    def read(self, keys: Sequence[str]) -> dict[str, Any]:
        if self.pt.archive.byteorder != "little":
            order = clip(self.pt.archive.byteorder)
            raise UsageError(f"{self.path} was saved on a {order}-endian machine; only torch.load reads it")
        out = {k: self._tensor(self.pt.tensors[k]) for k in keys if k in self.pt.tensors}
        out.update({k: _to_torch(v) for k, v in self.small_values([k for k in keys if k in self.pt.values]).items()})
        return out

    def _tensor(self, ref: TensorRef) -> Any:
        import torch

        record = self.pt.archive.storage_record(ref.storage.key)
        if record is None or record.size < ref.storage.nbytes or ref.extent_bytes() > ref.storage.nbytes:
            raise CorruptCheckpointError(
                f"{self.path}: the storage of a tensor is missing or too short; `ckpt-engine verify {self.path}` "
                "says which"
            )
        dtype = getattr(torch, ref.dtype.name)
        data = _pread(self.path, record.offset, ref.storage.nbytes)
        storage = torch.frombuffer(bytearray(data), dtype=dtype) if data else torch.empty(0, dtype=dtype)
        return storage.as_strided(ref.shape, ref.stride, ref.offset)

    def _trusted_values(self, keys: Sequence[str]) -> dict[str, Any]:
        """``keys`` as ``torch.load(weights_only=False)`` gives them: runs code from the file (``--trust``)."""
        if self._trusted is None:
            import torch

            loaded = torch.load(self.path, map_location="cpu", weights_only=False, mmap=True)
            self._trusted = dict(flatten(loaded, lambda v: isinstance(v, torch.Tensor)))
        return {k: self._trusted.get(k, Unreadable("not in the loaded object", needs_trust=False)) for k in keys}


def _pread(path: str, offset: int, n: int) -> bytes:
    with open_regular(path, "a weights file") as f:
        f.seek(offset)
        data = f.read(n)
    if len(data) != n:
        raise CorruptCheckpointError(f"{path} ends before byte {offset + n}: truncated; `ckpt-engine verify` checks it")
    return data


def _holds_opaque(value: Any) -> bool:
    if type(value) is Opaque:
        return True
    if isinstance(value, dict):
        return any(_holds_opaque(v) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds_opaque(v) for v in value)
    return False


def _opaque_name(value: Any) -> str:
    if type(value) is Opaque:
        return value.cls
    items = value.values() if isinstance(value, dict) else value
    return next(_opaque_name(v) for v in items if _holds_opaque(v))


def _to_torch(value: Any) -> Any:
    """A plain value with its torch stand-ins (dtypes, sizes) replaced by torch's own."""
    import torch

    kind = type(value)
    if kind is PlainDtype:
        return getattr(torch, value.name)
    if kind is Size:
        return torch.Size(value)
    if kind in (list, tuple, set, frozenset):
        return kind(_to_torch(v) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _to_torch(v)) for k, v in value.items())
    return value
