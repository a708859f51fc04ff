"""The node-local tier in one process: which saves go where, what a resume picks, the rank-local
format, and every refusal of a configuration that cannot work (the multi-rank behaviour, peer
replicas and the recovery planner, is tests/distributed/test_node_tiers.py's)."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ckpt_engine import (
    CheckpointEngine,
    CheckpointExistsError,
    CheckpointSaveError,
    ConfigError,
    CorruptCheckpointError,
    EngineConfig,
    hookimpl,
)
from ckpt_engine._format.manifest import lookup_manifest, parse_manifest
from ckpt_engine._format.metadata_read import is_rank_local, read_metadata, validate_metadata
from ckpt_engine._format.names import RANK_LOCAL_MARK
from ckpt_engine._tier.lineage import COMMITTED_FILE
from ckpt_engine._tier.topology import Topology
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal
from ckpt_engine.types import WriteContext, WriteResult


def _config(tmp_path: Path, **extra: Any) -> dict[str, Any]:
    return {"save_dir": str(tmp_path / "durable"), "local_dir": str(tmp_path / "local"), **extra}


def _snapshot(state: TinyTrainingState) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "optim": copy.deepcopy(state.optimizer.state_dict()),
    }


def _save_steps(config: dict[str, Any], steps: range, **save: Any) -> dict[int, dict[str, Any]]:
    """Train and save each step; returns each step's state and result."""
    state = TinyTrainingState.create(seed=1)
    out = {}
    with CheckpointEngine(config) as engine:
        for it in steps:
            state.train(1, seed=it)
            result = engine.save(it, **state.objects(), **save).result()
            out[it] = {"result": result, "state": _snapshot(state)}
    return out


def _resume(config: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    state = TinyTrainingState.create(seed=99)
    with CheckpointEngine(config) as engine:
        result = engine.load(**state.objects())
    return result, _snapshot(state)


# -- where saves go -------------------------------------------------------------------------------


def test_every_save_is_local_and_every_persist_every_th_also_durable(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=3)
    saved = _save_steps(config, range(1, 8))
    assert [saved[i]["result"].tier for i in range(1, 8)] == ["local", "local", "durable"] * 2 + ["local"]
    assert saved[4]["result"].path == str(tmp_path / "local/rank_00000/iter_000000004")
    assert saved[6]["result"].path == str(tmp_path / "durable/iter_000000006")
    assert sorted(os.listdir(tmp_path / "durable")) == [
        ".ckpt_engine_run.json",  # the run's id, recorded by its first save (the tier's lineage)
        "iter_000000003",
        "iter_000000006",
        "latest_checkpoint.txt",
    ]
    assert (tmp_path / "durable/latest_checkpoint.txt").read_text().strip() == "iter_000000006"
    # local_keep_last (2) in the rank's folder, a durable step included: every save is local too.
    folder = tmp_path / "local/rank_00000"
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith("iter_")) == [
        "iter_000000006",
        "iter_000000007",
    ]
    manifest = lookup_manifest(str(folder / "iter_000000007")).manifest
    assert manifest is not None and manifest.rank == 0 and manifest.world_size == 1 and manifest.iteration == 7


def test_durable_true_forces_a_save_into_save_dir(tmp_path: Path) -> None:
    saved = _save_steps(_config(tmp_path, persist_every=100), range(1, 3), durable=True)
    assert [saved[i]["result"].tier for i in (1, 2)] == ["durable", "durable"]
    assert (tmp_path / "durable/iter_000000002/ckpt_engine_manifest.json").is_file()


def test_without_a_local_tier_every_save_is_durable(tmp_path: Path) -> None:
    saved = _save_steps({"save_dir": str(tmp_path / "ckpt")}, range(1, 3))
    assert [saved[i]["result"].tier for i in (1, 2)] == ["durable", "durable"]


def test_a_resave_of_a_local_step_is_refused_as_in_save_dir(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=10)
    _save_steps(config, range(1, 2))
    state = TinyTrainingState.create(seed=1)
    with CheckpointEngine(config) as engine, pytest.raises(CheckpointExistsError, match="iter_000000001"):
        engine.save(1, **state.objects())


# -- what a resume takes ---------------------------------------------------------------------------


def test_a_resume_takes_the_newest_local_step_with_nothing_from_save_dir(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=3)
    saved = _save_steps(config, range(1, 6))
    result, got = _resume(config)
    assert result.iteration == 5
    assert result.checkpoint_path == str(tmp_path / "local/rank_00000/iter_000000005")
    assert set(result.bytes_by_source) == {"local"} and result.bytes_by_source["local"] == result.bytes_read > 0
    assert_state_dicts_equal(got, saved[5]["state"])


def test_a_load_dir_that_is_a_symlink_to_save_dir_still_resumes_the_tier(tmp_path: Path) -> None:
    """``load_dir`` spelled through a symbolic link is ``save_dir``: the resume consults the tier
    (steps 4 and 5 are local only), as it does for ``save_dir`` spelled plainly. Judged by absolute
    path alone, the link read ``save_dir``'s latest (step 3) and lost two steps of training."""
    config = _config(tmp_path, persist_every=3)
    saved = _save_steps(config, range(1, 6))
    (tmp_path / "link").symlink_to(tmp_path / "durable", target_is_directory=True)
    result, got = _resume({**config, "load_dir": str(tmp_path / "link")})
    assert (result.iteration, result.checkpoint_path) == (5, str(tmp_path / "local/rank_00000/iter_000000005"))
    assert_state_dicts_equal(got, saved[5]["state"])


def test_a_durable_step_as_new_as_the_local_one_is_read_locally(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=3)
    saved = _save_steps(config, range(1, 4))
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (3, {"local"})
    assert_state_dicts_equal(got, saved[3]["state"])


def test_a_lost_local_tier_falls_back_to_the_newest_durable_step(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=3)
    saved = _save_steps(config, range(1, 6))
    for path in sorted((tmp_path / "local").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (3, {"durable"})
    assert result.checkpoint_path == str(tmp_path / "durable/iter_000000003")
    assert_state_dicts_equal(got, saved[3]["state"])


def test_a_local_step_that_fails_its_sizes_is_not_resumed(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=3)
    saved = _save_steps(config, range(1, 6))
    data = next((tmp_path / "local/rank_00000/iter_000000005/model").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-10])  # truncated: a crash or a full disk
    result, got = _resume(config)
    assert result.iteration == 4  # the previous local step, still complete
    assert_state_dicts_equal(got, saved[4]["state"])


def test_a_damaged_local_step_is_found_by_its_checksums_and_not_resumed(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=3, verify="checksums")
    saved = _save_steps(config, range(1, 6))
    data = next((tmp_path / "local/rank_00000/iter_000000005/optim").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x55  # same size: only a checksum tells
    data.write_bytes(bytes(raw))
    result, got = _resume(config)
    assert result.iteration == 4
    assert_state_dicts_equal(got, saved[4]["state"])


def _flip_mid_file(data: Path) -> None:
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x55  # same size: only the blocks' digests tell, as the load reads them
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("component", ["model", "optim"])
def test_a_byte_flipped_in_a_local_step_found_while_reading_resumes_save_dir(tmp_path: Path, component: str) -> None:
    """Under the default ``verify: read`` a flip in a tier copy is found only while it is read, after
    earlier tensors were filled in place. The tier is passed over (with or without
    ``fallback_to_last_complete``: ``save_dir`` is the copy of record) and ``save_dir``'s latest is
    read over every component: the resume is step 3's, exactly. Before, the load raised with the
    model half-filled from step 5."""
    config = _config(tmp_path, persist_every=3)
    saved = _save_steps(config, range(1, 6))
    _flip_mid_file(next((tmp_path / f"local/rank_00000/iter_000000005/{component}").glob("*.distcp")))
    result, got = _resume(config)
    assert (result.iteration, result.checkpoint_path) == (3, str(tmp_path / "durable/iter_000000003"))
    assert set(result.bytes_by_source) == {"durable"}
    assert_state_dicts_equal(got, saved[3]["state"])


def test_a_step_damaged_in_the_tier_and_in_save_dir_is_a_typed_error(tmp_path: Path) -> None:
    """The tier's copy is passed over and save_dir's copy of the same step is damaged too: the
    second read's failure was a TypeError from DCP's exception (built with bare errors, where its
    ``str`` expects (error, traceback) pairs) instead of the CorruptCheckpointError naming the file."""
    config = _config(tmp_path, persist_every=3)
    _save_steps(config, range(1, 4))
    _flip_mid_file(next((tmp_path / "local/rank_00000/iter_000000003/model").glob("*.distcp")))
    durable = next((tmp_path / "durable/iter_000000003/model").glob("*.distcp"))
    _flip_mid_file(durable)
    with pytest.raises(CorruptCheckpointError, match=durable.name):
        _resume(config)


def test_a_damaged_local_step_with_nothing_in_save_dir_is_refused_not_a_fresh_start(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=10)
    _save_steps(config, range(1, 3))
    _flip_mid_file(next((tmp_path / "local/rank_00000/iter_000000002/model").glob("*.distcp")))
    with pytest.raises(CorruptCheckpointError, match=r"iter_000000002.*holds no checkpoint to resume instead"):
        _resume(config)


def test_a_hostile_committed_record_is_ignored_by_resume_and_save(tmp_path: Path) -> None:
    """The tier's record of committed steps is an aid, never a reason to fail: a 3,000-deep JSON
    nesting in it was a bare RecursionError from load(), save() and ``ckpt-engine ls``."""
    config = _config(tmp_path, persist_every=3)
    saved = _save_steps(config, range(1, 5))
    (tmp_path / "local/rank_00000" / COMMITTED_FILE).write_text("[" * 3000 + "]" * 3000)
    result, got = _resume(config)
    assert result.iteration == 4
    assert_state_dicts_equal(got, saved[4]["state"])
    state = TinyTrainingState.create(seed=1)
    with CheckpointEngine(config) as engine:
        assert engine.save(5, **state.objects()).result().succeeded


def test_incremental_local_saves_link_what_did_not_change(tmp_path: Path) -> None:
    state = TinyTrainingState.create(seed=1)
    state.model.register_buffer("table", torch.randn(256, 256))  # never changes, as a frozen part
    config = _config(tmp_path, persist_every=10, incremental=True)
    with CheckpointEngine(config) as engine:
        first = engine.save(1, **state.objects()).result()
        state.train(1, seed=2)
        second = engine.save(2, **state.objects()).result()
    assert first.bytes_reused == 0 and second.bytes_reused > 256 * 256 * 4
    assert second.bytes_written < first.bytes_written


# -- the rank-local format -------------------------------------------------------------------------


def test_a_rank_local_checkpoint_is_marked_and_plain_dcp_loads_it(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=10)
    saved = _save_steps(config, range(1, 2), durable=True)
    component = tmp_path / "local/rank_00000/iter_000000001/model"
    assert is_rank_local(read_metadata(str(component)))
    assert not is_rank_local(read_metadata(str(tmp_path / "durable/iter_000000001/model")))
    model = TinyTrainingState.create(seed=5).model
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(component))
    assert_state_dicts_equal(sd, saved[1]["state"]["model"])


def _metadata(chunks: list[tuple[int, int]], mark: bool) -> Metadata:
    size = torch.Size([4, 3])
    md = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        size,
        [ChunkStorageMetadata(torch.Size([o, 0]), torch.Size([n, 3])) for o, n in chunks],
    )
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    storage = {
        MetadataIndex("w", torch.Size([o, 0])): _StorageInfo("__0_0.distcp", 0, n * 3 * 4 + 1000) for o, n in chunks
    }
    return Metadata(
        {"w": md},
        storage_data=storage,
        storage_meta=StorageMeta(modules=[RANK_LOCAL_MARK] if mark else []),
    )


def test_only_a_rank_local_metadata_may_leave_part_of_a_tensor_out(tmp_path: Path) -> None:
    validate_metadata(_metadata([(0, 2)], mark=True), "rank-local")  # one rank's half: fine
    with pytest.raises(CorruptCheckpointError, match="do not cover it"):
        validate_metadata(_metadata([(0, 2)], mark=False), "job checkpoint")
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        validate_metadata(_metadata([(0, 2), (1, 2)], mark=True), "rank-local")


def test_a_peer_manifest_is_parsed_within_bounds(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=10)
    _save_steps(config, range(1, 2))
    raw = (tmp_path / "local/rank_00000/iter_000000001/ckpt_engine_manifest.json").read_bytes()
    assert parse_manifest(raw, "peer").rank == 0
    doc = json.loads(raw)
    hostile = [
        b"[" * 100_000,
        json.dumps({**doc, "iteration": int("9" * 200)}).encode(),
        json.dumps({**doc, "files": {"../escape": {"size": 1, "checksum": "ab"}}}).encode(),
        json.dumps({**doc, "rank": -1}).encode(),
        b"\xff\xfe not json",
    ]
    for bad in hostile:
        with pytest.raises(CorruptCheckpointError, match="peer"):
            parse_manifest(bad, "peer")


# -- configurations that cannot work ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"persist_every": 3}, "persist_every set without local_dir"),
        ({"peer_replicas": 1}, "peer_replicas set without local_dir"),
        ({"local_dir": "s3://bucket/local"}, "local_dir 's3://bucket/local' is a URL"),
        ({"local_dir": "/l", "save_dir": "s3://b/run", "storage": {"local_dir": "/m"}}, "set only one"),
        ({"local_dir": "/l", "persist_every": 0}, "persist_every"),
        ({"local_dir": "/l", "ranks_per_node": "2"}, "ranks_per_node"),
    ],
)
def test_local_tier_fields_are_checked(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**{"save_dir": "/tmp/x", **fields})


def test_the_topology_places_replicas_on_other_nodes() -> None:
    topo = Topology.of(EngineConfig(save_dir="/x", local_dir="/l", ranks_per_node=2, peer_replicas=2), world=6)
    assert topo.nodes == 3 and [topo.node(r) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert topo.holders(1) == [3, 5] and topo.sources(1) == [5, 3]
    assert all(topo.node(h) != topo.node(r) for r in range(6) for h in topo.holders(r))
    one_node = Topology.of(EngineConfig(save_dir="/x", local_dir="/l", ranks_per_node=4), world=4)
    assert one_node.replicas == 0 and one_node.holders(0) == []
    two_nodes = Topology.of(EngineConfig(save_dir="/x", local_dir="/l", ranks_per_node=2), world=4)
    assert two_nodes.replicas == 1 and two_nodes.holders(0) == [2]


def test_a_topology_that_does_not_fit_the_job_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="ranks_per_node=3 does not divide the job's 4 ranks"):
        Topology.of(EngineConfig(save_dir="/x", local_dir="/l", ranks_per_node=3), world=4)
    with pytest.raises(ConfigError, match=r"peer_replicas=2 needs 3 nodes .* lower peer_replicas to at most 1"):
        Topology.of(EngineConfig(save_dir="/x", local_dir="/l", ranks_per_node=2, peer_replicas=2), world=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE is 'two'"):
        Topology.of(EngineConfig(save_dir="/x", local_dir="/l"), world=4)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert Topology.of(EngineConfig(save_dir="/x", local_dir="/l"), world=4).ranks_per_node == 2


def test_a_local_tier_needs_checksums(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="local_dir needs save_checksums"):
        CheckpointEngine(_config(tmp_path, save_checksums=False))


class _OwnWriter:
    """A write provider that knows nothing of rank-local writes."""

    @hookimpl
    def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> WriteResult:
        raise AssertionError("never called")


def test_a_write_provider_that_cannot_write_rank_local_checkpoints_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not declare that it writes rank-local checkpoints"):
        CheckpointEngine(_config(tmp_path), plugins=[_OwnWriter()])


def test_pinned_staging_in_windows_cannot_write_the_local_tier(tmp_path: Path) -> None:
    plugin = {"name": "pinned_staging", "options": {"max_host_bytes": 1 << 20}}
    with pytest.raises(ConfigError, match=r"pinned_staging.*WritesRankLocal"):
        CheckpointEngine(_config(tmp_path, plugins=[plugin]))


class _Unpicklable:
    """An ``extra=`` component whose state cannot be written."""

    def state_dict(self) -> dict[str, Any]:
        return {"callback": lambda: None}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise AssertionError("never loaded")


def test_a_local_write_that_fails_fails_the_save_and_leaves_nothing(tmp_path: Path) -> None:
    config = _config(tmp_path, persist_every=10)
    _save_steps(config, range(1, 2))
    state = TinyTrainingState.create(seed=1)
    folder = tmp_path / "local/rank_00000"
    with CheckpointEngine(config) as engine:
        with pytest.raises(CheckpointSaveError, match="iteration 2"):
            engine.save(2, **state.objects(), extra={"hook": _Unpicklable()})
        assert not (folder / ".iter_000000002.partial").exists()
        assert (folder / "latest_checkpoint.txt").read_text().strip() == "iter_000000001"
        assert engine.save(3, **state.objects()).result().succeeded  # the next save is not blocked


@pytest.mark.cuda
@pytest.mark.parametrize("plugins", [[], ["pinned_staging"]], ids=["sync", "pinned_staging"])
def test_cuda_state_saves_to_the_local_tier_and_resumes_bit_exact(tmp_path: Path, plugins: list[str]) -> None:
    """On a GPU: CUDA parameters and AdamW state into the local tier (pinned host buffers and a
    side stream with pinned_staging), resumed into a fresh CUDA model bit for bit."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 64, device="cuda")).sum().backward()
    opt.step()
    config = _config(tmp_path, persist_every=10, plugins=plugins)
    with CheckpointEngine(config) as engine:
        assert engine.save(1, model=model, optimizer=opt).result().tier == "local"
    fresh = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8)).cuda()
    fresh_opt = torch.optim.AdamW(fresh.parameters())
    with CheckpointEngine(config) as engine:
        result = engine.load(model=fresh, optimizer=fresh_opt)
    assert (result.iteration, set(result.bytes_by_source)) == (1, {"local"})
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert b.is_cuda and torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg"], fresh_opt.state[b]["exp_avg"])


@pytest.mark.full  # over 2 s on 2 cores: the S3 server
def test_an_object_store_save_dir_with_a_local_tier(tmp_path: Path, s3_bucket: Any) -> None:
    """Local saves never reach the store; durable ones are committed there as always; a resume
    takes the local step, and after the local tier is lost the store's."""
    config = {
        "save_dir": s3_bucket.url,
        "storage": s3_bucket.storage,
        "local_dir": str(tmp_path / "local"),
        "persist_every": 2,
    }
    saved = _save_steps(config, range(1, 4))
    assert [saved[i]["result"].tier for i in (1, 2, 3)] == ["local", "durable", "local"]
    assert {k.split("/")[0] for k in s3_bucket.objects()} == {
        ".ckpt_engine_run.json",
        "iter_000000002",
        "latest_checkpoint.txt",
    }
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (3, {"local"})
    assert_state_dicts_equal(got, saved[3]["state"])
    for path in sorted((tmp_path / "local").rglob("*"), reverse=True):
        path.unlink() if path.is_file() else path.rmdir()
    result, got = _resume(config)
    assert (result.iteration, set(result.bytes_by_source)) == (2, {"durable"})
    assert_state_dicts_equal(got, saved[2]["state"])


@pytest.mark.full  # three writer-process start-ups
def test_overlapped_async_saves_to_the_local_tier_keep_their_snapshot(tmp_path: Path) -> None:
    """pinned_staging with overlap: the snapshot copy runs after save() returns, and both the
    durable and the local write wait for it; a resume is the state of the step saved."""
    plugin = {"name": "pinned_staging", "options": {"overlap": True}}
    config = _config(tmp_path, persist_every=2, plugins=[plugin])
    state = TinyTrainingState.create(seed=1)
    expected = {}
    with CheckpointEngine(config) as engine:
        for it in range(1, 4):
            handle = engine.save(it, **state.objects())
            expected[it] = _snapshot(state)
            state.train(1, seed=it)  # the next step, while the copy may still run
            assert handle.result().tier == ("durable" if it % 2 == 0 else "local")
    result, got = _resume(config)
    assert result.iteration == 3
    assert_state_dicts_equal(got, expected[3])
    durable, got = _resume({**config, "local_dir": str(tmp_path / "elsewhere")})
    assert durable.iteration == 2
    assert_state_dicts_equal(got, expected[2])
