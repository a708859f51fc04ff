"""A resume on another number of ranks or nodes from the node-local tier: the newest step is
resharded from the surviving copies (``tests/dist_scripts/reshard.py``, FSDP2 with AdamW on gloo,
simulated nodes), with nothing read from ``save_dir``, and equals the saved state bit for bit.

Two trainings save 7 steps (durable at 5): 4 ranks on 2 nodes, and 2 ranks on 2 nodes. Copies of
their folders are then damaged as failures would and resumed: 4 -> 2 ranks after node 1 is lost
(node 0 holds every part: its own and node 1's replicas), 4 -> 2 after node 0 is lost (the
surviving node sends its parts to the rank on the new, empty node), 2 -> 4, and 4 -> 3 ranks on 3
nodes (an uneven reshard; node 2 is new and empty). One resharding resume is SIGKILLed while it
exchanges the parts; the next resume of the same folders is still exact. A part damaged on the
node that serves it is refused on arrival, and the resume reads ``save_dir`` instead.

The launches are shared: a training's launch also runs the resume that is killed, and each
resume launch resumes every copy of its world size.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _torchrun import run_torchrun, start_torchrun

pytestmark = [pytest.mark.dist, pytest.mark.full]

TIMEOUT = 300.0


def _launch(nproc: int, *args: str) -> dict[int, list[Any]]:
    run = run_torchrun("reshard.py", *args, nproc=nproc, timeout=TIMEOUT)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == list(range(nproc)), run.describe()
    return results


def _copy(trained: Path, into: Path, *wipe: str) -> str:
    shutil.copytree(trained, into, symlinks=True)
    for node in wipe:
        shutil.rmtree(into / node)
    return str(into)


def _flip(path: Path) -> None:
    """One byte of ``path`` changed in place, its size kept (what only a checksum catches)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _wait_for(done: Callable[[], bool], job: Any, what: str) -> None:
    """Bounded by progress: the job is alive and still on its way (it exits on any failure)."""
    while not done():
        assert job.poll() is None, f"the job ended before {what}: " + (job.stdout.read()[-4000:] if job.stdout else "")
        time.sleep(0.05)


def _train_two_then_stall(two: Path, killed: str) -> None:
    """The 2-rank training, then in the same launch a resume of ``killed`` that stops inside its
    exchange of parts; then the whole job is SIGKILLed."""
    two.mkdir()
    with start_torchrun("reshard.py", "train", str(two), "1", "7", "then", "stall", f"{killed}:1") as job:
        try:
            _wait_for(lambda: os.path.exists(os.path.join(killed, "stalled")), job, "the resharding resume stopped")
        finally:
            ranks = [int(p.read_text()) for p in Path(killed).glob("pid_*")]
            for pid in ranks:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
            job.wait()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reshard")
    four = root / "four"
    four.mkdir()
    _launch(4, "train", str(four), "2", "7")
    lost1, killed = _copy(four, root / "lost1", "node1"), _copy(four, root / "killed", "node0")
    _train_two_then_stall(root / "two", killed)
    leftover = _resharded_folders(killed)
    grown, uneven = _copy(root / "two", root / "grown"), _copy(four, root / "uneven")
    damaged = _copy(four, root / "damaged", "node0")
    _flip(Path(damaged, "node1", "rank_00000", "iter_000000007", "model", "__0_0.distcp"))
    back = _copy(four, root / "back")  # 4 ranks, then 2 that save step 8 to the tier, then 4 again
    here = _copy(four, root / "damaged_here", "node1")  # node 0 holds every part; one of them damaged
    _flip(Path(here, "node0", "rank_00000", "iter_000000007", "model", "__0_0.distcp"))
    out: dict[str, Any] = {"leftover": leftover}
    resumes = (
        (2, [f"{lost1}:2", f"{killed}:1", f"{damaged}:1", f"{here}:2"]),
        (4, [f"{grown}:2", f"{back}:2"]),
        (3, [f"{uneven}:1"]),
    )
    for nproc, targets in resumes:
        chain = ["then", "continue", f"{back}:2"] if nproc == 2 else []
        results = _launch(nproc, "resume", *targets, *chain)
        if chain:  # the 2-rank job that resumed "back" and saved one step more
            out["back_on_two"] = [r for rank in sorted(results) for r in results[rank] if r["base"] == back]
        for target in targets:
            base = target.rsplit(":", 1)[0]
            out[Path(base).name] = [next(r for r in results[rank] if r["base"] == base) for rank in range(nproc)]
    out["left_after"] = _resharded_folders(killed)
    return out


def _resharded_folders(base: str) -> list[str]:
    return sorted(str(p.relative_to(base)) for p in Path(base).glob("node*/.ckpt_engine_reshard/rank_*"))


def _checked(reports: list[dict[str, Any]]) -> list[set[str]]:
    """Every rank resumed step 7 exactly, none read ``save_dir``: the sources each rank read."""
    assert [(r["iteration"], r["same"]) for r in reports] == [(7, True)] * len(reports), reports
    assert all(r["by_source"].get("durable", 0) == 0 for r in reports), reports
    return [set(r["by_source"]) for r in reports]


def test_four_ranks_shrink_to_two_after_a_node_is_lost(resumed: dict[str, Any]) -> None:
    # node 0 survived with every part: its ranks read them from its disk
    assert _checked(resumed["lost1"]) == [{"local"}, {"local"}]
    # node 0 lost: the job's rank 0 is on a new, empty node and receives everything from rank 1
    assert _checked(resumed["killed"]) == [{"peer"}, {"local"}]


def test_two_ranks_grow_to_four(resumed: dict[str, Any]) -> None:
    assert _checked(resumed["grown"]) == [{"local"}] * 4


def test_four_ranks_reshard_unevenly_onto_three(resumed: dict[str, Any]) -> None:
    assert _checked(resumed["uneven"]) == [{"local"}, {"local"}, {"peer"}]


def test_a_resharding_resume_killed_in_its_exchange_leaves_the_next_one_exact(resumed: dict[str, Any]) -> None:
    # the killed resume had begun to fill its resharded folder; the next one starts it afresh
    assert resumed["leftover"] == ["node0/.ckpt_engine_reshard/rank_00000", "node1/.ckpt_engine_reshard/rank_00001"]
    assert _checked(resumed["killed"])[0] == {"peer"}
    assert resumed["left_after"] == []  # a load removes its resharded folder once it has read it


def test_a_job_back_on_more_ranks_takes_the_newer_step_of_the_fewer(resumed: dict[str, Any]) -> None:
    """4 ranks save 7 steps; 2 ranks resume 7 (resharded) and save 8 to the tier; 4 ranks resume.
    The tier holds 7 of the 4-rank shape and 8 of the 2-rank one: the resume tried its own shape
    first and resharded only when it found none, so 7 was resumed and the committed 8 lost. It
    takes the newest step of any shape, resharded, exactly."""
    assert [(r["iteration"], r["same"]) for r in resumed["back_on_two"]] == [(7, True)] * 2
    reports = resumed["back"]
    assert [(r["iteration"], r["same"]) for r in reports] == [(8, True)] * 4, reports
    assert all(r["by_source"].get("durable", 0) == 0 for r in reports), reports


def test_a_damaged_part_read_on_its_node_is_named_by_its_own_file(resumed: dict[str, Any]) -> None:
    """A part the resuming node holds is read through a stand-in in the resharded folder, which
    is removed after the load: its damage was reported under the stand-in's name. It names the
    old rank's file, the one to restore; every rank resumes save_dir's step."""
    reports = resumed["damaged_here"]
    assert [(r["iteration"], r["same"], set(r["by_source"])) for r in reports] == [(5, True, {"durable"})] * 2
    said = [m for r in reports for m in r["damaged"]]
    assert said and all("node0/rank_00000/iter_000000007/model/__0_0.distcp" in m for m in said), said
    assert not [m for m in said if ".ckpt_engine_reshard" in m], said


def test_a_damaged_part_is_refused_on_arrival_and_the_resume_reads_save_dir(resumed: dict[str, Any]) -> None:
    """Node 0 lost, and node 1's replica of old rank 0's model file damaged (its size kept): rank
    0 receives it, its block does not match the manifest, and every rank resumes save_dir's step."""
    reports = resumed["damaged"]
    assert [(r["iteration"], r["same"]) for r in reports] == [(5, True)] * 2, reports
    assert [set(r["by_source"]) for r in reports] == [{"durable"}] * 2
