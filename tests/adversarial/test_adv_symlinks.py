"""Files that resolve outside their checkpoint folder, and a folder that is another checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from adversarial._adv import ckpt, load, save
from ckpt_engine import CorruptCheckpointError
from ckpt_engine._format.verify import verify_checkpoint


def test_a_data_file_symlinked_outside_is_refused(save_dir: str, tmp_path: Path) -> None:
    save(save_dir, 3)
    data = ckpt(save_dir, 3) / "model" / "__0_0.distcp"
    elsewhere = tmp_path / "elsewhere.bin"
    shutil.copy(data, elsewhere)  # same size, same bytes: only the location betrays it
    data.unlink()
    data.symlink_to(elsewhere)
    with pytest.raises(CorruptCheckpointError, match="outside its checkpoint folder") as info:
        load(save_dir)
    assert str(data) in str(info.value)
    assert not verify_checkpoint(str(ckpt(save_dir, 3))).ok


def test_a_component_folder_symlinked_outside_is_refused(save_dir: str, tmp_path: Path) -> None:
    save(save_dir, 3)
    model = ckpt(save_dir, 3) / "model"
    shutil.move(model, tmp_path / "model")
    model.symlink_to(tmp_path / "model")
    with pytest.raises(CorruptCheckpointError, match="outside its checkpoint folder"):
        load(save_dir)


def test_an_iteration_folder_that_is_another_runs_checkpoint_is_refused(tmp_path: Path) -> None:
    other, mine = str(tmp_path / "other"), str(tmp_path / "mine")
    save(other, 5)
    save(mine, 1)
    os.symlink(ckpt(other, 5), ckpt(mine, 10))
    Path(mine, "latest_checkpoint.txt").write_text("iter_000000010\n")
    with pytest.raises(CorruptCheckpointError, match=r"named for iteration 10, but its .* of iteration 5"):
        load(mine)
    report = verify_checkpoint(str(ckpt(mine, 10)))
    assert not report.ok and any("iteration 5" in p for p in report.problems)


def test_symlinks_inside_the_checkpoint_still_load(save_dir: str) -> None:
    saved = save(save_dir, 3)
    model = ckpt(save_dir, 3) / "model"
    os.rename(model / "__0_0.distcp", model / "data.bin")
    (model / "__0_0.distcp").symlink_to("data.bin")
    result, state = load(save_dir, verify="off")
    assert result.iteration == 3
    assert all(state.model.state_dict()[k].equal(v) for k, v in saved[3].items())
