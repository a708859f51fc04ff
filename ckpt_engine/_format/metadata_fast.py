"""A super-instruction for :mod:`.metadata_parser`: a batch of the storage entries DCP's pickler
writes (``MARK``, then ``MetadataIndex`` key and ``_StorageInfo`` value pairs, then ``SETITEMS``),
matched by one regular expression and built in bulk.

About 30 opcodes describe each ``storage_data`` entry, and a checkpoint has one per tensor chunk:
run one at a time, they are most of the parse. DCP's pickler writes them in one shape: every
class, field name, file name and key is a memo reference (``BINGET``/``LONG_BINGET``) after the
first entry, and only the key, the chunk offsets, the file offset and the length change. The
first entry of a batch is matched by a general pattern; its constant parts (the memo references
of the classes and field names) are checked once and become literals of a pattern for the rest of
the batch, which ``re`` matches in C.

The batch is an exact replay of the opcodes it covers, never an approximation:

* every memo reference is checked against what the opcode would find (the class tokens, the
  field names, a string key, a ``torch.Size``) and must point before the batch;
* ``FRAME`` opcodes: the batch matches the bytes with the headers of the frames that follow the
  current one removed, each where CPython's pickler writes it (exactly at the end of the frame
  before). A ``FRAME`` anywhere else stays in the bytes, matches no pattern, and leaves the MARK
  to the interpreter, which refuses a ``FRAME`` inside a frame;
* the memo gets one slot per ``MEMOIZE`` in the batch, in order. The records hold the objects
  built here; the slots of the state dicts and tuples hold :data:`OPAQUE`, which no opcode and
  no builder check accepts, so a file that reuses one fails and is parsed again by the full
  interpreter (:func:`~.metadata_parser.parse_metadata`): the result of any file is the
  interpreter's;
* the copies the opcodes would charge to the parse's budget (one per ``torch.Size`` element)
  are charged; the batch is applied (memo, dict) only once all of it matched.

Where a batch starts: pickle writes a dict's items in ``MARK ... SETITEMS`` groups of 1,000. The
first entry of the first group names the classes and field names (new strings the interpreter
memoises), so the interpreter runs that entry and the batch replays the rest of its group
(``run(..., head=)``); every later group is replayed whole. Without the first group, a
component of fewer than 1,000 entries (every model of a few hundred tensors, an optimizer of a
few hundred parameters) was parsed opcode by opcode: 24 ms for AdamW's 588 entries at 256 MiB,
9 ms now. Entries with an offset (tensors) and without (values) mix in one batch.

Anything else (a different shape, a ``PUT`` with a sparse index, a field name at another memo
slot) is left to the interpreter.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["OPAQUE", "StorageBatch"]


class _Opaque:
    """What the memo holds for a container a batch replayed but did not build."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "<replayed value>"


OPAQUE = _Opaque()

#: How many bytes past the current frame a batch looks at, first and once more: a ``SETITEMS``
#: group of 1,000 entries is 60-150 KB. A longer batch is left to the interpreter.
_WINDOWS = (256 << 10, 16 << 20)
_FRAME_HEADER = 9
#: More than any entry a batch replays takes (about 80-200 bytes).
_ENTRY_BYTES = 4096
_GET = rb"(?:h[\x00-\xff]|j[\x00-\xff]{4})"
_LONG1 = b"|".join(bytes([n]) + b"[\\x00-\\xff]{%d}" % n for n in range(1, 9))
_INT = rb"(?:K[\x00-\xff]|M[\x00-\xff]{2}|J[\x00-\xff]{4}|\x8a(?:\x00|" + _LONG1 + rb"))"


def _op(code: bytes) -> bytes:
    return code


def _cap(name: str, body: bytes) -> bytes:
    return b"(?P<" + name.encode() + b">" + body + b")"


_NEW = _op(rb"\)") + _op(rb"\x81") + _op(rb"\x94") + _op(rb"\}") + _op(rb"\x94") + _op(rb"\(")
_INTS = _INT
#: The offsets tuple of a ``torch.Size`` REDUCE: ``()`` (not memoised), TUPLE1-3 or MARK ... TUPLE.
_OFFSETS = (
    rb"(?:\)|(?:"
    + _INTS
    + rb"\x85|"
    + _INTS * 2
    + rb"\x86|"
    + _INTS * 3
    + rb"\x87|\("
    + rb"(?:"
    + _INTS
    + rb")*t)"
    + rb"\x94)"
)
_REDUCE_TAIL = _op(rb"\x85") + _op(rb"\x94") + _op(rb"R") + _op(rb"\x94")


def _entry(c: dict[str, bytes] | None) -> bytes:
    """The pattern of one entry; with ``c``, the constant parts are the literals it gives."""

    def const(name: str) -> bytes:
        return _cap(name, _GET) if c is None else re.escape(c[name])

    if c is None or "tsize" in c:  # a torch.Size built here, or (any entry) one referenced
        built = const("tsize") + _cap("offs", _OFFSETS) + _REDUCE_TAIL
        offset = const("koff") + rb"(?:" + built + rb"|" + _cap("oget", _GET) + rb")"
    else:
        # The first entry built no torch.Size (a value's entry has no offset, or it referenced
        # one): later entries may build one, whose class reference each row checks (``tsize``).
        # A first entry without an offset names no field name for it either: DCP's pickler
        # writes the ``_StorageInfo``'s ``offset`` field name, the same string, so the same memo
        # reference (any other reference does not match, and the interpreter runs the entry).
        koff = c["koff"] if "koff" in c else c["kpos"]
        built = _cap("tsize", _GET) + _cap("offs", _OFFSETS) + _REDUCE_TAIL
        offset = re.escape(koff) + rb"(?:" + built + rb"|" + _cap("oget", _GET) + rb")"
    return (
        const("mi")
        + _NEW
        + const("kfqn")
        + _cap("fqn", _GET)
        + const("kidx")
        + _cap("idx", _INT + rb"|N")
        + (rb"(?:" + offset + rb")?" if offset else b"")
        + _op(rb"u")
        + _op(rb"b")
        + const("si")
        + _NEW
        + const("krel")
        + _cap("rel", _GET)
        + const("kpos")
        + _cap("pos", _INT)
        + const("klen")
        + _cap("len", _INT)
        + _op(rb"u")
        + _op(rb"b")
    )


_FIRST = re.compile(_entry(None), re.DOTALL)
_CONSTANTS = ("mi", "kfqn", "kidx", "koff", "tsize", "si", "krel", "kpos", "klen")
#: What each constant memo reference must hold: a field name, or the token of a class.
_EXPECTED = {
    "kfqn": "fqn",
    "kidx": "index",
    "koff": "offset",
    "krel": "relative_path",
    "kpos": "offset",
    "klen": "length",
}
_TOKENS = {"mi": "MetadataIndex", "tsize": "Size", "si": "_StorageInfo"}
_TUPLE_SLOTS = ((OPAQUE,), (OPAQUE, OPAQUE))
#: Distinct constant sets one parse may compile a pattern for (a crafted file could vary them).
_MAX_PATTERNS = 16


@functools.lru_cache(maxsize=_MAX_PATTERNS)
def _batch_pattern(constants: tuple[tuple[str, bytes], ...]) -> re.Pattern[bytes]:
    entry = _entry(dict(constants))
    return re.compile(rb"(?:" + entry + rb")+u", re.DOTALL)


@functools.lru_cache(maxsize=_MAX_PATTERNS)
def _row_pattern(constants: tuple[tuple[str, bytes], ...]) -> re.Pattern[bytes]:
    return re.compile(_entry(dict(constants)), re.DOTALL)


def _index(raw: bytes) -> int:
    return raw[1] if raw[0] == 0x68 else int.from_bytes(raw[1:5], "little")


def _int(raw: bytes) -> int:
    op = raw[0]
    if op == 0x4B:
        return raw[1]
    if op == 0x4D:
        return raw[1] | raw[2] << 8
    if op == 0x4A:
        return int.from_bytes(raw[1:5], "little", signed=True)
    return int.from_bytes(raw[2:], "little", signed=True)  # LONG1


_UNPACK_FRAME = struct.Struct("<Q").unpack_from


def _offsets(raw: bytes) -> tuple[tuple[int, ...], int]:
    """The ints of an offsets tuple and the memo slots it took (1, or 0 for ``()``)."""
    if raw == b")":
        return (), 0
    out: list[int] = []
    i, n = 0, len(raw)
    while i < n:
        op = raw[i]
        if op == 0x4B:
            out.append(raw[i + 1])
            i += 2
        elif op == 0x4D:
            out.append(raw[i + 1] | raw[i + 2] << 8)
            i += 3
        elif op == 0x4A:
            out.append(int.from_bytes(raw[i + 1 : i + 5], "little", signed=True))
            i += 5
        elif op == 0x8A:
            size = raw[i + 1]
            out.append(int.from_bytes(raw[i + 2 : i + 2 + size], "little", signed=True))
            i += 2 + size
        else:  # TUPLE1-3, MARK, TUPLE, MEMOIZE
            i += 1
    return tuple(out), 1


def _following_frames(data: bytes, frame_end: int) -> Iterator[tuple[int, int]]:
    """Where the bytes of each frame after the one ending at ``frame_end`` start and end: only
    headers exactly at the end of the frame before, as CPython's pickler writes them, and only
    frames that fit in ``data``; the chain stops at the first that is not."""
    n, at = len(data), frame_end
    while at + _FRAME_HEADER <= n and data[at] == 0x95:
        (length,) = _UNPACK_FRAME(data, at + 1)
        start = at + _FRAME_HEADER
        if start + length > n:
            return
        yield start, start + length
        at = start + length


def _unframed(data: bytes, pos: int, frame_end: int, window: int) -> tuple[bytes, list[tuple[int, int]], bool]:
    """The bytes of ``data`` from ``pos`` (inside the frame that ends at ``frame_end``) with the
    headers of the frames that follow removed (:func:`_following_frames`), about ``window`` bytes
    of them; per removed header, where its frame's bytes start in the result and where that frame
    ends in ``data``; and whether ``window`` cut the result short."""
    parts: list[bytes] = [data[pos:frame_end]]
    frames: list[tuple[int, int]] = []
    size = frame_end - pos
    for start, end in _following_frames(data, frame_end):
        if size >= window:
            return b"".join(parts), frames, True
        frames.append((size, end))
        parts.append(data[start:end])
        size += end - start
    return b"".join(parts), frames, False


def _head(data: bytes, pos: int, frame_end: int, limit: int) -> bytes:
    """The first ``limit`` bytes of what :func:`_unframed` gives, copying no more than that."""
    parts, size = [data[pos:frame_end]], frame_end - pos
    for start, end in _following_frames(data, frame_end):
        if size >= limit:
            break
        take = min(end - start, limit - size)
        parts.append(data[start : start + take])
        size += take
    return b"".join(parts)


class StorageBatch:
    """The super-instruction for one parse: ``run(data, pos, target, memo)`` at a ``MARK``.

    ``is_token(value, kind)`` says whether a memo value is the parse's token for a global;
    ``charge(items, what)`` charges the budget; ``index_type`` / ``info_type`` / ``size_type`` are
    the classes to build (DCP's or the stand-ins; ``torch.Size`` when ``size_type`` is not given).
    """

    def __init__(
        self,
        is_token: Callable[[Any, str], bool],
        charge: Callable[[int, str], None],
        index_type: Any,
        info_type: Any,
        size_type: Any = None,
    ) -> None:
        if size_type is None:
            import torch

            size_type = torch.Size
        self._size_type = size_type
        self._is_token = is_token
        self._charge = charge
        self._index_type = index_type
        self._info_type = info_type
        self._known: set[tuple[tuple[str, bytes], ...]] = set()
        self._sizes: dict[bytes, tuple[torch.Size, int]] = {}
        self._copied = 0
        self.entries = 0

    def _constants(self, m: re.Match[bytes], memo: dict[int, Any], start: int) -> tuple[tuple[str, bytes], ...] | None:
        """The constant references of the batch's first entry, if each holds what it must."""
        found = []
        for name in _CONSTANTS:
            raw = m.group(name)
            if raw is None:
                continue
            slot = _index(raw)
            if slot >= start or slot not in memo:
                return None
            value = memo[slot]
            if name in _TOKENS:
                if not self._is_token(value, _TOKENS[name]):
                    return None
            elif type(value) is not str or value != _EXPECTED[name]:
                return None
            found.append((name, raw))
        return tuple(found)

    def run(
        self,
        data: bytes,
        pos: int,
        frame_end: int,
        target: dict[Any, Any],
        memo: dict[int, Any],
        head: tuple[Any, Any] | None = None,
    ) -> tuple[int, int] | None:
        """Replay ``MARK`` at ``pos - 1`` up to its ``SETITEMS`` into ``target``; the position
        after it and the end of the frame it is in, or ``None`` (nothing changed) when the bytes
        are not a batch of storage entries.

        ``frame_end``: where the frame the interpreter is in ends (at or before ``pos``: in
        none). ``head``: the key and value the interpreter built from the ``MARK``'s first entry
        (``pos`` is then where that entry ends): the rest of the ``MARK`` is replayed, and
        ``SETITEMS`` puts ``head`` before the replayed entries, as it would have."""
        if frame_end < pos or (frame_end == pos and data[pos : pos + 1] != b"\x95"):
            # outside frames: a FRAME here starts one, which the interpreter must see
            end = self._replay(data, pos, target, memo, head)
            return None if end < 0 else (end, frame_end)
        # Most MARKs are no batch: tell from the first entry before copying anything more.
        if frame_end - pos >= _ENTRY_BYTES:
            first = _FIRST.match(data, pos, frame_end)
        else:  # near the frame's end: the entry may go on in the next frames
            first = _FIRST.match(_head(data, pos, frame_end, _ENTRY_BYTES))
        if first is None:
            return None
        for window in _WINDOWS:
            if self._copied > 2 * len(data) + (4 << 20):
                return None  # a crafted file of many long failing batches: the interpreter's, linearly
            buf, frames, cut = _unframed(data, pos, frame_end, window)
            self._copied += len(buf)
            end = self._replay(buf, 0, target, memo, head)
            if end >= 0 or not cut:
                break
        if end < 0:
            return None
        done = end
        for begins, ends in frames:  # the headers inside the batch, and the frame it ends in
            if begins >= done:
                break
            frame_end = ends
            pos += _FRAME_HEADER
        return pos + done, frame_end

    def _replay(
        self, data: bytes, pos: int, target: dict[Any, Any], memo: dict[int, Any], head: tuple[Any, Any] | None
    ) -> int:
        """:meth:`run` on bytes without ``FRAME`` headers: the end, or -1."""
        first = _FIRST.match(data, pos)
        if first is None:
            return -1
        start = len(memo)
        if start and (start - 1) not in memo:
            return -1  # a sparse memo (PUT): MEMOIZE slots would not follow on
        constants = self._constants(first, memo, start)
        if constants is None or (constants not in self._known and len(self._known) >= _MAX_PATTERNS):
            return -1
        self._known.add(constants)
        whole = _batch_pattern(constants).match(data, pos)
        if whole is None:
            return -1
        end = whole.end()
        built = self._build(_row_pattern(constants), data, (pos, end - 1), memo, start)
        if built is None:
            return -1
        keys, values, slots, elements = built
        if elements:
            self._charge(elements, "torch.Size")
        memo.update(zip(range(start, start + len(slots)), slots, strict=True))
        if head is not None:
            target[head[0]] = head[1]
        target.update(zip(keys, values, strict=True))
        self.entries += len(keys)
        return end

    def _size_class(self, raw: bytes, memo: dict[int, Any], start: int, checked: dict[bytes, bool]) -> bool:
        """Whether the memo reference ``raw`` (before the batch) holds the ``torch.Size`` token."""
        ok = checked.get(raw)
        if ok is None:
            slot = _index(raw)
            ok = checked[raw] = slot < start and slot in memo and self._is_token(memo[slot], "Size")
        return ok

    def _size(self, raw: bytes) -> tuple[torch.Size, int]:
        got = self._sizes.get(raw)
        if got is None:
            ints, memoised = _offsets(raw)
            got = (self._size_type(ints), memoised)
            if len(self._sizes) < 4096:
                self._sizes[raw] = got
        return got

    def _build(
        self, rows: re.Pattern[bytes], data: bytes, span: tuple[int, int], memo: dict[int, Any], start: int
    ) -> tuple[list[Any], list[Any], list[Any], int] | None:
        """The keys, values, memo slots and ``torch.Size`` elements of the entries in ``span``."""
        where = rows.groupindex
        order = sorted(where, key=where.__getitem__)  # findall's tuple order (an unmatched group is b"")
        at = {name: order.index(name) for name in order}
        i_fqn, i_idx, i_rel, i_pos, i_len = (at[g] for g in ("fqn", "idx", "rel", "pos", "len"))
        i_offs, i_oget, i_tsize = at.get("offs", -1), at.get("oget", -1), at.get("tsize", -1)
        sizes_checked: dict[bytes, bool] = {}
        new, setattr_ = object.__new__, object.__setattr__
        index_type, info_type = self._index_type, self._info_type
        keys: list[Any] = []
        values: list[Any] = []
        slots: list[Any] = []
        elements = 0
        get = memo.get
        offset: Any
        for row in rows.findall(data, *span):
            raw = row[i_fqn]
            slot = raw[1] if raw[0] == 0x68 else int.from_bytes(raw[1:5], "little")
            fqn = get(slot) if slot < start else None
            raw = row[i_rel]
            slot = raw[1] if raw[0] == 0x68 else int.from_bytes(raw[1:5], "little")
            rel = get(slot) if slot < start else None
            if type(fqn) is not str or type(rel) is not str:
                return None
            raw = row[i_idx]
            index = raw[1] if raw[0] == 0x4B else None if raw == b"N" else _int(raw)
            raw = row[i_pos]
            pos = raw[1] if raw[0] == 0x4B else _int(raw)
            raw = row[i_len]
            length = raw[1] if raw[0] == 0x4B else raw[1] | raw[2] << 8 if raw[0] == 0x4D else _int(raw)
            key = new(index_type)
            value = new(info_type)
            if i_offs >= 0 and row[i_offs]:
                if i_tsize >= 0 and not self._size_class(row[i_tsize], memo, start, sizes_checked):
                    return None
                offset, memoised = self._size(row[i_offs])
                elements += len(offset)
                # the record, its state, [the offsets tuple], the argument tuple, the Size, the value, its state
                slots += (key, OPAQUE, *_TUPLE_SLOTS[memoised], offset, value, OPAQUE)
            elif i_oget >= 0 and row[i_oget]:
                slot = _index(row[i_oget])
                offset = get(slot) if slot < start else None
                if type(offset) is not self._size_type:
                    return None
                slots += (key, OPAQUE, value, OPAQUE)
            else:
                offset = None
                slots += (key, OPAQUE, value, OPAQUE)
            setattr_(key, "__dict__", {"fqn": fqn, "offset": offset, "index": index})
            setattr_(
                value,
                "__dict__",
                {"relative_path": rel, "offset": pos, "length": length, "transform_descriptors": None},
            )
            keys.append(key)
            values.append(value)
        return keys, values, slots, elements
