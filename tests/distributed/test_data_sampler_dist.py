"""``ResumableDistributedSampler`` saved through the engine under torchrun (gloo ranks, each with a
``DataLoader`` of ``num_workers=2``): an epoch started on 4 ranks, resumed on 2, and from those 2
on 3. Every sample of the epoch is trained on exactly once across the runs, the sampler's state
is the same on every rank, and a resume on the same world size (a second job in the 2 ranks'
processes) trains on the batches of the uninterrupted run, batch for batch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from _torchrun import run_torchrun

pytestmark = pytest.mark.dist

N = 120
TIMEOUT = 240.0  # 4 ranks with 2 loader workers each on 2 CPU cores; a hang fails the test


def launch(nproc: int, save_dir: Path, save_at: int, stop_at: int, *flags: str) -> list[dict[str, Any]]:
    args = (str(save_dir), str(save_at), str(stop_at), *flags)
    run = run_torchrun("sampler_resume.py", *args, nproc=nproc, timeout=TIMEOUT)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == list(range(nproc)), run.describe()
    ranks = [results[r][0] for r in range(nproc)]
    for key in ("saved_state", "end_state"):
        states = [r.get(key) for r in ranks]
        assert all(s == states[0] for s in states), f"the sampler's {key} differs across ranks: {states}"
    return ranks


def trained(ranks: list[dict[str, Any]], until: int | None = None) -> list[int]:
    """The indices the ranks trained on, up to iteration ``until``."""
    return [i for r in ranks for it, batch in r["batches"] if until is None or it <= until for i in batch]


def test_an_epoch_saved_on_4_ranks_resumes_on_2_and_3_seeing_every_sample_once(tmp_path: Path) -> None:
    save_dir = tmp_path / "ckpt"
    four = launch(4, save_dir, save_at=4, stop_at=4)  # 4 steps of 3 samples on 4 ranks: 48 of 120
    assert four[0]["saved_state"]["position"] == 48
    two = launch(2, save_dir, 10, 0, "--replay")  # 6 more steps on 2 ranks (84), then the epoch's end
    assert two[0]["resumed_from"] == 4 and two[0]["saved_state"]["position"] == 84
    assert two[0]["end_state"]["position"] == N
    assert sorted(trained(four) + trained(two)) == list(range(N))
    for rank in range(2):  # the second job resumed from iteration 10 on the world size that saved it
        replay = two[rank]["replay"]
        assert replay["resumed_from"] == 10
        assert replay["batches"] == [b for b in two[rank]["batches"] if b[0] > 10]

    three = launch(3, save_dir, save_at=0, stop_at=0)  # from iteration 10: the 36 left, 12 per rank
    assert three[0]["resumed_from"] == 10
    assert sorted(trained(four) + trained(two, until=10) + trained(three)) == list(range(N))
