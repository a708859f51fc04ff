"""``convert --force`` never destroys what it converts, nor any other checkpoints (review item 8).

An OUT that is, contains or is inside the input (the folder given, its checkpoint, the save
folder that checkpoint is in), or that is a save or checkpoint folder of any run, is refused
before anything is written; a symbolic link named as OUT has its target replaced, the link kept,
and no ``OUT.old.PID`` is left behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from adversarial._adv import ckpt, files_under, load, save
from ckpt_engine.cli import main
from ckpt_engine.errors import UsageError

Snapshot = dict[str, bytes]


def snapshot(root: Path) -> Snapshot:
    return {rel: (root / rel).read_bytes() for rel in files_under(root)}


def convert(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Run ``ckpt-engine convert ARGV``; returns (exit code, stderr)."""
    capsys.readouterr()
    code = main(["convert", *argv])
    return code, capsys.readouterr().err


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[int, dict[str, torch.Tensor]]]:
    """``tmp_path/exp/checkpoints`` with iterations 2 and 4 (latest), and the model state of each."""
    save_dir = tmp_path / "exp" / "checkpoints"
    return save_dir, save(str(save_dir), 2, 4)


def assert_intact(save_dir: Path, before: Snapshot, models: dict[int, dict[str, torch.Tensor]]) -> None:
    assert snapshot(save_dir) == before  # every file present, byte-identical, nothing added
    result, state = load(str(save_dir))
    assert result.iteration == 4
    assert all(torch.equal(state.model.state_dict()[k], v) for k, v in models[4].items())
    assert not [p for p in save_dir.parent.iterdir() if ".tmp." in p.name or ".old." in p.name]


@pytest.mark.parametrize("force", [True, False])
@pytest.mark.parametrize(
    ("given", "out"),
    [
        ("checkpoints", "checkpoints"),  # OUT == RUN
        ("checkpoints", "checkpoints/iter_000000004"),  # OUT == the iter_ folder being read
        ("checkpoints/iter_000000004", "checkpoints/iter_000000004"),
        ("checkpoints/iter_000000004/model", "checkpoints/iter_000000004"),  # a component given
        ("checkpoints", "checkpoints/iter_000000002"),  # another checkpoint of the run
        ("checkpoints", "checkpoints/iter_000000004/model"),  # OUT inside the input
        ("checkpoints", "checkpoints/hf_model"),  # a new folder inside the run
        ("checkpoints/iter_000000004", "checkpoints/hf_model"),  # inside the iter_ folder's save folder
        ("checkpoints", "."),  # OUT contains the input
        ("checkpoints/iter_000000004", "."),
    ],
)
def test_hf_out_overlapping_the_input_is_refused_and_changes_nothing(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]],
    capsys: pytest.CaptureFixture[str],
    given: str,
    out: str,
    force: bool,
) -> None:
    save_dir, models = run
    exp = save_dir.parent
    before = snapshot(save_dir)
    code, err = convert(capsys, str(exp / given), str(exp / out), "--to", "hf", *(["--force"] if force else []))
    assert code == 2, err
    assert "being converted" in err and "pass --force" not in err, err
    assert str(exp / out).rstrip("/.") in err or str(exp) in err  # names the path
    assert_intact(save_dir, before, models)
    assert not (save_dir / "hf_model").exists()


@pytest.mark.parametrize("to", ["torch", "safetensors"])
def test_a_file_out_inside_the_input_is_refused(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], capsys: pytest.CaptureFixture[str], to: str
) -> None:
    """``--force`` onto one of the checkpoint's own shard files would overwrite it with the export."""
    save_dir, models = run
    before = snapshot(save_dir)
    shard = next((ckpt(str(save_dir), 4) / "model").glob("*.distcp"))
    code, err = convert(capsys, str(save_dir), str(shard), "--to", to, "--force")
    assert code == 2 and "is inside" in err and str(shard) in err, err
    assert_intact(save_dir, before, models)


def test_the_refusal_is_a_typed_usage_error(run: tuple[Path, dict[int, dict[str, torch.Tensor]]]) -> None:
    save_dir, _ = run
    from ckpt_engine.cli import build_parser

    args = build_parser().parse_args(["convert", str(save_dir), str(save_dir), "--to", "hf", "--force"])
    with pytest.raises(UsageError, match=r"OUT .* is .*being converted.*Write the export outside it"):
        args.func(args)  # the command itself, as main() runs it: the error it raises is typed


@pytest.mark.parametrize("out", ["checkpoints", "checkpoints/iter_000000010", "checkpoints/iter_000000010/model"])
def test_a_save_or_checkpoint_folder_of_another_run_is_never_replaced(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    out: str,
) -> None:
    save_dir, models = run
    other = tmp_path / "other" / "checkpoints"
    other_models = save(str(other), 10)
    before, other_before = snapshot(save_dir), snapshot(other)
    code, err = convert(capsys, str(save_dir), str(other.parent / out), "--to", "hf", "--force")
    assert code == 2, err
    assert "never replaces checkpoints" in err and str(other.parent / out) in err, err
    assert snapshot(other) == other_before
    result, state = load(str(other))
    assert result.iteration == 10
    assert all(torch.equal(state.model.state_dict()[k], v) for k, v in other_models[10].items())
    assert_intact(save_dir, before, models)


def test_a_save_folder_holding_only_uncommitted_iterations_is_refused(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_dir, _ = run
    other = tmp_path / "other"
    (other / ".iter_000000007.partial" / "model").mkdir(parents=True)
    (other / ".iter_000000007.partial" / "model" / "__0_0.distcp").write_bytes(b"x" * 10)
    code, err = convert(capsys, str(save_dir), str(other), "--to", "hf", "--force")
    assert code == 2 and "a save folder" in err, err
    assert files_under(other) == [".iter_000000007.partial/model/__0_0.distcp"]


def test_a_symlinked_out_replaces_the_export_it_points_to_and_keeps_the_link(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_dir, models = run
    disk = tmp_path / "disk"
    disk.mkdir()
    target = disk / "hf_model"
    target.mkdir()
    (target / "stale.txt").write_text("a previous export")
    link = tmp_path / "hf_link"
    link.symlink_to(target, target_is_directory=True)
    code, err = convert(capsys, str(save_dir), str(link), "--to", "hf", "--force")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]
    got = load_file(str(link / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in models[4].items())
    leftovers = [p.name for d in (tmp_path, disk) for p in d.iterdir() if ".old." in p.name or ".tmp." in p.name]
    assert leftovers == []


def test_a_symlink_to_the_run_or_to_nothing_is_refused(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    save_dir, models = run
    before = snapshot(save_dir)
    to_run = tmp_path / "to_run"
    to_run.symlink_to(save_dir, target_is_directory=True)
    code, err = convert(capsys, str(save_dir / "iter_000000004"), str(to_run), "--to", "hf", "--force")
    assert code == 2 and "being converted" in err, err
    assert to_run.is_symlink()
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    code, err = convert(capsys, str(save_dir), str(dangling), "--to", "hf", "--force")
    assert code == 2 and "symbolic link" in err and str(dangling) in err, err
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()
    assert_intact(save_dir, before, models)
    assert not [p for p in tmp_path.iterdir() if ".old." in p.name or ".tmp." in p.name]


def test_the_suggested_out_works_and_force_still_replaces_a_previous_export(
    run: tuple[Path, dict[int, dict[str, torch.Tensor]]], capsys: pytest.CaptureFixture[str]
) -> None:
    save_dir, models = run
    before = snapshot(save_dir)
    code, err = convert(capsys, str(save_dir), str(save_dir), "--to", "hf", "--force")
    suggested = Path(err.rsplit("e.g. ", 1)[-1].strip())
    assert code == 2 and suggested == save_dir.parent / "hf_model", err
    assert convert(capsys, str(save_dir), str(suggested), "--to", "hf")[0] == 0
    (suggested / "stale.txt").write_text("from the previous export")
    code, err = convert(capsys, str(save_dir / "iter_000000002"), str(suggested), "--to", "hf")
    assert code == 2 and "pass --force" in err  # an ordinary export: --force is the fix
    code, err = convert(capsys, str(save_dir / "iter_000000002"), str(suggested), "--to", "hf", "--force")
    assert code == 0, err
    assert sorted(p.name for p in suggested.iterdir()) == ["model.safetensors"]
    got = load_file(str(suggested / "model.safetensors"))
    assert all(torch.equal(got[k], v) for k, v in models[2].items())
    assert_intact(save_dir, before, models)
