"""Every rank fails together, and no rank's state is silently dropped: the one primitive the
engine's save, commit and load agree with, and the ranks' check of what DCP keeps one copy of.

A rank that raises between collectives leaves the others waiting in the next one forever. So
wherever one rank's step can fail on its own (preparing a save, writing or committing it, the
checks before a load), every rank reports its outcome in one collective and then either all go
on or all raise. The error every rank raises is the lowest failing rank's own, with its type and
message (sent as the exception object; one that cannot travel is replaced by a typed
:class:`~ckpt_engine.errors.CkptEngineError` carrying its type name and message), so a user sees
the same ``IncompleteCheckpointError`` on rank 3 that rank 0 found.

With no process group (or one rank) nothing is exchanged.

**What DCP keeps one copy of.** DCP saves an item that several ranks hold under one key (a plain
tensor, a non-tensor value) once, from the lowest rank (``dedup_save_to_lowest_rank``). At every
save with several ranks each rank digests those items of its state dicts (:func:`digests`), the
digests travel in the all-gather that the save's preparation makes anyway, and every rank reads
the same verdict from them (:func:`differences`). Then (:func:`per_rank_maps`):

* a non-tensor value that differs, and every item of an extra (a ``Stateful`` passed in
  ``extra=``) any item of which differs, is saved per rank (under the keys of
  ``_format/names.per_rank_key``) and restored per rank;
* a plain tensor that differs fails the save on every rank with
  :class:`~ckpt_engine.errors.ReplicatedStateMismatchError` naming the key and the ranks;
* keys ``EngineConfig.per_rank_keys`` names are always saved per rank, and not digested;
* the buffers a ``DistributedDataParallel`` model broadcasts from rank 0 are not digested
  (:func:`without_broadcast_buffers`): rank 0's copy is the training state.

A tensor of at most :data:`FULL_HASH_BYTES` is hashed whole (``xxh3_64``); a larger one by its
shape, dtype and :data:`SAMPLED_PAGES` pages of :data:`PAGE_BYTES` spread over it, at offsets
that move with the iteration: a difference only in pages a save did not sample is not caught by
that save. Non-tensor values are hashed by their pickle.
"""

from __future__ import annotations

import contextlib
import fnmatch
import itertools
import pickle
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np
import torch
import xxhash
from torch import nn
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.nn.parallel import DistributedDataParallel

from .._dcpio import dist
from .._dcpio.planner import already_flat
from .._format.names import per_rank_key
from ..errors import CheckpointLoadError, CkptEngineError, ReplicatedStateMismatchError, clip, described, first_failure
from ..types import STANDARD_COMPONENTS

__all__ = [
    "FULL_HASH_BYTES",
    "PAGE_BYTES",
    "SAMPLED_PAGES",
    "Agreement",
    "Difference",
    "Failure",
    "LaterTensorCheck",
    "LocalDigests",
    "Part",
    "agree",
    "agreed",
    "differences",
    "digests",
    "gated",
    "page_offsets",
    "per_rank_maps",
    "plain_keys",
    "portable",
    "shares_memory",
    "tensor_digest",
    "unwrap",
    "value_digest",
    "without_broadcast_buffers",
]

_T = TypeVar("_T")


def portable(err: BaseException, fallback: type[CkptEngineError]) -> BaseException:
    """``err`` itself if it survives pickling (it will be sent to the other ranks), else a
    ``fallback`` error with its type name and message."""
    try:
        back = pickle.loads(pickle.dumps(err))
    except Exception:
        back = None
    if isinstance(back, type(err)) and str(back) == str(err):
        return err
    return fallback(described(err))


@dataclass(frozen=True)
class Failure:
    rank: int
    error: BaseException
    #: ``"TypeName: message"`` of the error as the failing rank raised it.
    text: str


@dataclass(frozen=True)
class Agreement:
    """What every rank reported: each rank's payload, and the failures (lowest rank first)."""

    payloads: list[Any] = field(default_factory=list)
    failures: list[Failure] = field(default_factory=list)

    @property
    def first(self) -> Failure | None:
        return self.failures[0] if self.failures else None


def agree(
    local_error: BaseException | None, payload: Any = None, *, fallback: type[CkptEngineError], step: str = "sync"
) -> Agreement:
    """Exchange every rank's outcome (``local_error`` or ``None``) and ``payload`` in one
    all-gather (without a payload inside a save or a load: one all-reduce of a flag, and the
    all-gather of the errors only if a rank failed); every rank gets the same
    :class:`Agreement`. A single process gets its own. Inside an engine's save or load the
    exchange is bounded by ``collective_timeout_s``; ``step`` names it in the
    :class:`~ckpt_engine.errors.CollectiveTimeoutError` a missing rank causes."""
    sent = None if local_error is None else portable(local_error, fallback)
    text = "" if local_error is None else f"{type(local_error).__name__}: {local_error}"
    world = dist.world_size()
    if world <= 1:
        return Agreement([payload], [] if sent is None else [Failure(dist.rank(), sent, text)])
    # Without a payload, a fixed-size all-reduce says whether any rank failed; only then are the
    # errors gathered (every rank knows to join that second collective).
    if payload is None and dist.any_rank(sent is not None, step=step) is False:
        return Agreement([None] * world, [])
    gathered = dist.all_gather_object((sent, text, payload), step=step)
    failures = [Failure(r, err, t) for r, (err, t, _) in enumerate(gathered) if err is not None]
    return Agreement([p for _, _, p in gathered], failures)


def agreed(fn: Callable[[], _T], *, fallback: type[CkptEngineError] = CheckpointLoadError, step: str = "checks") -> _T:
    """Run ``fn`` on every rank; if it raises on any rank, raise on every rank: a rank's own error
    where it failed, else the lowest failing rank's error (same type and message, ``found by rank
    r`` added). An error that is not a :class:`CkptEngineError` becomes ``fallback``."""
    local: BaseException | None = None
    value: Any = None
    try:
        value = fn()
    except CkptEngineError as err:
        local = err
    except Exception as err:
        local = fallback(described(err))
        local.__cause__ = err
    outcome = agree(local, fallback=fallback, step=step)
    if local is not None:
        raise local
    if outcome.first is not None:
        theirs = outcome.first.error
        if isinstance(theirs, CkptEngineError) and theirs.args and isinstance(theirs.args[0], str):
            theirs.args = (f"{theirs.args[0]} (found by rank {outcome.first.rank})", *theirs.args[1:])
        raise theirs
    return value  # type: ignore[no-any-return]


def unwrap(exc: BaseException) -> tuple[BaseException, list[int]]:
    """The error behind DCP's ``CheckpointException`` and the ranks that failed
    (:func:`~ckpt_engine.errors.first_failure`); an error raised outside DCP is this rank's."""
    err, ranks = first_failure(exc)
    return err, ranks or [dist.rank()]


# -- what DCP keeps one copy of ------------------------------------------------------------


#: Tensors of at most this many bytes are hashed whole.
FULL_HASH_BYTES = 256 * 1024
#: Larger tensors: this many pages, spread evenly over the bytes (the last page always among them).
SAMPLED_PAGES = 16
#: Bytes of one sampled page.
PAGE_BYTES = 4096


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    data = t.detach()
    if not data.is_contiguous():
        data = data.contiguous()
    return data.reshape(-1).view(torch.uint8)


def page_offsets(nbytes: int, salt: int) -> list[int]:
    """Where the sampled pages of a tensor of ``nbytes`` (more than :data:`FULL_HASH_BYTES`)
    start: one in each of :data:`SAMPLED_PAGES` equal stretches, at an offset inside the stretch
    that ``salt`` (the iteration) moves, and the last page."""
    stretch = nbytes // SAMPLED_PAGES
    shift = (salt * 2654435761) % max(1, stretch - PAGE_BYTES + 1)
    starts = [i * stretch + shift for i in range(SAMPLED_PAGES - 1)]
    return [*starts, nbytes - PAGE_BYTES]


def tensor_digest(t: torch.Tensor, salt: int = 0) -> int:
    """``xxh3_64`` of a plain tensor's shape, dtype and bytes (sampled pages above
    :data:`FULL_HASH_BYTES`, see :func:`page_offsets`)."""
    h = xxhash.xxh3_64(f"{tuple(t.shape)}|{t.dtype}".encode())
    flat = _byte_view(t)
    n = flat.numel()
    if flat.device.type != "cpu":  # the bytes hashed, copied to the host in one piece
        if n > FULL_HASH_BYTES:
            flat = torch.cat([flat[s : s + PAGE_BYTES] for s in page_offsets(n, salt)])
        h.update(flat.cpu().numpy().data)
        return h.intdigest()
    data = flat.numpy()  # the tensor's own memory: numpy slices cost a fraction of torch's
    if n <= FULL_HASH_BYTES:
        h.update(data.data)
    else:
        for s in page_offsets(n, salt):
            h.update(data[s : s + PAGE_BYTES].data)
    return h.intdigest()


def value_digest(value: Any) -> int:
    """``xxh3_64`` of a non-tensor value's pickle (a set's items sorted where they sort: their
    order differs between processes); its ``repr`` where it does not pickle."""
    if isinstance(value, (set, frozenset)):
        with contextlib.suppress(TypeError):  # unorderable items: as they come
            value = sorted(value)
    try:
        data = pickle.dumps(value, protocol=4)
    except Exception:
        data = repr(value).encode()
    return xxhash.xxh3_64_intdigest(data)


def _flat(state_dict: dict[str, Any]) -> Mapping[str, Any]:
    """``state_dict`` as DCP flattens it (keys as ``flat_keys`` gives them)."""
    if already_flat(state_dict):
        return state_dict
    planner = DefaultSavePlanner()
    planner.set_up_planner(state_dict, None, False)
    flat: Mapping[str, Any] = planner.state_dict
    return flat


def _per_rank(component: str, key: str, patterns: Sequence[str]) -> bool:
    name = f"{component}.{key}"
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def without_broadcast_buffers(
    state: dict[str, dict[str, Any]], modules: Sequence[nn.Module], patterns: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """``state`` without the ``model`` buffers a ``DistributedDataParallel`` with
    ``broadcast_buffers=True`` (its default) broadcasts from rank 0 at every forward (BatchNorm's
    running statistics): each rank updates its own copy in its forward, so at a save they differ,
    yet rank 0's, which DCP saves, is what every rank trains with next. The check leaves them out
    of :func:`digests`; a model passed unwrapped (``ddp.module``) has no such mark, and its
    differing buffers still fail the save. A buffer ``patterns`` (``per_rank_keys``) names stays:
    it is saved per rank, as configured."""
    names = {
        name
        for module in modules
        if isinstance(module, DistributedDataParallel) and module.broadcast_buffers
        for name, _ in module.module.named_buffers()
        if not _per_rank("model", name, patterns)
    }
    if not names or "model" not in state:
        return state
    return {**state, "model": {k: v for k, v in state["model"].items() if k not in names}}


@dataclass
class LocalDigests:
    """This rank's digests: per component, its items' flat keys (kept here) and, sent as bytes,
    the ``xxh3_64`` of each item's storage key, of its value, and whether it is a tensor."""

    keys: dict[str, list[str]]
    #: Keys ``per_rank_keys`` names, per component: saved per rank without a digest.
    configured: dict[str, list[str]]
    sent: dict[str, tuple[bytes, bytes, bytes]]

    def plus(self, other: LocalDigests) -> LocalDigests:
        """These digests and ``other``'s (of other items of the same components), as one."""
        out = LocalDigests(dict(self.keys), dict(self.configured), dict(self.sent))
        for name, sent in other.sent.items():
            mine = out.sent.get(name, (b"", b"", b""))
            out.sent[name] = (mine[0] + sent[0], mine[1] + sent[1], mine[2] + sent[2])
            out.keys[name] = [*out.keys.get(name, []), *other.keys[name]]
        return out


#: The tensor types DCP writes whole from one rank: its ``_create_write_items`` writes any tensor
#: without a layout of its own (a DTensor's ``__create_write_items__``, a ShardedTensor's shards)
#: as one item, and its planner keeps the lowest rank's copy. A parameter a ``Stateful`` extra
#: hands over without ``detach()`` is one, as a plain tensor is; so are their subclasses that
#: keep the plain tensor's storage (:func:`one_copy`).
ONE_COPY_TENSORS = (torch.Tensor, torch.nn.Parameter)


def one_copy(value: Any) -> bool:
    """Whether DCP writes ``value`` whole from one rank (lowest rank's copy): a plain tensor or
    parameter, or a subclass of one (a custom ``nn.Parameter``, a ``Buffer``-like tag class) that
    neither lays itself out (``__create_write_items__``: DTensor) nor wraps other tensors (a
    ``__torch_dispatch__`` of its own: quantised or sharded wrappers, whose bytes are not its own)."""
    if type(value) in ONE_COPY_TENSORS:
        return True
    return (
        isinstance(value, torch.Tensor)
        and not hasattr(value, "__create_write_items__")
        and getattr(type(value), "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__
        and type(value).__name__ != "ShardedTensor"
    )


#: Which items :func:`digests` hashes: every one; all but the plain tensors of the standard
#: components (their check may wait, :class:`LaterTensorCheck`); only those; none.
Part = Literal["all", "values", "tensors", "none"]


def digests(
    state: Mapping[str, dict[str, Any]],
    key_maps: Mapping[str, Mapping[str, str]],
    salt: int,
    patterns: Sequence[str],
    part: Part = "all",
) -> LocalDigests:
    """Digest the items of ``state`` (``part`` of them) that DCP would keep one copy of (plain
    tensors and parameters, :func:`one_copy`, and non-tensor values; DTensors and other tensor
    subclasses are sharded by their layout), but those ``patterns`` name
    (``per_rank_keys``), which are only listed."""
    out = LocalDigests({}, {}, {})
    for name, sd in state.items():
        key_map = key_maps.get(name, {})
        keys: list[str] = []
        kinds: list[bool] = []
        key_hashes: list[int] = []
        value_hashes: list[int] = []
        configured: list[str] = []
        for key, value in _flat(sd).items():
            if patterns and _per_rank(name, key, patterns):
                configured.append(key)
                continue
            plain = one_copy(value)
            if part == "none" or (not plain and isinstance(value, torch.Tensor)):
                continue
            if part != "all" and (part == "tensors") != (plain and name in STANDARD_COMPONENTS):
                continue
            keys.append(key)
            kinds.append(plain)
            key_hashes.append(xxhash.xxh3_64_intdigest(key_map.get(key, key).encode()))
            value_hashes.append(tensor_digest(value.detach(), salt) if plain else value_digest(value))
        out.keys[name], out.configured[name] = keys, configured
        out.sent[name] = (
            np.array(key_hashes, dtype=np.uint64).tobytes(),
            np.array(value_hashes, dtype=np.uint64).tobytes(),
            np.array(kinds, dtype=np.bool_).tobytes(),
        )
    return out


@dataclass(frozen=True)
class Difference:
    """One item that differs across the ranks holding it."""

    component: str
    #: Its flat key, or ``None`` where this rank does not hold it.
    key: str | None
    key_hash: int
    #: A plain tensor on some rank holding it (else a non-tensor value on every one).
    tensor: bool
    #: The ranks holding it, grouped by equal value (each group's ranks in order).
    groups: tuple[tuple[int, ...], ...]

    def describe(self) -> str:
        key = clip(self.key) if self.key is not None else f"(not held by this rank; key hash {self.key_hash:016x})"
        held = "; ".join(f"rank(s) {list(g)} hold value {i + 1}" for i, g in enumerate(self.groups))
        return f"component {self.component!r} key {key}: {held}"


def _groups(values: Mapping[int, int]) -> tuple[tuple[int, ...], ...]:
    by_value: dict[int, list[int]] = {}
    for rank in sorted(values):
        by_value.setdefault(values[rank], []).append(rank)
    return tuple(tuple(g) for g in by_value.values())


def differences(local: LocalDigests, gathered: Sequence[Mapping[str, tuple[bytes, bytes, bytes]]]) -> list[Difference]:
    """The items whose digests differ among the ranks that hold them, from every rank's ``sent``
    in rank order: the same list on every rank (a rank names only the keys it holds)."""
    found: list[Difference] = []
    for name in sorted({c for sent in gathered for c in sent}):
        held = [(r, sent[name]) for r, sent in enumerate(gathered) if name in sent]
        if len(held) < 2:
            continue
        own = local.sent.get(name)
        mine = dict(zip(np.frombuffer(own[0], np.uint64).tolist(), local.keys[name], strict=True)) if own else {}
        first = held[0][1][0]
        if all(k == first for _, (k, _, _) in held):  # the same keys in the same order: compare columns
            values = np.stack([np.frombuffer(v, dtype=np.uint64) for _, (_, v, _) in held])
            kinds: Any = np.stack([np.frombuffer(t, dtype=np.bool_) for _, (_, _, t) in held]).any(axis=0)
            key_hashes = np.frombuffer(first, np.uint64)
            for i in np.nonzero((values != values[0]).any(axis=0))[0].tolist():
                kh = int(key_hashes[i])
                ranks = {r: int(values[j, i]) for j, (r, _) in enumerate(held)}
                found.append(Difference(name, mine.get(kh), kh, bool(kinds[i]), _groups(ranks)))
            continue
        by_key: dict[int, dict[int, int]] = {}
        tensor: set[int] = set()
        for r, (k, v, t) in held:
            key_hashes, value_hashes = np.frombuffer(k, np.uint64).tolist(), np.frombuffer(v, np.uint64).tolist()
            for kh, vh, is_tensor in zip(key_hashes, value_hashes, np.frombuffer(t, np.bool_).tolist(), strict=True):
                by_key.setdefault(kh, {})[r] = vh
                if is_tensor:
                    tensor.add(kh)
        for kh in sorted(by_key):
            ranks = by_key[kh]
            if len(ranks) > 1 and len(set(ranks.values())) > 1:
                found.append(Difference(name, mine.get(kh), kh, kh in tensor, _groups(ranks)))
    return found


def per_rank_maps(
    local: LocalDigests,
    found: Sequence[Difference],
    key_maps: Mapping[str, Mapping[str, str]],
    rank: int,
) -> dict[str, dict[str, str]]:
    """``key_maps`` with the storage keys this rank saves per rank renamed to its own copy's
    (``per_rank_keys``, differing values, every key of a differing extra); raises
    :class:`ReplicatedStateMismatchError`, on every rank alike, for a plain tensor of a standard
    component that differs."""
    tensors = [d for d in found if d.component in STANDARD_COMPONENTS and d.tensor]
    if tensors:
        shown = "\n  ".join(d.describe() for d in tensors[:8])
        more = f"\n  ... and {len(tensors) - 8} more" if len(tensors) > 8 else ""
        raise ReplicatedStateMismatchError(
            f"{len(tensors)} plain (non-DTensor) tensor(s) differ across the ranks that save them under one key; "
            f"DCP would keep only the lowest rank's copy:\n  {shown}{more}\nIf the ranks are meant to hold "
            "different values (expert parallelism, buffers with broadcast_buffers=False), name them in "
            "per_rank_keys (e.g. 'model.experts.*') to save them per rank; otherwise the ranks have diverged: find "
            "out why before saving (docs/reliability.md, Per-rank state)"
        )
    maps = {name: dict(m) for name, m in key_maps.items()}
    whole = {d.component for d in found if d.component not in STANDARD_COMPONENTS}
    for name, key_map in maps.items():
        if name in whole:
            keys: Sequence[str] = local.keys.get(name, [])
        else:
            keys = [d.key for d in found if d.component == name and d.key is not None]
        for key in (*keys, *local.configured.get(name, ())):
            key_map[key] = per_rank_key(key_map.get(key, key), rank)
    return maps


def shares_memory(components: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether two plain tensors of staged ``components`` overlap in memory: a stager that refills
    one buffer in windows (``pinned_staging``'s ``max_host_bytes``), whose copy is never whole."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for sd in components.values()
        for t in _flat(dict(sd)).values()
        if one_copy(t) and t.numel()
    )
    return any(b[0] < a[1] for a, b in itertools.pairwise(spans))


class LaterTensorCheck:
    """The plain tensors' part of the check for a save whose state is a staged copy: hashed from
    that copy on a background thread once ``save()`` returned, compared across the ranks over a
    gloo group of its own, before the save may commit (:meth:`start` gives the future the
    commit waits for). One thread, so every rank runs its checks in the order of its saves; a
    check waits for :meth:`release` (the end of its ``save()``), so that its hashing does not
    contend with ``save()`` for the interpreter."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._group: Any = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-engine-replicated-check")
        self._held: list[threading.Event] = []

    def start(
        self,
        staged: Any,
        key_maps: tuple[Mapping[str, Mapping[str, str]], Mapping[str, Mapping[str, str]]],
        salt: int,
        patterns: Sequence[str],
        hashed: LocalDigests | None,
    ) -> Future[None]:
        """Check ``staged`` (``key_maps``: the save's, and :func:`plain_keys` of the live state;
        ``hashed``: its tensors' digests, taken from the live state already).
        Collective: every rank calls it for the same save (the first call creates the group)."""
        if self._group is None:
            self._group = dist.new_gloo_group(self.timeout_s)
        held = threading.Event()
        self._held.append(held)
        return self._pool.submit(self._run, held, staged, (key_maps, salt, patterns), hashed, self._group)

    def release(self) -> None:
        """Let the checks started so far run (``save()`` returns or failed)."""
        while self._held:
            self._held.pop().set()

    @staticmethod
    def _run(
        held: threading.Event, staged: Any, how: tuple[Any, int, Sequence[str]], hashed: LocalDigests | None, group: Any
    ) -> None:
        held.wait()
        (key_maps, plain), salt, patterns = how
        if hashed is None:  # a whole copy, taken inside save()
            hashed = digests(_plain_part(staged.components, plain), key_maps, salt, patterns, "tensors")
        gathered: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(gathered, hashed.sent, group=group)
        per_rank_maps(hashed, differences(hashed, gathered), {}, torch.distributed.get_rank())  # raises

    def close(self) -> None:
        self.release()
        self._pool.shutdown(wait=True)


def plain_keys(state: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, str]]:
    """Per standard component, the keys whose live value is a plain tensor (a key map of each to
    itself): all a staged copy is checked by, since a stager may copy a DTensor's local shard
    into a plain host tensor."""
    return {
        name: {k: k for k, v in _flat(sd).items() if one_copy(v)}
        for name, sd in state.items()
        if name in STANDARD_COMPONENTS
    }


def _plain_part(
    components: Mapping[str, Mapping[str, Any]], plain: Mapping[str, Mapping[str, str]]
) -> dict[str, dict[str, Any]]:
    """The items of staged ``components`` that :func:`plain_keys` names."""
    return {
        name: {k: v for k, v in _flat(dict(components[name])).items() if k in keys}
        for name, keys in plain.items()
        if name in components
    }


def gated(write: Future[Any], check: Future[None]) -> Future[Any]:
    """``write``'s outcome once ``check`` passed; ``check``'s error where it failed and the write
    did not."""
    out: Future[Any] = Future()
    lock = threading.Lock()

    def settle(_: Future[Any]) -> None:
        with lock:
            if out.done() or not (write.done() and check.done()):
                return
            err = write.exception() or check.exception()
            if err is not None:
                out.set_exception(err)
            else:
                out.set_result(write.result())

    write.add_done_callback(settle)
    check.add_done_callback(settle)
    return out
