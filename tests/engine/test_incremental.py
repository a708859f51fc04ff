"""Incremental saves (``incremental: true``): unchanged files are carried over, never rewritten,
and every checkpoint stays complete, loadable by plain ``dcp.load`` and safe to delete.

Real checkpoints on disk; a fine-tuning shape throughout: a frozen 4 MiB base (its weight a
file of its own) and a small trainable head with AdamW.
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _paths import ROOT
from torch import nn

from ckpt_engine import CheckpointEngine, ConfigError
from ckpt_engine._dcpio.carry import create_new
from ckpt_engine.integrity import verify_checkpoint

BASE = 1024  # a 1024 x 1024 fp32 base weight: 4 MiB, at least GROUP_BYTES


class FineTune:
    """A frozen base and a trainable head, with AdamW over the head only."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(BASE, BASE), nn.Linear(BASE, 8))
        for p in self.model[0].parameters():
            p.requires_grad_(False)
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-2)

    def step(self) -> None:
        self.model(torch.randn(4, BASE)).square().mean().backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def objects(self) -> dict[str, Any]:
        return {"model": self.model, "optimizer": self.optimizer}

    def model_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}


def _config(save_dir: str, **extra: Any) -> dict[str, Any]:
    return {"save_dir": save_dir, "incremental": True, **extra}


def _ckpt(save_dir: str, iteration: int) -> str:
    return os.path.join(save_dir, f"iter_{iteration:09d}")


def _dcp_model(path: str, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model component of a checkpoint, read by plain ``dcp.load`` (no engine involved)."""
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, checkpoint_id=os.path.join(path, "model"))
    return out


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


def _disk_use(save_dir: str) -> int:
    """Bytes the save folder really uses: every file's size, each inode counted once."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for root, _, files in os.walk(save_dir):
        for name in files:
            st = os.stat(os.path.join(root, name))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def _base_file(checkpoint: str) -> Path:
    """The model file that holds the frozen base (the largest one)."""
    return max(Path(checkpoint, "model").glob("*.distcp"), key=lambda p: p.stat().st_size)


def _hashes(path: str) -> dict[str, str]:
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            out[os.path.relpath(full, path)] = hashlib.sha256(Path(full).read_bytes()).hexdigest()
    return out


def _save_series(save_dir: str, count: int, **extra: Any) -> tuple[FineTune, list[Any], list[dict[str, torch.Tensor]]]:
    job = FineTune()
    results, states = [], []
    with CheckpointEngine(_config(save_dir, **extra)) as engine:
        for it in range(1, count + 1):
            job.step()
            results.append(engine.save(it, **job.objects()).result())
            states.append(job.model_state())
    return job, results, states


def test_unchanged_files_are_linked_and_every_checkpoint_loads_with_plain_dcp(save_dir: str) -> None:
    _, results, states = _save_series(save_dir, 4)
    base_bytes = BASE * BASE * 4
    first = results[0]
    assert first.bytes_reused == 0 and first.carried_by == "off"
    assert first.bytes_written > base_bytes
    for later in results[1:]:
        assert later.carried_by == "link"
        assert later.bytes_reused >= base_bytes  # the frozen weight, at least
        assert later.bytes_written < first.bytes_written * 0.1
        assert later.bytes_written + later.bytes_reused == pytest.approx(first.bytes_written, rel=0.01)
    # One copy of the frozen weight on disk, however many checkpoints share it.
    assert _disk_use(save_dir) < first.bytes_written + 3 * results[-1].bytes_written + 64 * 1024
    for it, want in enumerate(states, start=1):
        _assert_equal(_dcp_model(_ckpt(save_dir, it), want), want)
        report = verify_checkpoint(_ckpt(save_dir, it), "checksums")
        assert report.verified and not report.problems, report.problems
    # The manifest says which files were carried over, with their checksums.
    import json

    doc = json.loads(Path(_ckpt(save_dir, 3), "ckpt_engine_manifest.json").read_text())
    carried = {rel: e for rel, e in doc["files"].items() if e.get("carried")}
    assert carried and all(e["carried"] == "link" and e["checksum"] for e in carried.values())
    assert doc["carry_chain"] == 2


def test_engine_load_with_checksums_restores_each_checkpoint(save_dir: str) -> None:
    _, _, states = _save_series(save_dir, 3)
    for it in (1, 2, 3):
        job = FineTune(seed=99)
        config = {"save_dir": save_dir + "-resumed", "load_path": _ckpt(save_dir, it), "verify": "checksums"}
        with CheckpointEngine(config) as e:
            result = e.load(**job.objects())
        assert result.verified and result.source == "load_path"
        _assert_equal(job.model_state(), states[it - 1])


def _change_mul(job: FineTune) -> None:
    job.model[0].weight.data.mul_(1.5)


def _change_copy(job: FineTune) -> None:
    with torch.no_grad():
        job.model[0].weight.copy_(torch.randn(BASE, BASE))


def _change_one_element(job: FineTune) -> None:
    with torch.no_grad():
        job.model[0].weight[BASE - 1, BASE - 1] += 1.0


def _change_replace(job: FineTune) -> None:
    job.model[0].weight = nn.Parameter(torch.randn(BASE, BASE), requires_grad=False)


def _change_bias(job: FineTune) -> None:  # a small tensor, packed with others
    with torch.no_grad():
        job.model[0].bias.add_(1.0)


@pytest.mark.parametrize("change", [_change_mul, _change_copy, _change_one_element, _change_replace, _change_bias])
def test_a_change_made_by_any_means_is_written(save_dir: str, change: Any) -> None:
    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
        change(job)
        assert engine.save(2, **job.objects()).result().succeeded
    want = job.model_state()
    _assert_equal(_dcp_model(_ckpt(save_dir, 2), want), want)
    assert verify_checkpoint(_ckpt(save_dir, 2), "checksums").verified


def test_a_replaced_tensor_with_the_same_values_is_still_carried_over(save_dir: str) -> None:
    """Content decides, not the tensor object: a new parameter with equal bytes is carried over."""
    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
        job.model[0].weight = nn.Parameter(job.model[0].weight.detach().clone(), requires_grad=False)
        result = engine.save(2, **job.objects()).result()
    assert result.bytes_reused >= BASE * BASE * 4


def test_a_changed_value_in_a_non_tensor_item_is_written(save_dir: str) -> None:
    class Position:
        def __init__(self, value: int) -> None:
            self.value = value

        def state_dict(self) -> dict[str, Any]:
            return {"position": self.value, "name": "loader"}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.value = sd["position"]

    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects(), extra={"loader": Position(1)}).result()
        engine.save(2, **job.objects(), extra={"loader": Position(2)}).result()
    back = Position(0)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.load(**FineTune().objects(), extra={"loader": back})
    assert back.value == 2


@pytest.mark.parametrize("order", list(itertools.permutations([1, 2, 3])))
def test_deleting_checkpoints_in_any_order_never_breaks_the_others(tmp_path: Path, order: tuple[int, ...]) -> None:
    save_dir = str(tmp_path / "ckpt")
    _, _, states = _save_series(save_dir, 3)
    alive = {1, 2, 3}
    for gone in order:
        shutil.rmtree(_ckpt(save_dir, gone))
        alive.discard(gone)
        for it in alive:
            _assert_equal(_dcp_model(_ckpt(save_dir, it), states[it - 1]), states[it - 1])
            assert verify_checkpoint(_ckpt(save_dir, it), "checksums").verified


def test_retention_keeps_the_kept_checkpoints_whole(save_dir: str) -> None:
    _, results, states = _save_series(save_dir, 5, keep_last=2)
    assert sorted(os.listdir(save_dir)) == ["iter_000000004", "iter_000000005", "latest_checkpoint.txt"]
    for it in (4, 5):
        _assert_equal(_dcp_model(_ckpt(save_dir, it), states[it - 1]), states[it - 1])
        assert verify_checkpoint(_ckpt(save_dir, it), "checksums").verified
    assert results[-1].bytes_reused > 0


def test_a_resave_with_allow_overwrite_leaves_older_checkpoints_unchanged(save_dir: str) -> None:
    job = FineTune()
    with CheckpointEngine(_config(save_dir, allow_overwrite=True)) as engine:
        engine.save(1, **job.objects()).result()
        engine.save(2, **job.objects()).result()
        before = {it: _hashes(_ckpt(save_dir, it)) for it in (1, 2)}
        job.step()
        _change_mul(job)
        engine.save(2, **job.objects()).result()  # over the committed iteration 2
        engine.save(1, **job.objects()).result()  # and over iteration 1, which 2 shared files with
    want = job.model_state()
    for it in (1, 2):
        _assert_equal(_dcp_model(_ckpt(save_dir, it), want), want)
    assert before[1] != _hashes(_ckpt(save_dir, 1))  # (the re-saves did change what they replaced)


def test_a_resave_never_changes_a_checkpoint_it_did_not_replace(save_dir: str) -> None:
    job = FineTune()
    with CheckpointEngine(_config(save_dir, allow_overwrite=True)) as engine:
        engine.save(1, **job.objects()).result()
        engine.save(2, **job.objects()).result()
        before = _hashes(_ckpt(save_dir, 1))
        _change_one_element(job)
        engine.save(2, **job.objects()).result()
    assert _hashes(_ckpt(save_dir, 1)) == before


def test_a_new_file_is_never_written_through_an_existing_link(tmp_path: Path) -> None:
    """What a crashed save can leave: a link to a committed file where the next save writes."""
    committed, stale = tmp_path / "committed.distcp", tmp_path / "stale.distcp"
    committed.write_bytes(b"committed bytes")
    os.link(committed, stale)
    with create_new(str(stale)) as f:
        f.write(b"new")
    assert committed.read_bytes() == b"committed bytes"
    assert stale.read_bytes() == b"new"


def test_a_resumed_engine_carries_over_from_latest(save_dir: str) -> None:
    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
    with CheckpointEngine(_config(save_dir)) as engine:  # a new process would do the same
        engine.load(**job.objects())
        result = engine.save(2, **job.objects()).result()
    assert result.carried_by == "link" and result.bytes_reused >= BASE * BASE * 4


def test_no_manifest_no_carry_over(save_dir: str) -> None:
    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
        os.remove(os.path.join(_ckpt(save_dir, 1), "ckpt_engine_manifest.json"))
        result = engine.save(2, **job.objects()).result()
    assert result.bytes_reused == 0 and result.carried_by == "off"
    assert _base_file(_ckpt(save_dir, 2)).stat().st_nlink == 1


def test_a_previous_file_that_does_not_match_its_manifest_is_not_linked(save_dir: str) -> None:
    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
        victim = _base_file(_ckpt(save_dir, 1))
        with open(victim, "ab") as f:  # damaged: one byte longer than its manifest says
            f.write(b"x")
        result = engine.save(2, **job.objects()).result()
    assert result.bytes_reused < BASE * BASE * 4  # unchanged, but written: the base did not match
    new = Path(_ckpt(save_dir, 2), "model", victim.name)
    assert new.stat().st_nlink == 1
    want = job.model_state()
    _assert_equal(_dcp_model(_ckpt(save_dir, 2), want), want)


# -- a previous file that changed after its commit (silent wrong data before: it was linked) --------


def _flip_in_place(path: Path) -> None:
    """One byte in the middle of the file flipped through the same inode."""
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0xFF]))


def _replace_same_size(path: Path) -> None:
    """A new file of the same size renamed over it (another inode)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _flip_and_restore_mtime(path: Path) -> None:
    """Flipped in place, then its mtime set back (``touch -r``): only the ctime shows it."""
    st = path.stat()
    _flip_in_place(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


@pytest.mark.parametrize("damage", [_flip_in_place, _replace_same_size, _flip_and_restore_mtime])
def test_a_previous_file_changed_after_its_commit_is_written_not_carried(save_dir: str, damage: Any) -> None:
    """The newest checkpoint is never born damaged: a same-size change of the previous
    checkpoint's file is seen (version, then checksum) and the file is written from memory."""
    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
        victim = _base_file(_ckpt(save_dir, 1))
        damage(victim)
        result = engine.save(2, **job.objects()).result()
    assert result.carried_by == "write" and result.bytes_reused < BASE * BASE * 4
    assert Path(_ckpt(save_dir, 2), "model", victim.name).stat().st_nlink == 1
    want = job.model_state()
    job2 = FineTune(seed=7)
    with CheckpointEngine({"save_dir": save_dir}) as engine:  # the default verify: sizes
        assert engine.load(**job2.objects()).iteration == 2
    _assert_equal(job2.model_state(), want)
    assert verify_checkpoint(_ckpt(save_dir, 2), "checksums").verified


def test_a_touched_file_with_its_bytes_intact_is_read_again_and_carried(save_dir: str) -> None:
    """A version change that leaves the bytes alone (``touch``, retention removing another link)
    costs a re-read, not a write: the bytes still have the recorded checksum."""
    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
        victim = _base_file(_ckpt(save_dir, 1))
        os.utime(victim)
        result = engine.save(2, **job.objects()).result()
    assert result.carried_by == "link" and result.bytes_reused >= BASE * BASE * 4
    assert Path(_ckpt(save_dir, 2), "model", victim.name).stat().st_nlink == 2


def test_retention_of_a_sharing_checkpoint_keeps_the_carry_over(save_dir: str) -> None:
    """keep_last removes a link to the shared file after every commit (its ctime moves): every
    later save still carries it over, read again, and every kept checkpoint stays whole."""
    _, results, states = _save_series(save_dir, 4, keep_last=2)
    assert [r.carried_by for r in results] == ["off", "link", "link", "link"]
    assert all(r.bytes_reused >= BASE * BASE * 4 for r in results[1:])
    assert sorted(os.listdir(save_dir)) == ["iter_000000003", "iter_000000004", "latest_checkpoint.txt"]
    for it in (3, 4):
        _assert_equal(_dcp_model(_ckpt(save_dir, it), states[it - 1]), states[it - 1])
        assert verify_checkpoint(_ckpt(save_dir, it), "checksums").verified


def test_a_symlink_planted_in_the_previous_checkpoint_is_written_anew(
    save_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A symlink in latest (even to a copy of the right bytes) is never linked: the file is
    written anew and logged, and latest keeps moving (every save failed before)."""
    job = FineTune()
    outside = tmp_path / "outside.distcp"
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
        victim = _base_file(_ckpt(save_dir, 1))
        outside.write_bytes(victim.read_bytes())
        victim.unlink()
        victim.symlink_to(outside)
        with caplog.at_level("WARNING", logger="ckpt_engine"):
            for it in (2, 3):
                job.step()
                assert engine.save(it, **job.objects()).result().succeeded
    assert any("is a symlink" in r.getMessage() for r in caplog.records)
    assert Path(save_dir, "latest_checkpoint.txt").read_text().strip() == "iter_000000003"
    new = Path(_ckpt(save_dir, 2), "model", victim.name)
    assert not new.is_symlink() and new.stat().st_nlink == 2  # written by 2, linked by 3
    assert verify_checkpoint(_ckpt(save_dir, 3), "checksums").verified


def test_a_manifest_without_versions_is_carried_over_after_a_read(save_dir: str) -> None:
    """A checkpoint committed before versions were recorded: its files are vouched for by their
    checksum, read again, then linked."""
    import json

    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
        path = Path(_ckpt(save_dir, 1), "ckpt_engine_manifest.json")
        doc = json.loads(path.read_text())
        assert all("seen" in e for e in doc["files"].values())
        for e in doc["files"].values():
            del e["seen"]
        path.write_text(json.dumps(doc))
        result = engine.save(2, **job.objects()).result()
    assert result.carried_by == "link" and result.bytes_reused >= BASE * BASE * 4


def test_a_hostile_version_in_a_manifest_is_refused(save_dir: str) -> None:
    import json

    from ckpt_engine import CorruptCheckpointError

    job = FineTune()
    with CheckpointEngine(_config(save_dir)) as engine:
        engine.save(1, **job.objects()).result()
    path = Path(_ckpt(save_dir, 1), "ckpt_engine_manifest.json")
    doc = json.loads(path.read_text())
    next(iter(doc["files"].values()))["seen"] = "x" * 100_000 + "\n"
    path.write_text(json.dumps(doc))
    report = verify_checkpoint(_ckpt(save_dir, 1), "sizes")
    assert not report.verified and any("not a file version" in p for p in report.problems), report.problems
    assert all(len(p) < 1000 for p in report.problems)
    job2 = FineTune(seed=3)
    with (
        pytest.raises(CorruptCheckpointError, match="not a file version"),
        CheckpointEngine({"save_dir": save_dir}) as e,
    ):
        e.load(**job2.objects())


def test_full_save_every_bounds_what_checkpoints_share(save_dir: str) -> None:
    _, results, _ = _save_series(save_dir, 5, full_save_every=2)
    assert [r.bytes_reused > 0 for r in results] == [False, True, False, True, False]
    assert _base_file(_ckpt(save_dir, 5)).stat().st_nlink == 1


def test_links_refused_across_devices_fall_back_to_writing(save_dir: str) -> None:
    """The previous checkpoint on another filesystem (``/dev/shm``, a tmpfs): links fail with
    EXDEV, and the unchanged files are written instead, said in the result."""
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(os.path.dirname(save_dir)).st_dev:
        pytest.skip("needs /dev/shm on another filesystem than the test's folder")
    job = FineTune()
    elsewhere = Path("/dev/shm") / f"ckpt-engine-test-{os.getpid()}"
    try:
        with CheckpointEngine(_config(save_dir)) as engine:
            engine.save(1, **job.objects()).result()
            shutil.move(_ckpt(save_dir, 1), elsewhere)
            os.symlink(elsewhere, _ckpt(save_dir, 1))
            result = engine.save(2, **job.objects()).result()
        assert result.carried_by == "write" and result.bytes_reused == 0
        want = job.model_state()
        _assert_equal(_dcp_model(_ckpt(save_dir, 2), want), want)
        assert verify_checkpoint(_ckpt(save_dir, 2), "checksums").verified
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


def test_incremental_needs_checksums(save_dir: str) -> None:
    with pytest.raises(ConfigError, match="save_checksums"):
        CheckpointEngine(_config(save_dir, save_checksums=False))


def test_on_save_done_sees_the_same_figures(save_dir: str) -> None:
    from ckpt_engine import hookimpl

    seen: list[Any] = []

    class Observer:
        @hookimpl
        def on_save_done(self, result: Any) -> None:
            seen.append(copy.copy(result))

    job = FineTune()
    with CheckpointEngine(_config(save_dir), plugins=[Observer()]) as engine:
        engine.save(1, **job.objects()).result()
        final = engine.save(2, **job.objects()).result()
    assert [(r.bytes_written, r.bytes_reused, r.carried_by) for r in seen][-1] == (
        final.bytes_written,
        final.bytes_reused,
        final.carried_by,
    )
    assert seen[-1].bytes_reused > 0


@pytest.mark.full  # over 2 s on 2 cores: writer processes or the S3 server
@pytest.mark.parametrize("overlap", [False, True], ids=["pinned_staging", "overlap"])
def test_async_saves_carry_over_the_same_way(save_dir: str, overlap: bool) -> None:
    plugin: Any = {"name": "pinned_staging", "options": {"overlap": overlap}}
    job = FineTune()
    states = []
    results = []
    with CheckpointEngine(_config(save_dir, plugins=[plugin])) as engine:
        for it in (1, 2, 3):
            job.step()
            handle = engine.save(it, **job.objects())
            handle.wait_staged()
            states.append(job.model_state())
            results.append(handle.result())
    assert results[0].bytes_reused == 0
    assert all(r.carried_by == "link" and r.bytes_reused >= BASE * BASE * 4 for r in results[1:])
    for it, want in enumerate(states, start=1):
        _assert_equal(_dcp_model(_ckpt(save_dir, it), want), want)
        assert verify_checkpoint(_ckpt(save_dir, it), "checksums").verified


@pytest.mark.dist
@pytest.mark.parametrize("plugin", [None, "pinned_staging"], ids=["sync", "pinned_staging"])
def test_two_rank_fsdp2_with_a_frozen_part(tmp_path: Path, plugin: str | None) -> None:
    """Each rank carries its own shard files over; every checkpoint loads bit-exact with plain
    ``dcp.load`` in one process (resharding 2 -> 1)."""
    from _torchrun import run_torchrun

    save_dir = str(tmp_path / "ckpt")
    run = run_torchrun("incremental_fsdp.py", save_dir, *([plugin] if plugin else []), nproc=2, timeout=300)
    assert run.returncode == 0, run.describe()
    ranks = {r: payloads[0] for r, payloads in run.results().items()}
    assert sorted(ranks) == [0, 1], run.describe()
    shard = 1024 * 2048 * 4 // 2
    for rank, got in ranks.items():
        first, *later = got["saves"]
        assert first["ok"] and first["reused"] == 0, (rank, first)
        for save in later:
            assert save["ok"] and save["how"] == "link" and save["reused"] >= shard, (rank, save)
            assert save["written"] < shard // 8, (rank, save)
    torch.manual_seed(0)
    template = {
        k: torch.zeros_like(v)
        for k, v in nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 16)).state_dict().items()
    }
    for it, want in enumerate(ranks[0]["digests"], start=1):
        got = _dcp_model(_ckpt(save_dir, it), template)
        assert {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in got.items()} == want
        assert verify_checkpoint(_ckpt(save_dir, it), "checksums").verified


# -- object storage (moto's S3 server on loopback) --------------------------------------------------


def _s3(bucket: Any, **extra: Any) -> dict[str, Any]:
    return {"save_dir": bucket.url, "storage": dict(bucket.storage), "incremental": True, **extra}


def _resume_model(config: dict[str, Any], path: str, verify: str = "checksums") -> tuple[Any, dict[str, torch.Tensor]]:
    job = FineTune(seed=5)
    load = {**config, "save_dir": config["save_dir"] + "-elsewhere", "load_path": path, "verify": verify}
    load.pop("incremental", None)
    with CheckpointEngine(load) as engine:
        result = engine.load(**job.objects())
    return result, job.model_state()


@pytest.mark.full  # over 2 s on 2 cores: writer processes or the S3 server
def test_s3_unchanged_files_are_copied_inside_the_store(s3_bucket: Any) -> None:
    config = _s3(s3_bucket)
    job, results, states = FineTune(), [], []
    with CheckpointEngine(config) as engine:
        for it in (1, 2, 3):
            job.step()
            results.append(engine.save(it, **job.objects()).result())
            states.append(job.model_state())
    assert results[0].carried_by == "off"
    for r in results[1:]:
        assert r.carried_by == "copy" and r.bytes_reused >= BASE * BASE * 4
        assert r.bytes_written < results[0].bytes_written * 0.1  # what went up from this client
    import json

    for it, want in enumerate(states, start=1):
        result, got = _resume_model(config, f"{s3_bucket.url}/iter_{it:09d}")
        assert result.verified
        _assert_equal(got, want)
        doc = json.loads(s3_bucket.fs().cat_file(f"{s3_bucket.name}/run/iter_{it:09d}/ckpt_engine_manifest.json"))
        assert any(e.get("carried") == "copy" for e in doc["files"].values()) == (it > 1)


@pytest.mark.full  # over 2 s on 2 cores: writer processes or the S3 server
def test_s3_async_saves_copy_inside_the_store_too(s3_bucket: Any) -> None:
    config = _s3(s3_bucket, plugins=["pinned_staging"])
    job, states, results = FineTune(), [], []
    with CheckpointEngine(config) as engine:
        for it in (1, 2):
            job.step()
            handle = engine.save(it, **job.objects())
            states.append(job.model_state())
            results.append(handle.result())
    assert results[1].carried_by == "copy" and results[1].bytes_reused >= BASE * BASE * 4
    result, got = _resume_model(config, f"{s3_bucket.url}/iter_000000002")
    assert result.verified
    _assert_equal(got, states[1])


def test_two_tier_links_locally_and_copies_inside_the_store(s3_bucket: Any, tmp_path: Path) -> None:
    local = str(tmp_path / "local")
    config = {**_s3(s3_bucket), "storage": {**s3_bucket.storage, "local_dir": local, "local_keep_last": 2}}
    job, states = FineTune(), []
    with CheckpointEngine(config) as engine:
        for it in (1, 2):
            job.step()
            result = engine.save(it, **job.objects()).result()
            engine.wait()  # the upload runs after the local commit
            states.append(job.model_state())
    assert result.carried_by == "link"
    assert _base_file(os.path.join(local, "iter_000000002")).stat().st_nlink == 2
    for it in (1, 2):
        got_result, got = _resume_model(
            {**config, "storage": dict(s3_bucket.storage)}, f"{s3_bucket.url}/iter_{it:09d}"
        )
        assert got_result.verified
        _assert_equal(got, states[it - 1])


def _flip_object(bucket: Any, key: str) -> None:
    """Replace an object of the bucket by one of the same size with one byte flipped."""
    fs = bucket.fs()
    data = bytearray(fs.cat_file(key))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(key, bytes(data))


def _largest_object(bucket: Any, prefix: str) -> str:
    fs = bucket.fs()
    found = fs.find(prefix, detail=True)
    return max((k for k in found if k.endswith(".distcp")), key=lambda k: found[k]["size"])


def test_s3_an_object_changed_after_its_commit_is_uploaded_not_copied(s3_bucket: Any) -> None:
    """On an object store the ETag recorded at commit vouches for an object: a same-size
    replacement of the previous checkpoint's object is written again, never server-side copied."""
    config = _s3(s3_bucket)
    job = FineTune()
    with CheckpointEngine(config) as engine:
        engine.save(1, **job.objects()).result()
        victim = _largest_object(s3_bucket, f"{s3_bucket.name}/run/iter_000000001/model")
        _flip_object(s3_bucket, victim)
        result = engine.save(2, **job.objects()).result()
    assert result.bytes_reused < BASE * BASE * 4
    _, got = _resume_model(config, f"{s3_bucket.url}/iter_000000002", verify="sizes")
    _assert_equal(got, job.model_state())


@pytest.mark.full  # over 2 s on 2 cores: writer processes or the S3 server
def test_two_tier_a_remote_object_changed_after_its_upload_is_uploaded_again(s3_bucket: Any, tmp_path: Path) -> None:
    local = str(tmp_path / "local")
    config = {**_s3(s3_bucket), "storage": {**s3_bucket.storage, "local_dir": local}}
    job = FineTune()
    with CheckpointEngine(config) as engine:
        engine.save(1, **job.objects()).result()
        engine.wait()
        victim = _largest_object(s3_bucket, f"{s3_bucket.name}/run/iter_000000001/model")
        _flip_object(s3_bucket, victim)
        assert engine.save(2, **job.objects()).result().carried_by == "link"  # the local copy is intact
        engine.wait()
    import json

    doc = json.loads(s3_bucket.fs().cat_file(f"{s3_bucket.name}/run/iter_000000002/ckpt_engine_manifest.json"))
    assert all(e["seen"].startswith(("ETag:", "VersionId:")) for e in doc["files"].values())
    _, got = _resume_model({**config, "storage": dict(s3_bucket.storage)}, f"{s3_bucket.url}/iter_000000002", "sizes")
    _assert_equal(got, job.model_state())


# -- what ls and inspect show ----------------------------------------------------------------------


def test_ls_and_inspect_show_bytes_written_reused_and_the_real_disk_use(
    save_dir: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from ckpt_engine.cli import main

    _save_series(save_dir, 3)

    def cli(*args: str) -> str:
        capsys.readouterr()
        assert main(list(args)) == 0
        return capsys.readouterr().out

    listing = json.loads(cli("ls", save_dir, "--json"))
    rows = {r["iteration"]: r for r in listing["checkpoints"]}
    assert rows[1]["reused"] == 0 and rows[1]["written"] == rows[1]["bytes"]
    for it in (2, 3):
        assert rows[it]["reused"] > BASE * BASE * 4 and rows[it]["written"] + rows[it]["reused"] == rows[it]["bytes"]
    assert listing["disk_bytes"] == _disk_use(save_dir)
    assert listing["disk_bytes"] < sum(r["bytes"] for r in rows.values()) / 2  # the base is stored once
    text = cli("ls", save_dir)
    assert "written" in text.splitlines()[0] and "reused" in text.splitlines()[0]
    assert "disk use:" in text and "counted once" in text
    shown = json.loads(cli("inspect", _ckpt(save_dir, 2), "--json"))
    assert shown["reused_bytes"] == rows[2]["reused"] and shown["written_bytes"] == rows[2]["written"]
    assert "incremental save: wrote" in cli("inspect", _ckpt(save_dir, 2), "--summary")
    assert "incremental save" not in cli("inspect", _ckpt(save_dir, 1), "--summary")


def test_lora_adapters_interleaved_with_a_frozen_base_write_only_the_adapters(save_dir: str) -> None:
    """Adapters sit between the frozen weights in the state dict's order; only they, and what
    trains them, are written again."""

    class LoraLinear(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(512, 512)
            self.base.requires_grad_(False)
            self.lora_a = nn.Parameter(torch.randn(4, 512) * 0.01)
            self.lora_b = nn.Parameter(torch.zeros(512, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + x @ self.lora_a.T @ self.lora_b.T

    torch.manual_seed(0)
    model = nn.Sequential(*[LoraLinear() for _ in range(8)])
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    frozen = sum(m.base.weight.numel() + m.base.bias.numel() for m in model) * 4
    results = []
    with CheckpointEngine(_config(save_dir)) as engine:
        for it in (1, 2, 3):
            model(torch.randn(2, 512)).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            results.append(engine.save(it, model=model, optimizer=optimizer).result())
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    _assert_equal(_dcp_model(_ckpt(save_dir, 3), want), want)
    for r in results[1:]:
        assert r.bytes_reused >= frozen and r.bytes_written < frozen / 4, r


@pytest.mark.full  # the benchmark end to end
def test_the_benchmark_runs_in_its_smoke_mode(tmp_path: Path) -> None:
    """benchmarks/incremental_bench.py end to end on tiny sizes (untimed), so it cannot rot."""
    import json

    import _forked

    bench = ROOT / "benchmarks" / "incremental_bench.py"
    out = tmp_path / "results.json"
    args = ["--smoke", "--workdir", str(tmp_path / "work"), "--out", str(out)]
    # forked, with what it starts (tests/_forked_python.py): the smoke run checks paths, not costs
    proc = _forked.run(bench, *args, timeout=600, python=_forked.python_stand_in())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    ft = result["finetune"]
    assert ft["reused_bytes"] >= ft["frozen_bytes"] and ft["written_bytes"] < ft["full_checkpoint_bytes"] / 10
    assert result["s3"]["carried_by"] == ["copy"]
    assert result["pretrain_sync"]["incremental_s"] > 0 and result["pretrain_async"]["incremental_s"] > 0
