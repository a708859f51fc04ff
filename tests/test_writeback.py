"""Early writeback (``ckpt_engine._storage.writeback``): the fast writer hands each data file to
the disk in chunks as it writes it, only where the file will be fsynced, and a filesystem that
refuses the hint changes nothing about what is written."""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from ckpt_engine._dcpio.fast_write import FastFileSystemWriter
from ckpt_engine._storage import writeback
from ckpt_engine._storage.writeback import CHUNK_BYTES, Writeback

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="sync_file_range is Linux's")


class _Recorder:
    """Passes every request to the real ``sync_file_range`` and records it."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.calls: list[tuple[int, int, int, int]] = []

    def __call__(self, fd: int, offset: int, nbytes: int, flags: int) -> int:
        self.calls.append((fd, offset, nbytes, flags))
        return int(self.real(fd, offset, nbytes, flags))


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _Recorder:
    real = writeback._sync_file_range
    assert real is not None, "sync_file_range should be found in this Linux libc"
    rec = _Recorder(real)
    monkeypatch.setattr(writeback, "_sync_file_range", rec)
    return rec


def _big_state() -> dict[str, torch.Tensor]:
    # 3 tensors of 12 MiB: one file of 36 MiB, two chunks and a tail
    return {f"w{i}": torch.full((3 << 20,), float(i)) for i in range(3)}


@linux_only
def test_the_real_call_is_found_and_accepted_on_a_regular_file(tmp_path: Any) -> None:
    assert writeback._sync_file_range is not None
    with open(tmp_path / "f", "wb") as f:
        f.write(b"x" * (CHUNK_BYTES + 1))
        f.flush()
        wb = Writeback(f.fileno())
        wb.wrote(CHUNK_BYTES + 1)
        assert wb.active  # the kernel took the request (a refusal turns it off)


@linux_only
def test_a_refusing_file_turns_writeback_off(tmp_path: Any) -> None:
    read_end, write_end = os.pipe()  # sync_file_range on a pipe: ESPIPE, a real refusal
    try:
        wb = Writeback(write_end)
        wb.wrote(CHUNK_BYTES - 1)
        assert wb.active  # under a chunk: nothing asked yet
        wb.wrote(CHUNK_BYTES)
        assert not wb.active
    finally:
        os.close(read_end)
        os.close(write_end)


@linux_only
def test_the_writer_hands_each_chunk_to_the_disk_once_in_order(tmp_path: Any, recorder: _Recorder) -> None:
    state = _big_state()
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FastFileSystemWriter(path, thread_count=1))
    data = [n for n in os.listdir(path) if n.endswith(".distcp")]
    assert len(data) == 1
    size = os.path.getsize(os.path.join(path, data[0]))
    ranges = [(off, n) for _, off, n, _ in recorder.calls]
    assert recorder.calls and all(flags == 2 for *_, flags in recorder.calls)  # SYNC_FILE_RANGE_WRITE only
    assert ranges[0][0] == 0
    for (a, n), (b, _) in itertools.pairwise(ranges):
        assert b == a + n  # contiguous, no byte asked twice
    assert all(n >= CHUNK_BYTES for _, n in ranges)
    covered = ranges[-1][0] + ranges[-1][1]
    assert size - CHUNK_BYTES < covered <= size  # everything but the tail, left to the fsync
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(template, storage_reader=FileSystemReader(path))
    assert all(torch.equal(template[k], v) for k, v in state.items())


@linux_only
def test_no_writeback_without_fsync(tmp_path: Any, recorder: _Recorder) -> None:
    dcp.save(_big_state(), storage_writer=FastFileSystemWriter(str(tmp_path / "c"), sync_files=False))
    assert recorder.calls == []


def test_a_refused_hint_leaves_the_file_written_and_fsynced(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    refused: list[int] = []
    monkeypatch.setattr(writeback, "_sync_file_range", lambda fd, off, n, flags: refused.append(off) or -1)
    synced: list[int] = []
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real_fsync(fd)))
    state = _big_state()
    path = str(tmp_path / "ckpt")
    dcp.save(state, storage_writer=FastFileSystemWriter(path, thread_count=1))
    assert refused == [0]  # asked once, refused, not asked again for that file
    assert len(synced) >= 2  # the data file and the metadata, fsynced as without the hint
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(template, storage_reader=FileSystemReader(path))
    assert all(torch.equal(template[k], v) for k, v in state.items())
