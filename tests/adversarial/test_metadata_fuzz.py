"""Damaged ``.metadata``: every single-bit flip and every truncation is a typed error, in bounded memory.

Before the parse and the structural checks, 280 of 4,056 bit flips of one ``.metadata`` escaped as
bare ``MemoryError``/``OverflowError``/``RuntimeError``, ``verify_checkpoint`` raised
``AttributeError``, and one flip (BUILD -> LONG_BINPUT) got the process OOM-killed at 24 GB.
``CKPT_ENGINE_FUZZ=thorough`` also flips a larger model + optimizer ``.metadata``.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata

from ckpt_engine import CheckpointEngine, CorruptCheckpointError
from ckpt_engine._format.metadata import read_metadata
from ckpt_engine._format.metadata_read import metadata_from_bytes
from ckpt_engine._format.verify import verify_checkpoint

THOROUGH = os.environ.get("CKPT_ENGINE_FUZZ") == "thorough"


def small_metadata(tmp_path: Path) -> bytes:
    """The ``.metadata`` of a ``Linear(8, 16)``, as the issue's reproduction used."""
    dcp.save(nn.Linear(8, 16).state_dict(), checkpoint_id=tmp_path / "small")
    return (tmp_path / "small" / ".metadata").read_bytes()


def flips(data: bytes) -> Iterator[bytes]:
    for i in range(len(data)):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[i] ^= 1 << bit
            yield bytes(damaged)


def outcome(parse: Callable[[], Metadata], path: Path) -> str | None:
    """``None`` for a valid ``Metadata``, the error for a :class:`CorruptCheckpointError` (its
    subclass ``UnsafeCheckpointError`` included) naming ``path``; anything else fails the test."""
    try:
        md = parse()
    except CorruptCheckpointError as err:
        assert str(path) in str(err)
        return f"{type(err).__name__}: {err}"
    assert isinstance(md, Metadata)
    return None


def parse_all(cdir: Path, variants: Iterable[bytes], through_file_every: int = 100) -> tuple[int, int]:
    """Parse every variant as the bytes of ``cdir/.metadata``; returns (refused, accepted) counts.

    Each is parsed from memory, as :func:`read_metadata` parses what it read (writing each to the
    file costs a disk flush per case); every ``through_file_every``-th is also written to the file
    and read back by :func:`read_metadata`, which must give the same outcome."""
    refused = accepted = 0
    path = cdir / ".metadata"
    for n, data in enumerate(variants):
        got = outcome(lambda: metadata_from_bytes(data, str(path)), path)  # noqa: B023 (called at once)
        if n % through_file_every == 0:
            path.write_bytes(data)
            assert outcome(lambda: read_metadata(str(cdir)), path) == got, n
        refused += got is not None
        accepted += got is None
    return refused, accepted


@pytest.mark.full  # exhaustive over its inputs: the full tier (CI)
def test_every_bit_flip_and_truncation_is_a_typed_error_in_bounded_memory(tmp_path: Path) -> None:
    data = small_metadata(tmp_path)
    cdir = tmp_path / "fuzz"
    cdir.mkdir()
    tracemalloc.start()
    try:
        refused, accepted = parse_all(cdir, flips(data))
        t_refused, t_accepted = parse_all(cdir, (data[:n] for n in range(len(data))))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused + accepted == 8 * len(data)
    assert refused > len(data)  # most flips break the structure; some only change a string
    assert t_accepted == 0 and t_refused == len(data)  # no prefix of a pickle is complete
    assert peak < 32 << 20


@pytest.mark.full  # over 2 s on 2 cores: every damaged .metadata
def test_verify_never_raises_for_a_damaged_metadata(tmp_path: Path, save_dir: str) -> None:
    """``verify_checkpoint`` reports damage and never raises, whatever one flipped bit does."""
    model = nn.Linear(8, 16)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=model)
    ckpt = Path(save_dir) / "iter_000000001"
    md_path = ckpt / "model" / ".metadata"
    good = md_path.read_bytes()
    step = 1 if THOROUGH else 13
    for n, damaged in enumerate(flips(good)):
        if n % step:
            continue
        with md_path.open("r+b") as f:  # in place: truncating first costs ext4 a flush per case
            f.write(damaged)
        for level in ("sizes", "checksums"):
            report = verify_checkpoint(str(ckpt), level)  # type: ignore[arg-type]
            assert not report.verified and report.problems  # the manifest's checksum no longer matches
    md_path.write_bytes(good)
    assert verify_checkpoint(str(ckpt), "checksums").verified


@pytest.mark.slow
@pytest.mark.skipif(not THOROUGH, reason="exhaustive: set CKPT_ENGINE_FUZZ=thorough")
def test_every_bit_flip_of_a_model_and_optimizer_metadata(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    dcp.save({"model": model.state_dict(), "optim": opt.state_dict()}, checkpoint_id=tmp_path / "big")
    data = (tmp_path / "big" / ".metadata").read_bytes()
    cdir = tmp_path / "fuzz"
    cdir.mkdir()
    refused, accepted = parse_all(cdir, flips(data))
    assert refused + accepted == 8 * len(data)
