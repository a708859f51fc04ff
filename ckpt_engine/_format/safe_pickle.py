"""Read the ``data.pkl`` of a ``torch.save`` archive into inert values, without ``pickle`` or torch.

A ``torch.save`` file (a ``.pt``/``.pth``/``.bin`` checkpoint, or one non-tensor value of a DCP
checkpoint) is a zip whose ``data.pkl`` pickles the saved object, tensors as calls to
``torch._utils._rebuild_tensor_v2`` on persistent storage ids. ``pickle.load`` of it runs whatever
the file says. This module never calls ``pickle``: :mod:`pickletools` decodes the opcodes (it only
parses), and a small stack machine builds values of a closed vocabulary:

* ``None``, bools, ints (at most 255 bytes, as DCP's own interpreter allows), floats, complex,
  strings, bytes, tuples, lists, dicts, ``OrderedDict``, sets and frozensets;
* :class:`TensorRef` for each tensor or parameter: dtype, shape, stride, storage offset and the
  storage record that holds its bytes, never the bytes themselves;
* torch dtypes as the torch-free stand-ins of :mod:`.metadata_types`;
* :class:`Opaque` for an object of any other class: named, never constructed, its state dropped.

Globals resolve to tokens, never to the objects they name; ``REDUCE`` calls only the few
constructors above, each checking its arguments; ``BUILD`` sets nothing (it may only follow an
object this parse made). Time and memory are linear in the input: every opcode pushes at most one
value, containers take what other opcodes pushed, and :func:`load` then copies the result into a
tree (no shared or cyclic parts) charging every node to a budget of ``4 * len(data) + 64 Ki``,
nested at most :data:`MAX_DEPTH` deep, so walking or printing the result stays linear too.
Errors are :class:`~.metadata_parser.PickleMalformed` (not a well-formed pickle) or
:class:`~.metadata_parser.PickleRefused` (something no ``torch.save`` writes); messages never
quote a value the file built beyond :data:`~ckpt_engine.errors.SHOWN_CHARS` characters.
"""

from __future__ import annotations

import pickletools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import clip
from .metadata_parser import PickleMalformed, PickleRefused
from .metadata_types import PlainDtype, Size, plain_dtype

__all__ = ["MAX_DEPTH", "Opaque", "PickleTooLarge", "StorageRef", "TensorRef", "load", "storage_dtype"]

#: Deepest nesting of containers in a loaded value (a state dict nests about 5 deep).
MAX_DEPTH = 100
#: Largest integer, in bytes (``LONG1``'s limit; torch.save writes 64-bit values).
MAX_INT_BYTES = 255
_FLAT_KEYS = (str, int, float, bool, bytes, type(None))


class PickleTooLarge(PickleRefused):
    """The pickle builds more, or nests deeper, than a pickle of its size can describe (crafted)."""


@dataclass(frozen=True, slots=True)
class StorageRef:
    """A tensor storage, by its persistent id: its bytes are the archive's ``data/<key>`` record."""

    key: str
    #: The storage's dtype; ``None`` for an ``UntypedStorage`` (it counts bytes).
    dtype: PlainDtype | None
    location: str
    #: Elements of ``dtype`` (bytes for an untyped storage).
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * (self.dtype.itemsize if self.dtype is not None else 1)


@dataclass(frozen=True, slots=True, repr=False)
class TensorRef:
    """A tensor as ``data.pkl`` describes it: where its elements lie in a storage, not their values."""

    storage: StorageRef
    dtype: PlainDtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    #: In elements from the start of the storage.
    offset: int
    requires_grad: bool = False
    parameter: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        return f"tensor {self.dtype.name}{list(self.shape)}"

    def extent_bytes(self) -> int:
        """Bytes of the storage the tensor reaches, from its start (0 for an empty tensor)."""
        if self.numel == 0:
            return 0
        last = self.offset + sum((d - 1) * s for d, s in zip(self.shape, self.stride, strict=True))
        return (last + 1) * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class Opaque:
    """An object of a class this reader does not build (``argparse.Namespace``, a numpy scalar)."""

    cls: str

    def __repr__(self) -> str:
        return f"<{self.cls} object>"


@dataclass(frozen=True, slots=True)
class _Global:
    name: str  # "module.qualname"


class _Mutable:
    """An object made by ``REDUCE``/``NEWOBJ`` of an unknown class: ``SETITEMS``/``APPENDS``/``BUILD``
    may follow (a dict or list subclass); they are charged and dropped."""

    __slots__ = ("cls",)

    def __init__(self, cls: str) -> None:
        self.cls = cls


#: ``torch.<Name>Storage`` -> the dtype name (the legacy typed storages ``torch.save`` names).
_STORAGES = {
    "DoubleStorage": "float64",
    "FloatStorage": "float32",
    "HalfStorage": "float16",
    "BFloat16Storage": "bfloat16",
    "LongStorage": "int64",
    "IntStorage": "int32",
    "ShortStorage": "int16",
    "CharStorage": "int8",
    "ByteStorage": "uint8",
    "BoolStorage": "bool",
    "ComplexDoubleStorage": "complex128",
    "ComplexFloatStorage": "complex64",
    "QInt8Storage": "qint8",
    "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32",
    "QUInt4x2Storage": "quint4x2",
    "QUInt2x4Storage": "quint2x4",
}
_UNTYPED = ("torch.storage.UntypedStorage", "torch.UntypedStorage")
_CONSTRUCTORS = {
    "collections.OrderedDict",
    "builtins.set",
    "builtins.frozenset",
    "builtins.complex",
    "builtins.bytearray",
    "_codecs.encode",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_tensor_v3",
    "torch._utils._rebuild_parameter",
    "torch._utils._rebuild_parameter_with_state",
    "torch.Size",
}


def storage_dtype(name: str) -> PlainDtype | None:
    """The dtype of the legacy storage class ``torch.<name>`` (``FloatStorage``), or ``None``."""
    dtype = _STORAGES.get(name)
    return plain_dtype(dtype) if dtype is not None else None


class _Budget:
    __slots__ = ("left",)

    def __init__(self, n: int) -> None:
        self.left = 4 * n + 65_536

    def charge(self, items: int) -> None:
        self.left -= items
        if self.left < 0:
            raise PickleTooLarge(
                "builds more than a pickle of its size can hold (copies of shared values; a crafted file)"
            )


def load(data: bytes) -> Any:
    """The value pickled in ``data``, built of the vocabulary in the module docstring."""
    budget = _Budget(len(data))
    try:
        root = _Machine(budget).run(data)
    except (PickleMalformed, PickleRefused):
        raise
    except (IndexError, KeyError) as err:  # popping an empty stack, a GET of an unset memo slot
        raise PickleMalformed(f"inconsistent pickle stack or memo ({type(err).__name__})") from None
    except (ValueError, TypeError, OverflowError, UnicodeDecodeError) as err:  # pickletools' own checks
        raise PickleMalformed(f"{type(err).__name__}: {clip(str(err))}") from None
    return _tree(root, budget, 0)


class _Machine:
    """The stack machine over :func:`pickletools.genops`."""

    def __init__(self, budget: _Budget) -> None:
        self.budget = budget
        self.stack: list[Any] = []
        self.marks: list[list[Any]] = []
        self.memo: dict[int, Any] = {}
        self.ops: dict[str, Callable[[Any], None]] = {
            name.removeprefix("op_").upper(): getattr(self, name) for name in dir(self) if name.startswith("op_")
        }

    def run(self, data: bytes) -> Any:
        for opcode, arg, _pos in pickletools.genops(data):
            self.budget.charge(1)
            name = opcode.name
            if name == "STOP":
                if len(self.stack) != 1 or self.marks:
                    raise PickleMalformed("STOP with an unbalanced stack")
                return self.stack[0]
            op = self.ops.get(name)
            if op is not None:
                op(arg)
                continue
            simple = _SIMPLE.get(name)
            if simple is None:
                raise PickleRefused(f"uses opcode {name}, which torch.save never writes")
            self.stack.append(self._arg(name, arg) if simple is _PUSH_ARG else simple.make())
        raise PickleMalformed("truncated: no STOP opcode")

    def _arg(self, name: str, arg: Any) -> Any:
        if type(arg) is int and arg.bit_length() > 8 * MAX_INT_BYTES:
            raise PickleRefused(f"holds an integer of {arg.bit_length()} bits (torch.save writes 64-bit ones)")
        if type(arg) is bytearray:
            return bytes(arg)
        return arg

    def _pop_mark(self) -> list[Any]:
        items = self.stack
        self.stack = self.marks.pop()
        return items

    # -- structure ------------------------------------------------------------------------------

    def op_mark(self, _: Any) -> None:
        self.marks.append(self.stack)
        self.stack = []

    def op_pop(self, _: Any) -> None:
        self.stack.pop()

    def op_pop_mark(self, _: Any) -> None:
        self._pop_mark()

    def op_dup(self, _: Any) -> None:
        self.stack.append(self.stack[-1])

    def op_proto(self, arg: Any) -> None:
        if not 0 <= arg <= 5:
            raise PickleMalformed(f"unsupported pickle protocol {clip(str(arg))}")

    def op_frame(self, _: Any) -> None:
        pass

    def op_put(self, arg: Any) -> None:
        self.memo[arg] = self.stack[-1]

    op_binput = op_long_binput = op_put

    def op_memoize(self, _: Any) -> None:
        self.memo[len(self.memo)] = self.stack[-1]

    def op_get(self, arg: Any) -> None:
        self.stack.append(self.memo[arg])

    op_binget = op_long_binget = op_get

    # -- containers ------------------------------------------------------------------------------

    def op_tuple(self, _: Any) -> None:
        items = self._pop_mark()
        self.stack.append(tuple(items))

    def op_tuple1(self, _: Any) -> None:
        self.stack[-1] = (self.stack[-1],)

    def op_tuple2(self, _: Any) -> None:
        b = self.stack.pop()
        self.stack[-1] = (self.stack[-1], b)

    def op_tuple3(self, _: Any) -> None:
        c, b = self.stack.pop(), self.stack.pop()
        self.stack[-1] = (self.stack[-1], b, c)

    def op_list(self, _: Any) -> None:
        items = self._pop_mark()  # first: it replaces self.stack
        self.stack.append(items)

    def op_dict(self, _: Any) -> None:
        items = self._pop_mark()
        out: dict[Any, Any] = {}
        self._set_items(out, items)
        self.stack.append(out)

    def op_append(self, _: Any) -> None:
        value = self.stack.pop()
        self._extend(self.stack[-1], [value])

    def op_appends(self, _: Any) -> None:
        items = self._pop_mark()
        self._extend(self.stack[-1], items)

    def op_setitem(self, _: Any) -> None:
        value, key = self.stack.pop(), self.stack.pop()
        self._set_items(self.stack[-1], [key, value])

    def op_setitems(self, _: Any) -> None:
        items = self._pop_mark()
        self._set_items(self.stack[-1], items)

    def op_additems(self, _: Any) -> None:
        items = self._pop_mark()
        target = self.stack[-1]
        if type(target) is _Mutable:
            return
        if type(target) is not set:
            raise PickleRefused(f"ADDITEMS to a {type(target).__name__}")
        target.update(_keys(items, "a set element"))

    def op_frozenset(self, _: Any) -> None:
        items = _keys(self._pop_mark(), "a frozenset element")
        self.stack.append(frozenset(items))

    def _extend(self, target: Any, items: list[Any]) -> None:
        if type(target) is _Mutable:
            return
        if type(target) is not list:
            raise PickleRefused(f"APPEND to a {type(target).__name__}")
        target.extend(items)

    def _set_items(self, target: Any, items: list[Any]) -> None:
        if len(items) % 2:
            raise PickleMalformed("SETITEMS with an odd number of items")
        if type(target) is _Mutable:
            return
        if type(target) not in (dict, OrderedDict):
            raise PickleRefused(f"SETITEMS into a {type(target).__name__}")
        _keys(items[0::2], "a dict key")
        target.update(zip(items[0::2], items[1::2], strict=True))

    # -- objects ---------------------------------------------------------------------------------

    def op_global(self, arg: Any) -> None:
        module, _, name = str(arg).partition(" ")
        self.stack.append(_global(module, name))

    def op_stack_global(self, _: Any) -> None:
        name, module = self.stack.pop(), self.stack.pop()
        if type(module) is not str or type(name) is not str:
            raise PickleMalformed("STACK_GLOBAL needs two strings")
        self.stack.append(_global(module, name))

    def op_reduce(self, _: Any) -> None:
        args = self.stack.pop()
        self.stack[-1] = _call(self.stack[-1], args)

    def op_newobj(self, _: Any) -> None:
        args = self.stack.pop()
        self.stack[-1] = _call(self.stack[-1], args, new=True)

    def op_newobj_ex(self, _: Any) -> None:
        self.stack.pop()  # keyword arguments
        self.op_newobj(None)

    def op_build(self, _: Any) -> None:
        self.stack.pop()  # the state: never set on anything
        target = self.stack[-1]
        if type(target) not in (_Mutable, OrderedDict, TensorRef):
            raise PickleRefused(f"BUILD on a {type(target).__name__} (torch.save builds only objects it made)")

    def op_inst(self, arg: Any) -> None:
        module, _, name = str(arg).partition(" ")
        self._pop_mark()
        self.stack.append(_Mutable(f"{module}.{name}"))

    def op_obj(self, _: Any) -> None:
        items = self._pop_mark()
        cls = items[0] if items else None
        self.stack.append(_Mutable(cls.name if type(cls) is _Global else "object"))

    def op_persid(self, arg: Any) -> None:
        raise PickleRefused("a text persistent id (torch.save writes BINPERSID)")

    def op_binpersid(self, _: Any) -> None:
        self.stack[-1] = _storage(self.stack[-1])


class _Const:
    __slots__ = ("make",)

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make


_PUSH_ARG = object()
#: Opcodes that push their argument.
_ARG_OPS = [
    "INT",
    "BININT",
    "BININT1",
    "BININT2",
    "LONG",
    "LONG1",
    "LONG4",
    "FLOAT",
    "BINFLOAT",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
    "UNICODE",
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "BINBYTES",
    "SHORT_BINBYTES",
    "BINBYTES8",
    "BYTEARRAY8",
]
_SIMPLE: dict[str, Any] = {
    **dict.fromkeys(_ARG_OPS, _PUSH_ARG),
    "NONE": _Const(lambda: None),
    "NEWTRUE": _Const(lambda: True),
    "NEWFALSE": _Const(lambda: False),
    "EMPTY_TUPLE": _Const(tuple),
    "EMPTY_LIST": _Const(list),
    "EMPTY_DICT": _Const(dict),
    "EMPTY_SET": _Const(set),
}


def _keys(items: list[Any], what: str) -> list[Any]:
    """``items``, each of a flat type (or a tuple of flat ones): hashing costs their own bytes."""
    for k in items:
        if type(k) not in _FLAT_KEYS and not (type(k) is tuple and all(type(e) in _FLAT_KEYS for e in k)):
            raise PickleRefused(f"{what} of type {type(k).__name__}; torch.save writes strings and numbers")
    return items


def _global(module: str, name: str) -> Any:
    qualified = f"{'builtins' if module == '__builtin__' else module}.{name}"
    if qualified in _CONSTRUCTORS or qualified in _UNTYPED:
        return _Global(qualified)
    if module == "torch":
        dtype = plain_dtype(name)
        if dtype is not None:
            return dtype
        if name in _STORAGES:
            return _Global(qualified)
    return _Global(qualified)  # any other class: called, it makes an Opaque


def _storage(pid: Any) -> StorageRef:
    if not (type(pid) is tuple and len(pid) == 5 and pid[0] == "storage"):
        raise PickleRefused("a persistent id that is no ('storage', type, key, location, numel) record")
    _, kind, key, location, numel = pid
    if type(kind) is not _Global or type(key) is not str or type(location) is not str or type(numel) is not int:
        raise PickleMalformed("a storage record with fields of the wrong types")
    if numel < 0 or numel >= 1 << 62:
        raise PickleMalformed(f"a storage of {numel} elements")
    if kind.name in _UNTYPED:
        return StorageRef(key, None, location, numel)
    dtype = storage_dtype(kind.name.removeprefix("torch."))
    if dtype is None:
        raise PickleRefused(f"a storage of class {clip(kind.name)}, which torch.save never writes")
    return StorageRef(key, dtype, location, numel)


def _call(func: Any, args: Any, new: bool = False) -> Any:
    """``REDUCE``/``NEWOBJ``: the constructors of the vocabulary; any other class gives an opaque object."""
    if type(func) is not _Global:
        raise PickleRefused(f"calls a {type(func).__name__} (only a global may be called)")
    if type(args) is not tuple:
        raise PickleMalformed("REDUCE with arguments that are no tuple")
    name = func.name
    if name not in _CONSTRUCTORS:
        return _Mutable(name)
    if name == "collections.OrderedDict" and args == ():
        return OrderedDict()
    if name in ("builtins.set", "builtins.frozenset") and len(args) == 1 and type(args[0]) in (list, tuple):
        items = _keys(list(args[0]), "a set element")
        return set(items) if name == "builtins.set" else frozenset(items)
    if name == "builtins.complex" and all(type(a) in (int, float) for a in args) and len(args) <= 2:
        return complex(*args)
    if name in ("builtins.bytearray", "_codecs.encode"):
        return _bytes(name, args)
    if name == "torch.Size" and len(args) == 1 and _ints(args[0], None):
        return Size(args[0])
    if name.startswith("torch._utils._rebuild_"):
        return _rebuild(name, args)
    raise PickleMalformed(f"{name} called with arguments it does not take")


def _bytes(name: str, args: tuple[Any, ...]) -> bytes:
    """Protocol 2's ``bytes``: ``_codecs.encode(text, "latin1")`` (and ``bytearray`` of bytes)."""
    if name == "_codecs.encode" and len(args) == 2 and type(args[0]) is str and args[1] in ("latin1", "latin-1"):
        try:
            return args[0].encode("latin-1")
        except UnicodeEncodeError:
            raise PickleMalformed("_codecs.encode of text that is not latin-1") from None
    if name == "builtins.bytearray" and len(args) <= 1 and all(type(a) is bytes for a in args):
        return args[0] if args else b""
    raise PickleMalformed(f"{name} called with arguments it does not take")


def _rebuild(name: str, args: tuple[Any, ...]) -> TensorRef:
    """``_rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata])``,
    ``_rebuild_tensor_v3`` (an untyped storage, the dtype after the hooks) and
    ``_rebuild_parameter(tensor, requires_grad, hooks)``."""
    if name.startswith("torch._utils._rebuild_parameter"):
        if len(args) < 2 or type(args[0]) is not TensorRef or type(args[1]) is not bool:
            raise PickleMalformed(f"{name} of arguments that are no tensor and flag")
        t = args[0]
        return TensorRef(t.storage, t.dtype, t.shape, t.stride, t.offset, args[1], parameter=True)
    v3 = name.endswith("v3")
    if len(args) not in ((7, 8) if v3 else (6, 7)):
        raise PickleMalformed(f"{name} with {len(args)} arguments")
    storage, offset, shape, stride, requires_grad = args[:5]
    dtype = args[6] if v3 else getattr(storage, "dtype", None)
    if (
        type(storage) is not StorageRef
        or type(dtype) is not PlainDtype
        or (storage.dtype is None) != v3
        or type(offset) is not int
        or type(requires_grad) is not bool
        or not _ints(shape, 0)
        or not _ints(stride, None)
        or len(shape) != len(stride)
        or not 0 <= offset < 1 << 62
    ):
        raise PickleMalformed(f"{name} of arguments that describe no tensor")
    return TensorRef(storage, dtype, shape, stride, offset, requires_grad)


def _ints(value: Any, low: int | None) -> bool:
    return (
        type(value) is tuple
        and len(value) <= 64
        and all(type(v) is int and (low is None or v >= low) and -(1 << 62) < v < 1 << 62 for v in value)
    )


def _tree(value: Any, budget: _Budget, depth: int) -> Any:
    """``value`` copied into a tree (shared and cyclic parts copied, each node charged)."""
    budget.charge(1)
    kind = type(value)
    if kind in (str, int, float, bool, bytes, complex, type(None), TensorRef, PlainDtype, Size):
        return value
    if kind is _Mutable:
        return Opaque(value.cls)
    if kind is _Global:
        return Opaque(f"class {value.name}")  # a class object itself, pickled by reference
    if depth >= MAX_DEPTH:
        raise PickleTooLarge(f"nests containers more than {MAX_DEPTH} deep")
    if kind in (list, tuple, set, frozenset):
        budget.charge(len(value))
        return kind(_tree(v, budget, depth + 1) for v in value)
    if kind in (dict, OrderedDict):
        budget.charge(len(value))
        return kind((k, _tree(v, budget, depth + 1)) for k, v in value.items())
    if kind is StorageRef:
        return Opaque("torch storage")
    raise PickleMalformed(f"built a {kind.__name__}")
