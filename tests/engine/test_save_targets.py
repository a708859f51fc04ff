"""The save target is chosen once from ``save_dir`` and ``storage``, and each one's layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine import CheckpointEngine, EngineConfig
from ckpt_engine._engine.targets import LocalTarget, ObjectStoreTarget, TwoTierTarget, open_target
from ckpt_engine._format.names import MANIFEST_FILE, iter_dirname, partial_dirname
from ckpt_engine.testing import TinyTrainingState


def test_a_local_folder_or_file_url_commits_by_rename(tmp_path: Path) -> None:
    for save_dir in (str(tmp_path / "a"), f"file://{tmp_path}/b"):
        target = open_target(EngineConfig(save_dir=save_dir))
        assert isinstance(target, LocalTarget)
        paths = target.paths(7)
        folder = save_dir.removeprefix("file://")
        assert paths.final == paths.local_final == f"{folder}/{iter_dirname(7)}"
        assert paths.partial == f"{folder}/{partial_dirname(7)}"  # same filesystem: the rename is atomic
        assert target.local_dir is None and not target.after_commit_in_background
        assert not target.ranks_publish_files


def test_an_object_store_spools_locally_and_every_rank_uploads(tmp_path: Path) -> None:
    cfg = EngineConfig(save_dir="memory://targets/run1", storage={"spool_dir": str(tmp_path / "spool")})
    target = open_target(cfg)
    assert isinstance(target, ObjectStoreTarget)
    paths = target.paths(3)
    assert paths.final == f"memory://targets/run1/{iter_dirname(3)}" and paths.local_final is None
    assert paths.partial.startswith(str(tmp_path / "spool")) and paths.partial.endswith(partial_dirname(3))
    assert target.ranks_publish_files and target.local_dir is None
    # Another URL spools elsewhere: two jobs on one node never share a spool folder.
    other = open_target(EngineConfig(save_dir="memory://targets/run2", storage={"spool_dir": str(tmp_path / "spool")}))
    assert other.staging_root != target.staging_root


def test_two_tier_commits_into_the_local_folder_and_keeps_its_own_retention(tmp_path: Path) -> None:
    local = str(tmp_path / "local")
    storage = {"local_dir": local, "local_keep_last": 1}
    cfg = EngineConfig(save_dir="memory://targets/run3", keep_last=3, storage=storage)
    target = open_target(cfg)
    assert isinstance(target, TwoTierTarget)
    paths = target.paths(5)
    assert paths.local_final == f"{local}/{iter_dirname(5)}" and paths.partial == f"{local}/{partial_dirname(5)}"
    assert target.local_dir == local and target.after_commit_in_background
    jobs = {(job.folder, job.keep_last) for job in target.retention_jobs()}
    assert jobs == {("memory://targets/run3", 3), (local, 1)}


@pytest.mark.parametrize("mode", ["local", "object", "two-tier"])
def test_each_target_leaves_no_staging_files_after_a_commit(tmp_path: Path, mode: str) -> None:
    """The staging folder is the target's: after a committed save nothing uncommitted is left
    in it, and the checkpoint is where the target said it would be."""
    save_dir = str(tmp_path / "ckpt") if mode == "local" else f"memory://targets/{mode}-{tmp_path.name}"
    storage: dict[str, str] = {"spool_dir": str(tmp_path / "spool")}
    if mode == "two-tier":
        storage["local_dir"] = str(tmp_path / "local")
    state = TinyTrainingState.create(seed=3)
    with CheckpointEngine({"save_dir": save_dir, "storage": storage}) as engine:
        engine.save(2, **state.objects()).result()
        target = engine._target
        paths = target.paths(2)
    assert not Path(paths.partial).exists()
    assert target.store.exists(target.store.join(paths.final, MANIFEST_FILE))
    if paths.local_final is not None:
        assert Path(paths.local_final, MANIFEST_FILE).is_file()
