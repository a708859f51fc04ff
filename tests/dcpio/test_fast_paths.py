"""The direct tensor read path (``ckpt_engine._dcpio.fast_read``) against DCP's own reader: bit-exact."""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import warnings
import zipfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given
from hypothesis import strategies as st
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckpt_engine._dcpio.fast_read import FastFileSystemReader
from ckpt_engine._dcpio.torch_save_archive import contiguous_region
from ckpt_engine._format.names import METADATA_INDEX_FILE
from ckpt_engine.testing import TinyTrainingState, make_engine

warnings.filterwarnings("ignore", message="Detected an existing checkpoint")


def _bits(t: torch.Tensor) -> bytes:
    """A tensor's exact bytes (NaN payloads and -0.0 included)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _varied_state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    f32 = torch.randn(33, 17, generator=g)
    f32[0, 0] = float("nan")
    f32[0, 1] = -0.0
    return {
        "f32": f32,
        "bf16": torch.randn(64, 8, generator=g).to(torch.bfloat16),
        "f16": torch.randn(5, 3, 2, generator=g).half(),
        "f64": torch.randn(7, generator=g, dtype=torch.float64),
        "i64": torch.randint(-(2**62), 2**62, (11,), generator=g),
        "i32": torch.randint(-100, 100, (4, 4), generator=g, dtype=torch.int32),
        "u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
        "u16": torch.arange(6, dtype=torch.int32).to(torch.uint16),  # saved with _rebuild_tensor_v3
        "f8": torch.randn(8, generator=g).to(torch.float8_e4m3fn),
        "c64": torch.randn(3, generator=g, dtype=torch.complex64),
        "bool": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "transposed": torch.randn(6, 4, generator=g).t(),  # saved non-contiguous: fallback
        "view": torch.arange(20.0)[3:9],  # a view: DCP saves a compact clone
        "big": torch.randn(3000, 7, generator=g),  # larger than the prefetch window
        "nested": {"w": torch.randn(4, 4, generator=g), "n": 7},
        "text": "hello",
    }


def _zeros_like_state(state: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out[k] = _zeros_like_state(v)
        elif isinstance(v, torch.Tensor) and v.is_quantized:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[k] = torch.quantize_per_tensor(torch.zeros(v.shape), 0.1, 0, v.dtype)
        elif isinstance(v, torch.Tensor):
            out[k] = torch.zeros(v.shape, dtype=v.dtype)
        else:
            out[k] = None
    return out


def _flat_tensors(state: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat_tensors(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


@pytest.fixture
def zstd() -> Any:
    """DCP's zstd stream transform (experimental module); ``zstandard`` is in the test extra."""
    from torch.distributed.checkpoint._extension import ZStandard

    return ZStandard()


def _load(path: str, template: dict[str, Any], reader: Any) -> dict[str, Any]:
    dcp.load(template, storage_reader=reader, planner=DefaultLoadPlanner())
    return template


@pytest.mark.parametrize("thread_count", [1, 2])
def test_direct_read_is_bit_exact_against_dcp(tmp_path: Any, thread_count: int) -> None:
    state = _varied_state()
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=thread_count))
    ours_reader = FastFileSystemReader(path)
    ours = _load(path, _zeros_like_state(state), ours_reader)
    theirs = _load(path, _zeros_like_state(state), FileSystemReader(path))
    for key, want in _flat_tensors(theirs).items():
        got = _flat_tensors(ours)[key]
        assert got.dtype == want.dtype and got.shape == want.shape, key
        assert _bits(got) == _bits(want), key
        assert _bits(want) == _bits(_flat_tensors(state)[key]), key
    assert ours["text"] == "hello" and ours["nested"]["n"] == 7
    # Every tensor took the direct path but the one saved non-contiguous and the empty one
    # (DCP plans no read for a tensor without elements).
    assert ours_reader.stats.direct == len(_flat_tensors(state)) - 2
    assert ours_reader.stats.values == 2  # "text" and "nested.n": their archives read in runs
    assert ours_reader.stats.fallback == 1  # "transposed"


def test_values_are_read_in_runs_as_dcp_reads_them_and_a_damaged_one_names_its_file(tmp_path: Any) -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    from ckpt_engine.errors import CorruptCheckpointError

    state = {"lr": 0.1, "betas": (0.9, 0.99), "big": "x" * 20_000, "w": torch.randn(3)}
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path, single_file_per_rank=True))

    def template() -> dict[str, Any]:
        return {"lr": 0.0, "betas": (0.0, 0.0), "big": "", "w": torch.zeros(3)}

    reader = FastFileSystemReader(path)
    got, want = _load(path, template(), reader), _load(path, template(), FileSystemReader(path))
    assert got["lr"] == want["lr"] == 0.1 and got["betas"] == want["betas"] == (0.9, 0.99)
    assert got["big"] == want["big"] == state["big"] and torch.equal(got["w"], state["w"])
    assert reader.stats.values == 2 and reader.stats.fallback == 1  # "big" is past a small item's size
    (data_file,) = [f for f in os.listdir(path) if f.endswith(".distcp")]
    assert reader.stats.bytes_read == os.path.getsize(os.path.join(path, data_file))  # every byte once

    # The "lr" archive overwritten: torch.load's error, named by the reader with the file and key.
    info = next(i for k, i in reader.storage_data.items() if k.fqn == "lr")
    with open(os.path.join(path, data_file), "r+b") as f:
        f.seek(info.offset)
        f.write(b"\xab" * info.length)
    with pytest.raises(CheckpointException) as caught:  # dcp.load wraps what the reader raised
        _load(path, template(), FastFileSystemReader(path))
    error = caught.value.failures[0][0]
    assert isinstance(error, CorruptCheckpointError) and f"{data_file} is corrupt: reading 'lr'" in str(error)


def test_fallbacks_stay_bit_exact(tmp_path: Any) -> None:
    """Casts and non-contiguous destinations go through DCP's path, with DCP's result."""
    g = torch.Generator().manual_seed(1)
    state = {"a": torch.randn(5, 6, generator=g), "b": torch.randn(4, 3, generator=g).to(torch.bfloat16)}
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path))

    def template() -> dict[str, Any]:
        return {"a": torch.zeros(6, 5).t(), "b": torch.zeros(4, 3, dtype=torch.float32)}  # non-contig, cast

    reader = FastFileSystemReader(path)
    ours = _load(path, template(), reader)
    theirs = _load(path, template(), FileSystemReader(path))
    assert reader.stats.direct == 0 and reader.stats.fallback == 2
    for k in state:
        assert _bits(ours[k]) == _bits(theirs[k])
    assert torch.equal(ours["a"], state["a"])


def test_compressed_items_fall_back(tmp_path: Any, zstd: Any) -> None:
    state = {"w": torch.randn(100, 10)}
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path, _extensions=[zstd]))
    reader = FastFileSystemReader(path)
    out = _load(path, {"w": torch.zeros(100, 10)}, reader)
    assert reader.stats.direct == 0 and torch.equal(out["w"], state["w"])


class _SubBoxPlanner(DefaultLoadPlanner):
    """Reads the zero-origin sub-box ``sizes`` of every stored tensor into a tensor of that shape."""

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        items = []
        for fqn, target in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata)
            chunk = ChunkStorageMetadata(offsets=torch.Size([0] * target.dim()), sizes=target.size())
            items += create_read_items_for_chunk_list(fqn, md, [chunk])
        return LoadPlan(items)


@pytest.mark.parametrize(
    ("shape", "box", "direct"),
    [
        ((8, 4), (5, 4), True),  # a row range: contiguous in the stored chunk
        ((8, 4), (8, 3), False),  # a column range: strided, DCP's path
        ((2, 6, 5), (1, 3, 5), True),
        ((2, 6, 5), (2, 3, 5), False),
    ],
)
def test_sub_box_reads(tmp_path: Any, shape: tuple[int, ...], box: tuple[int, ...], direct: bool) -> None:
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    path = str(tmp_path / "ckpt")
    dcp.save({"t": full}, storage_writer=FileSystemWriter(path))
    reader = FastFileSystemReader(path)
    out = {"t": torch.zeros(box)}
    dcp.load(out, storage_reader=reader, planner=_SubBoxPlanner())
    assert torch.equal(out["t"], full[tuple(slice(0, n) for n in box)])
    assert reader.stats.direct == int(direct)


@given(
    st.lists(st.integers(1, 4), min_size=0, max_size=4).flatmap(
        lambda size: st.tuples(
            st.just(tuple(size)),
            st.tuples(*[st.integers(0, n - 1) for n in size]),
            st.tuples(*[st.integers(1, n) for n in size]),
        )
    )
)
def test_contiguous_region_matches_torch(case: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]) -> None:
    size, offsets, lengths = case
    lengths = tuple(min(ln, n - o) for n, o, ln in zip(size, offsets, lengths, strict=True))
    base = torch.arange(torch.Size(size).numel()).reshape(size)
    box = base
    for dim, (o, ln) in enumerate(zip(offsets, lengths, strict=True)):
        box = box.narrow(dim, o, ln)
    region = contiguous_region(size, offsets, lengths)
    if box.is_contiguous():
        assert region is not None
        first, count = region
        assert torch.equal(base.reshape(-1)[first : first + count], box.reshape(-1))
    else:
        assert region is None


def test_contiguous_region_rejects_out_of_range() -> None:
    assert contiguous_region((4,), (3,), (2,)) is None
    assert contiguous_region((4, 2), (0,), (1,)) is None
    assert contiguous_region((), (), ()) == (0, 1)
    assert contiguous_region((0, 3), (0, 0), (0, 3)) == (0, 0)
    assert contiguous_region((-2, -3), (0, 0), (-2, -3)) is None  # a whole box of a nonsense shape


def test_truncated_file_is_not_read_silently(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.randn(4096)}, storage_writer=FileSystemWriter(path))
    (data,) = [f for f in os.listdir(path) if f.endswith(".distcp")]
    size = os.path.getsize(os.path.join(path, data))
    with open(os.path.join(path, data), "r+b") as f:
        f.truncate(size - 9000)
    reader = FastFileSystemReader(path)
    with pytest.raises(BaseException):  # noqa: B017 - DCP's own error for a corrupt item
        _load(path, {"w": torch.zeros(4096)}, reader)
    assert reader.stats.direct == 0


def test_engine_load_takes_the_direct_path(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[FastFileSystemReader] = []
    original = FastFileSystemReader.read_data

    def spy(self: FastFileSystemReader, plan: Any, planner: Any) -> Any:
        seen.append(self)
        return original(self, plan, planner)

    monkeypatch.setattr(FastFileSystemReader, "read_data", spy)
    state = TinyTrainingState.create(seed=3)
    with make_engine(tmp_path / "ckpt") as engine:
        engine.save(5, **state.objects())
    fresh = TinyTrainingState.create(seed=4, steps=1)
    with make_engine(tmp_path / "ckpt") as engine:
        result = engine.load(**fresh.objects())
    assert result.iteration == 5
    for (k, a), b in zip(state.model.state_dict().items(), fresh.model.state_dict().values(), strict=True):
        assert _bits(a) == _bits(b), k
    model_reader = next(r for r in seen if os.fspath(r.path).endswith("model"))
    assert model_reader.stats.direct == len(state.model.state_dict())


def test_direct_read_can_be_switched_off(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.randn(3)}, storage_writer=FileSystemWriter(path))
    reader = FastFileSystemReader(path, direct=False)
    out = _load(path, {"w": torch.zeros(3)}, reader)
    assert reader.stats.direct == 0 and reader.stats.fallback == 1 and out["w"].abs().sum() > 0


def test_stats_are_per_read(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.randn(3)}, storage_writer=FileSystemWriter(path))
    reader = FastFileSystemReader(path)
    _load(path, {"w": torch.zeros(3)}, reader)
    first = dataclasses.replace(reader.stats)
    reader.reset(path)
    _load(path, {"w": torch.zeros(3)}, reader)
    assert reader.stats == first


def test_dtensor_destinations_read_directly(tmp_path: Any, one_rank_mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(2)
    full = {"s": torch.randn(8, 6, generator=g), "r": torch.randn(5, generator=g).to(torch.bfloat16)}
    state = {
        "s": distribute_tensor(full["s"], one_rank_mesh, [Shard(0)]),
        "r": distribute_tensor(full["r"], one_rank_mesh, [Replicate()]),
    }
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path))

    def template() -> dict[str, Any]:
        return {k: distribute_tensor(torch.zeros_like(v), one_rank_mesh, [Shard(0)]) for k, v in full.items()}

    reader = FastFileSystemReader(path)
    ours = template()
    dcp.load(ours, storage_reader=reader)
    theirs = template()
    dcp.load(theirs, storage_reader=FileSystemReader(path))
    assert reader.stats.direct == 2
    for k in full:
        assert isinstance(ours[k], DTensor)
        assert _bits(ours[k].full_tensor()) == _bits(theirs[k].full_tensor()) == _bits(full[k])


# -- the writer ------------------------------------------------------------------------------


def _writer_state() -> dict[str, Any]:
    state = _varied_state()
    with warnings.catch_warnings():  # quantized tensors are deprecated, and still saved by DCP
        warnings.simplefilter("ignore")
        state["quantized"] = torch.quantize_per_tensor(torch.randn(6), 0.1, 0, torch.qint8)  # torch.save path
    state["neg"] = torch.randn(4)._neg_view()  # a lazy negation: written resolved
    return state


def _template_for(state: dict[str, Any]) -> dict[str, Any]:
    return _zeros_like_state(state)


@pytest.mark.parametrize("thread_count", [1, 3])
def test_fast_writer_output_loads_with_plain_dcp(tmp_path: Any, thread_count: int) -> None:
    from ckpt_engine._dcpio.fast_write import FastFileSystemWriter

    state = _writer_state()
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    dcp.save(state, storage_writer=FastFileSystemWriter(ours, thread_count=thread_count))
    dcp.save(state, storage_writer=FileSystemWriter(theirs, thread_count=thread_count))
    # the same files, and the engine's compact index of its .metadata (which plain DCP ignores)
    assert sorted(os.listdir(ours)) == sorted([*os.listdir(theirs), METADATA_INDEX_FILE])
    a = _load(ours, _template_for(state), FileSystemReader(ours))  # plain DCP reads ours
    b = _load(theirs, _template_for(state), FileSystemReader(theirs))
    for key, want in _flat_tensors(b).items():
        got = _flat_tensors(a)[key]
        if want.is_quantized:
            assert torch.equal(got.dequantize(), want.dequantize())
        else:
            assert _bits(got) == _bits(want), key
    assert a["text"] == b["text"] == "hello" and a["nested"]["n"] == 7
    # Metadata says the same about every item but where its bytes lie.
    md_a, md_b = FileSystemReader(ours).read_metadata(), FileSystemReader(theirs).read_metadata()
    assert md_a.state_dict_metadata == md_b.state_dict_metadata
    assert md_a.storage_data.keys() == md_b.storage_data.keys()


def test_fast_writer_output_takes_the_direct_read_path(tmp_path: Any) -> None:
    from ckpt_engine._dcpio.fast_write import FastFileSystemWriter

    state = _writer_state()
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FastFileSystemWriter(path))
    reader = FastFileSystemReader(path)
    out = _load(path, _template_for(state), reader)
    # every dense tensor is direct now, the transposed one included (written contiguous)
    assert reader.stats.direct == len(_flat_tensors(state)) - 2  # not: empty (no read), quantized
    assert _bits(out["transposed"]) == _bits(state["transposed"])
    assert _bits(out["neg"]) == _bits(state["neg"].resolve_neg())


def test_fast_writer_writes_durably_and_reports_errors(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_engine._dcpio.fast_write import FastFileSystemWriter

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    dcp.save({"w": torch.ones(3)}, storage_writer=FastFileSystemWriter(str(tmp_path / "a"), thread_count=2))
    assert len(synced) >= 2  # one per data file (and the metadata)
    synced.clear()
    dcp.save({"w": torch.ones(3)}, storage_writer=FastFileSystemWriter(str(tmp_path / "b"), sync_files=False))
    assert synced == []

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise OSError(28, "No space left on device")

    from ckpt_engine._format import data_file

    monkeypatch.setattr(data_file.DataFile, "write", boom)  # the disk fills up mid-file
    with pytest.raises(BaseException, match="No space left"):
        dcp.save({"w": torch.ones(3)}, storage_writer=FastFileSystemWriter(str(tmp_path / "c"), thread_count=2))


def test_engine_save_uses_the_fast_writer_and_stays_loadable(tmp_path: Any) -> None:
    state = TinyTrainingState.create(seed=5)
    with make_engine(tmp_path / "ckpt") as engine:
        engine.save(1, **state.objects())
    model_dir = tmp_path / "ckpt" / "iter_000000001" / "model"
    template = {k: torch.zeros_like(v) for k, v in state.model.state_dict().items()}
    dcp.load(template, storage_reader=FileSystemReader(str(model_dir)))
    for k, v in state.model.state_dict().items():
        assert _bits(template[k]) == _bits(v), k
    # written by the fast writer: the data records carry no CRC (torch.save with crc32 off)
    md = FileSystemReader(str(model_dir)).read_metadata()
    info = next(iter(md.storage_data.values()))
    with open(model_dir / info.relative_path, "rb") as f:
        f.seek(info.offset)
        with zipfile.ZipFile(io.BytesIO(f.read(info.length))) as zf:
            (data,) = [i for i in zf.infolist() if i.filename.endswith("/data/0")]
            assert data.CRC == 0


def test_fast_writer_leaves_stream_transforms_to_dcp(tmp_path: Any, zstd: Any) -> None:
    from ckpt_engine._dcpio.fast_write import FastFileSystemWriter

    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.randn(100)}, storage_writer=FastFileSystemWriter(path, _extensions=[zstd]))
    md = FileSystemReader(path).read_metadata()
    assert all(info.transform_descriptors for info in md.storage_data.values())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_large_reads_split_over_threads_stay_bit_exact(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, threads: int
) -> None:
    import ckpt_engine._dcpio.fast_read as fr

    monkeypatch.setattr(fr, "_PARALLEL_MIN_BYTES", 1)
    g = torch.Generator().manual_seed(7)
    state = {f"w{i}": torch.randn(3000 + i, generator=g) for i in range(7)}
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path))
    reader = FastFileSystemReader(path)
    reader.threads = threads
    out = _load(path, {k: torch.zeros_like(v) for k, v in state.items()}, reader)
    assert reader.stats.direct == len(state)
    for k, v in state.items():
        assert _bits(out[k]) == _bits(v), k


def test_one_large_tensor_is_read_in_parts_by_the_threads(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Unverified (no blocks), a tensor larger than two parts is cut into parts of about
    ``_PART`` bytes that tile its data, so the threads share it; the load is bit-exact."""
    import ckpt_engine._dcpio.fast_read as fr

    monkeypatch.setattr(fr, "_PART", 64 << 10, raising=False)
    monkeypatch.setattr(fr, "_PARALLEL_MIN_BYTES", 1)
    state = {"big": torch.randn(300_000, generator=torch.Generator().manual_seed(2)), "small": torch.randn(9)}
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path))
    calls: list[tuple[int, int]] = []
    real = fr._readinto

    def readinto(fd: int, buf: memoryview, offset: int) -> bool:
        calls.append((offset, offset + len(buf)))
        return real(fd, buf, offset)

    monkeypatch.setattr(fr, "_readinto", readinto)
    reader = FastFileSystemReader(path)
    reader.threads = 2
    out = _load(path, {k: torch.zeros_like(v) for k, v in state.items()}, reader)
    assert all(_bits(out[k]) == _bits(v) for k, v in state.items())
    calls.sort()
    assert len(calls) >= 8 and all(a[1] == b[0] for a, b in itertools.pairwise(calls)), calls
    assert calls[-1][1] - calls[0][0] == 300_000 * 4 and all(hi - lo >= 32 << 10 for lo, hi in calls)


def test_a_stalled_read_thread_leaves_the_other_reads_to_the_rest(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread done with its part of the file takes the reads left of another's, so one that
    stalls on its first read (a page slow to come, a vCPU the host deschedules) holds up no other
    read. When each thread had a fixed part, the stalled thread's other reads waited for it, and
    here that waits forever: the stalled read goes on only once every other read is done
    (pytest-timeout then fails the test)."""
    import threading

    import ckpt_engine._dcpio.fast_read as fr

    monkeypatch.setattr(fr, "_PARALLEL_MIN_BYTES", 1)
    g = torch.Generator().manual_seed(11)
    state = {f"w{i}": torch.randn(3000 + i, generator=g) for i in range(8)}
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path))
    progress = threading.Condition()
    started: list[int] = []
    finished: list[int] = []  # the thread of each read done, in order
    real = fr._readinto

    def readinto(fd: int, buf: memoryview, offset: int) -> bool:
        with progress:
            stalls = not started
            started.append(offset)
            if stalls:
                progress.wait_for(lambda: len(finished) == len(state) - 1)
        ok = real(fd, buf, offset)
        with progress:
            finished.append(threading.get_ident())
            progress.notify_all()
        return ok

    monkeypatch.setattr(fr, "_readinto", readinto)
    reader = FastFileSystemReader(path)
    reader.threads = 2
    out = _load(path, {k: torch.zeros_like(v) for k, v in state.items()}, reader)
    assert reader.stats.direct == len(state)
    for k, v in state.items():
        assert _bits(out[k]) == _bits(v), k
    assert len(set(finished[:-1])) == 1 and finished[-1] != finished[0]  # the other thread read the rest


def test_io_error_on_the_direct_path_falls_back_to_the_mapped_reader(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk I/O error cannot be produced here, so os.preadv fails instead: every item then goes
    through the base reader (whose errors are typed and name the file), and the load is exact."""
    import errno

    state = {"a": torch.randn(64, 64), "b": torch.arange(1000, dtype=torch.int64)}
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FileSystemWriter(path))

    def failing_preadv(*args: Any, **kwargs: Any) -> int:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "preadv", failing_preadv)
    reader = FastFileSystemReader(path)
    loaded = _load(path, {"a": torch.zeros(64, 64), "b": torch.zeros(1000, dtype=torch.int64)}, reader)
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    assert reader.stats.direct == 0 and reader.stats.fallback == 2


# -- small items: one read per run of adjacent items, a checked memory copy ----------------------


def _many_small(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {f"p{i}": torch.randn(1 + i % 7, generator=g) for i in range(n)}


def test_many_small_items_are_read_in_runs_and_stay_bit_exact(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "ckpt")
    state = {**_many_small(300), "big": torch.randn(5000)}  # a large item among the small ones
    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=1))
    preads: list[int] = []
    real_pread = os.pread

    def counting(fd: int, n: int, offset: int) -> bytes:
        preads.append(n)
        return real_pread(fd, n, offset)

    monkeypatch.setattr(os, "pread", counting)
    reader = FastFileSystemReader(path)
    out = _load(path, {k: torch.zeros_like(v) for k, v in state.items()}, reader)
    assert reader.stats.direct == len(state) and reader.stats.fallback == 0
    assert all(_bits(out[k]) == _bits(v) for k, v in state.items())
    # the 300 small items came in a handful of runs, not one read each
    assert len(preads) < 20, preads


def test_a_truncated_run_of_small_items_is_not_read_silently(tmp_path: Any) -> None:
    path = str(tmp_path / "ckpt")
    state = _many_small(200)
    dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=1))
    (data,) = [f for f in os.listdir(path) if f.endswith(".distcp")]
    file = os.path.join(path, data)
    with open(file, "r+b") as f:
        f.truncate(os.path.getsize(file) // 2)
    reader = FastFileSystemReader(path)
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(BaseException):  # noqa: B017 - DCP's own error for the cut items
        _load(path, template, reader)
    # what was read directly came from before the cut, bit-exact; nothing past it
    assert 0 < reader.stats.direct < len(state)


def test_copy_small_refuses_a_size_mismatch() -> None:
    from ckpt_engine._dcpio.fast_read import _copy_small

    target = torch.zeros(4)
    _copy_small(target, torch.arange(4.0).numpy().tobytes())
    assert target.tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError):
        _copy_small(target, b"\0" * 12)
    with pytest.raises(ValueError):
        _copy_small(torch.zeros(4, 2).t(), b"\0" * 32)


# -- planner set-up without DCP's walk for flat tensor state dicts --------------------------------


def _flat_cases(mesh: Any) -> list[dict[str, Any]]:
    from torch.distributed.tensor import DTensor, Replicate

    return [
        {"a": torch.randn(3), "b.c": torch.zeros(2, 2, dtype=torch.bfloat16), "s": torch.tensor(1.0)},
        {"d": DTensor.from_local(torch.randn(4), mesh, [Replicate()]), "e": torch.randn(2)},
        # a flattened optimizer state dict: tensors and hyper-parameters (a tuple is a leaf)
        {"state.w.exp_avg": torch.randn(2), "param_groups.w.lr": 0.1, "param_groups.w.betas": (0.9, 0.99)},
        {"t": (torch.randn(2), 1), "n": None, "s": "text"},
        {},
    ]


def _not_flat_cases() -> list[dict[Any, Any]]:
    return [
        {"a": torch.randn(3), "n": {"x": torch.randn(2)}},
        {"a": [torch.randn(2)]},
        {"a": [1, 2]},
        {"p": torch.nn.Parameter(torch.randn(2))},  # a tensor subclass: DCP's walk decides
        {1: torch.randn(2)},
        {"m": torch.empty(3, device="meta")},
    ]


def test_already_flat_recognises_only_what_dcp_leaves_as_it_is(one_rank_mesh: Any) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ckpt_engine._dcpio.planner import already_flat

    for sd in _flat_cases(one_rank_mesh):
        assert already_flat(sd)
        flat, mappings = flatten_state_dict(sd)  # DCP's own: the identity on these
        assert list(flat.items()) == list(sd.items()) and mappings == {k: (k,) for k in sd}
    assert not any(already_flat(sd) for sd in _not_flat_cases())


def test_planner_set_up_matches_dcp_for_flat_and_nested_state_dicts(one_rank_mesh: Any) -> None:
    from torch.distributed.checkpoint import DefaultSavePlanner

    from ckpt_engine import EngineConfig
    from ckpt_engine._dcpio.planner import EngineLoadPlanner, EngineSavePlanner
    from ckpt_engine.pipeline import Pipeline
    from ckpt_engine.plugin_manager import build_plugin_manager

    pipeline = Pipeline(build_plugin_manager(EngineConfig(save_dir="unused")))
    for sd in [*_flat_cases(one_rank_mesh), *_not_flat_cases()[:4]]:
        ours, theirs = EngineSavePlanner(), DefaultSavePlanner(dedup_save_to_lowest_rank=True)
        ours.set_up_planner(sd, None, True)
        theirs.set_up_planner(sd, None, True)
        assert list(ours.state_dict.items()) == list(theirs.state_dict.items())
        assert ours.mappings == theirs.mappings and ours.is_coordinator is theirs.is_coordinator
        load = EngineLoadPlanner(component="model", checkpoint_dir="x", pipeline=pipeline, strict=True)
        dcp_load = DefaultLoadPlanner(flatten_state_dict=True, flatten_sharded_tensors=True)
        load.set_up_planner(sd, None, False)
        dcp_load.set_up_planner(sd, None, False)
        assert load.original_state_dict is sd and dcp_load.original_state_dict is sd
        assert list(load.state_dict.items()) == list(dcp_load.state_dict.items())
        assert load.mappings == dcp_load.mappings and load.metadata is None and load.is_coordinator is False


def test_plain_write_items_are_dcps_local_plan_item_for_item(one_rank_mesh: Any) -> None:
    """The save planner builds the local plan of plain tensors and values itself (one properties
    object per description): equal, item for item, to DCP's ``create_default_local_save_plan``;
    anything else is left to DCP."""
    from torch.distributed.checkpoint.default_planner import create_default_local_save_plan
    from torch.distributed.tensor import DTensor, Replicate

    from ckpt_engine._dcpio.local_plan import plain_write_items
    from ckpt_engine._dcpio.planner import EngineSavePlanner

    state = {**_varied_state(), "grad": torch.randn(3, requires_grad=True).detach().requires_grad_()}
    state = {k: v for k, v in state.items() if not isinstance(v, dict)}
    state.update({"lr": 0.1, "betas": (0.9, 0.99), "none": None, "zero-dim": torch.tensor(2), "s": "x"})
    items = plain_write_items(state)
    assert items is not None and items == create_default_local_save_plan(state, True).items
    f32 = [i.tensor_data.properties for i in items if i.tensor_data and i.index.fqn in ("f32", "big", "view")]
    assert len(f32) == 3 and len({id(p) for p in f32}) == 1  # one description, one object
    planner = EngineSavePlanner()
    planner.set_up_planner(state, None, True)
    reference = EngineSavePlanner()
    reference.set_up_planner(state, None, True)
    plan = planner.create_local_plan()
    assert plan == super(EngineSavePlanner, reference).create_local_plan() and planner.plan is plan
    for other in (
        {"d": DTensor.from_local(torch.randn(4), one_rank_mesh, [Replicate()])},
        {"p": torch.nn.Parameter(torch.randn(2))},
        {"sparse": torch.randn(3, 3).to_sparse()},
    ):
        assert plain_write_items(other) is None
