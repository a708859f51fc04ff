"""Pins every non-public torch behaviour that ``ckpt_engine._dcpio.torch_private`` relies on.

A torch upgrade that changes one of them fails here, by name, instead of mis-loading checkpoints.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import warnings
import zipfile
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata

from ckpt_engine._dcpio.archive_write import ARCHIVE_DTYPES, tensor_archive, tensor_data_pkl, value_archive
from ckpt_engine._dcpio.torch_private import (
    is_storage_info,
    loads_by_copy,
    local_chunks,
    pickle_metadata,
    storage_info,
    tensor_version,
)
from ckpt_engine._dcpio.torch_save_archive import SavedTensorLayout, parse_torch_save_tensor

warnings.filterwarnings("ignore", message="Detected an existing checkpoint")

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.uint16,  # no legacy storage class: saved through _rebuild_tensor_v3
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _archive(obj: Any, **kwargs: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(obj, buf, **kwargs)
    buf.seek(0)
    return buf


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.randint(0, 100, shape, generator=torch.Generator().manual_seed(0)).to(dtype)


# -- the torch.save archive of one tensor ---------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7,), (5, 4), (2, 3, 4), (1, 1, 9)], ids=str)
def test_layout_points_at_the_tensor_bytes(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _sample(dtype, shape)
    buf = _archive(t)
    layout = parse_torch_save_tensor(buf)
    assert layout == SavedTensorLayout(
        dtype=dtype, size=shape, data_offset=layout.data_offset if layout else -1, nbytes=t.numel() * t.element_size()
    )
    raw = buf.getvalue()
    assert raw[layout.data_offset : layout.data_offset + layout.nbytes] == _bits(t)
    # The data offset is where the stdlib zipfile finds the record's bytes, too.
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/data/0")]
        assert zf.getinfo(name).compress_type == zipfile.ZIP_STORED
        assert zf.read(name) == _bits(t)


def test_archive_record_names_the_parser_expects() -> None:
    """``<prefix>/data.pkl``, ``<prefix>/byteorder`` and ``<prefix>/data/<key>``, uncompressed."""
    with zipfile.ZipFile(_archive(torch.ones(3))) as zf:
        names = zf.namelist()
        prefix = names[0].split("/")[0]
        assert f"{prefix}/data.pkl" in names
        assert f"{prefix}/data/0" in names
        assert zf.read(f"{prefix}/byteorder").decode() == "little"
        assert all(i.compress_type == zipfile.ZIP_STORED for i in zf.infolist())


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda: torch.ones(4, 3).t(), id="non-contiguous"),
        pytest.param(lambda: torch.arange(10.0)[2:5], id="storage-offset-view"),
        pytest.param(lambda: torch.arange(10.0)[::2], id="strided-view"),
        pytest.param(lambda: {"a": torch.ones(2)}, id="dict"),
        pytest.param(lambda: [torch.ones(2), torch.ones(2)], id="list"),
        pytest.param(lambda: 3, id="int"),
        pytest.param(lambda: torch.nn.Parameter(torch.ones(2)), id="parameter"),
    ],
)
def test_anything_but_one_plain_tensor_is_refused(make: Any) -> None:
    assert parse_torch_save_tensor(_archive(make())) is None


def test_legacy_non_zip_format_is_refused() -> None:
    buf = _archive(torch.ones(3), _use_new_zipfile_serialization=False)
    assert parse_torch_save_tensor(buf) is None


def _rewrite(buf: io.BytesIO, edit: Any, compress: int = zipfile.ZIP_STORED) -> io.BytesIO:
    out = io.BytesIO()
    with zipfile.ZipFile(buf) as src, zipfile.ZipFile(out, "w", compression=compress) as dst:
        for info in src.infolist():
            data = edit(info.filename, src.read(info.filename))
            if data is not None:
                dst.writestr(info.filename, data)
    out.seek(0)
    return out


def test_compressed_records_are_refused() -> None:
    assert parse_torch_save_tensor(_rewrite(_archive(torch.ones(64)), lambda n, d: d, zipfile.ZIP_DEFLATED)) is None
    # The same rewrite without compression still parses: the refusal is about compression.
    assert parse_torch_save_tensor(_rewrite(_archive(torch.ones(64)), lambda n, d: d)) is not None


def test_foreign_byte_order_is_refused() -> None:
    edited = _rewrite(_archive(torch.ones(4)), lambda n, d: b"big" if n.endswith("/byteorder") else d)
    assert parse_torch_save_tensor(edited) is None
    missing = _rewrite(_archive(torch.ones(4)), lambda n, d: None if n.endswith("/byteorder") else d)
    assert parse_torch_save_tensor(missing) is None


def test_record_size_mismatch_is_refused() -> None:
    short = _rewrite(_archive(torch.ones(4)), lambda n, d: d[:-4] if n.endswith("/data/0") else d)
    assert parse_torch_save_tensor(short) is None


def test_unknown_globals_are_refused_without_running_them() -> None:
    class Evil:
        def __reduce__(self) -> Any:
            return (os.system, ("echo pwned > /dev/null",))

    raw = pickle.dumps(Evil(), protocol=2)
    edited = _rewrite(_archive(torch.ones(4)), lambda n, d: raw if n.endswith("/data.pkl") else d)
    assert parse_torch_save_tensor(edited) is None


def test_truncated_and_garbage_archives_are_refused() -> None:
    raw = _archive(torch.ones(100)).getvalue()
    for cut in (0, 10, len(raw) // 2, len(raw) - 1):
        assert parse_torch_save_tensor(io.BytesIO(raw[:cut])) is None
    assert parse_torch_save_tensor(io.BytesIO(b"PK" + b"\0" * 200)) is None


def test_dcp_items_are_torch_save_archives_at_their_storage_offsets(tmp_path: Any) -> None:
    """DCP's FileSystemWriter writes each tensor item as one torch.save archive (TORCH_SAVE)."""
    state = {f"t{i}": _sample(dtype, (3, i + 1)) for i, dtype in enumerate(DTYPES)}
    state["text"] = "not a tensor"  # type: ignore[assignment]
    path = str(tmp_path / "ckpt")
    md = dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=2))
    assert md.storage_data
    seen = 0
    for index, info in md.storage_data.items():
        if index.fqn == "text":
            continue
        with open(os.path.join(path, info.relative_path), "rb") as f:
            f.seek(info.offset)
            item = io.BytesIO(f.read(info.length))
        assert info.transform_descriptors is None  # no stream transforms by default
        layout = parse_torch_save_tensor(item)
        assert layout is not None, index.fqn
        want = state[index.fqn]
        assert layout.dtype == want.dtype and layout.size == tuple(want.shape)
        assert item.getvalue()[layout.data_offset : layout.data_offset + layout.nbytes] == _bits(want)
        seen += 1
    assert seen == len(DTYPES)


def test_dcp_reader_loads_items_with_torch_load(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback the fast path relies on: DCP's reader torch.loads each tensor item."""
    path = str(tmp_path / "ckpt")
    dcp.save({"w": torch.ones(3)}, storage_writer=FileSystemWriter(path))
    calls: list[Any] = []
    real = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs.get("weights_only"))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    out = {"w": torch.zeros(3)}
    dcp.load(out, storage_reader=FileSystemReader(path))
    assert calls == [True] and torch.equal(out["w"], torch.ones(3))


# -- DTensor.__create_chunk_list__ -----------------------------------------------------------


def test_local_chunks_of_a_plain_tensor() -> None:
    assert local_chunks(torch.zeros(3, 4)) == [
        ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=torch.Size([3, 4]))
    ]
    assert local_chunks(torch.tensor(1.0)) == [ChunkStorageMetadata(offsets=torch.Size([]), sizes=torch.Size([]))]


def test_local_chunks_of_a_dtensor_match_dcp(tmp_path: Any, one_rank_mesh: Any) -> None:
    """``__create_chunk_list__`` gives the chunks DCP itself records for the DTensor."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    state = {
        "shard0": distribute_tensor(torch.randn(6, 4), one_rank_mesh, [Shard(0)]),
        "shard1": distribute_tensor(torch.randn(6, 4), one_rank_mesh, [Shard(1)]),
        "repl": distribute_tensor(torch.randn(5), one_rank_mesh, [Replicate()]),
    }
    md = dcp.save(state, storage_writer=FileSystemWriter(str(tmp_path / "ckpt")))
    for key, value in state.items():
        stored = md.state_dict_metadata[key]
        assert isinstance(stored, TensorStorageMetadata)
        assert local_chunks(value) == stored.chunks, key
        assert value.__create_chunk_list__() == stored.chunks  # the protocol method itself


# -- writing archives without torch.save -------------------------------------------------------


def _dense_sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if dtype in (torch.uint32, torch.uint64):
        return torch.ones(shape, dtype=dtype)  # no randint / casts for these
    return _sample(dtype, shape)


@pytest.mark.parametrize("dtype", sorted(ARCHIVE_DTYPES, key=str), ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 0), (5,), (2, 3, 4)], ids=str)
def test_data_pkl_is_byte_identical_to_torch_save(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _dense_sample(dtype, shape)
    with zipfile.ZipFile(_archive(t)) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith("/data.pkl")]
        assert tensor_data_pkl(dtype, shape) == zf.read(name)


@pytest.mark.parametrize("dtype", sorted(ARCHIVE_DTYPES, key=str), ids=str)
def test_tensor_archive_loads_with_torch_load(dtype: torch.dtype) -> None:
    t = _dense_sample(dtype, (4, 5))
    parts = tensor_archive(dtype, (4, 5))
    assert parts is not None and parts.nbytes == t.numel() * t.element_size()
    raw = parts.head + _bits(t) + parts.tail
    assert len(raw) == parts.length and len(parts.head) % 64 == 0  # data 64-byte aligned
    back = torch.load(io.BytesIO(raw), weights_only=True)
    assert back.dtype == dtype and back.shape == t.shape and _bits(back) == _bits(t)
    layout = parse_torch_save_tensor(io.BytesIO(raw))
    assert layout is not None and layout.data_offset == len(parts.head)
    # the stdlib agrees on every record but the data's CRC (0: not recorded, as torch writes
    # it with set_crc32_options(False))
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        assert zf.testzip() in (None, "archive/data/0")
        assert {n.split("/", 1)[1] for n in zf.namelist()} == {
            "data.pkl", ".format_version", ".storage_alignment", "byteorder", "data/0", "version",
            ".data/serialization_id",
        }  # fmt: skip
    assert tensor_archive(torch.qint8, (3,)) is None


_VALUES = [
    1e-3, (0.9, 0.999), 7, -(2**70), None, True, "adamw", b"\x00raw", 1 + 2j,
    {"lr": 0.1, "nested": [1, 2.5, ("x", None)]}, collections.OrderedDict(a=1), [], {},
]  # fmt: skip


@pytest.mark.parametrize("value", _VALUES, ids=repr)
def test_value_archive_is_torch_saves_archive_byte_for_byte(value: Any) -> None:
    raw = value_archive(value)
    assert raw is not None
    buf = io.BytesIO()
    torch.save(value, buf)
    assert raw == buf.getvalue()  # torch.save's bytes depend on the pickle alone: a cache is exact
    assert value_archive(value) == raw
    assert torch.load(io.BytesIO(raw), weights_only=False) == value


def test_value_archive_leaves_storages_and_large_values_to_torch_save() -> None:
    assert value_archive(torch.ones(2)) is None
    assert value_archive({"t": [torch.zeros(1)]}) is None
    assert value_archive(torch.ones(3).untyped_storage()) is None
    assert value_archive({"table": list(range(5000))}) is None  # a pickle over the cached size


def test_value_archive_follows_the_crc32_setting() -> None:
    with_crc = value_archive(0.375)
    torch.serialization.set_crc32_options(False)
    try:
        without = value_archive(0.375)
        buf = io.BytesIO()
        torch.save(0.375, buf)
    finally:
        torch.serialization.set_crc32_options(True)
    assert without == buf.getvalue() != with_crc


def test_the_save_planner_torch_saves_each_distinct_plain_value_once(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save planner takes cached archives for plain values and torch.save's for a value
    holding a tensor, and plain ``dcp.load`` (``torch.load`` per item) reads both back."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    from ckpt_engine._dcpio.planner import EngineSavePlanner

    calls: list[Any] = []
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f, *a, **k: (calls.append(obj), real_save(obj, f, *a, **k))[1])
    planner = EngineSavePlanner()
    item = WriteItem(index=MetadataIndex("x"), type=WriteItemType.BYTE_IO)
    first = planner.transform_object(item, 0.123456789)
    assert planner.transform_object(item, 0.123456789).getvalue() == first.getvalue()
    assert calls == [0.123456789]  # torch.save once, then the cache
    holding = planner.transform_object(item, {"t": torch.ones(2)})
    assert len(calls) == 2  # a value holding a tensor: torch.save every time
    assert torch.equal(torch.load(io.BytesIO(holding.getvalue()), weights_only=True)["t"], torch.ones(2))

    state = {"lr": 0.25, "betas": (0.9, 0.95), "name": "adamw", "w": torch.ones(2)}
    dcp.save(state, checkpoint_id=str(tmp_path / "c"), planner=EngineSavePlanner())
    back: dict[str, Any] = {"lr": 0.0, "betas": (0.0, 0.0), "name": "", "w": torch.zeros(2)}
    dcp.load(back, storage_reader=FileSystemReader(str(tmp_path / "c")))
    assert back["lr"] == 0.25 and back["betas"] == (0.9, 0.95) and back["name"] == "adamw"
    assert torch.equal(back["w"], torch.ones(2))


def test_torch_save_without_crc_is_still_parsed() -> None:
    """Archives torch writes with CRCs off carry 0 CRCs; the parser accepts them."""
    torch.serialization.set_crc32_options(False)
    try:
        buf = _archive(torch.arange(6.0))
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        assert all(i.CRC == 0 for i in zf.infolist())
    assert parse_torch_save_tensor(buf) is not None


def test_zip64_records_load_and_parse(monkeypatch: pytest.MonkeyPatch) -> None:
    """Items over 4 GiB get zip64 fields; exercised with a lowered limit."""
    import ckpt_engine._dcpio.archive_write as tp

    monkeypatch.setattr(tp, "_ZIP64_LIMIT", 100)
    t = torch.arange(1000.0)
    parts = tensor_archive(t.dtype, (1000,))
    assert parts is not None
    raw = parts.head + _bits(t) + parts.tail
    assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), t)
    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
        assert zf.getinfo("archive/data/0").file_size == 4000
    # the struct parser leaves zip64 entries to zipfile; both give the same layout
    assert parse_torch_save_tensor(io.BytesIO(raw)) == parse_torch_save_tensor(io.BytesIO(raw), use_zipfile=True)
    assert parse_torch_save_tensor(io.BytesIO(raw)) is not None


def test_both_directory_parsers_agree_on_torch_archives() -> None:
    for t in (torch.ones(3), torch.zeros(2, 2, dtype=torch.bfloat16), torch.tensor(1), torch.empty(0)):
        buf = _archive(t)
        assert parse_torch_save_tensor(buf) == parse_torch_save_tensor(buf, use_zipfile=True) is not None


def test_storage_info_is_dcp_storage_record() -> None:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    info = storage_info("__0_0.distcp", 10, 20)
    assert info == _StorageInfo("__0_0.distcp", 10, 20)
    assert info.transform_descriptors is None  # "no transforms", as DCP's writer records it
    assert storage_info("__0_0.distcp", 10, 20, ["zstd"]) == _StorageInfo("__0_0.distcp", 10, 20, ["zstd"])
    assert is_storage_info(info) and not is_storage_info((info.relative_path, info.offset, info.length))


def test_pickle_metadata_gives_pickles_bytes() -> None:
    """The fast ``.metadata`` pickle reduces DCP's storage records as their ``__getstate__``
    does: the same bytes as ``pickle.dumps`` for records with and without transforms."""
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    size = torch.Size([4, 2])
    chunk = ChunkStorageMetadata(offsets=torch.Size([0, 0]), sizes=size)
    md = Metadata(
        state_dict_metadata={"w": TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, [chunk])},
        planner_data={"w": ("w",)},
        storage_data={
            MetadataIndex("w", torch.Size([0, 0]), 0): storage_info("__0_0.distcp", 0, 32),
            MetadataIndex("v", torch.Size([0]), 0): storage_info("__1_0.distcp", 64, 8, ["zstd"]),
            MetadataIndex("x", None, None): storage_info("__0_0.distcp", 32, 5),
        },
    )
    assert pickle_metadata(md) == pickle.dumps(md, protocol=pickle.DEFAULT_PROTOCOL)
    assert pickle.loads(pickle_metadata(md)).storage_data == md.storage_data


def test_tensor_version_is_shared_by_views_and_bumped_by_in_place_ops_under_no_grad() -> None:
    """``overlap`` saves rely on this: the state dict holds ``param.detach()`` (or a view), and a
    weight edit under ``no_grad`` on the parameter must show in that tensor's counter."""
    param = torch.nn.Parameter(torch.zeros(4, 4))
    alias = param.detach()
    view = alias[1]
    before = tensor_version(alias)
    assert tensor_version(view) == before
    with torch.no_grad():
        param.add_(1.0)
    assert tensor_version(alias) == tensor_version(view) > before
    copy = torch.empty(4, 4)
    copy.copy_(alias)  # reading never bumps it
    assert tensor_version(alias) == tensor_version(param)
    optim = torch.optim.AdamW([param])
    param.grad = torch.ones_like(param)
    stepped = tensor_version(alias)
    optim.step()
    assert tensor_version(alias) > stepped
    exp_avg = optim.state[param]["exp_avg"]
    seen = tensor_version(exp_avg)
    optim.step()
    assert tensor_version(exp_avg) > seen


def test_default_store_is_the_store_of_the_default_process_group() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from ckpt_engine._dcpio.torch_private import default_store

    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        found = default_store()
        assert isinstance(found, dist.Store)
        underlying = found.underlying_store if isinstance(found, dist.PrefixStore) else found
        assert underlying is store or isinstance(found, dist.PrefixStore)
        # Everything the bounded barriers use (ckpt_engine/_dcpio/watch.py).
        found.set("ckpt-engine-pin", "1")
        assert found.get("ckpt-engine-pin") == b"1" and found.check(["ckpt-engine-pin"])
        assert found.add("ckpt-engine-n", 1) == 1
        assert found.compare_set("ckpt-engine-cas", "", "ok") == b"ok"
        assert found.compare_set("ckpt-engine-cas", "", "late") == b"ok"
        with pytest.raises(dist.DistStoreError):
            found.wait(["ckpt-engine-never"], timedelta(seconds=0.1))
        found.delete_key("ckpt-engine-pin")
        assert not found.check(["ckpt-engine-pin"])
    finally:
        dist.destroy_process_group()


def test_load_hooks_and_overrides_are_what_loads_by_copy_sees() -> None:
    """The public hook registrations fill the private dicts ``loads_by_copy`` reads, and a plain
    module's ``load_state_dict`` of its own tensors copies them onto themselves (values kept,
    versions bumped): what the engine skips and replaces with ``increment_version``."""
    from torch import nn

    module = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    assert loads_by_copy(module)
    sd = module.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    versions = [p._version for p in module.parameters()]
    module.load_state_dict(sd)
    assert all(torch.equal(sd[k], before[k]) for k in sd)
    assert all(p._version > v for p, v in zip(module.parameters(), versions, strict=True))
    pre = module[0].register_load_state_dict_pre_hook(lambda *a: None)
    assert not loads_by_copy(module)
    pre.remove()
    post = module[1].register_load_state_dict_post_hook(lambda *a: None)
    assert not loads_by_copy(module)
    post.remove()
    assert loads_by_copy(module)
    assert not loads_by_copy(nn.Sequential(nn.BatchNorm1d(2)))  # its own _load_from_state_dict


class _Nested(torch.nn.Module):
    """A module tree with what plain models hold: children, buffers (one not persistent), a
    shared parameter under two names, extra state, a parameter list."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
        self.head = torch.nn.Linear(4, 2)
        self.tied = self.head  # one module under two names: its tensors under both
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scratch", torch.ones(2), persistent=False)
        self.extra = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(5)) for _ in range(3)])

    def get_extra_state(self) -> Any:
        return {"seen": 3}

    def set_extra_state(self, state: Any) -> None:
        pass


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return list(a) == list(b) and all(
        type(a[k]) is type(b[k])
        and (not isinstance(a[k], torch.Tensor) or (a[k].data_ptr() == b[k].data_ptr() and a[k].shape == b[k].shape))
        for k in a
    )


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.nn.Linear(3, 2),
        lambda: torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)),
        _Nested,
    ],
)
def test_dcp_returns_a_plain_modules_own_state_dict(make: Any) -> None:
    """Where ``dcp_state_dict_is_own`` says so, ``get_model_state_dict`` is the module's own
    ``state_dict()``: the engine then skips DCP's walk (``_engine/state.py``)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from ckpt_engine._dcpio.torch_private import dcp_state_dict_is_own

    module = make()
    own = module.state_dict()
    assert dcp_state_dict_is_own(module, own)
    assert _same(own, get_model_state_dict(module))


def test_dcp_state_dict_is_own_refuses_what_dcp_renames_or_refuses(one_rank_mesh: Any) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.distributed.checkpoint.state_dict import _patch_model_state_dict, get_model_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from ckpt_engine._dcpio.torch_private import dcp_state_dict_is_own

    def refused(module: torch.nn.Module) -> dict[str, Any]:
        own = module.state_dict()
        assert not dcp_state_dict_is_own(module, own), type(module).__name__
        return own

    # Wrappers whose keys DCP renames: its result differs from the module's own.
    ddp = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(3, 2)))
    assert not _same(refused(ddp), get_model_state_dict(ddp))
    refused(torch.nn.Sequential(checkpoint_wrapper(torch.nn.Linear(3, 2))))  # DCP strips its prefix
    compiled = torch.nn.Sequential(torch.compile(torch.nn.Linear(3, 2)))  # compiled lazily: nothing runs
    assert not _same(refused(compiled), get_model_state_dict(compiled))

    class Renames(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = torch.nn.Linear(3, 2)

        def _fqn_modifiers(self) -> dict[str, str]:
            return {"inner": "inner"}

    refused(torch.nn.Sequential(Renames()))
    # FSDP2 renames nothing: its DTensors are DCP's result too (the engine still asks DCP for
    # any state with tensor subclasses: _engine/state.py's signature refuses them first).
    sharded = torch.nn.Sequential(torch.nn.Linear(4, 4))
    fully_shard(sharded, mesh=one_rank_mesh)
    own = sharded.state_dict()
    assert dcp_state_dict_is_own(sharded, own) and _same(own, get_model_state_dict(sharded))
    # A state_dict DCP patched on the instance, an empty one, a key DCP refuses.
    patched = torch.nn.Linear(3, 2)
    _patch_model_state_dict(patched)
    assert not dcp_state_dict_is_own(patched, torch.nn.Linear(3, 2).state_dict())
    assert not dcp_state_dict_is_own(torch.nn.ReLU(), {})
    flat = torch.nn.Module()
    flat.register_parameter("my_flat_param", torch.nn.Parameter(torch.zeros(1)))
    refused(flat)
    with pytest.raises(RuntimeError, match="_flat_param"):
        get_model_state_dict(flat)


def test_engine_takes_a_plain_modules_state_dict_without_dcps_walk(monkeypatch: pytest.MonkeyPatch) -> None:
    from ckpt_engine._engine import state

    calls: list[Any] = []
    monkeypatch.setattr(state, "get_model_state_dict", lambda m: calls.append(m) or {})
    module = _Nested()
    sd = state.model_state_dict([module])
    assert calls == [] and _same(sd, module.state_dict())
    ddp_like = torch.nn.Sequential(torch.compile(torch.nn.Linear(3, 2)))
    state.model_state_dict([ddp_like])
    assert calls == [ddp_like]  # a wrapper: DCP's function decides
