"""A nested checkpoint dict as flat DCP items plus a JSON description of its shape, and back.

Lightning hands a checkpoint as one nested dict (lists of optimizer state dicts keyed by int
parameter ids, tuples, ``OrderedDict``\\ s, tensors at any depth). DCP stores a flat mapping of
string keys and, on load, reads in place into a skeleton of the same structure, turning int
dict keys into strings on the way. :func:`flatten` therefore describes the structure itself, as
JSON that keeps key types, container kinds, scalars and every tensor's dtype and shape, and
lists the tensors and other objects as flat items (readable keys such as
``optimizer_states.0.state.0.exp_avg``). :func:`skeleton` rebuilds empty tensors of the right
dtype and shape from that JSON, so a load needs no live objects (where it is given them, the
DTensors of a sharded model, it reads into those); :func:`unflatten` puts the loaded items
back. :func:`tensor_module` holds a flat tensor mapping as an ``nn.Module`` whose state dict is
that mapping, so a model state dict can be saved and loaded as the engine's ``model`` component.
"""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import uuid
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import torch
import xxhash
from torch import nn

from ..errors import ArgumentTypeError, CorruptCheckpointError

__all__ = [
    "differing_keys",
    "dtype_name",
    "fingerprint_checkpoint",
    "flatten",
    "live_target",
    "parse_dtype",
    "skeleton",
    "tensor_module",
    "unflatten",
]

#: The JSON node kinds: a dict, an ordered dict, a list, a tuple, an inline scalar, a tensor item,
#: an object item (any other value, stored by DCP as bytes and read with ``weights_only``).
_DICT, _ODICT, _LIST, _TUPLE, _VALUE, _TENSOR, _OBJECT = "d", "od", "l", "t", "v", "T", "o"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str, where: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{where}: {name!r} is not a torch dtype")
    return dtype


def _json_scalar(value: Any) -> bool:
    if isinstance(value, float):
        return not math.isnan(value)  # NaN != NaN would break a bit-exact round trip check; store it as an item
    return value is None or isinstance(value, (bool, int, str))


def _key_node(key: Any, path: str) -> list[Any]:
    if isinstance(key, bool) or key is None or isinstance(key, (int, str)):
        return [key]
    if isinstance(key, float) and math.isfinite(key):
        return [key]
    raise ArgumentTypeError(
        f"checkpoint key {key!r} at {path or '<top>'} is a {type(key).__name__}: only str, int, bool, None and finite "
        "float dict keys can be stored; convert it in on_save_checkpoint"
    )


class _Flattener:
    def __init__(self, reserved: frozenset[str]) -> None:
        self.items: dict[str, Any] = {}
        self.reserved = reserved

    def _item_key(self, path: str) -> str:
        key, n = path or "_", 1
        while key in self.items or key in self.reserved:
            key, n = f"{path}#{n}", n + 1
        return key

    def node(self, value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = self._item_key(path)
            self.items[key] = value
            return {_TENSOR: key, "dtype": dtype_name(value.dtype), "shape": list(value.shape)}
        if isinstance(value, Mapping):
            kind = _ODICT if isinstance(value, OrderedDict) else _DICT
            return {
                kind: [[_key_node(k, path), self.node(v, f"{path}.{k}" if path else str(k))] for k, v in value.items()]
            }
        if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
            kind = _LIST if isinstance(value, list) else _TUPLE
            return {kind: [self.node(v, f"{path}.{i}" if path else str(i)) for i, v in enumerate(value)]}
        if _json_scalar(value):
            return {_VALUE: value}
        key = self._item_key(path)
        self.items[key] = value
        return {_OBJECT: key}


def flatten(tree: Any, reserved: frozenset[str] = frozenset()) -> tuple[Any, dict[str, Any]]:
    """``(structure, items)``: a JSON-able description of ``tree``'s shape and scalars, and its
    tensors and other objects under flat string keys, none in ``reserved`` (the tensors
    themselves, no copies)."""
    flattener = _Flattener(reserved)
    spec = flattener.node(tree, "")
    return spec, flattener.items


def _either(node: dict[str, Any], first: str, second: str) -> Any:
    return node[first] if first in node else node[second]


def live_target(like: Any, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """``like`` itself where it is a tensor of ``dtype`` and ``shape`` (a live DTensor: a load
    reads this rank's shard into it), else an empty tensor of that dtype and shape."""
    if isinstance(like, torch.Tensor) and like.dtype == dtype and list(like.shape) == shape:
        return like
    return torch.empty(shape, dtype=dtype)


def _child(like: Any, key: Any) -> Any:
    if isinstance(like, Mapping):
        return like.get(key)
    if isinstance(like, (list, tuple)) and isinstance(key, int) and 0 <= key < len(like):
        return like[key]
    return None


def _walk_items(node: Any, out: dict[str, Any], where: str, like: Any) -> None:
    if not isinstance(node, dict) or not node:
        raise CorruptCheckpointError(f"{where}: malformed structure node {str(node)[:80]!r}")
    if _TENSOR in node:
        shape = node.get("shape")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CorruptCheckpointError(f"{where}: item {node[_TENSOR]!r} has a malformed shape {shape!r}")
        out[node[_TENSOR]] = live_target(like, parse_dtype(str(node.get("dtype")), where), shape)
    elif _OBJECT in node:
        out[node[_OBJECT]] = None
    elif _DICT in node or _ODICT in node:
        for pair in _either(node, _DICT, _ODICT):
            key = pair[0][0] if isinstance(pair[0], list) and pair[0] else None
            _walk_items(pair[1], out, where, _child(like, key))
    elif _LIST in node or _TUPLE in node:
        for i, child in enumerate(_either(node, _LIST, _TUPLE)):
            _walk_items(child, out, where, _child(like, i))


def skeleton(structure: Any, where: str, like: Any = None) -> dict[str, Any]:
    """What a DCP load of the items of ``structure`` reads into: an empty tensor of the stored
    dtype and shape per tensor item, ``None`` per object item. ``like`` is a value shaped as the
    saved tree (or a part of it): where it holds a tensor of the stored dtype and shape at an
    item's place, that tensor is the item's target, read in place (the live optimizer state of
    a sharded model, into whose DTensors each rank reads its own shard)."""
    out: dict[str, Any] = {}
    _walk_items(structure, out, where, like)
    return out


def _build(node: Any, items: Mapping[str, Any], where: str) -> Any:
    if not isinstance(node, dict):
        raise CorruptCheckpointError(f"{where}: malformed structure node {str(node)[:80]!r}")
    if _TENSOR in node or _OBJECT in node:
        key = _either(node, _TENSOR, _OBJECT)
        if key not in items:
            raise CorruptCheckpointError(f"{where}: item {key!r} named by the structure was not loaded")
        return items[key]
    if _VALUE in node:
        return node[_VALUE]
    if _DICT in node or _ODICT in node:
        pairs = [(pair[0][0], _build(pair[1], items, where)) for pair in _either(node, _DICT, _ODICT)]
        return OrderedDict(pairs) if _ODICT in node else dict(pairs)
    if _LIST in node:
        return [_build(child, items, where) for child in node[_LIST]]
    if _TUPLE in node:
        return tuple(_build(child, items, where) for child in node[_TUPLE])
    raise CorruptCheckpointError(f"{where}: malformed structure node {str(node)[:80]!r}")


def unflatten(structure: Any, items: Mapping[str, Any], where: str) -> Any:
    """The nested value ``structure`` describes, with its items taken from ``items``."""
    return _build(structure, items, where)


def tensor_module(tensors: Mapping[str, torch.Tensor]) -> nn.Module:
    """A module whose ``state_dict()`` is ``tensors`` (same keys, the very tensors): each dotted
    key becomes a buffer in nested submodules, so the engine saves and loads a plain state dict
    exactly as it saves and loads a model."""
    root = nn.Module()
    made: dict[str, nn.Module] = {"": root}
    for key, tensor in tensors.items():
        *parents, leaf = key.split(".")
        module, prefix = root, ""
        try:
            for name in parents:
                prefix = f"{prefix}.{name}" if prefix else name
                child = made.get(prefix)
                if child is None:
                    child = made[prefix] = nn.Module()
                    module.add_module(name, child)
                module = child
            module.register_buffer(leaf, tensor)
        except (KeyError, TypeError) as err:
            raise ArgumentTypeError(
                f"state_dict key {key!r} cannot be stored as the engine's model component ({err}); "
                "a key must be a dotted path of module attribute names, each naming one tensor"
            ) from err
    return root


#: Top-level keys of a Lightning checkpoint that count its progress, not its state: two saves of
#: one global step differ in them when one is made after ``fit`` returned (the epoch ended).
PROGRESS_KEYS = frozenset({"loops", "epoch"})


def _tensor_digest(tensor: torch.Tensor) -> str:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor: this rank's shard
    data = local.detach().cpu().contiguous().reshape(-1)
    raw: Any = data.view(torch.uint8).numpy()  # the tensor's own bytes, not a copy (a buffer)
    digest = xxhash.xxh3_64_hexdigest(raw) if data.numel() else "0"
    return f"{dtype_name(local.dtype)}{list(local.shape)}:{digest}"


def _object_digest(value: Any) -> str:
    try:
        return hashlib.sha256(pickle.dumps(value, protocol=4)).hexdigest()
    except (pickle.PicklingError, TypeError, AttributeError, ValueError):
        return type(value).__qualname__  # unpicklable: compared by type only


def fingerprint_checkpoint(checkpoint: Mapping[str, Any], bookkeeping: frozenset[str]) -> dict[str, str]:
    """A digest of each top-level entry of a checkpoint dict (of each callback's state under
    ``callbacks``): its structure and scalars, each tensor's bytes (xxh3_64), each object's pickle.
    :data:`PROGRESS_KEYS` and the callbacks named in ``bookkeeping`` are left out."""
    entries: dict[str, Any] = {}
    for key, value in checkpoint.items():
        if key in PROGRESS_KEYS:
            continue
        if key == "callbacks" and isinstance(value, Mapping):
            entries |= {f"callbacks[{k!r}]": v for k, v in value.items() if k not in bookkeeping}
        else:
            entries[repr(key)] = value
    digests = {}
    for name, value in entries.items():
        try:
            tree, items = flatten(value)
            hashed = {
                k: _tensor_digest(v) if isinstance(v, torch.Tensor) else _object_digest(v) for k, v in items.items()
            }
            text = json.dumps([tree, hashed], sort_keys=True, default=repr)
        except (RecursionError, ArgumentTypeError):  # the save refuses it, naming why
            text = f"unreadable {uuid.uuid4()}"  # never equal to another save's
        digests[name] = hashlib.sha256(text.encode()).hexdigest()
    return digests


def differing_keys(first: Mapping[str, str], second: Mapping[str, str]) -> list[str]:
    """The entries two :func:`fingerprint_checkpoint` results disagree on (present in one only, too)."""
    return sorted(k for k in first.keys() | second.keys() if first.get(k) != second.get(k))
