"""Verified reads (``verify: read``, the default): every byte a load reads is checked against the
digest its block got at save, so a flipped byte is a ``CorruptCheckpointError`` naming the file,
the byte range and the keys there, never wrong weights loaded in silence.

Real checkpoints on disk (and on the S3 protocol server of tests/_s3.py), damaged the way a disk
or a copy damages them: one byte flipped, the size unchanged.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ckpt_engine import CheckpointEngine, CorruptCheckpointError
from ckpt_engine._dcpio.fast_read import FastFileSystemReader
from ckpt_engine._format.manifest import lookup_manifest
from ckpt_engine._format.metadata_read import metadata_from_bytes
from ckpt_engine._format.names import MANIFEST_FILE
from ckpt_engine._format.verify import component_blocks
from ckpt_engine._storage.store import store_for
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal

HIDDEN = 512  # a 8 x 512 fp32 weight: 16 KiB, an item with blocks of its own


def _save(config: dict[str, Any], steps: int = 1, seed: int = 0) -> TinyTrainingState:
    state = TinyTrainingState.create(seed=seed, hidden=HIDDEN)
    with CheckpointEngine(config) as engine:
        for it in range(1, steps + 1):
            state.train(1, seed=it)
            engine.save(it, **state.objects()).result()
    return state


def _load(config: dict[str, Any], **extra: Any) -> tuple[Any, TinyTrainingState]:
    state = TinyTrainingState.create(seed=99, hidden=HIDDEN)
    with CheckpointEngine({**config, **extra}) as engine:
        result = engine.load(**state.objects())
    return result, state


def _largest(folder: Path) -> Path:
    return max(folder.glob("*.distcp"), key=lambda p: p.stat().st_size)


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x10
    path.write_bytes(bytes(raw))


def _refused(config: dict[str, Any], damaged: Path, at: int) -> str:
    """Load with the default ``verify``; it must refuse naming the file and a range holding ``at``."""
    with pytest.raises(CorruptCheckpointError) as err:
        _load(config)
    message = str(err.value)
    assert str(damaged) in message, message
    lo, hi = map(int, re.search(r"bytes (\d+)-(\d+)", message).groups())  # type: ignore[union-attr]
    assert lo <= at < hi, message
    assert "holding '" in message, message  # the keys stored there
    return message


@pytest.mark.parametrize("component", ["model", "optim"])
def test_a_flipped_byte_in_a_data_file_is_refused_by_the_default_load(tmp_path: Path, component: str) -> None:
    config = {"save_dir": str(tmp_path)}
    _save(config)
    data = _largest(tmp_path / "iter_000000001" / component)
    at = data.stat().st_size // 2  # inside a weight (or its moments): only a digest tells
    _flip(data, at)
    _refused(config, data, at)


def test_an_item_read_in_part_checks_its_blocks(tmp_path: Path) -> None:
    """A byte in a block no read item needs is not read and stops nothing; one in a block read is refused."""
    config = {"save_dir": str(tmp_path)}
    saved = _save(config)
    data = _largest(tmp_path / "iter_000000001" / "model")
    # A flip outside every block the load reads cannot exist for a full load; so damage the
    # scheduler component, which a load that leaves it out never reads.
    sched = _largest(tmp_path / "iter_000000001" / "scheduler")
    _flip(sched, sched.stat().st_size // 2)
    result, state = _load(config, keys_not_to_resume=("scheduler",))
    assert result.iteration == 1
    assert_state_dicts_equal(state.model.state_dict(), saved.model.state_dict())
    _flip(data, 100)  # the first weight's archive header: read (and checked) before its data
    _refused({**config, "keys_not_to_resume": ("scheduler",)}, data, 100)


class FrozenBase(nn.Module):
    """A frozen 4 MiB base (a file of its own in an incremental save) and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(1024, 1024)
        self.head = nn.Linear(1024, 4)
        self.base.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.base(x))
        return out


def test_a_flipped_byte_in_a_carried_file_is_refused(tmp_path: Path) -> None:
    config = {"save_dir": str(tmp_path), "incremental": True}
    torch.manual_seed(0)
    model = FrozenBase()
    opt = torch.optim.AdamW(model.head.parameters(), lr=0.1)
    with CheckpointEngine(config) as engine:
        for it in (1, 2):
            model(torch.randn(2, 1024)).sum().backward()
            opt.step()
            engine.save(it, model=model, optimizer=opt).result()
    doc = json.loads((tmp_path / "iter_000000002" / MANIFEST_FILE).read_text())
    carried = [rel for rel, e in doc["files"].items() if e.get("carried") == "link"]
    assert carried and all(doc["files"][rel].get("blocks") for rel in carried)  # its blocks, recorded again
    data = tmp_path / "iter_000000002" / carried[0]
    at = data.stat().st_size // 2
    _flip(data, at)
    fresh = FrozenBase()
    with pytest.raises(CorruptCheckpointError, match=re.escape(str(data))), CheckpointEngine(config) as engine:
        engine.load(model=fresh, optimizer=torch.optim.AdamW(fresh.head.parameters(), lr=0.1))


@pytest.mark.full  # the plugin's writer process starts in seconds
def test_the_pinned_staging_writer_records_blocks_too(tmp_path: Path) -> None:
    """The async plugin's writer process writes the data files: their blocks are recorded alike."""
    config = {"save_dir": str(tmp_path), "plugins": ["pinned_staging"]}
    _save(config)
    doc = json.loads((tmp_path / "iter_000000001" / MANIFEST_FILE).read_text())
    assert all(e.get("blocks") for rel, e in doc["files"].items() if rel.endswith(".distcp"))
    data = _largest(tmp_path / "iter_000000001" / "model")
    at = data.stat().st_size // 2
    _flip(data, at)
    _refused({"save_dir": str(tmp_path)}, data, at)


def test_a_flipped_byte_in_a_local_tier_copy_is_refused(tmp_path: Path) -> None:
    config = {"save_dir": str(tmp_path / "durable"), "local_dir": str(tmp_path / "local"), "persist_every": 5}
    _save(config, steps=2)
    data = _largest(tmp_path / "local/rank_00000/iter_000000002/model")
    doc = json.loads((tmp_path / "local/rank_00000/iter_000000002" / MANIFEST_FILE).read_text())
    assert all(e.get("blocks") for rel, e in doc["files"].items() if rel.endswith(".distcp"))
    at = data.stat().st_size // 2
    _flip(data, at)
    _refused(config, data, at)


def test_a_flipped_byte_in_an_object_store_range_is_refused(s3_bucket: Any, tmp_path: Path) -> None:
    config = {"save_dir": s3_bucket.url, "storage": {**s3_bucket.storage}}
    _save(config)
    fs = s3_bucket.fs()
    key = max(
        (k for k in s3_bucket.objects() if "/model/" in k and k.endswith(".distcp")),
        key=lambda k: int(fs.info(f"{s3_bucket.name}/run/{k}")["size"]),
    )
    raw = bytearray(fs.cat_file(f"{s3_bucket.name}/run/{key}"))
    at = len(raw) // 2
    raw[at] ^= 0x10
    fs.pipe_file(f"{s3_bucket.name}/run/{key}", bytes(raw))
    with pytest.raises(CorruptCheckpointError) as err:
        _load(config)
    message = str(err.value)
    assert key.rsplit("/", 1)[-1] in message and "bytes " in message, message


def test_an_object_store_checkpoint_with_whole_file_digests_only_is_checked(s3_bucket: Any) -> None:
    """The object-store reader checked a whole-file digest only where one request covered the
    whole object: an optimizer's load (its moments ranged or whole, its values apart, most of its
    hyper-parameters skipped) never did, and a flipped byte in a moment loaded in silence. Such an
    object is fetched once and checked before anything is read from it, as on a local disk."""
    config = {"save_dir": s3_bucket.url, "storage": {**s3_bucket.storage}}
    _save(config)
    fs = s3_bucket.fs()
    manifest_key = f"{s3_bucket.name}/run/iter_000000001/{MANIFEST_FILE}"
    doc = json.loads(fs.cat_file(manifest_key))
    for entry in doc["files"].values():
        entry.pop("blocks", None)
    fs.pipe_file(manifest_key, json.dumps(doc).encode())
    folder = f"{s3_bucket.name}/run/iter_000000001/optim"
    stored = metadata_from_bytes(fs.cat_file(f"{folder}/.metadata"), f"{folder}/.metadata").storage_data
    moment = next(i for k, i in stored.items() if k.fqn.endswith(".exp_avg"))
    raw = bytearray(fs.cat_file(f"{folder}/{moment.relative_path}"))
    raw[moment.offset + moment.length // 2] ^= 0x10
    fs.pipe_file(f"{folder}/{moment.relative_path}", bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=rf"optim/{moment.relative_path} is damaged: bytes 0-{len(raw)} "):
        _load(config)


def test_an_object_store_range_is_checked_from_the_bytes_that_reached_the_tensor(s3_bucket: Any) -> None:
    """A ranged read of the first rows of a 12 MiB weight: the block's bytes between the data's
    start and 4 KiB into the item came from two requests (the head, for the layout, and the rows),
    and the check hashed the head's copy. A byte the rows' response alone got wrong (a flaky link
    or cache) reached the tensor; the check now hashes what the tensor received."""
    from ckpt_engine._dcpio.object_read import ObjectStoreReader
    from ckpt_engine._storage.store import open_store
    from ckpt_engine.config import StorageOptions

    config = {"save_dir": s3_bucket.url, "storage": {**s3_bucket.storage}}
    saved = nn.Linear(1024, 3072, bias=False)
    with torch.no_grad():
        saved.weight.copy_(torch.randn(3072, 1024, generator=torch.Generator().manual_seed(0)))
    with CheckpointEngine(config) as engine:
        engine.save(1, model=saved).result()
    store = open_store(s3_bucket.url, StorageOptions(**s3_bucket.storage))
    checkpoint = store.join(s3_bucket.url, "iter_000000001")
    folder = store.join(checkpoint, "model")
    manifest = lookup_manifest(checkpoint, store).manifest
    assert manifest is not None
    real, damaged = type(store).read_ranges, []

    def read_ranges(self: Any, requests: list[tuple[str, int, int]]) -> list[bytes]:
        out = list(real(self, requests))
        for k, (_, start, end) in enumerate(requests):
            if not damaged and 0 < start < 4096 and end - start > 4096:  # the rows, from inside the head
                data = bytearray(out[k])
                data[100] ^= 0x10
                out[k] = bytes(data)
                damaged.append(start)
        return out

    reader = ObjectStoreReader(folder, store)
    reader.blocks = component_blocks(manifest, "model", folder, store.join)
    out = {"weight": torch.zeros(1000, 1024)}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(store), "read_ranges", read_ranges)
        with pytest.raises(CheckpointException) as err:
            dcp.load(out, storage_reader=reader, planner=_Rows(0))
    assert damaged, "no request of the rows was seen"
    ((failure, _),) = err.value.failures.values()
    assert isinstance(failure, CorruptCheckpointError) and "bytes 0-4194304 (holding 'weight')" in str(failure)


def _strip_blocks(checkpoint: Path) -> None:
    """Make the manifest one of before per-block digests (whole-file digests only)."""
    path = checkpoint / MANIFEST_FILE
    doc = json.loads(path.read_text())
    for entry in doc["files"].values():
        entry.pop("blocks", None)
    path.write_text(json.dumps(doc, indent=1) + "\n")


def test_a_manifest_without_blocks_loads_says_so_once_and_checks_whole_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = {"save_dir": str(tmp_path)}
    saved = _save(config)
    ckpt = tmp_path / "iter_000000001"
    _strip_blocks(ckpt)
    with caplog.at_level(logging.INFO, logger="ckpt_engine"):
        result, state = _load(config)
    assert result.iteration == 1
    assert_state_dicts_equal(state.model.state_dict(), saved.model.state_dict())
    said = [r for r in caplog.records if "before per-block digests" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]
    data = _largest(ckpt / "model")
    at = data.stat().st_size // 2
    _flip(data, at)  # the load reads the whole file: its whole-file digest tells
    message = _refused(config, data, at)
    assert f"bytes 0-{data.stat().st_size}" in message
    _flip(data, at)
    # The optimizer's file: the load reads its moments by the direct path, its values apart, and
    # skips most of its hyper-parameters (one parameter's per group). No path saw all of the
    # file, so a flipped byte in a moment loaded in silence; the file is now read once and checked.
    optim = _largest(ckpt / "optim")
    stored = FileSystemReader(str(ckpt / "optim")).read_metadata().storage_data
    moment = next(i for k, i in stored.items() if k.fqn.endswith(".exp_avg") and i.relative_path == optim.name)
    at = moment.offset + moment.length // 2  # in the moment's data
    _flip(optim, at)
    message = _refused(config, optim, at)
    assert f"bytes 0-{optim.stat().st_size}" in message


# -- damage anywhere: a typed error or the same values, nothing else ------------------------------


def _sweep(tmp_path: Path, component: str, verify: str, positions: int) -> list[str]:
    """Flip one bit (the lowest, then the highest) of each of ``positions`` bytes spread over the
    component's data file, one at a time, and load; returns the outcomes (an exception of
    another type than ``CorruptCheckpointError`` fails the test)."""
    config = {"save_dir": str(tmp_path / f"{component}-{verify}"), "verify": verify}
    saved = _save(config)
    data = _largest(tmp_path / f"{component}-{verify}" / "iter_000000001" / component)
    original = data.read_bytes()
    outcomes = []
    for at in sorted({round(i * (len(original) - 1) / (positions - 1)) for i in range(positions)}):
        for bit in (0x01, 0x80):
            raw = bytearray(original)
            raw[at] ^= bit
            data.write_bytes(bytes(raw))
            try:
                _, state = _load(config)
            except CorruptCheckpointError:
                outcomes.append("refused")
                continue
            if verify != "sizes":  # a load that reads a flipped byte must not succeed
                pytest.fail(f"byte {at} of {data} flipped, but the load succeeded")
            pairs = zip(state.model.state_dict().values(), saved.model.state_dict().values(), strict=True)
            outcomes.append("same" if all(torch.equal(a, b) for a, b in pairs) else "loaded")
    data.write_bytes(original)
    return outcomes


def test_every_flipped_byte_is_refused_by_the_default_load(tmp_path: Path) -> None:
    outcomes = _sweep(tmp_path, "scheduler", "read", 12) + _sweep(tmp_path, "optim", "read", 12)
    assert set(outcomes) == {"refused"}


def test_a_damaged_archive_is_a_typed_error_even_unverified(tmp_path: Path) -> None:
    """``verify: sizes`` cannot see a flipped byte in a tensor, but a damaged archive (a storage
    size, a pickle) must still be a ``CorruptCheckpointError`` naming the file, never a bare
    ``TypeError`` or ``IndexError`` (byte 0 of an optimizer file: its first value's pickle)."""
    outcomes = _sweep(tmp_path, "optim", "sizes", 16)
    assert "refused" in outcomes


# -- a file of many small items: read, checked and handed on window by window ---------------------


class _ManySmall(nn.Module):
    """2,000 parameters of 1,024 fp32: each item's archive (about 5 KiB) is read whole."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.p = nn.ParameterList([nn.Parameter(torch.randn(1024, generator=gen)) for _ in range(2000)])


def _read_data_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, int]]:
    """Every ``read_data`` of the direct reader as ``(reader, peak bytes of Python objects
    allocated while it ran)``."""
    import tracemalloc

    from ckpt_engine._dcpio import fast_read, torch_save_archive

    seen: list[tuple[Any, int]] = []
    original = fast_read.FastFileSystemReader.read_data

    def read_data(self: Any, plan: Any, planner: Any) -> Any:
        tracemalloc.start()
        try:
            return original(self, plan, planner)
        finally:
            seen.append((self, tracemalloc.get_traced_memory()[1]))
            tracemalloc.stop()

    monkeypatch.setattr(fast_read.FastFileSystemReader, "read_data", read_data)
    monkeypatch.setattr(torch_save_archive, "_WINDOW", 64 << 10)
    return seen


def test_many_small_items_are_held_one_window_at_a_time_and_read_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load of a file of small items holds one window of their archives, not the whole file
    (which was a third of a 50,000-tensor load's peak), reads each byte once, checks every block
    and loads bit-exact."""
    saved = _ManySmall(seed=0)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=saved).result()
    data = _largest(tmp_path / "iter_000000001" / "model")
    seen = _read_data_spy(monkeypatch)
    live = _ManySmall(seed=1)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=live)
    assert_state_dicts_equal(live.state_dict(), saved.state_dict())
    reader, peak = next((r, p) for r, p in seen if r.stats.direct == 2000)
    assert reader.stats.bytes_read == data.stat().st_size  # every byte once, across the windows
    assert reader.stats.fallback == 0
    assert peak < data.stat().st_size // 4, (peak, data.stat().st_size)  # 2x the file when held whole


def test_a_flipped_byte_in_a_later_window_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=_ManySmall(seed=0)).result()
    data = _largest(tmp_path / "iter_000000001" / "model")
    _read_data_spy(monkeypatch)
    for at in (data.stat().st_size * 3 // 4, data.stat().st_size - 100):
        original = data.read_bytes()
        _flip(data, at)
        with pytest.raises(CorruptCheckpointError) as err, CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
            engine.load(model=_ManySmall(seed=1))
        data.write_bytes(original)
        message = str(err.value)
        assert str(data) in message, message
        lo, hi = map(int, re.search(r"bytes (\d+)-(\d+)", message).groups())  # type: ignore[union-attr]
        assert lo <= at < hi and hi - lo <= 2 << 20, message  # one block, not the file


def test_a_tensor_larger_than_a_part_is_read_in_parts_cut_where_blocks_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One large tensor is cut into parts that the read threads share (it was read by one
    thread: a 1 GiB moment at half the speed). The parts tile the tensor's data, every cut is
    where a block starts (each block is hashed whole by one thread), the load is bit-exact, and
    a flipped byte in a part after the first is refused, naming its block."""
    import ckpt_engine._dcpio.fast_read as fr

    monkeypatch.setattr(fr, "_PART", 1 << 20, raising=False)
    monkeypatch.setattr(fr, "_PARALLEL_MIN_BYTES", 1)
    monkeypatch.setenv("CKPT_ENGINE_READ_THREADS", "2")
    gen = torch.Generator().manual_seed(3)
    saved = nn.Linear(2560, 2048, bias=False)  # 20 MiB of fp32: five blocks
    with torch.no_grad():
        saved.weight.copy_(torch.randn(2048, 2560, generator=gen))
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=saved).result()
    parts: list[tuple[int, int]] = []
    real = fr._read_checked

    def read_checked(fd: int, r: Any, blocks: Any, keys: Any) -> bool:
        parts.append((r.offset, r.offset + r.nbytes))
        return real(fd, r, blocks, keys)

    monkeypatch.setattr(fr, "_read_checked", read_checked)
    live = nn.Linear(2560, 2048, bias=False)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=live)
    assert torch.equal(live.weight, saved.weight)
    parts.sort()
    assert len(parts) >= 4, parts
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts)), parts  # they tile the data
    assert parts[-1][1] - parts[0][0] == 2048 * 2560 * 4
    manifest = json.loads((tmp_path / "iter_000000001" / MANIFEST_FILE).read_text())
    data = _largest(tmp_path / "iter_000000001" / "model")
    lengths = [int(b.split(":")[0]) for b in manifest["files"][f"model/{data.name}"]["blocks"].split(",")]
    block_starts = {sum(lengths[:k]) for k in range(len(lengths))}
    assert all(lo in block_starts for lo, _ in parts[1:]), (parts, sorted(block_starts))
    original = data.read_bytes()
    at = parts[2][0] + 12_345
    _flip(data, at)
    with pytest.raises(CorruptCheckpointError) as err, CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=nn.Linear(2560, 2048, bias=False))
    data.write_bytes(original)
    lo, hi = map(int, re.search(r"bytes (\d+)-(\d+)", str(err.value)).groups())  # type: ignore[union-attr]
    assert lo <= at < hi and lo in block_starts, str(err.value)


def test_a_large_tensor_is_checked_piece_by_piece_as_it_is_read(tmp_path: Path) -> None:
    """A tensor of 5 MiB (two blocks, each hashed in pieces as it is read): a flipped byte in its
    archive's header, inside a piece, at a piece's edge, in the second block or in its archive's
    tail is refused, naming a range in one block; undamaged, it loads bit-exact."""
    gen = torch.Generator().manual_seed(0)
    saved = nn.Linear(1280, 1024, bias=False)  # 5 MiB of fp32
    with torch.no_grad():
        saved.weight.copy_(torch.randn(1024, 1280, generator=gen))
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=saved).result()
    data = _largest(tmp_path / "iter_000000001" / "model")
    size = data.stat().st_size
    original = data.read_bytes()
    for at in (10, 300_000, (256 << 10) * 3, (4 << 20) + 12_345, size - 2_000, size - 10):
        _flip(data, at)
        live = nn.Linear(1280, 1024, bias=False)
        with pytest.raises(CorruptCheckpointError) as err, CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
            engine.load(model=live)
        data.write_bytes(original)
        message = str(err.value)
        lo, hi = map(int, re.search(r"bytes (\d+)-(\d+)", message).groups())  # type: ignore[union-attr]
        assert lo <= at < hi and hi - lo <= (4 << 20) + 8192, (at, message)
        assert "holding 'weight'" in message, message
    live = nn.Linear(1280, 1024, bias=False)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=live)
    assert torch.equal(live.weight, saved.weight)


class _Rows(DefaultLoadPlanner):
    """Reads rows ``first:`` of each stored tensor into a target of that many rows: the share of
    one rank in a load resharded by rows."""

    def __init__(self, first: int) -> None:
        super().__init__()
        self.first = first

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, target in self.state_dict.items():
            md = self.metadata.state_dict_metadata[fqn]
            assert isinstance(md, TensorStorageMetadata)
            box = ChunkStorageMetadata(offsets=torch.Size((self.first, 0)), sizes=target.size())
            items += create_read_items_for_chunk_list(fqn, md, [box])
        return LoadPlan(items)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        return self.state_dict[index.fqn]  # the whole target: its rows start at the box's


def _read_rows(checkpoint: Path, first: int, rows: int, width: int) -> torch.Tensor:
    """Rows ``first:first + rows`` of the stored ``weight``, by the engine's reader with the
    manifest's blocks (as a load at ``verify: read`` sets them)."""
    folder = str(checkpoint / "model")
    manifest = lookup_manifest(str(checkpoint), store_for(str(checkpoint))).manifest
    assert manifest is not None
    reader = FastFileSystemReader(folder)
    reader.blocks = component_blocks(manifest, "model", folder, os.path.join)
    out = {"weight": torch.zeros(rows, width)}
    dcp.load(out, storage_reader=reader, planner=_Rows(first))
    assert reader.stats.direct == 1, reader.stats
    return out["weight"]


def test_a_read_of_some_rows_checks_the_archive_header_its_layout_came_from(tmp_path: Path) -> None:
    """A read of the last rows of a 12 MiB weight (three 4 MiB blocks) touches only the last
    block, but the archive header that says where the tensor's data starts is in the first. A
    damaged header (the data record's local-header extra length, +64) moved where the rows were
    read from, and the load returned wrong rows in silence; the header's block is now checked."""
    gen = torch.Generator().manual_seed(0)
    saved = nn.Linear(1024, 3072, bias=False)
    with torch.no_grad():
        saved.weight.copy_(torch.randn(3072, 1024, generator=gen))
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=saved).result()
    checkpoint = tmp_path / "iter_000000001"
    assert torch.equal(_read_rows(checkpoint, 2048, 1024, 1024), saved.weight[2048:])
    data = _largest(checkpoint / "model")
    raw = bytearray(data.read_bytes())
    header = raw.index(b"PK\x03\x04", raw.index(b"/data/0") - 64)  # the data record's local header
    assert raw[header + 30 : header + 30 + 64].find(b"/data/0") > 0
    extra = int.from_bytes(raw[header + 28 : header + 30], "little")
    raw[header + 28 : header + 30] = (extra + 64).to_bytes(2, "little")
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointException) as err:
        _read_rows(checkpoint, 2048, 1024, 1024)
    ((failure, _),) = err.value.failures.values()  # DCP's (exception, stack) per rank
    assert isinstance(failure, CorruptCheckpointError), failure
    assert re.search(rf"{re.escape(str(data))} is damaged: bytes 0-{4 << 20} \(holding 'weight'\)", str(failure))


def test_a_whole_file_digest_is_checked_in_bounded_reads(tmp_path: Path) -> None:
    """A block not in memory (with a whole-file digest, the block is the file) was read with one
    ``pread``: all of a file of several GiB in one buffer, and over 2 GiB Linux returns less than
    asked, which read as a damaged file. It is read in pieces of at most 8 MiB; a flipped byte is
    still refused, naming the whole file."""
    from ckpt_engine._format.hashing import hash_file
    from ckpt_engine._format.verify import FileBlocks, check_read

    size = 40 << 20
    path = tmp_path / "__0_0.distcp"
    with open(path, "wb") as f:  # sparse: zeros, and one byte at the end
        f.truncate(size - 1)
        f.seek(size - 1)
        f.write(b"\x01")
    checksum = hash_file(str(path), "xxh3_64").checksum
    assert checksum is not None
    blocks = FileBlocks(str(path), "xxh3_64", (0, size), (checksum,), whole_only=True)
    asked: list[int] = []
    fd = os.open(path, os.O_RDONLY)
    try:

        def pread(offset: int, n: int) -> bytes:
            asked.append(n)
            return os.pread(fd, n, offset)

        check_read(blocks, [(0, size)], [], pread, lambda lo, hi: ["w"])
        assert sum(asked) == size and max(asked) <= 8 << 20, asked
        _flip(path, size // 2)
        with pytest.raises(CorruptCheckpointError, match=rf"bytes 0-{size} \(holding 'w'\)"):
            check_read(blocks, [(0, size)], [], pread, lambda lo, hi: ["w"])
    finally:
        os.close(fd)
