"""The safe parser's batches (``_format/metadata_fast.py``) against its interpreter alone: on every
fixture and every fuzz case, both give the same ``Metadata`` (compared field by field, types
included) or the same error.

The batches replay DCP's storage entries in bulk and fall back to the interpreter on anything
unusual, so a file that makes them disagree is a parser bug a crafted file could exploit. The
fixtures are real ``dcp.save`` and engine checkpoints (large enough that pickle writes storage
entries in more than one batch, where the batches take over), sharded layouts and other pickle
protocols; the fuzz cases flip bits, retarget memo references, insert ``FRAME`` opcodes and
truncate inside the batched region. ``CKPT_ENGINE_SLOW_TESTS=1`` runs every bit flip of it.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import pickletools
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt_engine import CheckpointEngine
from ckpt_engine._dcpio.torch_private import storage_info
from ckpt_engine._format import metadata_parser as mp
from ckpt_engine._format.metadata_fast import StorageBatch
from ckpt_engine._format.metadata_types import dcp_types, plain_types

SLOW = os.environ.get("CKPT_ENGINE_SLOW_TESTS") == "1"


def canon(x: Any, memo: dict[int, Any] | None = None) -> Any:
    """``x`` as nested tuples: type names (a leading ``_`` dropped, for the stand-ins), fields in
    order, dict items in order; so equal canons mean equal values of equal types.

    An object met twice (the parsers share equal tensor descriptions) is walked once: ``memo``,
    by ``id``, holds only objects reachable from ``x``, so none is freed and its id reused."""
    handler = _HANDLERS.get(type(x)) or _handler(type(x))
    return handler(x, {} if memo is None else memo)


_Handler = Callable[[Any, dict[int, Any]], Any]
_HANDLERS: dict[type, _Handler] = {}


def _handler(cls: type) -> _Handler:
    """How :func:`canon` writes an instance of ``cls`` (found once per class)."""
    name = cls.__name__.lstrip("_")

    def leaf(x: Any, memo: dict[int, Any]) -> Any:
        return (name, x)

    def other(x: Any, memo: dict[int, Any]) -> Any:
        return (name, str(x))

    def fields(x: Any, memo: dict[int, Any]) -> Any:
        return (name, tuple([(n, canon(getattr(x, n), memo)) for n in names]))

    def items(x: Any, memo: dict[int, Any]) -> Any:
        return (name, tuple([(canon(k, memo), canon(v, memo)) for k, v in x.items()]))

    def values(x: Any, memo: dict[int, Any]) -> Any:
        return (name, tuple([canon(v, memo) for v in x]))

    def members(x: Any, memo: dict[int, Any]) -> Any:
        return (name, tuple([canon(v, memo) for v in sorted(x, key=repr)]))

    names = tuple(f.name for f in dataclasses.fields(cls)) if dataclasses.is_dataclass(cls) else ()
    if cls in (str, int, float, bool, bytes, type(None)):
        handler = leaf
    elif dataclasses.is_dataclass(cls):
        handler = _once(fields)
    elif issubclass(cls, dict):
        handler = _once(items)
    elif issubclass(cls, (list, tuple)):
        handler = _once(values)
    elif issubclass(cls, (set, frozenset)):
        handler = _once(members)
    else:
        handler = other
    _HANDLERS[cls] = handler
    return handler


def _once(build: _Handler) -> _Handler:
    def memoised(x: Any, memo: dict[int, Any]) -> Any:
        found = memo.get(id(x))
        if found is None:
            found = memo[id(x)] = build(x, memo)
        return found

    return memoised


def outcome(data: bytes, *, batches: bool, plain: bool = False) -> Any:
    try:
        md = mp.parse_metadata(data, plain_types() if plain else None, batches=batches)
    except (mp.PickleRefused, mp.PickleMalformed) as err:
        return ("error", type(err).__name__, str(err))
    return ("ok", canon(md))


def batched_entries(data: bytes) -> int:
    """How many storage entries the batches built in one parse of ``data``."""
    budget = mp._Budget(len(data))
    types = dcp_types()
    batch = StorageBatch(mp._is_token, budget.charge, types.MetadataIndex, types.StorageInfo)
    mp._parse(data, types, budget, batch)
    return batch.entries


def agree(data: bytes) -> Any:
    fast, slow = outcome(data, batches=True), outcome(data, batches=False)
    assert fast == slow
    return fast


# -- fixtures ---------------------------------------------------------------------------------------


def _dcp_file(tmp_path: Path, name: str, state: dict[str, Any]) -> bytes:
    dcp.save(state, checkpoint_id=tmp_path / name)
    return (tmp_path / name / ".metadata").read_bytes()


def varied(tmp_path: Path) -> bytes:
    """Every dtype and odd shape of tests/dcpio/test_fast_paths.py, non-tensor values, 1,200 more tensors."""
    g = torch.Generator().manual_seed(0)
    state: dict[str, Any] = {
        "bf16": torch.randn(64, 8, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, 3, 2, generator=g).half(),
        "i64": torch.randint(-(2**62), 2**62, (11,), generator=g),
        "u16": torch.arange(6, dtype=torch.int32).to(torch.uint16),
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "bool": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "four_d": torch.zeros(2, 1, 2, 1),
        "nested": {"w": torch.randn(4, 4, generator=g), "n": 7},
        "text": "hello",
    }
    state.update({f"t{i}": torch.full((i % 5 + 1,), float(i)) for i in range(1200)})
    return _dcp_file(tmp_path, "varied", state)


def model_and_optimizer(tmp_path: Path) -> bytes:
    """Parameters, AdamW state (tensors and per-parameter steps) and param_groups (bytes entries)."""
    model = nn.Sequential(*[nn.Linear(3, 2) for _ in range(300)])
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return _dcp_file(tmp_path, "optim", {"model": model.state_dict(), "optim": opt.state_dict()})


def engine_file(tmp_path: Path, count: int = 1500) -> bytes:
    """The engine's own ``.metadata`` (equal tensor descriptions shared), as the benchmark's."""
    model = nn.Module()
    for i in range(count):
        model.register_buffer(f"p{i}", torch.full((16,), float(i)))
    with CheckpointEngine({"save_dir": str(tmp_path / f"engine{count}")}) as engine:
        engine.save(1, model=model)
    return (tmp_path / f"engine{count}" / "iter_000000001" / "model" / ".metadata").read_bytes()


def sharded(offset_base: int) -> bytes:
    """One 2-D tensor in 1,100 row chunks, pickled by pickle; storage offsets from ``offset_base``
    (past 2**31 they are LONG1 integers)."""
    rows = 1100
    chunks = [ChunkStorageMetadata(offsets=torch.Size([r, 0]), sizes=torch.Size([1, 300])) for r in range(rows)]
    item = TensorStorageMetadata(TensorProperties(dtype=torch.float32), torch.Size([rows, 300]), chunks)
    storage = {
        MetadataIndex(fqn="w", offset=c.offsets, index=i): storage_info("__0_0.distcp", offset_base + 1200 * i, 1200)
        for i, c in enumerate(chunks)
    }
    return pickle.dumps(Metadata(state_dict_metadata={"w": item}, storage_data=storage), protocol=4)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    tmp = tmp_path_factory.mktemp("fast-path")
    out = {
        "dcp_varied": varied(tmp),
        "dcp_model_optimizer": model_and_optimizer(tmp),
        "engine_1500": engine_file(tmp),
        "sharded_small_offsets": sharded(0),
        "sharded_long_offsets": sharded(3 << 32),
    }
    engine_md = pickle.loads(out["engine_1500"])  # our own file: the test may unpickle it
    for protocol in (2, 3, 5):
        out[f"engine_protocol_{protocol}"] = pickle.dumps(engine_md, protocol=protocol)
    return out


@pytest.mark.full  # exhaustive over its inputs: the full tier (CI)
def test_batches_and_interpreter_agree_on_every_fixture(fixtures: dict[str, bytes]) -> None:
    for name, data in fixtures.items():
        result = agree(data)
        assert result[0] == "ok", (name, result)
        assert result == ("ok", canon(pickle.loads(data))), name  # and both are what pickle builds
        assert outcome(data, batches=True, plain=True) == result, name  # the stand-ins: same fields
    # The batches took over where pickle batches (protocol 2 uses BINPUT: no batches, by design).
    for name in ("dcp_varied", "dcp_model_optimizer", "engine_1500", "sharded_small_offsets", "sharded_long_offsets"):
        assert batched_entries(fixtures[name]) >= 100, name
    assert batched_entries(fixtures["engine_protocol_2"]) == 0


# -- fuzz cases in the batched region ------------------------------------------------------------


def small_optimizer_file(tmp_path: Path, layers: int = 20) -> bytes:
    """The engine's ``.metadata`` of AdamW over ``layers`` linear layers: 560 entries, values then
    tensors, in one pickle batch (so only the replay after its first entry batches them)."""
    model = nn.Sequential(*[nn.Linear(3, 2) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with CheckpointEngine({"save_dir": str(tmp_path / f"small{layers}")}) as engine:
        engine.save(1, model=model, optimizer=opt).result()
    return (tmp_path / f"small{layers}" / "iter_000000001" / "optim" / ".metadata").read_bytes()


@pytest.fixture(scope="module", params=["second batch", "first batch after its first entry"])
def fuzz_base(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[bytes, list[tuple[int, str, Any]]]:
    """A ``.metadata`` and the opcodes of a batched region of its storage entries: the second
    pickle batch of an engine file of 1,100 tensors (the first holds the new strings, so the
    interpreter runs its first entry), or the entries after the first of a file with one batch."""
    if request.param == "second batch":
        data = engine_file(tmp_path_factory.mktemp("fuzz"), 1100)
    else:
        data = small_optimizer_file(tmp_path_factory.mktemp("fuzz-head"))
    ops = [(pos or 0, op.name, arg) for op, arg, pos in pickletools.genops(data)]
    storage = next(i for i, (_, name, arg) in enumerate(ops) if name == "SHORT_BINUNICODE" and arg == "storage_data")
    meta = ops.index(next(o for o in ops[storage:] if o[2] == "storage_meta"))
    records = builds = 0
    for i in range(storage, len(ops)):
        records += ops[i][1] == "NEWOBJ"
        builds += ops[i][1] == "BUILD"
        if request.param != "second batch" and builds == 2:  # the first entry's two records
            return data, ops[i + 1 : meta]
        if ops[i][1] == "SETITEMS" and records >= 2000:  # the storage dict's first SETITEMS
            return data, ops[i + 1 : meta]
    raise AssertionError("no batched region")


# Every bit of the region (CKPT_ENGINE_SLOW_TESTS=1) is about 69,000 pairs of parses, 43 ms each here: about
# 50 minutes, far past the suite's 420 s per test.
@pytest.mark.full  # over 2 s on 2 cores: every damaged byte of a batch
@pytest.mark.timeout(7200 if SLOW else 420)
def test_bit_flips_in_the_batched_region_agree(fuzz_base: tuple[bytes, list[tuple[int, str, Any]]]) -> None:
    data, ops = fuzz_base
    lo, hi = ops[0][0], ops[-1][0]
    bits = range(8 * lo, 8 * hi) if SLOW else random.Random(1).sample(range(8 * lo, 8 * hi), 60)
    errors = 0
    for bit in bits:
        damaged = bytearray(data)
        damaged[bit // 8] ^= 1 << (bit % 8)
        errors += agree(bytes(damaged))[0] == "error"
    assert errors  # the cases reach the errors, not only values


@pytest.mark.full  # over 2 s on 2 cores: every retargeted reference of a batch
def test_retargeted_memo_references_agree(fuzz_base: tuple[bytes, list[tuple[int, str, Any]]]) -> None:
    """A reference inside a batch pointed at another memo slot: another string, a class token, a
    record or state dict the batch built, a slot not yet set."""
    data, ops = fuzz_base
    rng = random.Random(2)
    gets = [(pos, name, arg) for pos, name, arg in ops if name in ("BINGET", "LONG_BINGET")]
    memo_size = sum(1 for op, _, _ in pickletools.genops(data) if op.name == "MEMOIZE")
    seen = {"ok": 0, "error": 0}
    for pos, name, _ in rng.sample(gets, 60 if not SLOW else len(gets)):
        target = rng.randrange(256) if name == "BINGET" else rng.randrange(memo_size + 10)
        width = 1 if name == "BINGET" else 4
        edited = data[: pos + 1] + target.to_bytes(width, "little") + data[pos + 1 + width :]
        seen[agree(edited)[0]] += 1
    assert seen["ok"] and seen["error"]


def reframed(data: bytes, size: int) -> bytes:
    """``data`` with its frames replaced by frames of about ``size`` bytes, each header exactly at
    the end of the frame before: framed as CPython's pickler frames, only smaller."""
    ops = [pos or 0 for _, _, pos in pickletools.genops(data)]
    spans = [data[a:b] for a, b in zip(ops, [*ops[1:], len(data)], strict=True) if data[a] != 0x95]
    out, frame = [spans[0]], bytearray()  # PROTO stays outside the frames
    for span in spans[1:]:
        frame += span
        if len(frame) >= size:
            out += [b"\x95" + len(frame).to_bytes(8, "little"), bytes(frame)]
            frame.clear()
    if frame:
        out += [b"\x95" + len(frame).to_bytes(8, "little"), bytes(frame)]
    return b"".join(out)


@pytest.mark.parametrize("size", [64, 1000, 70_000])
def test_frames_where_cpython_writes_them_change_nothing(
    fuzz_base: tuple[bytes, list[tuple[int, str, Any]]], size: int
) -> None:
    """Frames of any size, each header at the end of the frame before: the batches replay across
    every boundary (here up to one every 64 bytes) and agree with the interpreter."""
    data, _ = fuzz_base
    edited = reframed(data, size)
    assert canon(pickle._loads(edited)) == canon(pickle.loads(data))  # valid for the pure-Python unpickler
    assert agree(edited) == agree(data)
    assert batched_entries(edited) == batched_entries(data) > 0


def test_a_frame_inside_a_frame_is_refused_as_the_pure_python_unpickler_refuses_it(
    fuzz_base: tuple[bytes, list[tuple[int, str, Any]]],
) -> None:
    """CPython's unpicklers disagree on a FRAME before the current frame's end: the pure-Python
    one refuses it, the C one reads on from memory and reads other bytes from a file (DCP reads
    ``.metadata`` from a file). The parser refuses it, batches or not, wherever it stands."""
    data, ops = fuzz_base
    rng = random.Random(3)
    for pos in rng.sample([pos for pos, _, _ in ops], 40 if SLOW else 8):
        edited = data[:pos] + b"\x95" + rng.randrange(1, 64).to_bytes(8, "little") + data[pos:]
        with pytest.raises(pickle.UnpicklingError, match="new frame before end of current frame"):
            pickle._loads(edited)
        got = agree(edited)
        assert got[0] == "error" and "FRAME inside a frame" in got[2], got
    too_long = data[:2] + b"\x95" + (len(data)).to_bytes(8, "little") + data[2:]
    assert "longer than the rest" in agree(too_long)[2]


@pytest.mark.full  # exhaustive over its inputs: the full tier (CI)
def test_truncations_and_reused_batch_slots_agree(fuzz_base: tuple[bytes, list[tuple[int, str, Any]]]) -> None:
    data, ops = fuzz_base
    rng = random.Random(4)
    for pos, _, _ in rng.sample(ops, 10):
        assert agree(data[:pos])[0] == "error"
    # After the storage dict: GET the last slots the batches filled (records, state dicts, sizes)
    # and use each as a dict key, a list item, a SETITEM target and a BUILD state, then POP it.
    end = data.rindex(b"\x8c\x0cstorage_meta")
    memo_size = sum(1 for op, _, pos in pickletools.genops(data) if op.name == "MEMOIZE" and (pos or 0) < end)
    for slot in range(memo_size - 7, memo_size):  # one entry's: 2 records, 2 state dicts, 2 tuples, 1 Size
        get = b"j" + slot.to_bytes(4, "little")
        for use in (
            get + b"0",
            b"}" + get + b"Ns0",
            b"]" + get + b"a0",
            get + b"\x8c\x01kNs0",
            get + b"}b0",
            get + b"0",
        ):
            assert agree(data[:end] + use + data[end:])[0] in ("ok", "error")


def test_a_sparse_memo_switches_the_batches_off(fixtures: dict[str, bytes]) -> None:
    """A PUT past the end of the memo: MEMOIZE slots no longer follow on, so no batch runs (the
    shifted slots then break the file's references: both parses refuse it alike)."""
    data = fixtures["engine_1500"]
    edited = data[:2] + b"N\x72\x00\x00\x01\x000" + data[2:]  # NONE, LONG_BINPUT 65536, POP
    budget = mp._Budget(len(edited))
    types = dcp_types()
    batch = StorageBatch(mp._is_token, budget.charge, types.MetadataIndex, types.StorageInfo)
    with pytest.raises(mp.PickleMalformed):
        mp._parse(edited, types, budget, batch)
    assert batch.entries == 0
    assert agree(edited)[0] == "error"


def test_values_first_then_tensors_parse_in_batches(tmp_path: Path) -> None:
    """An optimizer's ``.metadata`` as the engine writes it: the first pickle batch holds only
    values (no offsets, so no ``torch.Size`` is memoised yet), the next ones tensors, whose
    entries build a Size. The batches built the second batch's pattern from the first entry's
    constants, which then lacked the Size's: a ``KeyError`` that failed every load of a model
    with AdamW over about 170 or more parameters."""
    params = [nn.Parameter(torch.randn(2, 2)) for _ in range(200)]  # 2,400 values, then 600 tensors
    optimizer = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer.step()
    model = nn.ParameterList(params)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=model, optimizer=optimizer).result()
    data = (tmp_path / "iter_000000001" / "optim" / ".metadata").read_bytes()
    assert outcome(data, batches=False)[0] == "ok"
    assert outcome(data, batches=True) == outcome(data, batches=False)
    assert batched_entries(data) > 0  # the batches ran (and did not fail over to the interpreter)


def test_a_file_of_one_pickle_batch_is_replayed_after_its_first_entry(tmp_path: Path) -> None:
    """Pickle writes a dict's items in batches of 1,000, and the first entry of the first batch
    names the classes and field names (new strings, which the interpreter memoises). A component
    of fewer entries (an optimizer of a few hundred parameters, any model) is one batch: the
    entries after the first are replayed in bulk, values and tensors mixed."""
    data = small_optimizer_file(tmp_path)
    storage = pickle.loads(data).storage_data
    assert len(storage) < 1000 and {e.offset is None for e in storage} == {True, False}  # mixed, one batch
    assert agree(data) == ("ok", canon(pickle.loads(data)))
    assert batched_entries(data) == len(storage) - 1
