"""The storage writer's data files: exact bytes and checksums whichever way they are hashed and handed
to the disk (``ckpt_engine._format.data_file.DataFile``), and end to end through a save."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ckpt_engine import CheckpointEngine
from ckpt_engine._format import data_file
from ckpt_engine._format.hashing import new_hasher
from ckpt_engine._format.manifest import lookup_manifest

MIB = 1 << 20


def _parts() -> list[Any]:
    """What a data file is made of: archive headers (bytes), small tensors' copies, large
    tensors' own memory (memoryviews), in an order that crosses every batch boundary."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(3 * MIB // 4 + 17, generator=g)  # over three batches, not a multiple of one
    mid = torch.randn(300_000, generator=g)
    out: list[Any] = []
    for n in range(40):
        out.append(b"head-%d" % n)
        out.append(bytes(range(n % 256)) * 3)
    out += [memoryview(big.numpy()).cast("B"), b"tail", mid.numpy().data, bytearray(b"x" * 70_000)]
    out += [memoryview(big.numpy()).cast("B")[5:1000], b"", b"end"]
    return out


@pytest.mark.parametrize("spare_cpu", [True, False], ids=["hash-thread", "hash-inline"])
@pytest.mark.parametrize("durable", [True, False], ids=["durable", "not-durable"])
@pytest.mark.parametrize("batch", [data_file._HASH_BATCH, 4096])
def test_output_writes_exactly_its_parts_and_their_digest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spare_cpu: bool, durable: bool, batch: int
) -> None:
    monkeypatch.setattr(data_file, "_SPARE_CPU", spare_cpu)
    monkeypatch.setattr(data_file, "_HASH_BATCH", batch)
    monkeypatch.setattr(data_file, "_WRITEBACK_BYTES", MIB)  # several hand-overs in 4 MiB
    parts = _parts()
    expected = b"".join(bytes(memoryview(p).cast("B")) if not isinstance(p, bytes) else p for p in parts)
    path = tmp_path / "f.distcp"
    with data_file.DataFile(open(path, "wb"), "xxh3_64", durable) as out:
        for p in parts:
            out.write(p)
        out.sync(durable)
        assert out.pos == len(expected)
        digest = out.digest()
    assert path.read_bytes() == expected
    reference = new_hasher("xxh3_64")
    assert reference is not None
    reference.update(expected)
    assert digest == reference.hexdigest()


def test_writeback_hands_finished_ranges_to_the_disk_only_for_durable_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[int, int, int]] = []

    def record(fd: int, start: int, length: int, flags: int) -> int:
        calls.append((start, length, flags))
        return 0

    monkeypatch.setattr(data_file, "_sync_file_range", record)
    monkeypatch.setattr(data_file, "_WRITEBACK_BYTES", MIB)
    data = memoryview(torch.arange(MIB, dtype=torch.int32).numpy()).cast("B")  # 4 MiB
    with data_file.DataFile(open(tmp_path / "a", "wb"), None, durable=True) as out:
        for start in range(0, len(data), MIB):
            out.write(data[start : start + MIB])
        out.sync(True)
    # consecutive ranges from the start of the file, each handed over once, written and waited for
    assert [c[:2] for c in calls] == [(n * MIB, MIB) for n in range(len(calls))] and len(calls) >= 3
    assert {c[2] for c in calls} == {data_file._WRITE_AND_WAIT}
    assert (tmp_path / "a").read_bytes() == bytes(data)
    calls.clear()
    with data_file.DataFile(open(tmp_path / "b", "wb"), None, durable=False) as out:
        out.write(data)
        out.sync(False)
    assert calls == []  # a file that is not fsynced is left to the kernel


def test_a_filesystem_that_refuses_writeback_still_gets_the_whole_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def refuse(fd: int, start: int, length: int, flags: int) -> int:
        calls.append(start)
        return -1  # EINVAL on some FUSE and network filesystems

    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd))[1])
    monkeypatch.setattr(data_file, "_sync_file_range", refuse)
    monkeypatch.setattr(data_file, "_WRITEBACK_BYTES", MIB)
    data = bytes(range(256)) * (5 * MIB // 256)
    with data_file.DataFile(open(tmp_path / "a", "wb"), "crc32", durable=True) as out:
        for start in range(0, len(data), MIB):
            out.write(data[start : start + MIB])
        out.sync(True)
    assert calls == [0]  # refused once: no more requests for this file
    assert len(synced) == 1  # the fsync that makes it durable still ran
    assert (tmp_path / "a").read_bytes() == data


def test_a_failing_hash_fails_the_file_without_hanging(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken:
        def update(self, data: Any) -> None:
            raise MemoryError("hash state lost")

        def hexdigest(self) -> str:
            return "0"

    monkeypatch.setattr(data_file, "_SPARE_CPU", True)
    monkeypatch.setattr(data_file, "new_hasher", lambda algorithm: Broken())
    with (
        pytest.raises(MemoryError, match="hash state lost"),
        data_file.DataFile(open(tmp_path / "a", "wb"), "xxh3_64") as out,
    ):
        for _ in range(8):  # more than the helper thread has taken when it fails
            out.write(b"y" * (2 * MIB))
        out.digest()


@pytest.mark.parametrize("spare_cpu", [True, False], ids=["hash-thread", "hash-inline"])
def test_saves_checksums_match_the_files_whichever_way_they_were_hashed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spare_cpu: bool
) -> None:
    monkeypatch.setattr(data_file, "_SPARE_CPU", spare_cpu)
    monkeypatch.setattr(data_file, "_WRITEBACK_BYTES", MIB)
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 16))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt"), "verify": "checksums"}) as engine:
        engine.save(1, model=model)
        fresh = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 16))
        result = engine.load(model=fresh)  # verify="checksums": every file hashed again and compared
    assert result.iteration == 1 and result.verified
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    manifest = lookup_manifest(str(tmp_path / "ckpt" / "iter_000000001")).manifest
    assert manifest is not None
    assert all(e.checksum for e in manifest.files.values())


def test_the_commit_makes_every_folder_durable_before_the_rename(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every component folder and the hidden folder are fsynced (concurrently) before the rename
    that commits; the parent after it."""
    from ckpt_engine._format import layout

    events: list[tuple[str, str]] = []
    real_replace = os.replace
    monkeypatch.setattr(layout, "fsync_dir", lambda p: events.append(("fsync", os.path.basename(p))))
    monkeypatch.setattr(
        layout.os, "replace", lambda a, b: (events.append(("rename", os.path.basename(b))), real_replace(a, b))[1]
    )
    partial, final = tmp_path / ".iter_000000001.partial", tmp_path / "iter_000000001"
    for comp in ("model", "optim", "trainer"):
        (partial / comp).mkdir(parents=True)
        (partial / comp / ".metadata").write_bytes(b"x")
    layout.commit_rename(partial, final)
    rename = events.index(("rename", "iter_000000001"))
    assert sorted(events[:rename]) == [("fsync", n) for n in (".iter_000000001.partial", "model", "optim", "trainer")]
    assert events[rename + 1 :] == [("fsync", tmp_path.name)]
    assert (final / "optim" / ".metadata").read_bytes() == b"x" and not partial.exists()


def test_a_folder_fsync_that_fails_on_a_helper_thread_fails_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folders are fsynced on helper threads: an error there (EIO from the disk; simulated,
    it cannot be produced here) fails the commit, and nothing is renamed into place."""
    from ckpt_engine._format import layout

    def fsync_dir(p: Any) -> None:
        if os.path.basename(p) == ".iter_000000001.partial":  # the last of the list: a helper thread's
            raise OSError(5, "Input/output error", os.fspath(p))

    monkeypatch.setattr(layout, "fsync_dir", fsync_dir)
    partial, final = tmp_path / ".iter_000000001.partial", tmp_path / "iter_000000001"
    for comp in ("model", "optim", "trainer"):
        (partial / comp).mkdir(parents=True)
    with pytest.raises(OSError, match="Input/output error"):
        layout.commit_rename(partial, final)
    assert partial.is_dir() and not final.exists()
