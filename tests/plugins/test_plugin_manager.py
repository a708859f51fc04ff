"""``ckpt_engine.plugin_manager``: which plugins are installed, found once per state of the import path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckpt_engine import plugin_manager
from ckpt_engine.plugin_manager import installed_plugins


def _install(site: Path, name: str) -> None:
    """A distribution providing plugin ``name``, as an installer writes it: a ``.dist-info`` folder."""
    dist = site / f"{name}_dist-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-dist\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[ckpt_engine]\n{name} = {name}_mod:Plugin\n")


def test_installed_plugins_are_found_once_while_the_import_path_is_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = plugin_manager.entry_points

    def counting(*, group: str) -> object:
        calls.append(group)
        return real(group=group)

    monkeypatch.setattr(plugin_manager, "entry_points", counting)
    monkeypatch.syspath_prepend(str(tmp_path))
    first = installed_plugins()
    assert installed_plugins() == first and installed_plugins() == first
    assert len(calls) == 1  # the second and third engines find what the first found
    installed_plugins().clear()  # each caller gets its own copy
    assert installed_plugins() == first


def test_a_plugin_installed_into_a_folder_on_the_path_is_found_by_the_next_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    assert "late_plugin" not in installed_plugins()
    old = os.stat(site).st_mtime_ns
    _install(site, "late_plugin")
    os.utime(
        site, ns=(old + 1_000_000_000, old + 1_000_000_000)
    )  # the kernel's clock ticks in milliseconds: as if a tick passed
    assert installed_plugins()["late_plugin"].value == "late_plugin_mod:Plugin"


def test_a_folder_added_to_the_path_is_searched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install(site, "path_plugin")
    assert "path_plugin" not in installed_plugins()
    monkeypatch.syspath_prepend(str(site))
    assert "path_plugin" in installed_plugins()


def test_a_plugin_upgraded_in_place_is_described_by_its_new_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_engine.plugin_manager import describe_entry_point

    site = tmp_path / "site"
    site.mkdir()
    _install(site, "upgraded")
    monkeypatch.syspath_prepend(str(site))
    assert describe_entry_point(installed_plugins()["upgraded"]).endswith("from upgraded-dist 0.1)")
    old = os.stat(site).st_mtime_ns
    (site / "upgraded_dist-0.1.dist-info").rename(site / "upgraded_dist-0.2.dist-info")  # as an installer replaces it
    meta = site / "upgraded_dist-0.2.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 0.1", "Version: 0.2"))
    os.utime(site, ns=(old + 1_000_000_000, old + 1_000_000_000))
    assert describe_entry_point(installed_plugins()["upgraded"]).endswith("from upgraded-dist 0.2)")
