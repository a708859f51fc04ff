"""Plain Python values (numbers, strings, ``None`` and containers of them) read from the
``torch.save`` archives DCP writes for non-tensor items, without ``torch.load``.

DCP stores every non-tensor value of a state dict (an optimizer's ``step`` counts when they are
Python numbers, its hyper-parameters, a scheduler's fields) as one ``torch.save`` archive, and
its reader calls ``torch.load(..., weights_only=True)`` on each: about 140 microseconds of fixed
cost per value, 66 ms of a 256 MiB AdamW load's 140 ms here. :func:`plain_value` reads the
archive's ``data.pkl`` record (the engine's zip reader, CRC checked) and unpickles it with the C
unpickler and **no globals at all**: ``find_class`` and ``persistent_load`` refuse, so nothing
but the pickle machine's own types can be built and no code can run (the "Restricting Globals"
recipe of the ``pickle`` documentation, with an empty allow-list). An archive that holds
anything else (a tensor storage, any global, a damaged record) is not read here, and the caller
falls back to ``torch.load``, whose answer, value or error, stands.

Identical archives hold identical values (``torch.save`` derives an archive's serialization id
from its content), and an optimizer's hyper-parameters are a handful of values repeated for
every parameter (about 1,900 archives, a dozen distinct, in a 1 GiB AdamW state): the answer for
an archive of immutable values is kept by its bytes, so each distinct one is read once.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from typing import Any

from .torch_save_archive import _central_directory, _read_record

__all__ = ["plain_value"]

#: Larger values go to ``torch.load`` (the point is the fixed cost of small ones).
_MAX_BYTES = 1 << 16
#: Answers kept by archive bytes: archives up to this size, at most this many (then all are
#: dropped): 4 MiB of keys at most.
_CACHED_MAX_BYTES = 2048
_CACHED_ENTRIES = 2048
_answers: dict[bytes, Any] = {}
_IMMUTABLE = (int, float, bool, complex, str, bytes, type(None))


def _immutable(value: Any) -> bool:
    """Whether ``value`` is made of immutable scalars and tuples only. Iterative, each tuple
    looked at once: a crafted pickle may nest tuples deeply or share one tuple many times."""
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if type(v) is tuple:
            if id(v) not in seen:
                seen.add(id(v))
                stack.extend(v)
        elif type(v) not in _IMMUTABLE:
            return False
    return True


class _NoGlobals(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError("a global")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id (a tensor storage)")


def _memo_bounded(raw: bytes) -> bool:
    """Whether every memo index ``raw`` stores under is one a pickle of its size can need.

    The C unpickler sizes its memo to the largest index a ``PUT`` names: 12 bytes of
    ``LONG_BINPUT 2**30`` would make it allocate (and zero) gigabytes. No pickle stores more
    objects than it has bytes, so a larger index means a crafted pickle: ``torch.load``'s own
    unpickler (pure Python, a dict for its memo) then judges it. A few microseconds a value."""
    try:
        for op, arg, _ in pickletools.genops(raw):
            if op.code in "pqr" and isinstance(arg, int) and arg > len(raw):
                return False
    except ValueError:  # not a pickle genops can walk: torch.load's to judge
        return False
    return True


def plain_value(data: bytes | memoryview) -> tuple[bool, Any]:
    """``(True, value)`` for an archive of a plain value, else ``(False, None)``."""
    length = len(data)
    if length > _MAX_BYTES:
        return False, None
    if length > _CACHED_MAX_BYTES:
        return _read(data)
    key = bytes(data)
    value = _answers.get(key, _answers)
    if value is not _answers:
        return True, value
    found, value = _read(key)
    if found and _immutable(value):  # shared by every reader of these bytes: never a list or dict
        if len(_answers) >= _CACHED_ENTRIES:
            _answers.clear()
        _answers[key] = value
    return found, value


def _read(data: bytes | memoryview) -> tuple[bool, Any]:
    length = len(data)
    view = memoryview(data)

    def pread(offset: int, n: int) -> bytes:
        return bytes(view[offset : offset + n])

    entries = _central_directory(pread, length)
    if entries is None:
        return False, None
    pkl = [name for name in entries if name.endswith(b"/data.pkl")]
    if len(pkl) != 1 or any(b"/data/" in name for name in entries):  # a storage record: a tensor
        return False, None
    raw = _read_record(pread, pkl[0], entries[pkl[0]], length)
    if raw is None or not _memo_bounded(raw):
        return False, None
    try:
        return True, _NoGlobals(io.BytesIO(raw)).load()
    except Exception:  # anything unusual is torch.load's to judge
        return False, None
