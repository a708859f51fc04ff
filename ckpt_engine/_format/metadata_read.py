"""Reading DCP ``.metadata`` without running code from the checkpoint, and checking it, with no
import of ``torch.distributed.checkpoint`` (so that ``ckpt-engine ls`` need not pay for it).

DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``: a crafted file
runs arbitrary code. The engine parses it with its own interpreter (:mod:`.metadata_parser`) and
validates the result (:func:`validate_metadata`); :mod:`.metadata` hands it to DCP. Where the
engine's writer left the compact index of a ``.metadata`` beside it (:mod:`.metadata_index`),
the records are built from the index instead, once it has shown it describes exactly the bytes
read.
"""

from __future__ import annotations

import gc
import math
import os
import stat
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._storage.store import Store, store_for
from ..errors import (
    CheckpointLoadError,
    CheckpointPermissionError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    clip,
    denied,
)
from .metadata_index import metadata_from_index, read_index
from .metadata_parser import PickleMalformed, PickleRefused, parse_metadata
from .metadata_types import current_types, types_of
from .names import METADATA_FILE, METADATA_INDEX_FILE, RANK_LOCAL_MARK

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata


#: Largest ``.metadata`` the engine parses. DCP writes tens of bytes per tensor and chunk, so this
#: allows tens of millions of tensors while bounding the memory a crafted file can claim.
MAX_METADATA_BYTES = 4 << 30
#: Bound on the coordinate comparisons of :func:`validate_metadata`'s sweep for irregular chunk
#: layouts (a crafted file could ask for a quadratic number): this many per stored chunk
#: coordinate, and at least :data:`_MIN_COMPARISONS`, so validation stays linear in the file.
_COMPARISONS_PER_COORD = 64
_MIN_COMPARISONS = 4_000_000
_MAX_DIMS = 64
Box = tuple[tuple[int, ...], tuple[int, ...]]
_MAX_OFFSET = 1 << 62


def _read_bytes(path: str, store: Store) -> bytes:
    """The bytes of ``path``, refusing anything that is not a regular file of bounded size."""
    if not store.capabilities.local_files:
        data = store.read_bytes(path, MAX_METADATA_BYTES + 1)
    else:
        # Check the type before opening: a FIFO would block open() forever.
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(path)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(f"{path} is not a regular file; a DCP metadata file is one")
        if st.st_size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError(
                f"{path} is {st.st_size} bytes, more than any DCP metadata this engine reads ({MAX_METADATA_BYTES})"
            )
        with open(path, "rb") as f:
            data = f.read(st.st_size + 1)  # not MAX_METADATA_BYTES: read(n) allocates n bytes up front
    if len(data) > MAX_METADATA_BYTES:
        raise CorruptCheckpointError(f"{path} is larger than any DCP metadata this engine reads ({MAX_METADATA_BYTES})")
    return data


def read_metadata(
    component_dir: str | os.PathLike[str],
    store: Store | None = None,
    check_bytes: Callable[[str, bytes], None] | None = None,
) -> Metadata:
    """Read and validate ``component_dir/.metadata`` (from any :class:`~ckpt_engine._storage.store.Store`).

    The file is parsed by :func:`~ckpt_engine._format.metadata_parser.parse_metadata` (no pickle: reading
    it cannot run code or change the process) and checked by :func:`validate_metadata`. The result is
    built of DCP's classes, or of the stand-ins inside
    :func:`~ckpt_engine._format.metadata_types.records_without_dcp`.
    ``check_bytes(path, data)``, when given, sees the raw bytes first (the manifest's size and
    checksum), so a damaged file is refused before it is parsed. Typed errors name the file:
    :class:`UnsafeCheckpointError` for content DCP never writes, :class:`CorruptCheckpointError`
    for damage.
    """
    component_dir = os.fspath(component_dir)
    store = store_for(component_dir, store)
    path = store.join(component_dir, METADATA_FILE)
    try:
        data = _read_bytes(path, store)
    except FileNotFoundError as err:
        raise IncompleteCheckpointError(
            f"{path} does not exist: the component was never committed (an interrupted save?)"
        ) from err
    except PermissionError as err:
        raise CheckpointPermissionError(f"cannot read {path}: {denied(err, 'make it readable')}") from err
    except IsADirectoryError as err:
        raise CorruptCheckpointError(f"{path} is a folder, not a DCP metadata file") from err
    except OSError as err:
        raise CheckpointLoadError(f"cannot read {path}: {err.strerror or err}") from err
    if check_bytes is not None:
        check_bytes(path, data)
    if store.capabilities.local_files:
        md = indexed_metadata(read_index(os.path.join(component_dir, METADATA_INDEX_FILE), data), data, path)
        if md is not None:
            return md
    return metadata_from_bytes(data, path)


def metadata_from_bytes(data: bytes, path: str) -> Metadata:
    """Parse and validate ``data``, the bytes of the ``.metadata`` at ``path``, as :func:`read_metadata`
    does after reading them; its typed errors name ``path``."""
    # No cyclic collection while the records are built and checked (see parse_metadata).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        try:
            md = parse_metadata(data, current_types())
        except PickleRefused as err:
            raise UnsafeCheckpointError(
                f"{path} {err}; refusing to read it (the file may have been tampered with; nothing was executed or "
                "changed)"
            ) from err
        except PickleMalformed as err:
            raise CorruptCheckpointError(
                f"{path} is not a valid DCP metadata file (truncated or damaged): {err}"
            ) from err
        validate_metadata(md, path)
    finally:
        if was_enabled:
            gc.enable()
    return md


def indexed_metadata(index: bytes | None, data: bytes, path: str) -> Metadata | None:
    """The validated records that ``index``, the bytes of a compact index (:mod:`.metadata_index`),
    gives for ``data``, the bytes of the ``.metadata`` at ``path``; ``None`` where there is no index
    or it does not describe exactly those bytes, or its records fail :func:`validate_metadata` (the
    caller then parses ``data``, whose error, if any, names the fault)."""
    if index is None:
        return None
    was_enabled = gc.isenabled()
    gc.disable()  # no cyclic collection while the records are built and checked (as metadata_from_bytes)
    try:
        md = metadata_from_index(index, data)
        if md is not None:
            validate_metadata(md, path)
    except CorruptCheckpointError:
        return None
    finally:
        if was_enabled:
            gc.enable()
    return md


def is_rank_local(md: Any) -> bool:
    """Whether ``md`` is the ``.metadata`` of a rank-local checkpoint (the node-local tier): one
    rank's shards, marked so in ``storage_meta.modules``."""
    modules = getattr(getattr(md, "storage_meta", None), "modules", None)
    return isinstance(modules, list) and RANK_LOCAL_MARK in modules


def validate_metadata(md: Metadata, path: str) -> None:
    """Check the rules between the fields of ``md`` before anything relies on them.

    Every tensor's shape is non-negative; its chunks lie inside it, do not overlap and cover it
    exactly. A rank-local checkpoint (:func:`is_rank_local`) holds one rank's shards: its chunks
    cover exactly the elements they say they hold, which may be fewer than the shape's. It is
    never presented as the whole tensor: the engine's loads check that they read every element
    they need, and the command line's readers say it is one rank's part and refuse a read of an
    element it lacks (``ckpt_engine._inspect.parts``); nothing is ever filled in. Every chunk and
    every non-tensor value has a storage entry; every storage entry names a plain file in the
    component folder with a non-negative offset and length. Raises
    :class:`CorruptCheckpointError` naming ``path`` and the key. ``md`` may be built of DCP's
    classes or of the stand-ins (:mod:`.metadata_types`).
    """
    storage = md.storage_data or {}
    if not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{path}: storage_data is a {type(storage).__name__}, not a mapping")
    # Checked in bulk (few distinct file names); the entry-by-entry loop only names the first failure.
    if any(_bad_file(rel) for rel in {info.relative_path for info in storage.values()}) or not all(
        0 <= info.offset < _MAX_OFFSET and 0 <= info.length < _MAX_OFFSET for info in storage.values()
    ):
        _name_bad_entry(storage, path)
    # (a torch.Size hashes and compares as the tuple of its ints)
    stored: dict[tuple[str, Any], Any] = {(index.fqn, index.offset): info for index, info in storage.items()}
    types = types_of(md)
    bytes_type = types.BytesStorageMetadata
    items: dict[str, Any] = md.state_dict_metadata
    # per distinct description: one shared by many keys is checked once, so it earns its budget once
    distinct = {id(item): item for item in items.values() if not isinstance(item, bytes_type)}
    coords = sum(len(item.chunks) * len(item.size) for item in distinct.values())
    budget = [max(_MIN_COMPARISONS, _COMPARISONS_PER_COORD * coords)]
    #: per distinct tensor description (DCP shares one among equal tensors): (offsets, bytes needed)
    needs: dict[int, list[tuple[tuple[int, ...], int]]] = {}
    partial = is_rank_local(md)
    for key, item in items.items():
        if isinstance(item, bytes_type):
            if (key, None) not in stored:
                raise CorruptCheckpointError(f"{path}: the value of {clip(key)} has no storage entry")
            continue
        need = needs.get(id(item))
        if need is None:
            _check_chunks(key, item, path, budget, partial)
            itemsize = item.properties.dtype.itemsize
            need = needs[id(item)] = [(tuple(c.offsets), math.prod(c.sizes) * itemsize) for c in item.chunks]
        for offsets, needed in need:
            info = stored.get((key, offsets))
            if info is None:
                raise CorruptCheckpointError(
                    f"{path}: the chunk of {clip(key)} at offset {list(offsets)} has no storage entry"
                )
            if info.length < needed and not info.transform_descriptors:  # a compressed item may be smaller
                raise CorruptCheckpointError(
                    f"{path}: the chunk of {clip(key)} at offset {list(offsets)} needs {needed} bytes of "
                    f"{item.properties.dtype}, but its storage entry holds {info.length}"
                )


def _bad_file(rel: str) -> bool:
    return not rel or "\0" in rel or "/" in rel or "\\" in rel or rel.startswith(".")


def _name_bad_entry(storage: dict[Any, Any], path: str) -> None:
    """Raise for the first storage entry naming a file outside the folder or an impossible range."""
    for index, info in storage.items():
        if _bad_file(info.relative_path):
            raise CorruptCheckpointError(
                f"{path} names data file {clip(info.relative_path)} for {clip(index.fqn)}, outside its folder"
            )
        if not 0 <= info.offset < _MAX_OFFSET or not 0 <= info.length < _MAX_OFFSET:
            raise CorruptCheckpointError(
                f"{path}: the storage entry of {clip(index.fqn)} has offset {info.offset} and length {info.length}"
            )


def _check_chunks(key: str, item: TensorStorageMetadata, path: str, budget: list[int], partial: bool = False) -> None:
    """The chunks of ``item`` tile its shape exactly: inside it, disjoint, covering every element
    (``partial``, a rank-local checkpoint: covering exactly the elements they hold, which the
    readers count and never present as the whole tensor)."""
    shape = tuple(item.size)
    if len(shape) > _MAX_DIMS or any(d < 0 or d >= _MAX_OFFSET for d in shape):
        raise CorruptCheckpointError(f"{path}: tensor {clip(key)} has an impossible shape ({len(shape)} dimensions)")
    where = f"{path}: tensor {clip(key)} of shape {list(shape)}"
    boxes: list[Box] = []
    covered = 0
    for chunk in item.chunks:
        off, sz = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(off) != len(shape) or len(sz) != len(shape):
            raise CorruptCheckpointError(f"{where} has a chunk with {len(off)}-d offsets and {len(sz)}-d sizes")
        if any(o < 0 or s < 0 or o + s > d for o, s, d in zip(off, sz, shape, strict=True)):
            raise CorruptCheckpointError(f"{where} has a chunk at {list(off)} of size {list(sz)} outside it")
        volume = math.prod(sz)
        if volume:
            covered += volume
            boxes.append((off, sz))
    total = math.prod(shape)
    if (covered > total if partial else covered != total) or (
        len(boxes) > 1 and _any_overlap(boxes, shape, budget, where)
    ):
        raise CorruptCheckpointError(
            f"{where}: its stored chunks {'overlap' if covered >= total else 'do not cover it'} "
            f"({covered} of {total} elements stored); the metadata is damaged or crafted"
        )


#: Most grid cells :func:`_any_overlap` marks in an array (one byte each) for an irregular layout.
_MAX_GRID_CELLS = 1 << 24


def _any_overlap(boxes: list[Box], shape: tuple[int, ...], budget: list[int], where: str) -> bool:
    """Whether two of ``boxes`` (non-empty, inside ``shape``) intersect, in time linear in their
    coordinates for every layout a sharding produces.

    The lines where some box starts or ends cut ``shape`` into a grid. In every regular layout
    (row or column shards, 2-D and N-D meshes, uneven last shards, unit chunks) each box is one
    cell of that grid, so two boxes intersect exactly when they start at the same cell: a set
    of start cells decides it. A box spanning several cells (an irregular layout) marks its cells
    in an array when the grid is small enough; otherwise a sweep compares boxes, charging each
    comparison its width to ``budget``.
    """
    ndim = len(shape)
    if ndim == 0:
        return len(boxes) > 1
    lines = [sorted({0, shape[d], *(b[0][d] for b in boxes), *(b[0][d] + b[1][d] for b in boxes)}) for d in range(ndim)]
    index = [{v: i for i, v in enumerate(ln)} for ln in lines]
    starts: list[tuple[int, ...]] = []
    ends: list[tuple[int, ...]] = []
    one_cell = True
    for off, sz in boxes:
        lo = tuple(ix[o] for ix, o in zip(index, off, strict=True))
        hi = tuple(ix[o + s] for ix, o, s in zip(index, off, sz, strict=True))
        one_cell = one_cell and all(h == low + 1 for low, h in zip(lo, hi, strict=True))
        starts.append(lo)
        ends.append(hi)
    if one_cell:
        return len(set(starts)) != len(starts)
    cells = math.prod(len(ln) - 1 for ln in lines)
    if cells <= _MAX_GRID_CELLS:
        import numpy  # here: listings of regular layouts (ckpt-engine ls) never pay its import

        grid = numpy.zeros([len(ln) - 1 for ln in lines], dtype=numpy.bool_)
        for lo, hi in zip(starts, ends, strict=True):
            region = grid[tuple(slice(a, b) for a, b in zip(lo, hi, strict=True))]
            if region.any():
                return True
            region[...] = True
        return False
    return _sweep_overlap(boxes, max(range(ndim), key=lambda d: len(lines[d])), budget, where)


def _sweep_overlap(boxes: list[Box], dim: int, budget: list[int], where: str) -> bool:
    """Whether two boxes intersect: a sweep along ``dim``, each comparison charged its width."""
    width = len(boxes[0][0])
    active: list[Box] = []
    for off, sz in sorted(boxes, key=lambda b: b[0][dim]):
        active = [a for a in active if a[0][dim] + a[1][dim] > off[dim]]
        budget[0] -= (len(active) + 1) * width
        if budget[0] < 0:
            raise CorruptCheckpointError(
                f"{where}: its chunk layout is too irregular to validate in time linear in the file (crafted?)"
            )
        for a_off, a_sz in active:
            if all(ao < o + s and o < ao + asz for ao, asz, o, s in zip(a_off, a_sz, off, sz, strict=True)):
                return True
        active.append((off, sz))
    return False


# -- metadata this process wrote ----------------------------------------------------------------

#: ``.metadata`` files this process wrote, by path: (size, mtime_ns, inode, Metadata). The commit
#: check of a synchronous save reads them from here instead of unpickling its own file again.
_WRITTEN: dict[str, tuple[int, int, int, Metadata]] = {}
_WRITTEN_LOCK = threading.Lock()
_MAX_WRITTEN = 32


def remember_metadata(component_dir: str, metadata: Metadata) -> None:
    """Note that this process just wrote ``metadata`` to ``component_dir/.metadata``."""
    path = os.path.join(os.path.abspath(component_dir), METADATA_FILE)
    st = os.stat(path)
    with _WRITTEN_LOCK:
        _WRITTEN[path] = (st.st_size, st.st_mtime_ns, st.st_ino, metadata)
        while len(_WRITTEN) > _MAX_WRITTEN:
            del _WRITTEN[next(iter(_WRITTEN))]


def recall_metadata(component_dir: str) -> Metadata | None:
    """The metadata this process wrote to ``component_dir/.metadata``, if the file is unchanged."""
    path = os.path.join(os.path.abspath(component_dir), METADATA_FILE)
    with _WRITTEN_LOCK:
        found = _WRITTEN.get(path)
    if found is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    if (st.st_size, st.st_mtime_ns, st.st_ino) != found[:3]:
        return None
    return found[3]
