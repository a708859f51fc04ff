"""JSON from files users hand the engine, parsed within bounds fixed before the parse starts.

``json.loads`` alone is unbounded in ways that matter for hostile files: its C parser recurses
once per nesting level (a deep file gives a bare ``RecursionError``, or overflows the C stack
under a raised recursion limit), and an integer of thousands of digits costs quadratic time before
Python's own digit limit raises a bare ``ValueError``. :func:`loads` counts the nesting first (one
vectorised pass) and bounds every integer as it is parsed; every refusal is a
:class:`JSONRefused` that callers turn into their typed error naming the file.
"""

from __future__ import annotations

import json
from typing import Any

from ..errors import SHOWN_CHARS, clip

__all__ = ["JSONRefused", "loads", "nesting"]


class JSONRefused(ValueError):
    """The text is not JSON, or is JSON beyond the caller's bounds (the message names which)."""


_NOT_BRACKETS_OR_QUOTES = bytes(b for b in range(256) if b not in b'[]{}"')
#: Below this many brackets and quotes a plain loop counts them (no numpy import: a safetensors
#: header of thousands of tensors); above, one vectorised pass.
_SCALAR_LIMIT = 1 << 16


def nesting(raw: bytes) -> int:
    """How deep arrays and objects nest in the JSON text ``raw`` (brackets inside strings skipped).
    Linear; vectorised for long texts."""
    # Escaped backslashes, then escaped quotes: runs of backslashes pair up from the left, as JSON reads them.
    text = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_BRACKETS_OR_QUOTES)
    if len(text) <= _SCALAR_LIMIT:
        return _nesting_loop(text)
    import numpy

    step = numpy.zeros(256, dtype=numpy.int8)
    step[list(b"[{")] = 1
    step[list(b"]}")] = -1
    codes = numpy.frombuffer(text, dtype=numpy.uint8)
    outside = (numpy.cumsum(codes == ord('"'), dtype=numpy.uint8) & 1) == 0  # an even number of quotes so far
    levels = numpy.cumsum(step[codes] * outside, dtype=numpy.int32)
    return int(levels.max()) if len(levels) else 0


def _nesting_loop(text: bytes) -> int:
    """:func:`nesting` of ``text`` (only brackets and quotes left), one character at a time."""
    depth = deepest = 0
    inside = False
    for c in text:
        if c == 0x22:  # "
            inside = not inside
        elif not inside:
            if c in (0x5B, 0x7B):
                depth += 1
                deepest = max(deepest, depth)
            else:
                depth -= 1
    return deepest


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise JSONRefused(f"{clip(key)} is a key twice in one JSON object")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise JSONRefused(f"it holds {name}, which is not JSON")


def loads(
    raw: bytes | str,
    *,
    max_depth: int,
    max_int_digits: int,
    constants: bool = True,
    unique_keys: bool = False,
) -> Any:
    """``raw`` parsed as JSON, refusing (:class:`JSONRefused`) text that is not UTF-8, nesting
    deeper than ``max_depth``, an integer of more than ``max_int_digits`` digits and, unless
    allowed, ``NaN``/``Infinity`` (``constants``) and a key twice in one object (``unique_keys``)."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    depth = nesting(data)
    if depth > max_depth:
        raise JSONRefused(f"its JSON nests {depth} deep, more than the {max_depth} allowed")

    def bounded_int(text: str) -> int:
        if len(text.lstrip("-")) > max_int_digits:
            raise JSONRefused(f"it holds an integer of {len(text)} digits; at most {max_int_digits} are allowed")
        return int(text)

    try:
        return json.loads(
            data.decode("utf-8"),
            object_pairs_hook=_unique_keys if unique_keys else None,
            parse_int=bounded_int,
            parse_constant=None if constants else _no_constant,
        )
    except JSONRefused:
        raise
    except (RecursionError, ValueError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise JSONRefused(f"it is not valid JSON ({str(err)[:SHOWN_CHARS]})") from None
