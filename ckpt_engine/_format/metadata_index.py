"""The compact index of a DCP ``.metadata``: written beside it at save, read in its place at load.

The engine parses ``.metadata`` with its own interpreter (:mod:`.metadata_parser`: a pickle never
runs code here), which costs about four times ``pickle.loads``: 27 ms for the 2,814 entries of a
small language model's AdamW state, against 7 ms, a large part of a hot load. So the engine's
writer also leaves the *index* of each ``.metadata`` beside it (:func:`encode_index`,
``.metadata_index``): the same records as JSON columns, each key once and each tensor
description and property set once, after a header line naming the size and xxh3-128 digest of
the exact ``.metadata`` bytes it describes and of its own body.

A load reads the ``.metadata`` bytes as before (the manifest checks them). Where the index names
exactly those bytes and its body is intact, it builds the records from the index
(:func:`metadata_from_index`: 9 ms for those 2,814 entries) and validates them as it validates
the parser's; anything else (no index, another ``.metadata``, a damaged or crafted index, records
that fail validation) parses the ``.metadata``, which stays the copy of record. The index is JSON
read within bounds fixed before the parse (its size against the ``.metadata``'s, its nesting, the
digits of its integers), so it cannot run code or claim unbounded memory; every position it
holds is checked before it is used. The writer writes none where the records hold anything the
index does not describe exactly (a transform descriptor, a planner path of another shape). DCP
and older engines ignore the file.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import stat
from typing import TYPE_CHECKING, Any

from .bounded_json import nesting
from .metadata_types import RecordTypes, current_types, types_of

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["INDEX_FORMAT", "INDEX_VERSION", "decode_index", "encode_index", "metadata_from_index", "read_index"]


#: What the index's header says it is; a later version is ignored (the ``.metadata`` is parsed).
INDEX_FORMAT = "ckpt-engine-metadata-index"
INDEX_VERSION = 1
#: The index is read only up to this many times its ``.metadata``'s size, plus a little: the one
#: the engine writes is smaller than the pickle (each key once, each description once).
_INDEX_FACTOR, _INDEX_SLACK = 4, 64 << 10
#: The header line's most bytes, and the body's deepest nesting (``descs``: 5 levels).
_HEAD_BYTES, _INDEX_DEPTH = 1024, 6
#: Integers of more digits cost quadratic time to parse; none the engine writes has them. Found
#: with two C passes: every digit made ``0``, every other byte a space, then a substring search.
_LONG_INT = b"0" * 25
_DIGITS_ONLY = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_ERRORS = (ValueError, TypeError, KeyError, IndexError, AttributeError, OverflowError, RuntimeError, RecursionError)
logger = logging.getLogger("ckpt_engine")


class _NotIndexable(Exception):
    """The metadata holds something the index does not describe exactly."""


def _digest(data: bytes) -> str | None:
    try:
        import xxhash
    except ImportError:  # pragma: no cover - xxhash is a dependency; without it no index is written or read
        return None
    return str(xxhash.xxh3_128_hexdigest(data))


def encode_index(md: Metadata, data: bytes) -> bytes | None:
    """The compact index of ``md``, the ``Metadata`` whose pickle is ``data`` (the bytes of its
    ``.metadata``); ``None`` where ``md`` holds anything the index does not describe exactly
    (then the writer writes none, and loads parse the ``.metadata``)."""
    meta_digest = _digest(data)
    try:
        doc = _index_doc(md)
    except _NotIndexable:
        return None
    try:  # a string strict UTF-8 cannot hold (a lone surrogate) is one the parser refuses
        body = json.dumps(doc, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return None
    head = {"format": INDEX_FORMAT, "version": INDEX_VERSION}
    head.update(metadata=[len(data), meta_digest], body=[len(body), _digest(body)])
    return json.dumps(head, separators=(",", ":")).encode() + b"\n" + body


def read_index(index_path: str, data: bytes) -> bytes | None:
    """The bytes of the index at ``index_path`` (beside the ``.metadata`` whose bytes are
    ``data``), or ``None``: no such regular file, or one larger than any index of ``data``."""
    try:
        st = os.stat(index_path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _INDEX_FACTOR * len(data) + _INDEX_SLACK:
            return None
        with open(index_path, "rb") as f:
            return f.read(st.st_size + 1)
    except OSError:
        return None


def metadata_from_index(raw: bytes, data: bytes) -> Metadata | None:
    """The records index ``raw`` gives for ``data`` (the ``.metadata`` bytes it should describe),
    built of the classes of this context (:func:`~.metadata_types.current_types`), or ``None``
    (the caller parses ``data``). The caller validates them, as it does the parser's."""
    md = decode_index(raw, data, current_types())
    if md is None:
        logger.debug("a .metadata_index does not describe the .metadata beside it; parsing that")
    return md


def decode_index(raw: bytes, data: bytes, types: RecordTypes) -> Metadata | None:
    """The records the index ``raw`` holds, built of ``types``, where its header names exactly
    ``data`` (size and digest) and its body is intact and within bounds; else ``None``."""
    end = raw.find(b"\n", 0, _HEAD_BYTES)
    if end < 0:
        return None
    body = raw[end + 1 :]
    try:
        head = json.loads(raw[:end])
        if type(head) is not dict or head.get("format") != INDEX_FORMAT or head.get("version") != INDEX_VERSION:
            return None
        if head.get("metadata") != [len(data), _digest(data)] or head.get("body") != [len(body), _digest(body)]:
            return None
        if nesting(body) > _INDEX_DEPTH or _LONG_INT in body.translate(_DIGITS_ONLY):
            return None
        return _build(json.loads(body), types)
    except _ERRORS:
        return None


def _index_doc(md: Any) -> dict[str, Any]:
    """The index body of ``md``: its records as columns (see :func:`_build` for the reverse)."""
    types = types_of(md)
    sdm = md.state_dict_metadata
    if type(sdm) is not dict or not all(type(k) is str for k in sdm):
        raise _NotIndexable
    keys = list(sdm)
    key_at = {k: i for i, k in enumerate(keys)}
    describe = _Describer(types)
    kinds = [describe.item(v) for v in sdm.values()]
    return {
        "version": _optional_str(md.version),
        "storage_meta": _storage_meta_doc(md.storage_meta, types),
        "props": describe.props,
        "descs": describe.descs,
        "keys": keys,
        "kinds": kinds,
        "planner": _planner_doc(md.planner_data, keys, key_at),
        "storage": _storage_doc(md.storage_data, key_at, describe),
    }


class _Describer:
    """Tensor descriptions and properties, each distinct object once (as the pickle memoises them)."""

    def __init__(self, types: RecordTypes) -> None:
        self.types = types
        self.codes = {v: k for k, v in types.vocab.memory_formats.items()}
        self.props: list[list[Any]] = []
        self.descs: list[list[Any]] = []
        #: by ``id``: every object is reachable from the ``Metadata`` encoded, so no id is reused
        self._props_at: dict[int, int] = {}
        self._descs_at: dict[int, int] = {}

    def item(self, v: Any) -> int:
        t = self.types
        if type(v) is t.BytesStorageMetadata:
            return -1
        if type(v) is not t.TensorStorageMetadata or type(v.chunks) is not list:
            raise _NotIndexable
        at = self._descs_at.get(id(v))
        if at is None:
            chunks = []
            for c in v.chunks:
                if type(c) is not t.ChunkStorageMetadata:
                    raise _NotIndexable
                chunks.append([self.ints(c.offsets), self.ints(c.sizes)])
            at = self._descs_at[id(v)] = len(self.descs)
            self.descs.append([self.prop(v.properties), self.ints(v.size), chunks])
        return at

    def prop(self, p: Any) -> int:
        at = self._props_at.get(id(p))
        if at is not None:
            return at
        vocab = self.types.vocab
        if type(p) is not self.types.TensorProperties or type(p.requires_grad) is not bool:
            raise _NotIndexable
        dtype, layout = str(p.dtype).removeprefix("torch."), str(p.layout).removeprefix("torch.")
        code = self.codes.get(p.memory_format)
        if vocab.value(dtype) != p.dtype or vocab.value(layout) != p.layout or code is None:
            raise _NotIndexable
        if type(p.pin_memory) is not bool:
            raise _NotIndexable
        at = self._props_at[id(p)] = len(self.props)
        self.props.append([dtype, layout, p.requires_grad, code, p.pin_memory])
        return at

    def ints(self, size: Any) -> list[int]:
        if type(size) is not self.types.vocab.size_type:
            raise _NotIndexable
        out = list(size)
        if not all(type(i) is int for i in out):
            raise _NotIndexable
        return out


def _optional_str(value: Any) -> str | None:
    if value is not None and type(value) is not str:
        raise _NotIndexable
    return value


def _storage_meta_doc(sm: Any, types: RecordTypes) -> list[Any] | None:
    if sm is None:
        return None
    if type(sm) is not types.StorageMeta or type(sm.modules) is not list:
        raise _NotIndexable
    cid = sm.checkpoint_id
    if isinstance(cid, pathlib.PurePath):
        where: list[Any] = ["path", str(cid)]
    else:
        where = ["str", _optional_str(cid)]
    return [where, _optional_str(sm.save_id), _optional_str(sm.load_id), [_optional_str(m) for m in sm.modules]]


def _planner_doc(pd: Any, keys: list[str], key_at: dict[str, int]) -> dict[str, Any] | None:
    """``planner_data``: the position in ``keys`` of each of its keys, in its own order (``None``:
    the keys' order), and each key's path (``0``: the key alone; ``1``: the key cut at its dots)."""
    if pd is None:
        return None
    if type(pd) is not dict or len(pd) != len(keys):
        raise _NotIndexable
    order = None if list(pd) == keys else [key_at.get(k, -1) for k in pd]
    if order is not None and min(order) < 0:
        raise _NotIndexable
    paths: list[Any] = []
    for k, path in pd.items():
        if type(path) is not tuple or not all(type(x) is str or type(x) is int for x in path):
            raise _NotIndexable
        paths.append(0 if path == (k,) else 1 if path == tuple(k.split(".")) else list(path))
    return {"order": order, "paths": paths}


def _storage_doc(sd: Any, key_at: dict[str, int], describe: _Describer) -> dict[str, list[Any]] | None:
    """``storage_data`` as columns: each entry's key (its position in the keys, ``key_at``), chunk
    offset, index, file (its position in ``files``), offset and length."""
    if sd is None:
        return None
    if type(sd) is not dict:
        raise _NotIndexable
    types = describe.types
    files: dict[str, int] = {}
    cols: dict[str, list[Any]] = {c: [] for c in ("key", "offset", "index", "file", "pos", "length")}
    for mi, si in sd.items():
        if type(mi) is not types.MetadataIndex or type(si) is not types.StorageInfo:
            raise _NotIndexable
        k, rel = key_at.get(mi.fqn), si.relative_path
        if k is None or type(rel) is not str or getattr(si, "transform_descriptors", None) is not None:
            raise _NotIndexable
        if (mi.index is not None and type(mi.index) is not int) or type(si.offset) is not int:
            raise _NotIndexable
        if type(si.length) is not int:
            raise _NotIndexable
        cols["key"].append(k)
        cols["offset"].append(None if mi.offset is None else describe.ints(mi.offset))
        cols["index"].append(mi.index)
        cols["file"].append(files.setdefault(rel, len(files)))
        cols["pos"].append(si.offset)
        cols["length"].append(si.length)
    return {"files": list(files), **cols}


def _at(seq: list[Any], i: Any) -> Any:
    if type(i) is not int or i < 0:
        raise IndexError(i)
    return seq[i]


def _ints(value: Any) -> list[int]:
    if type(value) is not list or not all(type(i) is int for i in value):
        raise TypeError("not a list of ints")
    return value


def _build(doc: Any, types: RecordTypes) -> Metadata:
    """The ``Metadata`` of index body ``doc``; raises one of :data:`_ERRORS` where it is malformed."""
    vocab, size = types.vocab, types.vocab.size_type
    props = []
    for dtype, layout, grad, code, pin in doc["props"]:
        dt, lay = vocab.value(dtype), vocab.value(layout)
        if not isinstance(dt, vocab.dtype_type) or not isinstance(lay, vocab.layout_type):
            raise TypeError("not a dtype or layout")
        if type(grad) is not bool or type(pin) is not bool or type(code) is not int:
            raise TypeError("not a flag")
        props.append(
            types.TensorProperties(
                dtype=dt, layout=lay, requires_grad=grad, memory_format=vocab.memory_formats[code], pin_memory=pin
            )
        )
    descs = [
        types.TensorStorageMetadata(
            properties=_at(props, p),
            size=size(_ints(shape)),
            chunks=[types.ChunkStorageMetadata(offsets=size(_ints(o)), sizes=size(_ints(s))) for o, s in chunks],
        )
        for p, shape, chunks in doc["descs"]
    ]
    keys, kinds = doc["keys"], doc["kinds"]
    if type(keys) is not list or type(kinds) is not list or len(keys) != len(kinds):
        raise ValueError("keys and kinds differ in length")
    if keys and set(map(type, keys)) != {str}:
        raise TypeError("a key that is not a string")
    _positions(kinds, len(descs), -1)  # -1: a non-tensor value
    new, bytes_type = object.__new__, types.BytesStorageMetadata
    sdm = {k: new(bytes_type) if kind < 0 else descs[kind] for k, kind in zip(keys, kinds, strict=True)}
    if len(sdm) != len(keys):
        raise ValueError("a key twice")
    md: Metadata = types.Metadata(
        state_dict_metadata=sdm,
        planner_data=_build_planner(doc["planner"], keys),
        storage_data=_build_storage(doc["storage"], keys, types),
        storage_meta=_build_storage_meta(doc["storage_meta"], types),
        version=_str_or_none(doc["version"]),
    )
    return md


def _str(value: Any) -> str:
    if type(value) is not str:
        raise TypeError("not a string")
    return value


def _str_or_none(value: Any) -> str | None:
    return None if value is None else _str(value)


def _build_planner(pl: Any, keys: list[str]) -> dict[str, tuple[Any, ...]] | None:
    if pl is None:
        return None
    order, paths = pl["order"], pl["paths"]
    if type(paths) is not list or len(paths) != len(keys):
        raise ValueError("planner_data differs from the keys")
    # a permutation of the keys, checked before any path is built (a key named many times would
    # cost its length each time)
    if order is not None and (len(_positions(order, len(keys))) != len(keys) or len(set(order)) != len(keys)):
        raise ValueError("planner_data names a key twice")
    named = keys if order is None else [keys[i] for i in order]
    out: dict[str, tuple[Any, ...]] = {}
    for k, path in zip(named, paths, strict=True):
        if type(path) is int and path in (0, 1):
            out[k] = (k,) if path == 0 else tuple(k.split("."))
        elif type(path) is list and all(type(x) is str or type(x) is int for x in path):
            out[k] = tuple(path)
        else:
            raise TypeError("not a planner path")
    return out  # one entry per key: the keys are distinct (``_build``) and ``order`` a permutation


def _positions(column: list[Any], bound: int, least: int = 0) -> list[int]:
    """``column``, where every value is an int in ``[least, bound)`` (checked in bulk)."""
    if column and (set(map(type, column)) != {int} or min(column) < least or max(column) >= bound):
        raise IndexError("a position outside its table")
    return column


def _build_storage(st: Any, keys: list[str], types: RecordTypes) -> dict[Any, Any] | None:
    if st is None:
        return None
    files = [_str(f) for f in st["files"]]
    cols = [st[c] for c in ("key", "offset", "index", "file", "pos", "length")]
    if any(type(c) is not list or len(c) != len(cols[0]) for c in cols):
        raise ValueError("storage columns differ in length")
    key_col, offsets, indexes, file_col, pos, length = cols
    _positions(key_col, len(keys))
    _positions(file_col, len(files))
    if not set(map(type, pos)) | set(map(type, length)) <= {int} or not set(map(type, indexes)) <= {int, type(None)}:
        raise TypeError("not an int")
    if not set(map(type, offsets)) <= {list, type(None)}:
        raise TypeError("not an offset")
    new, setattr_ = object.__new__, object.__setattr__
    index_type, info_type, size = types.MetadataIndex, types.StorageInfo, types.vocab.size_type
    out: dict[Any, Any] = {}
    for k, offset, index, f, at, n in zip(*cols, strict=True):
        key = new(index_type)
        setattr_(
            key, "__dict__", {"fqn": keys[k], "offset": None if offset is None else size(_ints(offset)), "index": index}
        )
        value = new(info_type)
        setattr_(
            value, "__dict__", {"relative_path": files[f], "offset": at, "length": n, "transform_descriptors": None}
        )
        out[key] = value
    if len(out) != len(cols[0]):
        raise ValueError("a storage entry twice")
    return out


def _build_storage_meta(sm: Any, types: RecordTypes) -> Any:
    if sm is None:
        return None
    (kind, where), save_id, load_id, modules = sm
    if kind == "path":
        checkpoint_id: Any = pathlib.Path(_str(where))
    elif kind == "str":
        checkpoint_id = _str_or_none(where)
    else:
        raise ValueError("not a checkpoint id")
    if type(modules) is not list:
        raise TypeError("not a list of modules")
    return types.StorageMeta(
        checkpoint_id=checkpoint_id,
        save_id=_str_or_none(save_id),
        load_id=_str_or_none(load_id),
        modules=[_str(m) for m in modules],
    )
