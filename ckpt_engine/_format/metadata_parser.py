"""Parse DCP ``.metadata`` pickles without ``pickle``: an interpreter that can only build metadata.

DCP pickles its ``Metadata`` and reads it back with ``pickle.load``, which runs whatever the file
says. A class filter on ``pickle.Unpickler.find_class`` is not enough: the ``BUILD`` opcode calls
``setattr`` on whatever object is on the stack, and an allowed *class* is such an object, so a file
that still unpickles to a valid ``Metadata`` can rewrite ``Metadata.__getstate__`` for the whole
process; and the C unpickler sizes its memo by the largest index a ``PUT`` names, so nine bytes can
allocate gigabytes before any check runs.

This module never calls ``pickle``. It walks the opcodes itself and builds values of a closed
vocabulary: ``None``, bools, ints, floats, strings, bytes, tuples, lists, dicts, sets and the DCP
metadata records. Globals resolve to inert tokens, never to the real classes; ``NEWOBJ`` on a token
creates a fresh record that only this parse can see; ``BUILD`` may only fill such a record, once,
with the fields its type declares; ``SETITEMS``/``APPENDS``/``ADDITEMS`` may only fill containers
the parse created. Only when the whole file has been read are the records turned into real DCP
objects, through their constructors, checked field by field. Reading a checkpoint therefore cannot
change the process.

Time and memory are linear in the file's size, whatever the file says:

* every opcode adds at most one reference (the memo is a dict), and the containers built from the
  stack (``TUPLE``, ``LIST``, ``DICT``, ``SETITEMS``, ...) take items other opcodes pushed;
* values may be shared (``DUP``, ``GET``), so a few bytes can describe a tuple whose expansion is
  exponential. Nothing walks a value's expansion: dict keys and set elements must be of the flat
  types DCP uses (strings, numbers, ``None``, records), so hashing costs what the key's own bytes
  cost; every copy a constructor makes (``torch.Size``, ``set``, ``OrderedDict``, a path, the
  builder's chunk lists and plain values) is charged to one :class:`_Budget` of
  ``4 * len(file) + 64 Ki`` items, so copying one memoised tuple many times is refused;
* integers are at most 255 bytes (``LONG1``'s limit; DCP writes 64-bit values), so hashing or
  comparing one is constant time;
* no error message formats a value the file built: messages name types, lengths and at most
  the first :data:`_SHOWN` characters of a string (:func:`_describe`, :func:`_clip`).

Errors: :class:`PickleRefused` for anything DCP never writes (a forbidden global, a mutating opcode
on an object the parse did not create, an unknown attribute); :class:`PickleMalformed` for a file
that is not a well-formed pickle of metadata. The caller turns both into typed engine errors that
name the file.
"""

from __future__ import annotations

import gc
import pathlib
import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import SHOWN_CHARS
from ..errors import clip as _clip
from .metadata_fast import StorageBatch
from .metadata_types import RecordTypes, Vocabulary, dcp_types

if TYPE_CHECKING:
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

__all__ = ["PickleMalformed", "PickleRefused", "parse_metadata"]


class PickleMalformed(ValueError):
    """The bytes are not a well-formed pickle of DCP metadata (damage, truncation)."""


class PickleRefused(ValueError):
    """The pickle asks for something DCP metadata never contains (a crafted file)."""


# --------------------------------------------------------------------------------------------------
# The vocabulary: which globals a DCP .metadata may name, and what each resolves to.

_DCP_MD = "torch.distributed.checkpoint.metadata"

#: record kind -> the fields a BUILD may set (in the order of the dataclass).
_RECORD_FIELDS: dict[str, tuple[str, ...]] = {
    "Metadata": ("state_dict_metadata", "planner_data", "storage_data", "storage_meta", "version"),
    "TensorStorageMetadata": ("properties", "size", "chunks"),
    "BytesStorageMetadata": (),
    "ChunkStorageMetadata": ("offsets", "sizes"),
    "TensorProperties": ("dtype", "layout", "requires_grad", "memory_format", "pin_memory"),
    "MetadataIndex": ("fqn", "offset", "index"),
    "StorageMeta": ("checkpoint_id", "save_id", "load_id", "modules"),
    "_StorageInfo": ("relative_path", "offset", "length", "transform_descriptors"),
}

_FIELD_SETS = {kind: frozenset(fields) for kind, fields in _RECORD_FIELDS.items()}

_GLOBALS: dict[tuple[str, str], str] = {
    **{(_DCP_MD, kind): kind for kind in _RECORD_FIELDS if kind != "_StorageInfo"},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): "_StorageInfo",
    (_DCP_MD, "_MEM_FORMAT_ENCODING"): "mem_format",
    ("torch", "Size"): "Size",
    ("torch.serialization", "_get_layout"): "get_layout",
    ("collections", "OrderedDict"): "OrderedDict",
    ("builtins", "set"): "set",
    ("builtins", "frozenset"): "frozenset",
    **{(mod, cls): "path" for mod in ("pathlib", "pathlib._local") for cls in ("PosixPath", "WindowsPath")},
    ("pathlib", "_local.PosixPath"): "path",
    ("pathlib", "_local.WindowsPath"): "path",
}

# ``torch.<name>`` globals that are values (dtypes and layouts), DCP's memory-format codes and
# ``torch.Size`` come from the ``Vocabulary`` of the record types (torch's, or torch-free stand-ins).


@dataclass(eq=False, slots=True)
class _Token:
    """A global as the parse sees it: a name to call, never the object itself."""

    kind: str


@dataclass(eq=False, slots=True, repr=False)
class _Record:
    """A DCP record under construction; only this parse holds a reference to it."""

    kind: str
    state: dict[str, Any] | None = None

    def __repr__(self) -> str:  # never the state: it may be shared structure of any size
        return f"<{self.kind} record>"


@dataclass(frozen=True, slots=True)
class _MemFormat:
    value: int


_MARK = object()

#: The types a dict key or a set element may have: hashing them costs their own bytes (strings
#: and bytes cache their hash), never a walk of shared structure.
_FLAT_TYPES = frozenset({str, bytes, int, float, bool, type(None)})
_KEY_TYPES = _FLAT_TYPES | {_Record}
_SHOWN = SHOWN_CHARS
#: Largest integer a file may hold, in bytes: LONG1's limit (DCP's ints fit in 8).
_MAX_INT_BYTES = 255


class _Budget:
    """The items the parse may still copy: a small multiple of the file's size (module docstring)."""

    __slots__ = ("left",)

    def __init__(self, data_len: int) -> None:
        self.left = 4 * data_len + 65_536

    def charge(self, items: int, what: str) -> None:
        self.left -= items
        if self.left < 0:
            raise PickleRefused(
                f"builds more than a DCP metadata file of its size can describe ({what}: copies of shared "
                "values; a crafted file)"
            )


def _describe(value: Any) -> str:
    """A value the file built, named by type and length only: never its repr (it may be huge)."""
    if type(value) is str:
        return f"the string {_clip(value)}"
    if isinstance(value, (tuple, list, dict, set, frozenset)):
        return f"a {type(value).__name__} of {len(value)} items"
    return f"a {type(value).__name__}"


def _check_flat(values: Any, what: str) -> None:
    """Every element of ``values`` is of a flat type (dict keys, set elements)."""
    for v in values:
        if type(v) not in _KEY_TYPES:
            raise PickleRefused(
                f"{what} of type {type(v).__name__}; DCP metadata uses only strings, numbers and records"
            )


# --------------------------------------------------------------------------------------------------
# The interpreter.


def _refuse(what: str) -> PickleRefused:
    return PickleRefused(f"asks for {what}, which DCP metadata never contains")


def _call(token: Any, args: Any, budget: _Budget, vocab: Vocabulary) -> Any:
    """``REDUCE``: the few constructors DCP metadata uses, each with checked arguments; every
    copy a constructor makes is charged to ``budget`` (a memoised tuple may be passed many times)."""
    if not isinstance(token, _Token) or type(args) is not tuple:
        raise _refuse(f"REDUCE of {type(token).__name__} (only the DCP metadata constructors may be called)")
    kind = token.kind
    if kind == "Size":
        if len(args) != 1 or type(args[0]) is not tuple:
            raise PickleMalformed("torch.Size takes one tuple of ints")
        budget.charge(len(args[0]), "torch.Size")
        if not all(type(d) is int for d in args[0]):
            bad = next(d for d in args[0] if type(d) is not int)
            raise PickleMalformed(f"torch.Size of a tuple holding {_describe(bad)}; it takes ints")
        try:
            return vocab.size_type(args[0])
        except (TypeError, OverflowError, RuntimeError) as err:
            raise PickleMalformed(f"torch.Size of {len(args[0])} ints: {str(err)[:_SHOWN]}") from err
    if kind == "get_layout":
        layout = vocab.layout(args[0]) if len(args) == 1 and type(args[0]) is str else None
        if layout is None:
            raise PickleMalformed(f"unknown tensor layout: {_describe(args[0]) if len(args) == 1 else 'no name'}")
        return layout
    if kind == "mem_format":
        if len(args) != 1 or not _is_int(args[0]) or args[0] not in vocab.memory_formats:
            shown = str(args[0]) if len(args) == 1 and _is_int(args[0]) else _describe(args)
            raise PickleMalformed(f"unknown memory-format encoding {shown[:_SHOWN]}")
        return _MemFormat(args[0])
    if kind == "OrderedDict":
        if args == ():
            return OrderedDict()
        if len(args) == 1 and type(args[0]) is list:
            budget.charge(len(args[0]), "OrderedDict")
            if all(type(p) in (list, tuple) and len(p) == 2 for p in args[0]):
                _check_flat((p[0] for p in args[0]), "an OrderedDict key")
                return OrderedDict(args[0])
        raise PickleMalformed("OrderedDict takes no arguments or one list of pairs")
    if kind in ("set", "frozenset"):
        if len(args) == 1 and type(args[0]) in (list, tuple):
            budget.charge(len(args[0]), kind)
            _check_flat(args[0], f"a {kind} element")
            return set(args[0]) if kind == "set" else frozenset(args[0])
        raise PickleMalformed(f"{kind} takes one list")
    if kind == "path":
        budget.charge(len(args), "a path")
        if not all(type(a) is str and "\0" not in a for a in args):
            raise PickleMalformed("a path takes strings")
        budget.charge(sum(map(len, args)), "a path")
        return pathlib.PurePosixPath(*args)
    raise _refuse(f"REDUCE of {kind} (DCP creates it with NEWOBJ)")


def _new(token: Any, args: Any) -> _Record:
    """``NEWOBJ``: a fresh, empty DCP record."""
    if not isinstance(token, _Token) or token.kind not in _RECORD_FIELDS:
        name = token.kind if isinstance(token, _Token) else type(token).__name__
        raise _refuse(f"NEWOBJ of {name} (only DCP metadata records may be created)")
    if args != ():
        raise PickleMalformed(f"NEWOBJ of {token.kind} with arguments")
    return _Record(token.kind)


def _build(target: Any, state: Any) -> None:
    """``BUILD``: fill a record this parse created, once, with its declared fields."""
    if type(target) is not _Record:
        raise _refuse(f"BUILD on a {type(target).__name__} (it may only fill a DCP record the file created)")
    if target.state is not None:
        raise _refuse(f"a second BUILD on one {target.kind}")
    if type(state) is not dict:
        state = _state_dict(target.kind, state)
    _check_flat(state.keys(), f"a {target.kind} field name")
    if not state.keys() <= _FIELD_SETS[target.kind]:
        unknown = min(map(str, state.keys() - _FIELD_SETS[target.kind]))
        raise _refuse(f"BUILD sets {_clip(unknown)}, which {target.kind} does not have")
    target.state = state


def _state_dict(kind: str, state: Any) -> dict[Any, Any]:
    """The other state forms DCP's records pickle with, as one dict."""
    fields = _RECORD_FIELDS[kind]
    if kind == "TensorProperties" and type(state) is tuple:  # TensorProperties.__getstate__
        if len(state) != len(fields):
            raise PickleMalformed("TensorProperties state has the wrong length")
        return dict(zip(fields, state, strict=True))
    if type(state) is tuple and len(state) == 2:  # (dict state, slot state)
        merged: dict[Any, Any] = {}
        for part in state:
            if part is not None and type(part) is not dict:
                raise PickleMalformed(f"{kind} state is not a dict")
            merged.update(part or {})
        return merged
    raise PickleMalformed(f"{kind} state is a {type(state).__name__}, not a dict")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _text_line(data: bytes, pos: int) -> tuple[str, int]:
    end = data.find(b"\n", pos)
    if end < 0:
        raise PickleMalformed("unterminated text argument")
    try:
        return data[pos:end].decode("ascii"), end + 1
    except UnicodeDecodeError as err:
        raise PickleMalformed("non-ASCII text argument") from err


def _interpret(data: bytes, budget: _Budget, vocab: Vocabulary, batch: StorageBatch | None = None) -> Any:
    """Run the opcodes of ``data`` and return the value STOP leaves (copies charged to ``budget``).

    Kept as one loop with the opcodes ordered by how often DCP metadata uses them: this is the hot
    path of every load (tens of bytes per tensor, millions of opcodes for large models). With
    ``batch``, a ``MARK`` that starts a batch of DCP storage entries is replayed by it
    (:mod:`.metadata_fast`); a ``PUT`` that leaves a gap in the memo switches it off.
    """
    stack: list[Any] = []
    metastack: list[list[Any]] = []
    memo: dict[int, Any] = {}
    unpack_from = struct.unpack_from
    n = len(data)
    pos = 0
    frame_end = 0  # where the current frame ends (at or before pos: outside any frame)
    append = stack.append
    key_types = _KEY_TYPES
    while True:
        if pos >= n:
            raise PickleMalformed("truncated: no STOP opcode")
        op = data[pos]
        pos += 1
        if op == 0x94:  # MEMOIZE
            memo[len(memo)] = stack[-1]
        elif op == 0x6A:  # LONG_BINGET
            (idx,) = unpack_from("<I", data, pos)
            pos += 4
            append(memo[idx])
        elif op == 0x68:  # BINGET
            append(memo[data[pos]])
            pos += 1
        elif op == 0x8C:  # SHORT_BINUNICODE
            size = data[pos]
            end = pos + 1 + size
            if end > n:
                raise PickleMalformed("truncated string")
            append(data[pos + 1 : end].decode("utf-8"))
            pos = end
        elif op == 0x28:  # MARK
            if batch is not None and stack and type(stack[-1]) is dict:
                replayed = batch.run(data, pos, frame_end, stack[-1], memo)
                if replayed is not None:
                    pos, frame_end = replayed
                    continue
            metastack.append(stack)
            stack = []
            append = stack.append
        elif op == 0x29:  # EMPTY_TUPLE
            append(())
        elif op == 0x7D:  # EMPTY_DICT
            append({})
        elif op == 0x75:  # SETITEMS
            items = stack
            stack = metastack.pop()
            append = stack.append
            target = stack[-1]
            if type(target) is not dict and type(target) is not OrderedDict:
                raise _refuse(f"SETITEMS into a {type(target).__name__}")
            if len(items) % 2:
                raise PickleMalformed("SETITEMS with an odd number of items")
            for i in range(0, len(items), 2):
                k = items[i]
                if type(k) not in key_types:
                    _check_flat((k,), "a dict key")
                target[k] = items[i + 1]
        elif op == 0x81:  # NEWOBJ
            args = stack.pop()
            stack[-1] = _new(stack[-1], args)
        elif op == 0x62:  # BUILD
            state = stack.pop()
            _build(stack[-1], state)
            if batch is not None and len(stack) == 2 and metastack and stack[1].kind == "_StorageInfo":
                # The first storage entry of a MARK, run here (its classes and field names are
                # new strings): if the MARK is a dict's, the batch replays the rest of it.
                key, target = stack[0], metastack[-1][-1]
                if type(key) is _Record and key.kind == "MetadataIndex" and type(target) is dict:
                    replayed = batch.run(data, pos, frame_end, target, memo, head=(key, stack[1]))
                    if replayed is not None:
                        stack = metastack.pop()
                        append = stack.append
                        pos, frame_end = replayed
        elif op == 0x4B:  # BININT1
            append(data[pos])
            pos += 1
        elif op == 0x4D:  # BININT2
            (v,) = unpack_from("<H", data, pos)
            append(v)
            pos += 2
        elif op == 0x4A:  # BININT
            (v,) = unpack_from("<i", data, pos)
            append(v)
            pos += 4
        elif op == 0x85:  # TUPLE1
            stack[-1] = (stack[-1],)
        elif op == 0x86:  # TUPLE2
            b = stack.pop()
            stack[-1] = (stack[-1], b)
        elif op == 0x87:  # TUPLE3
            c = stack.pop()
            b = stack.pop()
            stack[-1] = (stack[-1], b, c)
        elif op == 0x74:  # TUPLE
            items = stack
            stack = metastack.pop()
            append = stack.append
            append(tuple(items))
        elif op == 0x52:  # REDUCE
            args = stack.pop()
            stack[-1] = _call(stack[-1], args, budget, vocab)
        elif op == 0x4E:  # NONE
            append(None)
        elif op == 0x88:  # NEWTRUE
            append(True)
        elif op == 0x89:  # NEWFALSE
            append(False)
        elif op == 0x5D:  # EMPTY_LIST
            append([])
        elif op == 0x61:  # APPEND
            v = stack.pop()
            if type(stack[-1]) is not list:
                raise _refuse(f"APPEND to a {type(stack[-1]).__name__}")
            stack[-1].append(v)
        elif op == 0x65:  # APPENDS
            items = stack
            stack = metastack.pop()
            append = stack.append
            if type(stack[-1]) is not list:
                raise _refuse(f"APPENDS to a {type(stack[-1]).__name__}")
            stack[-1].extend(items)
        elif op == 0x93:  # STACK_GLOBAL
            name = stack.pop()
            module = stack.pop()
            if not isinstance(module, str) or not isinstance(name, str):
                raise PickleMalformed("STACK_GLOBAL needs two strings")
            append(_resolve(module, name, vocab))
        elif op == 0x63:  # GLOBAL
            module, pos = _text_line(data, pos)
            name, pos = _text_line(data, pos)
            append(_resolve(module, name, vocab))
        elif op == 0x80:  # PROTO
            if data[pos] > 5:
                raise PickleMalformed(f"unsupported pickle protocol {data[pos]}")
            pos += 1
        elif op == 0x95:  # FRAME: a length hint, but only where CPython's unpicklers agree on it
            if pos <= frame_end:  # the pure-Python one refuses it; the C one reads on, from a file differently
                raise PickleMalformed("a FRAME inside a frame (its unread bytes would be read differently)")
            (size,) = unpack_from("<Q", data, pos)
            pos += 8
            if size > n - pos:
                raise PickleMalformed("a FRAME longer than the rest of the data")
            frame_end = pos + size
        elif op == 0x2E:  # STOP
            if len(stack) != 1 or metastack:
                raise PickleMalformed("STOP with an unbalanced stack")
            return stack[0]
        elif op in (0x58, 0x8D, 0x42, 0x43, 0x8E):  # BINUNICODE, BINUNICODE8, BINBYTES, SHORT_BINBYTES, BINBYTES8
            fmt, width = {0x58: ("<I", 4), 0x8D: ("<Q", 8), 0x42: ("<I", 4), 0x43: ("<B", 1), 0x8E: ("<Q", 8)}[op]
            (size,) = unpack_from(fmt, data, pos)
            start = pos + width
            if start + size > n:
                raise PickleMalformed("truncated string")
            raw = data[start : start + size]
            append(raw.decode("utf-8") if op in (0x58, 0x8D) else raw)
            pos = start + size
        elif op == 0x71:  # BINPUT
            idx = data[pos]
            if idx > len(memo):
                batch = None
            memo[idx] = stack[-1]
            pos += 1
        elif op == 0x72:  # LONG_BINPUT
            (idx,) = unpack_from("<I", data, pos)
            if idx > len(memo):
                batch = None
            memo[idx] = stack[-1]
            pos += 4
        elif op == 0x70:  # PUT
            text, pos = _text_line(data, pos)
            idx = _parse_int(text)
            if idx > len(memo):
                batch = None
            memo[idx] = stack[-1]
        elif op == 0x67:  # GET
            text, pos = _text_line(data, pos)
            append(memo[_parse_int(text)])
        elif op == 0x30:  # POP
            if stack:
                stack.pop()
            else:
                stack = metastack.pop()
                append = stack.append
        elif op == 0x31:  # POP_MARK
            stack = metastack.pop()
            append = stack.append
        elif op == 0x32:  # DUP
            append(stack[-1])
        elif op == 0x8A:  # LONG1
            size = data[pos]
            if pos + 1 + size > n:
                raise PickleMalformed("truncated long")
            append(int.from_bytes(data[pos + 1 : pos + 1 + size], "little", signed=True))
            pos += 1 + size
        elif op == 0x8B:  # LONG4
            (size,) = unpack_from("<i", data, pos)
            if size > _MAX_INT_BYTES:
                raise _refuse(f"an integer of {size} bytes (DCP writes 64-bit integers)")
            if size < 0 or pos + 4 + size > n:
                raise PickleMalformed("truncated long")
            append(int.from_bytes(data[pos + 4 : pos + 4 + size], "little", signed=True))
            pos += 4 + size
        elif op == 0x49:  # INT (text; "00"/"01" are False/True)
            text, pos = _text_line(data, pos)
            append({"00": False, "01": True}.get(text) if text in ("00", "01") else _parse_int(text))
        elif op == 0x4C:  # LONG (text)
            text, pos = _text_line(data, pos)
            append(_parse_int(text.removesuffix("L")))
        elif op == 0x47:  # BINFLOAT
            (f,) = unpack_from(">d", data, pos)
            append(f)
            pos += 8
        elif op == 0x46:  # FLOAT (text)
            text, pos = _text_line(data, pos)
            try:
                append(float(text))
            except ValueError as err:
                raise PickleMalformed(f"bad float {text[:40]!r}") from err
        elif op == 0x56:  # UNICODE (text, raw-unicode-escape)
            end = data.find(b"\n", pos)
            if end < 0:
                raise PickleMalformed("unterminated string")
            append(data[pos:end].decode("raw-unicode-escape"))
            pos = end + 1
        elif op == 0x6C:  # LIST
            items = stack
            stack = metastack.pop()
            append = stack.append
            append(items)
        elif op == 0x64:  # DICT
            items = stack
            stack = metastack.pop()
            append = stack.append
            if len(items) % 2:
                raise PickleMalformed("DICT with an odd number of items")
            _check_flat(items[::2], "a dict key")
            append({items[i]: items[i + 1] for i in range(0, len(items), 2)})
        elif op == 0x73:  # SETITEM
            v = stack.pop()
            k = stack.pop()
            if type(stack[-1]) is not dict and type(stack[-1]) is not OrderedDict:
                raise _refuse(f"SETITEM into a {type(stack[-1]).__name__}")
            _check_flat((k,), "a dict key")
            stack[-1][k] = v
        elif op == 0x8F:  # EMPTY_SET
            append(set())
        elif op == 0x90:  # ADDITEMS
            items = stack
            stack = metastack.pop()
            append = stack.append
            if type(stack[-1]) is not set:
                raise _refuse(f"ADDITEMS to a {type(stack[-1]).__name__}")
            _check_flat(items, "a set element")
            stack[-1].update(items)
        elif op == 0x91:  # FROZENSET
            items = stack
            stack = metastack.pop()
            append = stack.append
            _check_flat(items, "a frozenset element")
            append(frozenset(items))
        elif op == 0x92:  # NEWOBJ_EX
            kwargs = stack.pop()
            args = stack.pop()
            if kwargs != {}:
                raise PickleMalformed("NEWOBJ_EX with keyword arguments")
            stack[-1] = _new(stack[-1], args)
        elif op in _REFUSED_OPS:
            raise _refuse(f"opcode {_REFUSED_OPS[op]} (DCP metadata never uses it)")
        else:
            raise PickleMalformed(f"unknown opcode 0x{op:02x} at byte {pos - 1}")


_REFUSED_OPS = {
    0x69: "INST",
    0x6F: "OBJ",
    0x82: "EXT1",
    0x83: "EXT2",
    0x84: "EXT4",
    0x50: "PERSID",
    0x51: "BINPERSID",
    0x97: "NEXT_BUFFER",
    0x98: "READONLY_BUFFER",
    0x96: "BYTEARRAY8",
    0x53: "STRING",
    0x54: "BINSTRING",
    0x55: "SHORT_BINSTRING",
}


def _parse_int(text: str) -> int:
    if len(text) > 2 * _MAX_INT_BYTES:  # 255 bytes are at most 615 decimal digits
        raise PickleMalformed(f"an integer of {len(text)} digits (DCP writes 64-bit integers)")
    try:
        return int(text)
    except ValueError as err:  # also Python's limit on the digits of a decimal int
        raise PickleMalformed(f"bad integer {text[:40]!r}") from err


def _resolve(module: str, name: str, vocab: Vocabulary) -> Any:
    if module == "torch":
        value = vocab.value(name)
        if value is not None:
            return value
    kind = _GLOBALS.get((module, name))
    if kind is None:
        raise PickleRefused(f"references {module[:_SHOWN]}.{name[:_SHOWN]}, a global DCP metadata never contains")
    return _Token(kind)


# --------------------------------------------------------------------------------------------------
# From records to real DCP objects, checked field by field.


#: Leaves :meth:`_Builder.plain` returns as they are.
_PLAIN_LEAVES = frozenset({str, int, float, bool, bytes, type(None)})


@dataclass
class _Builder:
    """Turns the parse's records into DCP objects (or the stand-ins of ``types``); shared records
    are converted once. Objects :mod:`.metadata_fast` built already (checked as they were built)
    are taken as they are where a record of their kind may stand."""

    budget: _Budget
    types: RecordTypes
    done: dict[int, Any] = field(default_factory=dict)
    #: The chunk lists already given to a tensor: DCP never shares one, a crafted file may.
    chunk_lists: set[int] = field(default_factory=set)

    def record(self, value: Any, kind: str, where: str) -> _Record:
        if not isinstance(value, _Record) or value.kind != kind:
            got = value.kind if isinstance(value, _Record) else type(value).__name__
            raise PickleMalformed(f"{where} is a {got}, not a {kind}")
        if value.state is None and _RECORD_FIELDS[kind]:
            raise PickleMalformed(f"{where}: a {kind} that was never filled in")
        return value

    def cached(self, value: _Record, make: Callable[[dict[str, Any]], Any]) -> Any:
        key = id(value)
        if key not in self.done:
            self.done[key] = make(value.state or {})
        return self.done[key]

    def plain(self, value: Any, where: str, depth: int = 0) -> Any:
        """A value of the plain vocabulary (for ``planner_data`` and ids), bounded in depth and size."""
        self.budget.charge(1, where)
        if depth > 32:
            raise PickleMalformed(f"{where} is nested too deeply")
        vocab = self.types.vocab
        if value is None or type(value) in (bool, int, float, str, bytes, vocab.size_type, vocab.dtype_type):
            return value
        if isinstance(value, vocab.layout_type):
            return value
        if isinstance(value, pathlib.PurePath):
            return pathlib.Path(value)
        if type(value) in (tuple, list, set, frozenset):
            return type(value)(self.plain(v, where, depth + 1) for v in value)
        if type(value) in (dict, OrderedDict):
            return self.plain_dict(value, where, depth)
        raise PickleMalformed(f"{where} holds a {type(value).__name__}")

    def plain_dict(self, value: dict[Any, Any], where: str, depth: int) -> dict[Any, Any]:
        """:meth:`plain` of a dict; a leaf key with a tuple of leaves (DCP's ``planner_data``
        entry) is taken as it is, charged what :meth:`plain` charges for it."""
        out = type(value)()
        budget, leaves = self.budget, _PLAIN_LEAVES
        for k, v in value.items():
            if type(k) in leaves and type(v) is tuple:
                n = len(v)
                budget.left -= 2 + n  # before the walk: a shared tuple may be long
                if budget.left < 0:
                    budget.charge(0, where)
                if (n == 1 and type(v[0]) in leaves) or all(type(e) in leaves for e in v):
                    out[k] = v
                    continue
                budget.left += 2 + n
            out[self.plain(k, where, depth + 1)] = self.plain(v, where, depth + 1)
        return out

    def metadata(self, value: Any) -> Metadata:
        rec = self.record(value, "Metadata", "the top-level object")
        st = rec.state or {}
        sdm: Any = st.get("state_dict_metadata")
        if type(sdm) not in (dict, OrderedDict):
            raise PickleMalformed("state_dict_metadata is not a dict")
        storage = st.get("storage_data")
        if storage is not None and type(storage) not in (dict, OrderedDict):
            raise PickleMalformed("storage_data is not a dict")
        version = st.get("version")
        if version is not None and not isinstance(version, str):
            raise PickleMalformed("version is not a string")
        meta = st.get("storage_meta")
        md: Metadata = self.types.Metadata(
            state_dict_metadata=self.items(sdm),
            planner_data=self.plain(st.get("planner_data"), "planner_data"),
            storage_data=None if storage is None else self.storage(storage),
            storage_meta=None if meta is None else self.storage_meta(meta),
            version=version,
        )
        return md

    def items(self, sdm: dict[Any, Any]) -> dict[str, Any]:
        """``state_dict_metadata``: a description shared by consecutive keys is converted once."""
        out: dict[str, Any] = {}
        last: Any = _MARK
        built: Any = None
        for k, v in sdm.items():
            if type(k) is not str:
                _key(k)
            if v is not last:
                last, built = v, self.item(v, k)
            out[k] = built
        return out

    def storage(self, storage: dict[Any, Any]) -> dict[Any, Any]:
        index_type, info_type = self.types.MetadataIndex, self.types.StorageInfo
        if all(type(k) is index_type for k in storage) and all(type(v) is info_type for v in storage.values()):
            return dict(storage)  # all built by the batches: keeps the hashes already computed
        return {
            (k if type(k) is index_type else self.index(k)): (v if type(v) is info_type else self.info(v, k))
            for k, v in storage.items()
        }

    def item(self, value: Any, key: str) -> TensorStorageMetadata | BytesStorageMetadata:
        if type(value) is _Record and id(value) in self.done and value.kind in _ITEM_KINDS:
            return self.done[id(value)]  # type: ignore[no-any-return]  # a description shared by many keys
        if isinstance(value, _Record) and value.kind == "BytesStorageMetadata":
            return self.cached(value, lambda st: self.types.BytesStorageMetadata())  # type: ignore[no-any-return]
        rec = self.record(value, "TensorStorageMetadata", f"the entry of {_clip(key)}")

        def make(st: dict[str, Any]) -> TensorStorageMetadata:
            chunks = st.get("chunks")
            if type(chunks) is not list:
                raise PickleMalformed(f"the chunks of {_clip(key)} are not a list")
            if id(chunks) in self.chunk_lists:
                raise _refuse(f"one chunk list shared by several tensors ({_clip(key)} and another)")
            self.chunk_lists.add(id(chunks))
            self.budget.charge(len(chunks), f"the chunks of {_clip(key)}")
            out: TensorStorageMetadata = self.types.TensorStorageMetadata(
                properties=self.properties(st.get("properties"), key),
                size=_size(st.get("size"), f"the size of {_clip(key)}", self.types.vocab.size_type),
                chunks=[self.chunk(c, key) for c in chunks],
            )
            return out

        return self.cached(rec, make)  # type: ignore[no-any-return]

    def properties(self, value: Any, key: str) -> TensorProperties:
        rec = self.record(value, "TensorProperties", f"the properties of {_clip(key)}")

        def make(st: dict[str, Any]) -> TensorProperties:
            vocab = self.types.vocab
            dtype, layout, mem = st.get("dtype"), st.get("layout", vocab.strided), st.get("memory_format")
            if not isinstance(dtype, vocab.dtype_type) or not isinstance(layout, vocab.layout_type):
                raise PickleMalformed(f"the dtype or layout of {_clip(key)} is not one torch knows")
            flags = [st.get("requires_grad", False), st.get("pin_memory", False)]
            if not all(type(f) is bool for f in flags):
                raise PickleMalformed(f"the flags of {_clip(key)} are not bools")
            fmt = vocab.memory_formats[mem.value] if isinstance(mem, _MemFormat) else vocab.contiguous_format
            if mem is not None and not isinstance(mem, _MemFormat):
                raise PickleMalformed(f"the memory format of {_clip(key)} is not DCP's encoding")
            out: TensorProperties = self.types.TensorProperties(
                dtype=dtype, layout=layout, requires_grad=flags[0], memory_format=fmt, pin_memory=flags[1]
            )
            return out

        return self.cached(rec, make)  # type: ignore[no-any-return]

    def chunk(self, value: Any, key: str) -> ChunkStorageMetadata:
        rec = self.record(value, "ChunkStorageMetadata", f"a chunk of {_clip(key)}")
        return self.cached(  # type: ignore[no-any-return]
            rec,
            lambda st: self.types.ChunkStorageMetadata(
                offsets=_size(st.get("offsets"), f"a chunk offset of {_clip(key)}", self.types.vocab.size_type),
                sizes=_size(st.get("sizes"), f"a chunk size of {_clip(key)}", self.types.vocab.size_type),
            ),
        )

    def index(self, value: Any) -> MetadataIndex:
        rec = self.record(value, "MetadataIndex", "a storage_data key")

        def make(st: dict[str, Any]) -> MetadataIndex:
            size_type = self.types.vocab.size_type
            fqn, offset, index = st.get("fqn"), st.get("offset"), st.get("index")
            if not isinstance(fqn, str):
                raise PickleMalformed("a storage_data key has no string fqn")
            if index is not None and not _is_int(index):
                raise PickleMalformed(f"the storage index of {_clip(fqn)} is not an int")
            out: MetadataIndex = self.types.MetadataIndex(
                fqn=fqn,
                offset=None if offset is None else _size(offset, f"a storage offset of {_clip(fqn)}", size_type),
                index=index,
            )
            return out

        return self.cached(rec, make)  # type: ignore[no-any-return]

    def info(self, value: Any, index: Any) -> Any:
        fqn = index.fqn if type(index) is self.types.MetadataIndex else (getattr(index, "state", None) or {}).get("fqn")
        where = _clip(fqn) if type(fqn) is str else "a storage_data key"
        rec = self.record(value, "_StorageInfo", f"the storage entry of {where}")

        def make(st: dict[str, Any]) -> Any:
            rel, offset, length = st.get("relative_path"), st.get("offset"), st.get("length")
            transforms = st.get("transform_descriptors")
            if not isinstance(rel, str) or type(offset) is not int or type(length) is not int:
                raise PickleMalformed(f"the storage entry of {where} has no file, offset or length")
            if transforms is not None and (
                type(transforms) not in (list, tuple) or not all(isinstance(t, str) for t in transforms)
            ):
                raise PickleMalformed(f"the transforms of {where} are not strings")
            out = self.types.StorageInfo(rel, offset, length)
            if transforms is not None:
                out.transform_descriptors = list(transforms)
            return out

        return self.cached(rec, make)

    def storage_meta(self, value: Any) -> StorageMeta:
        rec = self.record(value, "StorageMeta", "storage_meta")

        def make(st: dict[str, Any]) -> StorageMeta:
            ids = [self.plain(st.get(k), f"storage_meta.{k}") for k in ("checkpoint_id", "save_id", "load_id")]
            if not all(v is None or isinstance(v, (str, pathlib.Path)) for v in ids):
                raise PickleMalformed("storage_meta ids are not strings")
            modules = st.get("modules", [])
            if type(modules) is not list or not all(isinstance(m, str) for m in modules):
                raise PickleMalformed("storage_meta.modules is not a list of strings")
            out: StorageMeta = self.types.StorageMeta(
                checkpoint_id=ids[0], save_id=ids[1], load_id=ids[2], modules=list(modules)
            )
            return out

        return self.cached(rec, make)  # type: ignore[no-any-return]


_ITEM_KINDS = frozenset({"TensorStorageMetadata", "BytesStorageMetadata"})


def _key(k: Any) -> str:
    if not isinstance(k, str):
        raise PickleMalformed(f"a state_dict_metadata key is a {type(k).__name__}, not a string")
    return k


def _size(value: Any, where: str, size_type: type[torch.Size]) -> torch.Size:
    if type(value) is not size_type:
        raise PickleMalformed(f"{where} is a {type(value).__name__}, not a torch.Size")
    return value


def _is_token(value: Any, kind: str) -> bool:
    return type(value) is _Token and value.kind == kind


def _parse(data: bytes, types: RecordTypes, budget: _Budget, batch: StorageBatch | None) -> Metadata:
    """One parse of ``data``; with ``batch``, storage entries are replayed in bulk."""
    try:
        root = _interpret(data, budget, types.vocab, batch)
    except (PickleRefused, PickleMalformed):
        raise
    except (IndexError, KeyError) as err:  # a GET of an unset memo slot, a pop from an empty stack
        raise PickleMalformed(f"inconsistent pickle stack or memo ({type(err).__name__}: {str(err)[:_SHOWN]})") from err
    except (struct.error, UnicodeDecodeError, TypeError, ValueError, OverflowError, RecursionError) as err:
        raise PickleMalformed(f"{type(err).__name__}: {str(err)[:_SHOWN]}") from err
    try:
        return _Builder(budget=budget, types=types).metadata(root)
    except (PickleRefused, PickleMalformed):
        raise
    except (TypeError, ValueError, OverflowError, RecursionError) as err:
        raise PickleMalformed(f"{type(err).__name__}: {str(err)[:_SHOWN]}") from err


def parse_metadata(data: bytes, types: RecordTypes | None = None, *, batches: bool = True) -> Metadata:
    """The DCP ``Metadata`` pickled in ``data``, built without running any code from it.

    Raises :class:`PickleRefused` or :class:`PickleMalformed`; the structure is checked only as far
    as building needs (types of every field); see :func:`ckpt_engine._format.metadata.validate_metadata`
    for the rules between fields. ``types``: the classes to build (default DCP's,
    :mod:`.metadata_types`). ``batches=False`` runs the interpreter alone, opcode by opcode;
    the default replays DCP's storage entries in bulk (:mod:`.metadata_fast`) and, should that
    parse fail, parses again without them, so the outcome (value or error) of every file is the
    interpreter's (a refused file costs two parses, still linear in its size).
    """
    types = types or dcp_types()
    # Without cyclic collection: the parse allocates millions of objects and (unless crafted)
    # no cycles, and each full collection walked all of them (as in any load: _dcpio/fast_read.py).
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        if not batches:
            return _parse(data, types, _Budget(len(data)), None)
        budget = _Budget(len(data))
        batch = StorageBatch(_is_token, budget.charge, types.MetadataIndex, types.StorageInfo, types.vocab.size_type)
        try:
            return _parse(data, types, budget, batch)
        except (PickleRefused, PickleMalformed):
            pass  # whatever the batches did or did not do: the interpreter alone decides
        return _parse(data, types, _Budget(len(data)), None)
    finally:
        if was_enabled:
            gc.enable()
