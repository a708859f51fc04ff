"""The one rule for whether two configured folders are one (``_storage.paths.same_folder``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ckpt_engine._storage.paths import same_folder


def test_local_spellings_of_one_folder_are_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = tmp_path / "ckpt"
    real.mkdir()
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert same_folder(str(real), str(real) + "/")
    assert same_folder(str(real), "ckpt")  # relative to the working folder
    assert same_folder(str(real), f"file://{real}")
    assert same_folder(str(tmp_path / "link"), str(real))  # a symlinked spelling
    assert same_folder(str(tmp_path / "missing" / ".." / "ckpt"), str(real))


def test_different_folders_and_urls_are_not_one(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert not same_folder(str(tmp_path / "a"), str(tmp_path / "b"))
    assert same_folder("s3://bucket/run/", "s3://bucket/run")
    assert not same_folder("s3://bucket/run", "s3://bucket/run2")
    assert not same_folder("s3://bucket/run", "/bucket/run")
