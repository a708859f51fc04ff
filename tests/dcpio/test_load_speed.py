"""The per-tensor shortcuts of the load path give what the general path gives.

* ``torch_save_archive.LayoutCache``: an archive's layout is reused only when every byte its parse
  depended on is equal, so a changed archive (another checkpoint, a rewritten or crafted file)
  is parsed in full.
* ``planner._whole_tensor_read``: the read item of a plain tensor stored whole is DCP's own.
* ``planner.target_spec`` / ``stored_spec``: one spec object per shape and dtype, bounded.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt_engine import CheckpointEngine
from ckpt_engine._dcpio import planner
from ckpt_engine._dcpio.fast_read import FastFileSystemReader
from ckpt_engine._dcpio.planner import _whole_tensor_read, stored_spec, target_spec
from ckpt_engine._dcpio.torch_save_archive import ArchiveItem, LayoutCache, parse_torch_save_tensor_at


def _archive(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def _item(data: bytes) -> ArchiveItem:
    return ArchiveItem(data, data, len(data), lambda off, n: data[off : off + n])


def _replace(data: bytes, old: bytes, new: bytes) -> bytes:
    assert data.count(old) == 1 and len(old) == len(new)
    return data.replace(old, new)


def test_same_shape_archives_parse_once_and_agree_with_the_full_parse() -> None:
    cache = LayoutCache()
    # torch.save gives each archive its own serialisation id and data CRC: both are ignored
    archives = [_archive(torch.full((16,), float(i))) for i in range(5)]
    assert len({a for a in archives}) == 5 and len({len(a) for a in archives}) == 1
    layouts = [cache.layout(_item(a)) for a in archives]
    assert (cache.parsed, cache.reused) == (1, 4)
    assert layouts == [parse_torch_save_tensor_at(_item(a).pread, len(a)) for a in archives]
    assert layouts[0] is not None and layouts[0].size == (16,)


def test_an_archive_that_differs_where_the_parse_looked_is_parsed_in_full() -> None:
    cache = LayoutCache()
    good = _archive(torch.zeros(16))
    assert cache.layout(_item(good)) is not None
    # same length, a foreign byte order: must not reuse the template (the parse refuses it)
    flipped = _replace(good, b"little", b"bittle")
    assert cache.layout(_item(flipped)) is None
    # same length, another dtype of the same size in data.pkl: another layout
    as_int = _replace(good, b"FloatStorage", b"IntStorage\x00\x00")
    assert cache.layout(_item(as_int)) == parse_torch_save_tensor_at(_item(as_int).pread, len(as_int))
    assert cache.parsed == 3 and cache.reused == 0
    # the templates stay: the good archive and a crafted one still get their own answers
    assert cache.layout(_item(good)) is not None and cache.layout(_item(flipped)) is None
    assert cache.reused == 2


def test_a_checkpoint_rewritten_between_loads_reads_the_new_bytes(tmp_path: str) -> None:
    """One reader's cache across two reads of a file that changed between them."""

    class M(nn.Module):
        def __init__(self, fill: float, shape: tuple[int, ...]) -> None:
            super().__init__()
            for i in range(20):
                self.register_buffer(f"b{i}", torch.full(shape, fill + i))

    engine = CheckpointEngine({"save_dir": str(tmp_path), "keep_last": 5})
    engine.save(1, model=M(1.0, (16,)))
    folder = os.path.join(str(tmp_path), "iter_000000001", "model")
    reader = FastFileSystemReader(folder)
    dst = M(0.0, (16,))
    import torch.distributed.checkpoint as dcp

    dcp.load(dst.state_dict(), storage_reader=reader)
    assert torch.equal(dst.b3, torch.full((16,), 4.0))
    assert reader.layouts.reused > 0 and reader.stats.direct == 20
    # the same folder now holds another checkpoint with other values and another shape
    engine.save(2, model=M(100.0, (4, 4)))
    engine.close()
    for name in os.listdir(folder):
        os.remove(os.path.join(folder, name))
    new = os.path.join(str(tmp_path), "iter_000000002", "model")
    for name in os.listdir(new):
        os.link(os.path.join(new, name), os.path.join(folder, name))
    dst2 = M(0.0, (4, 4))
    reader2 = FastFileSystemReader(folder)
    reader2.layouts = reader.layouts  # the old templates, kept
    dcp.load(dst2.state_dict(), storage_reader=reader2)
    assert torch.equal(dst2.b3, torch.full((4, 4), 103.0)) and reader2.stats.direct == 20


def _md(size: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> TensorStorageMetadata:
    return TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size(size),
        [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in chunks],
    )


@pytest.mark.parametrize("shape", [(16,), (3, 4), (1,), (2, 1, 5), ()])
def test_whole_tensor_read_item_is_dcps(shape: tuple[int, ...]) -> None:
    md = _md(shape, [((0,) * len(shape), shape)])
    value = torch.zeros(shape)
    (dcp_item,) = create_default_local_load_plan({"k": value}, Metadata({"k": md}), strict=True).items
    ours = _whole_tensor_read("k", "k", value, md)
    assert ours == dcp_item
    renamed = _whole_tensor_read("k", "dest", value, md)
    assert renamed is not None and renamed.dest_index.fqn == "dest" and renamed.storage_index.fqn == "k"


@pytest.mark.parametrize(
    ("shape", "stored", "chunks"),
    [
        ((0,), (0,), [((0,), (0,))]),  # empty: DCP makes no read item
        ((8,), (8,), [((0,), (4,)), ((4,), (4,))]),  # several chunks: resharding
        ((8,), (4,), [((0,), (4,))]),  # another shape
    ],
)
def test_whole_tensor_read_leaves_the_rest_to_dcp(
    shape: tuple[int, ...], stored: tuple[int, ...], chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]
) -> None:
    assert _whole_tensor_read("k", "k", torch.zeros(shape), _md(stored, chunks)) is None
    assert _whole_tensor_read("k", "k", 3, _md(stored, chunks)) is None


@pytest.mark.parametrize("value", [0.1, (0.9, 0.99), None, "text", torch.zeros(2)])
def test_value_read_item_is_dcps(value: object, one_rank_mesh: object) -> None:
    """A stored value (a hyper-parameter) gets DCP's byte read item, whatever the destination
    holds now; a DTensor destination is left to DCP."""
    from torch.distributed.tensor import DTensor, Replicate

    md = BytesStorageMetadata()
    (dcp_item,) = create_default_local_load_plan({"k": value}, Metadata({"k": md}), strict=True).items
    assert _whole_tensor_read("k", "k", value, md) == dcp_item
    renamed = _whole_tensor_read("k", "dest", value, md)
    assert renamed is not None and renamed.dest_index.fqn == "dest" and renamed.storage_index.fqn == "k"
    assert _whole_tensor_read("k", "k", DTensor.from_local(torch.zeros(2), one_rank_mesh, [Replicate()]), md) is None


def test_tensor_specs_are_one_object_per_shape_and_dtype_and_bounded() -> None:
    """A load of 50,000 parameters of one shape holds one spec for them, not 100,000 (about 12 MB
    of its peak memory); a load of ever new shapes does not grow the cache past its bound."""
    stored = TensorStorageMetadata(
        properties=TensorProperties(dtype=torch.float32),
        size=torch.Size([16]),
        chunks=[ChunkStorageMetadata(offsets=torch.Size([0]), sizes=torch.Size([16]))],
    )
    specs = {id(target_spec(torch.zeros(16))) for _ in range(1000)} | {id(stored_spec(stored)) for _ in range(1000)}
    assert len(specs) == 1
    one = target_spec(torch.zeros(16))
    assert (one.shape, one.dtype, one.is_tensor) == ((16,), torch.float32, True)
    assert target_spec(torch.zeros(16, dtype=torch.bfloat16)) is not one  # another dtype, another spec
    assert target_spec(torch.zeros(4, 4)).shape == (4, 4)
    bound = planner._tensor_spec.cache_parameters()["maxsize"]
    assert bound is not None
    for n in range(1, bound + 100):
        target_spec(torch.empty(n))
    assert planner._tensor_spec.cache_info().currsize <= bound
