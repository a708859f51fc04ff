"""Tiny ``.metadata`` files that made the parser hang or exhaust memory, and chunk layouts that made
validation quadratic: every input parses, or is refused with a typed error naming the file, in
time and memory linear in its size.

Bounds are measured in this process with generous margins (CPU seconds with ``process_time``,
peak Python allocations with ``tracemalloc``); the payloads are as small as the ones that broke
main. The hangs ran in C with the GIL held, where no signal gets through, so the tests that
would hang without the fix use pytest-timeout's thread method: a regression ends the run with a
stack dump instead of hanging it.
"""

from __future__ import annotations

import pickle
import time
import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt_engine import CheckpointEngine, CorruptCheckpointError, UnsafeCheckpointError
from ckpt_engine._dcpio.torch_private import storage_info
from ckpt_engine._format import metadata_read as metadata_module
from ckpt_engine._format.metadata import read_metadata
from ckpt_engine.cli import main
from ckpt_engine.testing import TinyTrainingState

from ._adv import ckpt, rehash

MD = "torch.distributed.checkpoint.metadata"
P4 = b"\x80\x04"


def g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def dag(levels: int) -> bytes:
    """A tuple whose expansion has ``2**levels`` leaves, in ``2 * levels + 1`` bytes: ``()`` and
    then, ``levels`` times, DUP and TUPLE2 (each level is a pair of the level below, shared)."""
    return b")" + b"2\x86" * levels


#: name -> payload; each builds a value of 2**64 leaves from a few bytes (the issue's item 1-2).
EXPONENTIAL = {
    # the issue's 135-byte file: the DAG as a dict key (hashing it walked every leaf)
    "dict_key_setitem": P4 + b"}" + dag(64) + b"Ns.",
    "dict_key_setitems": P4 + b"}(" + dag(64) + b"Nu.",
    "dict_key_dict": P4 + b"(" + dag(64) + b"Nd.",
    "frozenset_element": P4 + b"(" + dag(64) + b"\x91.",
    "set_element_additems": P4 + b"\x8f(" + dag(64) + b"\x90.",
    "set_reduce_element": P4 + g("builtins", "set") + b"(" + dag(64) + b"l\x85R.",
    "ordereddict_key": P4 + g("collections", "OrderedDict") + b"(" + dag(64) + b"N\x86l\x85R.",
    "layout_membership": P4 + g("torch.serialization", "_get_layout") + dag(64) + b"\x85R.",
    # the error paths that repr'd the value (item 2)
    "size_error_repr": P4 + g("torch", "Size") + dag(64) + b"\x85\x85R.",
    "memory_format_error_repr": P4 + g(MD, "_MEM_FORMAT_ENCODING") + dag(64) + b"\x85R.",
    "build_field_name": P4 + g(MD, "BytesStorageMetadata") + b")\x81}" + dag(64) + b"Nsb.",
}


@contextmanager
def bounded(max_cpu_s: float, max_peak_bytes: int) -> Iterator[None]:
    """The block takes at most ``max_cpu_s`` CPU seconds and ``max_peak_bytes`` of Python memory."""
    tracemalloc.start()
    cpu = time.process_time()
    try:
        yield
        used = time.process_time() - cpu
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert used < max_cpu_s, f"took {used:.2f} CPU seconds"
    assert peak < max_peak_bytes, f"peak {peak} bytes"


def component(tmp_path: Path, data: bytes) -> Path:
    cdir = tmp_path / "iter_000000001" / "model"
    cdir.mkdir(parents=True, exist_ok=True)
    (cdir / ".metadata").write_bytes(data)
    return cdir


def refused(cdir: Path, error: type[Exception] = CorruptCheckpointError) -> str:
    with pytest.raises(error) as info:
        read_metadata(cdir)
    message = str(info.value)
    assert f"{cdir}/.metadata" in message
    assert len(message) < 1000, "the message formats a value the file built"
    return message


@pytest.mark.timeout(60, method="thread")
@pytest.mark.parametrize("name", sorted(EXPONENTIAL))
def test_a_shared_tuple_of_2_to_the_64_leaves_is_refused_at_once(tmp_path: Path, name: str) -> None:
    payload = EXPONENTIAL[name]
    assert len(payload) < 200
    cdir = component(tmp_path, payload)
    with bounded(max_cpu_s=2.0, max_peak_bytes=1 << 20):
        message = refused(cdir)
    assert "tuple" in message


def test_the_issues_135_byte_file_is_the_one_tested() -> None:
    assert EXPONENTIAL["dict_key_setitem"] == b"\x80\x04}" + b")" + b"2\x86" * 64 + b"Ns."
    assert len(EXPONENTIAL["dict_key_setitem"]) == 135


@pytest.mark.timeout(120, method="thread")
def test_load_ls_verify_and_inspect_refuse_the_135_byte_file(save_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Item 1's scenario: the attacker replaces a real checkpoint's ``.metadata`` and rewrites the
    manifest, so the checksum passes and every reader reaches the parser."""
    state = TinyTrainingState.create()
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, **state.objects())
    checkpoint = ckpt(save_dir, 1)
    (checkpoint / "model" / ".metadata").write_bytes(EXPONENTIAL["dict_key_setitem"])
    rehash(checkpoint)
    for verify in ("off", "sizes", "checksums"):
        with pytest.raises(UnsafeCheckpointError, match=r"model/\.metadata .*dict key of type tuple"):
            CheckpointEngine({"save_dir": save_dir, "verify": verify}).load(**TinyTrainingState.create().objects())
    assert main(["verify", str(checkpoint)]) == 1
    assert main(["inspect", str(checkpoint)]) != 0
    main(["ls", save_dir])
    out = capsys.readouterr()
    assert "dict key of type tuple" in out.out + out.err


def test_a_long_string_is_clipped_in_every_message(tmp_path: Path) -> None:
    """Names from the file appear in messages, but never more than a fixed number of characters."""
    huge = "x" * 1_000_000
    raw = huge.encode()
    string = b"X" + len(raw).to_bytes(4, "little") + raw
    for payload in (
        P4 + b"c" + raw + b"\nname\n.",  # a forbidden global with a megabyte module name
        P4 + g(MD, "BytesStorageMetadata") + b")\x81}" + string + b"Nsb.",  # an unknown field name
        P4 + g("torch.serialization", "_get_layout") + string + b"\x85R.",  # an unknown layout
    ):
        cdir = component(tmp_path, payload)
        with pytest.raises(CorruptCheckpointError) as info:
            read_metadata(cdir)
        assert len(str(info.value)) < 1000


def memoised_tuple_reused(constructor: bytes, n: int, uses: int, wrap: Callable[[bytes], bytes]) -> bytes:
    """One memoised ``n``-tuple of ints passed ``uses`` times to ``constructor`` (item 3)."""
    items = b"(" + b"K\x01" * n + b"t\x94"  # the tuple, memo slot 0
    calls = b"".join(constructor + wrap(b"h\x00") + b"R0" for _ in range(uses))
    return P4 + items + b"0" + calls + b"N."


QUADRATIC = {
    "torch_size": (g("torch", "Size"), lambda t: t + b"\x85"),
    "set": (g("builtins", "set"), lambda t: t + b"\x85"),
    "frozenset": (g("builtins", "frozenset"), lambda t: t + b"\x85"),
    "path": (g("pathlib", "PosixPath"), lambda t: t),
}


@pytest.mark.parametrize("name", sorted(QUADRATIC))
def test_copying_one_memoised_tuple_many_times_is_refused_in_linear_memory(tmp_path: Path, name: str) -> None:
    constructor, wrap = QUADRATIC[name]
    if name == "path":  # a path takes strings: a tuple of one memoised 50 kB string, many times
        big = b"a" * 50_000
        items = b"(" + (b"X" + len(big).to_bytes(4, "little") + big + b"\x94" + b"h\x00" * 2000) + b"t\x94"
        calls = b"".join(constructor + b"h\x01R0" for _ in range(2000))
        payload = P4 + items + b"0" + calls + b"N."
    else:
        payload = memoised_tuple_reused(constructor, n=20_000, uses=3_000, wrap=wrap)
    assert len(payload) < 130_000
    cdir = component(tmp_path, payload)
    with bounded(max_cpu_s=5.0, max_peak_bytes=40 * len(payload) + (8 << 20)):
        message = refused(cdir, UnsafeCheckpointError)
    assert "copies of shared values" in message


def test_one_chunk_list_shared_by_many_tensors_is_refused_in_linear_time(tmp_path: Path) -> None:
    """A memoised list of n chunks given to n tensors asked the builder for n**2 chunk records."""
    n = 3000
    chunk = g(MD, "ChunkStorageMetadata") + b")\x81}(" + b"\x8c\x07offsets" + b"h\x00" + b"\x8c\x05sizes" + b"h\x00ub"
    size = g("torch", "Size") + b"(K\x00t\x85R\x94"  # memo 0: Size([0])
    props = g(MD, "TensorProperties") + b")\x81}(\x8c\x05dtype" + g("torch", "float32") + b"ub\x94"  # memo 1
    chunks = b"](" + chunk * n + b"e\x94"  # memo 2
    tensor = (
        g(MD, "TensorStorageMetadata")
        + b")\x81}(\x8c\nproperties"
        + b"h\x01\x8c\x04size"
        + b"h\x00\x8c\x06chunks"
        + b"h\x02ub"
    )
    entries = b"".join(b"\x8c\x06k" + str(i).zfill(5).encode() + tensor for i in range(n))
    payload = (
        P4
        + size
        + b"0"
        + props
        + b"0"
        + chunks
        + b"0"
        + g(MD, "Metadata")
        + b")\x81}(\x8c\x13state_dict_metadata}("
        + entries
        + b"uub."
    )
    cdir = component(tmp_path, payload)
    with bounded(max_cpu_s=5.0, max_peak_bytes=40 * len(payload) + (8 << 20)):
        assert "shared by several tensors" in refused(cdir, UnsafeCheckpointError)


# -- chunk validation (item 4) ---------------------------------------------------------------------


def write_layout(tmp_path: Path, shape: list[int], chunks: list[tuple[list[int], list[int]]]) -> Path:
    """A real DCP ``.metadata`` (pickled by ``pickle``) of one float32 tensor with ``chunks``."""
    item = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32),
        size=torch.Size(shape),
        chunks=[ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s in chunks],
    )
    storage = {
        MetadataIndex(fqn="w", offset=torch.Size(o), index=0): storage_info("__0_0.distcp", 0, 4 * _volume(s))
        for o, s in chunks
    }
    md = Metadata(state_dict_metadata={"w": item}, storage_data=storage)
    return component(tmp_path, pickle.dumps(md, protocol=4))


def _volume(sizes: list[int]) -> int:
    out = 1
    for s in sizes:
        out *= s
    return out


def unit_chunks(shape: list[int]) -> list[tuple[list[int], list[int]]]:
    offsets: list[list[int]] = [[]]
    for d in shape:
        offsets = [[*o, i] for o in offsets for i in range(d)]
    return [(o, [1] * len(shape)) for o in offsets]


@pytest.mark.full  # over 2 s on 2 cores: metadata with 90,000 chunks
@pytest.mark.parametrize(
    ("shape", "label"),
    [([2] * 12 + [1] * 52, "4,096 unit chunks of a 64-dim tensor (27.8 s on main)"), ([300, 300], "90,000 1x1 chunks")],
)
def test_many_unit_chunks_validate_in_linear_time(tmp_path: Path, shape: list[int], label: str) -> None:
    cdir = write_layout(tmp_path, shape, unit_chunks(shape))
    cpu = time.process_time()
    md = read_metadata(cdir)
    used = time.process_time() - cpu
    assert len(md.state_dict_metadata["w"].chunks) == _volume(shape)  # type: ignore[union-attr]
    assert used < 10.0, f"{label}: {used:.1f} CPU seconds"


GRID_CASES = {
    # name -> (shape, chunks, valid)
    "rows": ([10, 4], [([0, 0], [4, 4]), ([4, 0], [4, 4]), ([8, 0], [2, 4])], True),
    "mesh_2x2": ([4, 4], [([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 2]), ([2, 2], [2, 2])], True),
    "duplicate_cell": ([4, 4], [([0, 0], [2, 4]), ([0, 0], [2, 4])], False),
    # irregular: a 2x4 box beside two 2x2 boxes stacked differently in each column
    "irregular_valid": ([4, 4], [([0, 0], [4, 2]), ([0, 2], [1, 2]), ([1, 2], [3, 2])], True),
    # irregular, with the right volume: two 3-row bands sharing a row, the last row uncovered
    "irregular_overlap": ([4, 4], [([0, 0], [2, 4]), ([1, 0], [2, 4])], False),
    "nested_with_gap": ([2, 4], [([0, 0], [2, 3]), ([0, 1], [1, 1]), ([1, 3], [1, 1])], False),
}


@pytest.mark.parametrize("sweep", [False, True], ids=["grid", "sweep"])
@pytest.mark.parametrize("name", sorted(GRID_CASES))
def test_overlap_detection_agrees_on_every_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, sweep: bool
) -> None:
    shape, chunks, valid = GRID_CASES[name]
    if sweep:  # no grid array: the sweep decides irregular layouts
        monkeypatch.setattr(metadata_module, "_MAX_GRID_CELLS", 0)
    cdir = write_layout(tmp_path, shape, chunks)
    if valid:
        read_metadata(cdir)
    else:
        message = refused(cdir)
        assert "overlap" in message or "do not cover" in message


def test_an_irregular_layout_too_large_for_the_grid_and_the_budget_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(metadata_module, "_MAX_GRID_CELLS", 0)
    monkeypatch.setattr(metadata_module, "_MIN_COMPARISONS", 0)
    monkeypatch.setattr(metadata_module, "_COMPARISONS_PER_COORD", 1)
    n = 200  # 200 column strips crossed by one full-height strip: every comparison is active
    chunks = [([0, 0], [n, 1])] + [([i, 1], [1, 1]) for i in range(n)]
    cdir = write_layout(tmp_path, [n, 2], chunks)
    assert "too irregular to validate" in refused(cdir)
