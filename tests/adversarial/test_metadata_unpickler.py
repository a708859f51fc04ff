"""Crafted ``.metadata`` pickles: reading a checkpoint never changes the process or runs its code.

Each payload is the kind of pickle an attacker writes by hand. Before the engine parsed metadata
with its own interpreter, the BUILD payloads rewrote real classes for the whole process (the
first one made every later save pickle an empty ``Metadata``), and the memo bombs allocated
gigabytes before any check.
"""

from __future__ import annotations

import pathlib
import pickle
import tracemalloc
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorProperties

from ckpt_engine import CheckpointEngine, CorruptCheckpointError, UnsafeCheckpointError
from ckpt_engine._format.metadata import read_metadata
from ckpt_engine._format.verify import verify_checkpoint
from ckpt_engine.testing import TinyTrainingState

MD = "torch.distributed.checkpoint.metadata"


def s(text: str) -> bytes:
    """BINUNICODE ``text``."""
    raw = text.encode()
    return b"X" + len(raw).to_bytes(4, "little") + raw


def g(module: str, name: str) -> bytes:
    """GLOBAL ``module.name``."""
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


P2, P4 = b"\x80\x02", b"\x80\x04"

#: name -> (payload, text the refusal names)
MUTATING = {
    # BUILD with (None, {attr: value}) calls setattr on its target, whatever it is.
    "build_on_class": (
        P2 + g(MD, "Metadata") + b"N}" + s("__getstate__") + g("collections", "OrderedDict") + b"s\x86b.",
        "BUILD on a _Token",
    ),
    "build_on_path_class": (
        P2 + g("pathlib", "PosixPath") + b"N}" + s("_str") + s("/tmp/evil") + b"s\x86b.",
        "BUILD on a _Token",
    ),
    "build_on_function": (
        P2 + g("torch.serialization", "_get_layout") + b"}" + s("__code__") + b"Nsb.",
        "BUILD on a _Token",
    ),
    "build_on_dtype": (P2 + g("torch", "float32") + b"}" + s("is_signed") + b"Nsb.", "BUILD on a dtype"),
    "build_on_layout": (
        P2 + g("torch.serialization", "_get_layout") + s("torch.strided") + b"\x85R}" + s("x") + b"Nsb.",
        "BUILD on a layout",
    ),
    "build_on_enum_member": (
        P2 + g(MD, "_MEM_FORMAT_ENCODING") + b"K\x00\x85R}" + s("_value_") + b"K\x01sb.",
        "BUILD on a _MemFormat",
    ),
    "build_on_size": (P2 + g("torch", "Size") + b"K\x01\x85\x85R}" + s("x") + b"Nsb.", "BUILD on a Size"),
    "build_twice": (P2 + g(MD, "BytesStorageMetadata") + b")\x81}b}b.", "second BUILD"),
    "build_unknown_attribute": (
        P2 + g(MD, "BytesStorageMetadata") + b")\x81}" + s("__class__") + b"Nsb.",
        "'__class__'",
    ),
    "build_slots_unknown": (
        P2 + g(MD, "ChunkStorageMetadata") + b")\x81N}" + s("__dict__") + b"Ns\x86b.",
        "'__dict__'",
    ),
    "setitem_into_global": (P2 + g("collections", "OrderedDict") + s("k") + b"Ns.", "SETITEM into a _Token"),
    "setitems_into_global": (P2 + g(MD, "Metadata") + b"(" + s("k") + b"Nu.", "SETITEMS into a _Token"),
    "setitem_into_record": (P2 + g(MD, "BytesStorageMetadata") + b")\x81" + s("k") + b"Ns.", "SETITEM into a _Record"),
    "setitem_into_tuple": (P2 + b")" + s("k") + b"Ns.", "SETITEM into a tuple"),
    "appends_into_global": (P2 + g("builtins", "set") + b"(Ne.", "APPENDS to a _Token"),
    "append_into_dict": (P2 + b"}Na.", "APPEND to a dict"),
    "additems_into_list": (P4 + b"](N\x90.", "ADDITEMS to a list"),
    "additems_into_frozenset": (P4 + b"(N\x91(N\x90.", "ADDITEMS to a frozenset"),
    "inst": (P2 + b"(i" + MD.encode() + b"\nMetadata\n.", "INST"),
    "obj": (P2 + b"(" + g(MD, "Metadata") + b"o.", "OBJ"),
    "newobj_on_container": (P2 + g("collections", "OrderedDict") + b")\x81.", "NEWOBJ of OrderedDict"),
    "newobj_on_size": (P2 + g("torch", "Size") + b")\x81.", "NEWOBJ of Size"),
    "newobj_on_value": (P2 + g("torch", "float32") + b")\x81.", "NEWOBJ of dtype"),
    "newobj_ex_on_function": (P4 + g("torch.serialization", "_get_layout") + b")}\x92.", "NEWOBJ of get_layout"),
    "reduce_on_record_class": (P2 + g(MD, "Metadata") + b")R.", "REDUCE of Metadata"),
    "reduce_on_value": (P2 + g("torch", "float32") + b")R.", "REDUCE of dtype"),
    "forbidden_global": (P2 + g("posix", "system") + s("id") + b"\x85R.", "references posix.system"),
    "forbidden_builtin": (P2 + g("builtins", "getattr") + b".", "references builtins.getattr"),
    "forbidden_torch_function": (P2 + g("torch", "load") + b".", "references torch.load"),
    "nested_pickle": (P2 + g("pickle", "loads") + b"C\x03abc\x85R.", "references pickle.loads"),
    "stack_global_forbidden": (P4 + b"\x8c\x05posix\x8c\x06system\x93.", "references posix.system"),
    "ext1": (P2 + b"\x82\x01.", "EXT1"),
    "persid": (P2 + b"P0\n.", "PERSID"),
    "binpersid": (P2 + b"N" + b"Q.", "BINPERSID"),
    "next_buffer": (b"\x80\x05\x97.", "NEXT_BUFFER"),
}


def component(tmp_path: Path, data: bytes) -> str:
    cdir = tmp_path / "iter_000000001" / "model"
    cdir.mkdir(parents=True, exist_ok=True)
    (cdir / ".metadata").write_bytes(data)
    return str(cdir)


def process_is_intact() -> None:
    """The classes the payloads target behave as they did before."""
    md = Metadata(state_dict_metadata={"a": BytesStorageMetadata()}, storage_data={}, version="1.0.0")
    back = pickle.loads(pickle.dumps(md))
    assert back == md and back.state_dict_metadata == {"a": BytesStorageMetadata()}
    assert "__getstate__" not in Metadata.__dict__
    assert str(pathlib.PosixPath("/a/b")) == "/a/b"
    assert torch.float32.is_floating_point and not hasattr(torch.float32, "x")
    assert TensorProperties(dtype=torch.float32) == pickle.loads(pickle.dumps(TensorProperties(dtype=torch.float32)))


@pytest.mark.parametrize("name", sorted(MUTATING))
def test_mutating_or_forbidden_opcode_is_refused_and_changes_nothing(tmp_path: Path, name: str) -> None:
    payload, named = MUTATING[name]
    cdir = component(tmp_path, payload)
    with pytest.raises(UnsafeCheckpointError) as info:
        read_metadata(cdir)
    message = str(info.value)
    assert f"{cdir}/.metadata" in message and named in message
    assert "nothing was executed or changed" in message
    process_is_intact()


def test_class_pollution_payload_inside_a_valid_checkpoint_is_refused(tmp_path: Path, save_dir: str) -> None:
    """The issue's scenario: a real checkpoint whose ``.metadata`` also rewrites ``Metadata``.

    The payload BUILDs the class first and then leaves a valid ``Metadata`` as the result, so a
    class filter alone accepted it and every later save in the process was empty."""
    state = TinyTrainingState.create()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=state.model)
    md_path = Path(save_dir) / "iter_000000001" / "model" / ".metadata"
    good = md_path.read_bytes()
    assert good.startswith(P4)
    prefix = g(MD, "Metadata") + b"N}" + s("__getstate__") + g("collections", "OrderedDict") + b"s\x86b0"
    md_path.write_bytes(P4 + prefix + good[2:])  # POP the polluted class, then the real pickle
    with pytest.raises(UnsafeCheckpointError, match=r"BUILD on a _Token"):
        CheckpointEngine({"save_dir": save_dir, "verify": "off"}).load(model=TinyTrainingState.create().model)
    process_is_intact()
    # A save after the refused load still writes real metadata.
    with CheckpointEngine({"save_dir": str(tmp_path / "b")}) as engine:
        engine.save(2, model=state.model)
    reread = read_metadata(str(tmp_path / "b" / "iter_000000002" / "model"))
    assert set(reread.state_dict_metadata) == set(state.model.state_dict())


@pytest.mark.parametrize("index", [b"\x00\x00\x00\x08", b"\xff\xff\xff\xff"])
def test_memo_bomb_is_refused_in_bounded_memory(tmp_path: Path, index: bytes) -> None:
    """Nine bytes (LONG_BINPUT with a huge memo index) made the C unpickler allocate 2.4 GB (64 GB
    for 0xFFFFFFFF) before the error; the parse's memo is a dict, so it costs nothing."""
    cdir = component(tmp_path, P2 + b"Nr" + index + b".")
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError, match=r"\.metadata is not a valid DCP metadata file"):
            read_metadata(cdir)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20


def test_memo_bomb_in_a_checkpoint_is_refused_by_load_and_verify(save_dir: str) -> None:
    state = TinyTrainingState.create()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=state.model)
    md_path = Path(save_dir) / "iter_000000001" / "model" / ".metadata"
    md_path.write_bytes(P2 + b"Nr\xff\xff\xff\xff.")
    tracemalloc.start()
    try:
        with pytest.raises(CorruptCheckpointError):
            CheckpointEngine({"save_dir": save_dir, "verify": "off"}).load(model=TinyTrainingState.create().model)
        report = verify_checkpoint(str(Path(save_dir) / "iter_000000001"), "sizes")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert not report.complete and not report.verified and any(".metadata" in p for p in report.problems)
    assert peak < 64 << 20


def test_manifest_checksum_of_metadata_is_checked_before_parsing(save_dir: str) -> None:
    """With a manifest, a damaged ``.metadata`` is refused by its checksum before the parse runs."""
    state = TinyTrainingState.create()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=state.model)
    md_path = Path(save_dir) / "iter_000000001" / "model" / ".metadata"
    data = bytearray(md_path.read_bytes())
    data[-2] ^= 0x01  # same size, different bytes
    md_path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"does not match the checksum.*nothing was parsed"):
        CheckpointEngine({"save_dir": save_dir, "verify": "sizes"}).load(model=TinyTrainingState.create().model)


def test_parse_equals_pickle_on_real_checkpoints(tmp_path: Path) -> None:
    """Every kind of value DCP writes parses to exactly what ``pickle.load`` gives."""
    from torch.distributed.checkpoint._extension import ZStandard  # DCP's zstd transform (experimental module)

    state = TinyTrainingState.create()
    opt_sd = {"state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(3, 2)}}, "lr": 0.1}
    payloads = {
        "plain": {"model": state.model.state_dict(), "it": 5, "name": "run", "blob": b"\x00\x01"},
        "bf16": {"w": torch.ones(4, 4, dtype=torch.bfloat16), "i8": torch.ones(3, dtype=torch.int8), "opt": opt_sd},
        "scalar": {
            "s": torch.tensor(1.5),
            "empty": torch.empty(0, 3),
            "cl": torch.ones(2, 3, 4, 5).to(memory_format=torch.channels_last),
        },
    }
    for name, sd in payloads.items():
        dcp.save(sd, checkpoint_id=tmp_path / name)  # a Path id is pickled as a PosixPath
    writer = dcp.FileSystemWriter(str(tmp_path / "zstd"), _extensions=[ZStandard()])
    dcp.save({"w": torch.arange(100.0)}, storage_writer=writer)
    for name in [*payloads, "zstd"]:
        data = (tmp_path / name / ".metadata").read_bytes()
        expected = pickle.loads(data)
        got = read_metadata(str(tmp_path / name))
        assert got == expected
        assert got.storage_data == expected.storage_data and got.planner_data == expected.planner_data
        assert got.storage_meta == expected.storage_meta
        assert [i.transform_descriptors for i in got.storage_data.values()] == [
            i.transform_descriptors for i in expected.storage_data.values()
        ]
