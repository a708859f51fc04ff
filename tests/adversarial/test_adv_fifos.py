"""A FIFO (or any non-regular file) where a checkpoint file belongs is refused, never waited on."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from adversarial._adv import ckpt, load, save
from ckpt_engine import CorruptCheckpointError
from ckpt_engine._format.manifest import MANIFEST_FILE
from ckpt_engine.cli import main


@pytest.fixture(autouse=True)
def _alarm() -> Iterator[None]:
    """Without the check, each of these blocks forever: fail after a minute instead."""

    def hung(signum: int, frame: Any) -> None:
        raise TimeoutError("blocked opening a FIFO")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


@pytest.mark.parametrize(
    "where", ["latest_checkpoint.txt", "iter_000000002/model/.metadata", f"iter_000000002/{MANIFEST_FILE}"]
)
def test_fifo_is_refused_by_load_and_the_cli(where: str, save_dir: str, capsys: Any) -> None:
    save(save_dir, 2)
    victim = Path(save_dir, where)
    _fifo(victim)
    with pytest.raises(CorruptCheckpointError, match="FIFO") as info:
        load(save_dir)
    assert str(victim) in str(info.value)
    assert main(["verify", save_dir]) != 0
    assert "FIFO" in "".join(capsys.readouterr())
    for command in (["ls", save_dir], ["inspect", str(ckpt(save_dir, 2))]):
        main(command)  # an error or a listing, never a hang


def test_regular_file_helper_names_the_kind(tmp_path: Path) -> None:
    from ckpt_engine._storage.fscheck import read_regular, require_regular_file

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(CorruptCheckpointError, match="FIFO"):
        require_regular_file(fifo)
    with pytest.raises(CorruptCheckpointError, match="FIFO"):
        read_regular(fifo)
    require_regular_file(tmp_path / "missing")  # a missing file is the caller's to report


def test_every_wait_of_an_async_save_is_bounded_in_minutes_by_default() -> None:
    from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin

    options = PinnedStagingPlugin.Options()
    assert options.write_timeout_s <= 300 and options.writer_start_timeout_s <= 300
    assert options.close_timeout_s <= 300
