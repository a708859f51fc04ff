"""Saves of many tensors: the plan cache, compact metadata and checksums computed while writing."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from ckpt_engine import CheckpointEngine
from ckpt_engine._dcpio.fast_save import plan_cache
from ckpt_engine._format.hashing import hash_files
from ckpt_engine._format.manifest import MANIFEST_FILE, list_files


class Bag(nn.Module):
    def __init__(self, n: int, fill: float = 1.0) -> None:
        super().__init__()
        for i in range(n):
            self.register_buffer(f"b{i}", torch.full((4,), fill + i))
        self.w = nn.Parameter(torch.arange(12.0).reshape(3, 4) * fill)


def _cache(engine: CheckpointEngine, component: str = "model") -> Any:
    return plan_cache(engine._plan_prefix + component)


def _manifest(path: str) -> dict[str, Any]:
    with open(os.path.join(path, MANIFEST_FILE)) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def test_unchanged_structure_plans_once_and_any_change_plans_again(tmp_path: Any) -> None:
    m = Bag(50)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        for it in (1, 2, 3):
            with torch.no_grad():
                m.b0.add_(1)  # values change, the structure does not
            engine.save(it, model=m)
        cache = _cache(engine)
        assert (cache.misses, cache.hits) == (1, 2)
        m.register_buffer("new", torch.zeros(2))  # a new key
        engine.save(4, model=m)
        assert (cache.misses, cache.hits) == (2, 2)
        m.b1 = torch.zeros(5)  # a new shape
        engine.save(5, model=m)
        m.b2 = torch.zeros(4, dtype=torch.float64)  # a new dtype
        engine.save(6, model=m)
        assert (cache.misses, cache.hits) == (4, 2)
        engine.save(7, model=m)
        assert (cache.misses, cache.hits) == (4, 3)
        # every checkpoint holds what the model held at its save, cached plan or not
        out = Bag(50, fill=0.0)
        out.register_buffer("new", torch.ones(2))
        out.b1, out.b2 = torch.ones(5), torch.ones(4, dtype=torch.float64)
        result = engine.load(model=out)
    assert result.iteration == 7
    for key, value in m.state_dict().items():
        assert torch.equal(out.state_dict()[key], value), key


def test_cached_saves_are_exact_and_plain_dcp_reads_them(tmp_path: Any) -> None:
    m = Bag(20)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=m)
        with torch.no_grad():
            m.b3.fill_(-7.0)
            m.w.mul_(3)
        engine.save(2, model=m)  # from the cache
        assert _cache(engine).hits == 1
    folder = str(tmp_path / "iter_000000002" / "model")
    template = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
    dcp.load(template, storage_reader=FileSystemReader(folder))
    for key, value in m.state_dict().items():
        assert torch.equal(template[key], value), key
    md = FileSystemReader(folder).read_metadata()
    # equal tensor descriptions are one object (pickle memo), per dtype/shape/requires_grad
    sdm = md.state_dict_metadata
    assert sdm["b0"] is sdm["b19"] and sdm["b0"] is not sdm["w"]


def test_a_new_key_map_from_a_plugin_plans_again(tmp_path: Any) -> None:
    from ckpt_engine import hookimpl

    class Prefix:
        name = "prefix"
        prefix = ""

        @hookimpl
        def remap_keys(self, ctx: Any, key_map: dict[str, str]) -> dict[str, str]:
            if ctx.direction != "save" or ctx.component != "model":
                return key_map
            return {k: self.prefix + v for k, v in key_map.items()}

    plugin = Prefix()
    m = Bag(5)
    with CheckpointEngine({"save_dir": str(tmp_path), "plugins": ["prefix"]}, plugins=[plugin]) as engine:
        engine.save(1, model=m)
        plugin.prefix = "net."
        engine.save(2, model=m)
        assert _cache(engine).misses == 2
    md = FileSystemReader(str(tmp_path / "iter_000000002" / "model")).read_metadata()
    assert "net.b0" in md.state_dict_metadata and "b0" not in md.state_dict_metadata


def test_checksums_computed_while_writing_equal_a_full_reread(tmp_path: Any) -> None:
    m = Bag(30)
    opt = torch.optim.AdamW(m.parameters())
    m.w.grad = torch.ones_like(m.w)
    opt.step()
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=m, optimizer=opt)
        engine.save(2, model=m, optimizer=opt)  # cached plans
    for it in (1, 2):
        path = str(tmp_path / f"iter_{it:09d}")
        doc = _manifest(path)
        files = list_files(path)
        assert sorted(doc["files"]) == sorted(files)
        assert not [f for f in os.listdir(os.path.join(path, "model")) if f.startswith(".ckpt_engine_part")]
        reread = hash_files(path, files, doc["checksum_algorithm"])
        for rel, entry in reread.items():
            got = doc["files"][rel]
            assert (got["size"], got["checksum"]) == (entry.size, entry.checksum), rel
            assert got["seen"].startswith("i")  # the version recorded at commit


def test_commit_uses_the_streamed_digests(tmp_path: Any, monkeypatch: Any) -> None:
    """The commit reads no data file back: hashing a file at commit is an error here."""
    import ckpt_engine._format.hashing as integrity

    hashed: list[str] = []
    real = integrity.hash_file

    def spy(path: str, *args: Any, **kwargs: Any) -> Any:
        hashed.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(integrity, "hash_file", spy)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=Bag(10))
    assert hashed == []


def test_a_part_that_disagrees_with_its_file_is_not_trusted(tmp_path: Any) -> None:
    from ckpt_engine._format.digests import read_parts, write_part
    from ckpt_engine._format.manifest import FileEntry

    comp = tmp_path / "model"
    comp.mkdir()
    (comp / "__0_0.distcp").write_bytes(b"x" * 10)
    write_part(str(comp), "__0_", "crc32", {"__0_0.distcp": (9, "deadbeef")})
    assert read_parts(str(tmp_path), "crc32") == {}
    write_part(str(comp), "__0_", "crc32", {"__0_0.distcp": (10, "deadbeef")})
    assert read_parts(str(tmp_path), "crc32") == {"model/__0_0.distcp": FileEntry(size=10, checksum="deadbeef")}
    assert read_parts(str(tmp_path), "xxh3_64") == {}  # another algorithm: hashed again


@pytest.mark.full  # over 2 s on 2 cores: many async saves
def test_async_saves_stream_their_checksums_too(tmp_path: Any, monkeypatch: Any) -> None:
    import ckpt_engine._format.hashing as integrity

    hashed: list[str] = []
    real = integrity.hash_file

    def spy(path: str, *args: Any, **kwargs: Any) -> Any:
        hashed.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(integrity, "hash_file", spy)
    m = Bag(40)
    with CheckpointEngine({"save_dir": str(tmp_path), "plugins": ["pinned_staging"]}) as engine:
        engine.save(1, model=m)
        with torch.no_grad():
            m.b5.fill_(3.0)
        engine.save(2, model=m)
        engine.wait()
    assert hashed == []  # the commit thread read no file back
    monkeypatch.setattr(integrity, "hash_file", real)
    for it in (1, 2):
        path = str(tmp_path / f"iter_{it:09d}")
        doc = _manifest(path)
        reread = hash_files(path, list_files(path), doc["checksum_algorithm"])
        recorded = {rel: {"size": e["size"], "checksum": e["checksum"]} for rel, e in doc["files"].items()}
        assert {rel: {"size": e.size, "checksum": e.checksum} for rel, e in reread.items()} == recorded
    out = Bag(40, fill=0.0)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=out)
    assert torch.equal(out.b5, m.b5) and torch.equal(out.w, m.w)


# -- a warm save writes the last .metadata again with its own storage_meta ---------------------


def _metadata_bytes(path: str) -> bytes:
    with open(os.path.join(path, "model", ".metadata"), "rb") as f:
        return f.read()


def test_a_warm_save_reuses_the_last_metadata_bytes_with_its_own_storage_meta(tmp_path: Any) -> None:
    import pickle

    from ckpt_engine._format.metadata_read import read_metadata

    m = Bag(30)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        paths = []
        for it in (1, 2, 3):
            with torch.no_grad():
                m.b0.add_(1)
            paths.append(engine.save(it, model=m).path)
        cache = _cache(engine)
        assert (cache.misses, cache.hits, cache.metadata_reused) == (1, 2, 2)
    for it, path in zip((1, 2, 3), paths, strict=True):
        data = _metadata_bytes(path)
        md = pickle.loads(data)
        # its own save: the folder it was written in and a save id of its own
        assert f".iter_{it:09d}.partial" in str(md.storage_meta.checkpoint_id)
        # byte for byte what pickling the metadata with that storage_meta gives
        assert pickle.dumps(md, protocol=pickle.DEFAULT_PROTOCOL) == data
        # the engine's own reader and plain DCP read it
        assert read_metadata(os.path.join(path, "model")).state_dict_metadata.keys() == md.state_dict_metadata.keys()
        template = {k: torch.zeros_like(v) for k, v in m.state_dict().items()}
        dcp.load(template, storage_reader=FileSystemReader(os.path.join(path, "model")))
        assert template["b0"][0].item() == 1.0 + it
    ids = {pickle.loads(_metadata_bytes(p)).storage_meta.save_id for p in paths}
    assert len(ids) == 3


def test_changed_results_or_a_longer_folder_name_pickle_the_metadata_again(tmp_path: Any) -> None:
    from pathlib import PurePosixPath

    from torch.distributed.checkpoint.metadata import StorageMeta

    from ckpt_engine._dcpio.fast_write import MetadataFile

    m = Bag(10)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=m)
        m.extra = nn.Parameter(torch.zeros(3))  # a new key: a new plan, pickled
        engine.save(2, model=m)
        cache = _cache(engine)
        assert cache.metadata_reused == 0
        engine.save(3, model=m)
        assert cache.metadata_reused == 1
    # patching needs equal-length strings found once after the key; anything else is refused
    old = StorageMeta(checkpoint_id=PurePosixPath("/r/.iter_1.partial/model"), save_id="a" * 36)
    data = pickle_with(old)
    longer = StorageMeta(checkpoint_id=PurePosixPath("/r/.iter_10.partial/model"), save_id="b" * 36)
    assert MetadataFile(data, old).patched(longer) is None
    other_shape = StorageMeta(checkpoint_id="/r/.iter_2.partial/model", save_id="b" * 36)
    assert MetadataFile(data, old).patched(other_shape) is None
    same_len = StorageMeta(checkpoint_id=PurePosixPath("/r/.iter_2.partial/model"), save_id="b" * 36)
    patched = MetadataFile(data, old).patched(same_len)
    assert patched is not None and patched == pickle_with(same_len)


def pickle_with(storage_meta: Any) -> bytes:
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    md = Metadata(state_dict_metadata={}, planner_data={"k": ("k",)}, storage_data={}, storage_meta=storage_meta)
    return pickle.dumps(md, protocol=pickle.DEFAULT_PROTOCOL)
