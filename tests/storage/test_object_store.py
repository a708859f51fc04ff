"""Object storage: save to and resume from URLs (issue #7).

``memory://`` runs the store logic in-process; ``s3://`` runs against a real S3 protocol
endpoint, moto's server on loopback (tests/_s3.py), over HTTP with s3fs.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import _forked
import fsspec
import pytest
import torch
from _paths import CRASH_SCRIPTS, TESTS
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ckpt_engine import (
    CheckpointEngine,
    CheckpointExistsError,
    CheckpointPermissionError,
    CheckpointSaveError,
    CkptEngineError,
    IncompleteCheckpointError,
    SaveContext,
    StagedState,
    StorageError,
    hookimpl,
)
from ckpt_engine._engine.targets import LocalTarget
from ckpt_engine._format.names import LATEST_FILE
from ckpt_engine._format.pointer import read_latest
from ckpt_engine._storage.store import FsspecStore, is_transient, open_store
from ckpt_engine.integrity import MANIFEST_FILE, verify_checkpoint
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal

_MEM = iter(range(10**6))


@pytest.fixture
def mem_url() -> Any:
    """A fresh ``memory://`` prefix (fsspec's in-process filesystem), removed afterwards."""
    url = f"memory://ckpt-tests/run{next(_MEM)}"
    yield url
    fs = fsspec.filesystem("memory")
    if fs.exists(url):
        fs.rm(url, recursive=True)


def _mem_keys(url: str) -> list[str]:
    fs = fsspec.filesystem("memory")
    root = fsspec.core.strip_protocol(url) + "/"
    return sorted(k[len(root) :] for k in fs.find(root))


def _local_keys(folder: str) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file())


def _resume(config: dict[str, Any], seed: int = 1, **kw: Any) -> tuple[Any, TinyTrainingState]:
    fresh = TinyTrainingState.create(seed=seed + 100, hidden=kw.pop("hidden", 64))
    with CheckpointEngine({**config, **kw}) as engine:
        return engine.load(**fresh.objects()), fresh


def _assert_same_state(a: TinyTrainingState, b: TinyTrainingState) -> None:
    assert_state_dicts_equal(a.model.state_dict(), b.model.state_dict())
    assert_state_dicts_equal(a.optimizer.state_dict(), b.optimizer.state_dict())
    assert_state_dicts_equal(a.scheduler.state_dict(), b.scheduler.state_dict())


# -- memory:// -------------------------------------------------------------------------------------


def test_memory_url_round_trip_has_the_local_layout(mem_url: str, tmp_path: Path) -> None:
    state = TinyTrainingState.create(seed=1, hidden=64)
    big = _linear(torch.randn(1024, 768))  # 3 MiB: read by ranges, straight into the tensor
    local = str(tmp_path / "local")
    for folder in (mem_url, local):
        with CheckpointEngine({"save_dir": folder}) as engine:
            engine.save(3, **state.objects(), extra={"big": big}).result()
    assert _mem_keys(mem_url) == _local_keys(local)
    assert MANIFEST_FILE in "".join(_mem_keys(mem_url)) and LATEST_FILE in _mem_keys(mem_url)

    fresh = TinyTrainingState.create(seed=101, hidden=64)
    big_fresh = _linear(torch.zeros(1024, 768))
    with CheckpointEngine({"save_dir": mem_url, "verify": "checksums"}) as engine:
        result = engine.load(**fresh.objects(), extra={"big": big_fresh})
    assert (result.iteration, result.verified) == (3, True)
    assert result.checkpoint_path == f"{mem_url}/iter_000000003"
    _assert_same_state(state, fresh)
    assert torch.equal(big_fresh.weight, big.weight)


def test_a_load_lists_the_checkpoint_prefix_once(mem_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Completeness and the manifest's size check share one listing (a paginated request on S3)."""
    state = TinyTrainingState.create(seed=1, hidden=64)
    with CheckpointEngine({"save_dir": mem_url}) as engine:
        engine.save(1, **state.objects())
    listed: list[str] = []
    real = FsspecStore.list_files

    def counting(self: FsspecStore, path: str) -> dict[str, int]:
        listed.append(path)
        return real(self, path)

    monkeypatch.setattr(FsspecStore, "list_files", counting)
    result, _ = _resume({"save_dir": mem_url})
    assert result.verified and listed == [f"{mem_url}/iter_000000001"]


def test_a_prefix_without_its_marker_is_never_loaded(mem_url: str) -> None:
    state = TinyTrainingState.create(seed=1, hidden=64)
    with CheckpointEngine({"save_dir": mem_url}) as engine:
        engine.save(1, **state.objects())
        state.train(1)
        engine.save(2, **state.objects())
    fs = fsspec.filesystem("memory")
    fs.rm_file(f"{mem_url}/iter_000000002/{MANIFEST_FILE}")  # as if killed before the marker

    with pytest.raises(IncompleteCheckpointError, match="completion marker"):
        _resume({"save_dir": mem_url})
    result, _ = _resume({"save_dir": mem_url, "fallback_to_last_complete": True})
    assert result.iteration == 1 and result.fell_back_from == f"{mem_url}/iter_000000002"
    report = verify_checkpoint(f"{mem_url}/iter_000000002")
    assert not report.ok and "no completion marker" in (report.unverified_reason or "")


def test_retention_on_an_object_store_deletes_whole_prefixes(mem_url: str) -> None:
    state = TinyTrainingState.create(seed=1)
    with CheckpointEngine({"save_dir": mem_url, "keep_last": 2, "keep_every": 4}) as engine:
        for it in range(1, 7):
            engine.save(it, **state.objects())
    prefixes = sorted({k.split("/")[0] for k in _mem_keys(mem_url)})
    assert prefixes == ["iter_000000004", "iter_000000005", "iter_000000006", LATEST_FILE]


def test_resaving_an_iteration_replaces_every_object(mem_url: str) -> None:
    big = TinyTrainingState.create(seed=1, hidden=64)
    small = TinyTrainingState.create(seed=2, hidden=8)
    with CheckpointEngine({"save_dir": mem_url, "thread_count": 2}) as engine:
        engine.save(5, **big.objects())
    with (
        CheckpointEngine({"save_dir": mem_url}) as engine,
        pytest.raises(CheckpointExistsError, match="allow_overwrite"),
    ):
        engine.save(5, **small.objects())  # refused by default, on an object store too
    with CheckpointEngine({"save_dir": mem_url, "allow_overwrite": True}) as engine:
        engine.save(5, **small.objects())
    assert not any("__0_1" in k for k in _mem_keys(mem_url))  # thread_count=2's second file is gone
    result, fresh = _resume({"save_dir": mem_url, "verify": "checksums"}, hidden=8)
    assert result.iteration == 5
    _assert_same_state(small, fresh)


def test_a_run_resumed_from_an_older_step_moves_the_history_it_left_aside_on_an_object_store(mem_url: str) -> None:
    """With ``allow_overwrite``, a run resumed from step 2 that saves 3 moves steps 4 and 5 of the
    history it left under ``.ckpt_engine_abandoned/`` (objects copied, the markers first removed)
    and ``latest`` names 3: a restart resumes this run, not the other."""
    first = TinyTrainingState.create(seed=1)
    with CheckpointEngine({"save_dir": mem_url}) as engine:
        for it in range(1, 6):
            first.train(1, seed=it)
            engine.save(it, **first.objects())
    branch = TinyTrainingState.create(seed=7)
    config = {"save_dir": mem_url, "load_path": f"{mem_url}/iter_000000002", "load_training_state": True}
    with CheckpointEngine({**config, "allow_overwrite": True}) as engine:
        engine.load(**branch.objects())
        branch.train(1, seed=99)
        engine.save(3, **branch.objects())
    keys = _mem_keys(mem_url)
    assert sorted({k.split("/")[0] for k in keys if not k.startswith(".")}) == [
        *(f"iter_00000000{i}" for i in (1, 2, 3)),
        LATEST_FILE,
    ]
    aside = {tuple(k.split("/")[1:3]) for k in keys if k.startswith(".ckpt_engine_abandoned/")}
    assert {folder for _, folder in aside} == {"iter_000000004", "iter_000000005"}
    assert len({rewind for rewind, _ in aside}) == 1 and next(iter(aside))[0].startswith("iter_000000003-")
    result, fresh = _resume({"save_dir": mem_url, "verify": "checksums"}, hidden=16)
    assert result.iteration == 3
    _assert_same_state(branch, fresh)


def test_file_url_is_the_local_path(tmp_path: Path) -> None:
    state = TinyTrainingState.create(seed=1)
    engine = CheckpointEngine({"save_dir": f"file://{tmp_path}/ckpt"})
    assert engine.save_dir == f"{tmp_path}/ckpt" and isinstance(engine._target, LocalTarget)
    engine.save(1, **state.objects())
    engine.close()
    assert read_latest(tmp_path / "ckpt") == "iter_000000001"


class _PartialPlanner:
    """The planner side DCP's read step needs: destinations, and a record of what was committed."""

    def __init__(self, target: torch.Tensor) -> None:
        self.target = target
        self.committed: list[ReadItem] = []

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        return self.target

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        self.committed.append(req)

    def load_bytes(self, req: ReadItem, value: io.BytesIO) -> None:
        raise AssertionError("no bytes items here")


def test_a_row_range_is_read_without_fetching_the_rest(mem_url: str) -> None:
    """Resharded loads read only their rows: 256 of 2048 rows cost 1/8 of the bytes (+ headers)."""
    from ckpt_engine._dcpio.object_read import ObjectStoreReader

    weight = torch.randn(2048, 1024)
    with CheckpointEngine({"save_dir": mem_url}) as engine:
        engine.save(
            1,
            model=torch.nn.Linear(1024, 2048, bias=False).requires_grad_(False).copy_(weight)
            if False
            else _linear(weight),
        )
    store = open_store(mem_url)
    assert isinstance(store, FsspecStore)
    reader = ObjectStoreReader(f"{mem_url}/iter_000000001/model", store)
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    target = torch.empty(256, 1024)
    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("weight"),
        dest_offsets=torch.Size([0, 0]),
        storage_index=MetadataIndex("weight", torch.Size([0, 0])),
        storage_offsets=torch.Size([512, 0]),
        lengths=torch.Size([256, 1024]),
    )
    planner = _PartialPlanner(target)
    reader.read_data(LoadPlan([req]), planner).wait()  # type: ignore[arg-type]
    assert torch.equal(target, weight[512:768]) and planner.committed == [req]
    rows = 256 * 1024 * 4
    assert rows <= reader.bytes_fetched <= rows + 16 * 1024


def test_metadata_naming_a_file_outside_the_component_is_refused(mem_url: str) -> None:
    """A crafted ``.metadata`` cannot make the reader fetch other objects of the bucket."""
    import dataclasses

    from ckpt_engine import CorruptCheckpointError
    from ckpt_engine._dcpio.object_read import ObjectStoreReader

    with CheckpointEngine({"save_dir": mem_url}) as engine:
        engine.save(1, model=_linear(torch.randn(4, 4)))
    store = open_store(mem_url)
    assert isinstance(store, FsspecStore)
    reader = ObjectStoreReader(f"{mem_url}/iter_000000001/model", store)
    metadata = reader.read_metadata()
    metadata.storage_data = {
        k: dataclasses.replace(v, relative_path="../../latest_checkpoint.txt") for k, v in metadata.storage_data.items()
    }
    reader.set_up_storage_reader(metadata, True)
    req = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex("weight"),
        dest_offsets=torch.Size([0, 0]),
        storage_index=next(iter(metadata.storage_data)),
        storage_offsets=torch.Size([0, 0]),
        lengths=torch.Size([4, 4]),
    )
    with pytest.raises(CorruptCheckpointError, match="outside its folder"):
        reader.read_data(LoadPlan([req]), _PartialPlanner(torch.empty(4, 4)))  # type: ignore[arg-type]


def _linear(weight: torch.Tensor) -> torch.nn.Module:
    module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


def test_transient_errors_are_retried_with_backoff_then_named(mem_url: str) -> None:
    store = FsspecStore("memory", retries=3, backoff_s=0.01)
    calls = []

    def flaky() -> bytes:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return b"ok"

    assert store.call("reading", "memory://x/y", flaky) == b"ok" and len(calls) == 3

    def down() -> bytes:
        raise ConnectionRefusedError("connection refused")

    with pytest.raises(StorageError, match=r"reading memory://x/y failed after 3 attempt\(s\)"):
        store.call("reading", "memory://x/y", down)
    with pytest.raises(FileNotFoundError):  # permanent: no retry
        store.call("reading", "memory://x/y", lambda: (_ for _ in ()).throw(FileNotFoundError("memory://x/y")))
    assert is_transient(TimeoutError()) and not is_transient(ValueError("bad request"))


# -- s3:// against moto's server ------------------------------------------------------------------


def _s3_config(bucket: Any, **kw: Any) -> dict[str, Any]:
    return {"save_dir": bucket.url, "storage": {**bucket.storage, **kw.pop("storage", {})}, **kw}


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_s3_save_resume_and_retention(s3_bucket: Any) -> None:
    state = TinyTrainingState.create(seed=1, hidden=64)
    config = _s3_config(s3_bucket, keep_last=2, thread_count=2)
    saved = []
    with CheckpointEngine(config) as engine:
        for it in (1, 2, 3):
            state.train(1)
            engine.save(it, **state.objects()).result()
            saved.append(it)
    keys = s3_bucket.objects()
    assert {k.split("/")[0] for k in keys} == {"iter_000000002", "iter_000000003", LATEST_FILE}
    assert f"iter_000000003/{MANIFEST_FILE}" in keys and "iter_000000003/model/__0_1.distcp" in keys
    assert s3_bucket.fs().cat_file(f"{s3_bucket.name}/run/{LATEST_FILE}") == b"iter_000000003\n"

    result, fresh = _resume({**config, "verify": "checksums"})
    assert (result.iteration, result.verified) == (3, True)
    _assert_same_state(state, fresh)


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_memory_urls_of_two_processes_get_two_spools() -> None:
    # memory:// objects live in one process: another process saving to the same URL saves to
    # another store, and must not find this one's spool locked (test workers each saving to
    # memory://ckpt-tests/run0 raised SaveDirLockedError).
    url = f"memory://ckpt-tests/two-processes-{os.getpid()}"
    child = (
        "import sys; from ckpt_engine import CheckpointEngine; from ckpt_engine.testing import TinyTrainingState; "
        f"e = CheckpointEngine({{'save_dir': {url!r}}}); e.save(1, **TinyTrainingState.create(seed=1).objects()); "
        "print('saved', flush=True); sys.stdin.read(); e.close()"
    )
    proc = _forked.popen(_forked.Code(child), stdin=_forked.PIPE, stdout=_forked.PIPE)  # forked: torch imported once
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "saved"  # it holds its lock
        state = TinyTrainingState.create(seed=2)
        with CheckpointEngine({"save_dir": url}) as engine:
            assert engine.save(1, **state.objects()).result().succeeded
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_one_bucket_name_on_two_servers_gets_two_spools(s3_bucket: Any) -> None:
    # Two jobs on one machine, each saving to its own server's bucket of the same name: the same
    # URL, so one spool folder and its save lock before (the second engine raised
    # SaveDirLockedError; seen as a flake when two test workers each ran their own server).
    from _s3 import Bucket, S3ServerProcess

    other = S3ServerProcess()
    other.start()
    try:
        other.client_fs().call_s3("create_bucket", Bucket=s3_bucket.name)
        twin = Bucket(other, s3_bucket.name, {**s3_bucket.storage, "endpoint_url": other.endpoint})
        assert twin.url == s3_bucket.url
        first, second = TinyTrainingState.create(seed=1, hidden=64), TinyTrainingState.create(seed=2, hidden=64)
        with CheckpointEngine(_s3_config(s3_bucket)) as a, CheckpointEngine(_s3_config(twin)) as b:
            a.save(1, **first.objects()).result()
            b.save(1, **second.objects()).result()  # while a holds its spool's lock
        for bucket, state, seed in ((s3_bucket, first, 1), (twin, second, 2)):
            result, fresh = _resume({**_s3_config(bucket), "verify": "checksums"}, seed=seed + 10)
            assert (result.iteration, result.verified) == (1, True)
            _assert_same_state(state, fresh)
    finally:
        other.stop()


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_s3_async_save_uploads_in_the_background(s3_bucket: Any) -> None:
    pytest.importorskip("ckpt_engine_plugins.pinned_staging")
    state = TinyTrainingState.create(seed=1, hidden=64)
    config = _s3_config(s3_bucket, plugins=["pinned_staging"])
    with CheckpointEngine(config) as engine:
        handle = engine.save(1, **state.objects())
        snapshot = TinyTrainingState.create(seed=1, hidden=64)
        snapshot.model.load_state_dict(state.model.state_dict())
        state.train(2)  # after save() returned: must not leak into the checkpoint
        result = handle.result()
        assert result.succeeded and result.path == f"{s3_bucket.url}/iter_000000001"
    loaded, fresh = _resume({**config, "plugins": []})
    assert loaded.iteration == 1
    assert_state_dicts_equal(snapshot.model.state_dict(), fresh.model.state_dict())


class _StopServerWhileStaging:
    """A ``stage`` provider that stops the S3 server in the middle of a save (after the save began,
    before anything is uploaded), then stages like the default."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.results: list[Any] = []

    @hookimpl
    def stage(self, ctx: SaveContext, state: Any) -> StagedState:
        if ctx.iteration == 2:
            self.server.stop()
        return StagedState(components=dict(state), is_copy=False)

    @hookimpl
    def on_save_done(self, result: Any) -> None:
        self.results.append(result)


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_s3_upload_failure_is_reported_and_latest_stays(s3_bucket: Any) -> None:
    state = TinyTrainingState.create(seed=1, hidden=64)
    plugin = _StopServerWhileStaging(s3_bucket.server)
    with CheckpointEngine(_s3_config(s3_bucket), plugins=[plugin]) as engine:
        engine.save(1, **state.objects())
        with pytest.raises(CheckpointSaveError, match=r"iter_000000002.*failed after 2 attempt\(s\)") as info:
            engine.save(2, **state.objects())
        assert "EndpointConnectionError" in str(info.value) and s3_bucket.storage["secret_access_key"] not in str(
            info.value
        )
        assert [r.succeeded for r in plugin.results] == [True, False]
        s3_bucket.server.start()
        assert read_latest(s3_bucket.url, open_store(s3_bucket.url, engine.config.storage)) == "iter_000000001"
        assert f"iter_000000002/{MANIFEST_FILE}" not in s3_bucket.objects()
        engine.save(3, **state.objects())  # the next save succeeds once the server is back
    result, _ = _resume(_s3_config(s3_bucket))
    assert result.iteration == 3


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_s3_async_upload_failure_goes_through_on_save_done(s3_bucket: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ckpt_engine_plugins.pinned_staging")
    state = TinyTrainingState.create(seed=1, hidden=64)

    class Observer:
        def __init__(self) -> None:
            self.results: list[Any] = []

        @hookimpl
        def on_save_done(self, result: Any) -> None:
            self.results.append(result)

    real_upload = FsspecStore.upload

    def stop_then_upload(self: FsspecStore, local: str, remote: str, part_concurrency: int = 1) -> int:
        if "iter_000000002" in remote:  # the moment to stop: iteration 2's first upload
            s3_bucket.server.stop()
        return real_upload(self, local, remote, part_concurrency)

    observer = Observer()
    with CheckpointEngine(_s3_config(s3_bucket, plugins=["pinned_staging"]), plugins=[observer]) as engine:
        engine.save(1, **state.objects()).result()
        monkeypatch.setattr(FsspecStore, "upload", stop_then_upload)
        handle = engine.save(2, **state.objects())  # returns after staging; the upload fails
        with pytest.raises(CheckpointSaveError, match="failed after 2 attempt"):
            handle.result()
        s3_bucket.server.start()
        assert [r.succeeded for r in observer.results] == [True, False]
        assert isinstance(observer.results[1].error, StorageError)
        assert s3_bucket.fs().cat_file(f"{s3_bucket.name}/run/{LATEST_FILE}") == b"iter_000000001\n"
        # The failure was seen through its handle: the next save proceeds (it used to raise it again).
        engine.save(3, **state.objects()).result()
    assert s3_bucket.fs().cat_file(f"{s3_bucket.name}/run/{LATEST_FILE}") == b"iter_000000003\n"


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_s3_wrong_credentials_give_a_clear_error_without_the_secret(s3_bucket: Any) -> None:
    import moto.settings

    state = TinyTrainingState.create(seed=1)
    with CheckpointEngine(_s3_config(s3_bucket)) as engine:
        engine.save(1, **state.objects())
    wrong = "wrong-secret-value-must-not-leak-42"
    config = _s3_config(s3_bucket, storage={"secret_access_key": wrong})
    old = moto.settings.INITIAL_NO_AUTH_ACTION_COUNT
    moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = 0  # moto checks signatures from now on
    try:
        with pytest.raises(CheckpointPermissionError) as load_err:
            _resume(config)
        with CheckpointEngine(config) as engine, pytest.raises(CheckpointSaveError) as save_err:
            engine.save(2, **state.objects())
    finally:
        moto.settings.INITIAL_NO_AUTH_ACTION_COUNT = old
    for err in (load_err.value, save_err.value):
        text = f"{err} {err.__cause__} {err.__context__}"
        assert wrong not in text and "access denied" in str(err) and "credentials" in str(err)
    assert wrong not in repr(CheckpointEngine(config).config)


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_s3_killed_save_leaves_no_marker_and_is_ignored(s3_bucket: Any, tmp_path: Path) -> None:
    config = _s3_config(s3_bucket, storage={"max_concurrency": 1, "spool_dir": str(tmp_path / "spool")})
    flag = tmp_path / "uploading"
    env = {"PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    # A forked child (torch and s3fs imported once, by the fork server). Its hang guard bounds the
    # wait for the flag: a child stuck before its first upload is killed, and the loop sees it end.
    with _forked.popen(
        CRASH_SCRIPTS / "s3_killed_save.py",
        json.dumps(config),
        str(flag),
        env=env,
        start_new_session=True,
        timeout=120,
        preload=["s3fs"],
    ) as child:
        while not flag.exists():
            assert child.poll() is None, child.describe(f"ended (rc={child.returncode}) before uploading iteration 2")
            time.sleep(0.05)
        os.killpg(child.pid, signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL
    keys = s3_bucket.objects()
    assert any(k.startswith("iter_000000002/") for k in keys), keys  # it did upload something
    assert f"iter_000000002/{MANIFEST_FILE}" not in keys
    result, _ = _resume(config)
    assert result.iteration == 1
    assert not verify_checkpoint(
        f"{s3_bucket.url}/iter_000000002", store=open_store(s3_bucket.url, _storage(config))
    ).ok

    state = TinyTrainingState.create(seed=3, hidden=64)
    with CheckpointEngine(config) as engine:
        engine.save(2, **state.objects())  # the leftover prefix is replaced, not mixed in
    result, fresh = _resume({**config, "verify": "checksums"})
    assert (result.iteration, result.verified) == (2, True)
    _assert_same_state(state, fresh)


def _storage(config: dict[str, Any]) -> Any:
    from ckpt_engine import EngineConfig

    return EngineConfig.model_validate(config).storage


def test_s3_large_files_go_up_as_multipart_uploads_and_load_by_ranges(s3_bucket: Any) -> None:
    weight = torch.randn(3 * 1024, 1024)  # 12 MiB: three parts of 5 MiB (the smallest S3 allows)
    config = _s3_config(s3_bucket, storage={"part_size_mb": 5, "max_concurrency": 3})
    with CheckpointEngine(config) as engine:
        engine.save(1, model=_linear(weight))
    info = s3_bucket.fs().info(f"{s3_bucket.name}/run/iter_000000001/model/__0_0.distcp")
    assert info["size"] > 12 * 2**20 and info["ETag"].strip('"').endswith("-3")  # S3's multipart ETag
    restored = _linear(torch.zeros_like(weight))
    with CheckpointEngine({**config, "verify": "checksums"}) as engine:
        assert engine.load(model=restored).verified
    assert torch.equal(restored.weight, weight)


# -- two-tier ----------------------------------------------------------------------------------------


def test_two_tier_commits_locally_then_uploads_in_the_background(s3_bucket: Any, tmp_path: Path) -> None:
    local = str(tmp_path / "local")
    config = _s3_config(s3_bucket, keep_last=3, storage={"local_dir": local, "local_keep_last": 1})
    state = TinyTrainingState.create(seed=1, hidden=64)
    with CheckpointEngine(config) as engine:
        handles = []
        for it in (1, 2):
            state.train(1)
            handles.append(engine.save(it, **state.objects()))
            assert read_latest(local) == f"iter_{it:09}"  # the local copy is committed on return
        assert [h.result().path for h in handles] == [f"{s3_bucket.url}/iter_{i:09}" for i in (1, 2)]
    assert sorted(os.listdir(local)) == ["iter_000000002", LATEST_FILE]  # local_keep_last=1
    remote = s3_bucket.objects()
    assert f"iter_000000001/{MANIFEST_FILE}" in remote and f"iter_000000002/{MANIFEST_FILE}" in remote
    assert [k for k in remote if k.startswith("iter_000000002/")] == [
        f"iter_000000002/{rel}" for rel in _local_keys(f"{local}/iter_000000002")
    ]
    # Resuming on the same machine reads the local copy; elsewhere, the object store.
    result, fresh = _resume(config)
    assert result.checkpoint_path == f"{local}/iter_000000002" and result.iteration == 2
    _assert_same_state(state, fresh)
    result, fresh = _resume(_s3_config(s3_bucket))
    assert result.checkpoint_path == f"{s3_bucket.url}/iter_000000002"
    _assert_same_state(state, fresh)


def test_two_tier_local_copy_with_a_flipped_byte_resumes_the_object_store(s3_bucket: Any, tmp_path: Path) -> None:
    """docs/storage.md: a damaged local copy is not resumed; the object store is. A flip is found
    only while the copy is read (verify: read), after earlier tensors were filled: the store's read
    replaces every component, with no fallback option set."""
    local = str(tmp_path / "local")
    config = _s3_config(s3_bucket, storage={"local_dir": local})
    state = TinyTrainingState.create(seed=1, hidden=64)
    with CheckpointEngine(config) as engine:
        state.train(1)
        engine.save(2, **state.objects()).result()
    data = next(Path(local, "iter_000000002", "model").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    data.write_bytes(bytes(raw))
    result, fresh = _resume(config)
    assert result.checkpoint_path == f"{s3_bucket.url}/iter_000000002"
    assert set(result.bytes_by_source) == {"durable"}
    _assert_same_state(state, fresh)


def test_a_two_tier_resave_whose_upload_fails_leaves_the_old_copy(
    s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/storage.md: a re-save (allow_overwrite) never puts the old copy at risk before the new
    one is complete. The two-tier upload removed the old checkpoint first: an upload that failed
    then left latest naming nothing on the store (another machine could not resume)."""
    import ckpt_engine._engine.targets as targets

    config = _s3_config(s3_bucket, storage={"local_dir": str(tmp_path / "local")}, allow_overwrite=True)
    state = TinyTrainingState.create(seed=1, hidden=64)
    with CheckpointEngine(config) as engine:
        state.train(1)
        engine.save(2, **state.objects()).result()
    other = TinyTrainingState.create(seed=5, hidden=64)

    def failing_upload(*args: Any, **kwargs: Any) -> None:
        raise StorageError("the object store went away")

    monkeypatch.setattr(targets, "upload_files", failing_upload)
    with pytest.raises(CkptEngineError, match="the object store went away"), CheckpointEngine(config) as engine:
        engine.save(2, **other.objects()).result()  # (close() reports the failed upload again)
    monkeypatch.undo()
    result, fresh = _resume(_s3_config(s3_bucket))  # another machine: the object store only
    assert result.checkpoint_path == f"{s3_bucket.url}/iter_000000002"
    _assert_same_state(state, fresh)
    # The upload works again: the re-save replaces the old copy, and nothing is left beside it.
    with CheckpointEngine(config) as engine:
        engine.save(2, **other.objects()).result()
    assert not [k for k in s3_bucket.objects() if ".replacing" in k]
    _assert_same_state(other, _resume(_s3_config(s3_bucket))[1])


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_two_tier_with_async_saves(s3_bucket: Any, tmp_path: Path) -> None:
    pytest.importorskip("ckpt_engine_plugins.pinned_staging")
    local = str(tmp_path / "local")
    config = _s3_config(s3_bucket, plugins=["pinned_staging"], storage={"local_dir": local})
    state = TinyTrainingState.create(seed=1, hidden=64)
    with CheckpointEngine(config) as engine:
        handle = engine.save(4, **state.objects())
        snapshot = {k: v.clone() for k, v in state.model.state_dict().items()}
        state.train(1)  # after save() returned: not in the checkpoint
        assert handle.result().succeeded
    assert read_latest(local) == "iter_000000004"
    assert s3_bucket.fs().cat_file(f"{s3_bucket.name}/run/{LATEST_FILE}") == b"iter_000000004\n"
    for source in (config, _s3_config(s3_bucket)):  # the local copy, then the object store
        result, fresh = _resume({**source, "plugins": []})
        assert result.iteration == 4
        assert_state_dicts_equal(fresh.model.state_dict(), snapshot)


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_two_tier_upload_failure_keeps_the_local_copy(s3_bucket: Any, tmp_path: Path, caplog: Any) -> None:
    local = str(tmp_path / "local")
    config = _s3_config(s3_bucket, storage={"local_dir": local})
    state = TinyTrainingState.create(seed=1, hidden=64)
    with CheckpointEngine(config) as engine:
        engine.save(1, **state.objects()).result()
        s3_bucket.server.stop()
        state.train(1)
        handle = engine.save(2, **state.objects())
        with pytest.raises(CheckpointSaveError, match=r"local copy .*iter_000000002 is complete"):
            handle.result()
        s3_bucket.server.start()
        with pytest.raises(CheckpointSaveError, match="iter_000000002"):
            engine.wait()  # the failure is reported again to the training loop
    assert s3_bucket.fs().cat_file(f"{s3_bucket.name}/run/{LATEST_FILE}") == b"iter_000000001\n"
    with caplog.at_level(logging.INFO, logger="ckpt_engine"):
        result, fresh = _resume(config)
    assert result.checkpoint_path == f"{local}/iter_000000002" and "resuming from the local copy" in caplog.text
    _assert_same_state(state, fresh)
    # A newer checkpoint in the object store (saved from another machine) wins over the local one.
    with CheckpointEngine(_s3_config(s3_bucket)) as engine:
        engine.save(3, **state.objects())
    result, _ = _resume(config)
    assert result.checkpoint_path == f"{s3_bucket.url}/iter_000000003"


# -- the command line on s3:// ------------------------------------------------------------------------


@pytest.mark.full  # over 2 s on 2 cores: the S3 server and its uploads
def test_cli_ls_inspect_verify_convert_on_s3(
    s3_bucket: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from _s3 import KEY_ID, SECRET

    from ckpt_engine.cli import main

    state = TinyTrainingState.create(seed=1, hidden=64)
    with CheckpointEngine(_s3_config(s3_bucket)) as engine:
        engine.save(1, **state.objects())
        engine.save(2, **state.objects())
    s3_bucket.fs().rm_file(f"{s3_bucket.name}/run/iter_000000001/{MANIFEST_FILE}")  # an interrupted save
    # The command line takes credentials and endpoint from the standard environment variables.
    for name, value in {
        "AWS_ACCESS_KEY_ID": KEY_ID,
        "AWS_SECRET_ACCESS_KEY": SECRET,
        "AWS_ENDPOINT_URL": s3_bucket.server.endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)

    def run(*argv: str) -> tuple[int, str]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out + err

    code, out = run("ls", s3_bucket.url, "--json")
    listing = json.loads(out)
    assert code == 1 and listing["latest"] == "iter_000000002"  # 1: a problem found (the incomplete one)
    status = {r["name"]: r["status"] for r in listing["checkpoints"]}
    assert status == {"iter_000000001": "INCOMPLETE", "iter_000000002": "verified"}

    code, out = run("inspect", s3_bucket.url)
    assert code == 0 and "iter_000000002" in out and "weight" in out

    code, out = run("verify", f"{s3_bucket.url}/iter_000000002")
    assert code == 0 and "checksums match the manifest" in out
    code, out = run("verify", f"{s3_bucket.url}/iter_000000001")
    assert code != 0 and "interrupted save" in out

    target = tmp_path / "model.pt"
    code, out = run("convert", s3_bucket.url, str(target))
    assert code == 0, out
    converted = torch.load(target, weights_only=True)
    assert_state_dicts_equal(converted, state.model.state_dict())
    assert SECRET not in out


# -- two ranks under torchrun ------------------------------------------------------------------------


@pytest.mark.dist
def test_two_ranks_save_to_s3_sync_and_async_and_reshard_back(s3_bucket: Any, tmp_path: Path) -> None:
    from _common import make_model
    from _torchrun import run_torchrun

    config = _s3_config(s3_bucket, storage={"spool_dir": str(tmp_path / "spool")})
    run = run_torchrun("s3_fsdp.py", json.dumps(config), nproc=2, timeout=150.0)
    assert run.returncode == 0, run.describe()
    ranks = {rank: payloads[0] for rank, payloads in run.results().items()}
    assert sorted(ranks) == [0, 1], run.describe()
    for rank, report in ranks.items():
        assert report["async_succeeded"], rank
        assert (report["loaded_iteration"], report["loaded_verified"], report["loaded_equal"]) == (2, True, True), rank
    keys = s3_bucket.objects()
    for it in (1, 2):
        assert {f"iter_{it:09}/model/__0_0.distcp", f"iter_{it:09}/model/__1_0.distcp"} <= set(keys)
        assert f"iter_{it:09}/{MANIFEST_FILE}" in keys
    assert not [k for k in keys if ".ckpt_engine_rank_" in k]  # upload reports are cleaned up
    manifest = json.loads(s3_bucket.fs().cat_file(f"{s3_bucket.name}/run/iter_000000002/{MANIFEST_FILE}"))
    assert manifest["world_size"] == 2 and all(e["checksum"] for e in manifest["files"].values())
    assert not list((tmp_path / "spool").rglob("*.distcp"))  # the spool is emptied after upload

    # Both checkpoints reshard into one process.
    for it in (1, 2):
        model = make_model(seed=5)
        cfg = {**config, "load_path": f"{s3_bucket.url}/iter_{it:09}", "save_dir": str(tmp_path / "none")}
        with CheckpointEngine(cfg) as engine:
            assert engine.load(model=model).iteration == 0  # load_path: the model only
        got = {n: p.detach().tolist() for n, p in model.named_parameters()}
        assert got == ranks[0]["saved"][str(it)], it
