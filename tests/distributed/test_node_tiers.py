"""The node-local tier on 4 gloo ranks as 2 simulated nodes (``tests/dist_scripts/tiers.py``).

Each scenario trains once (a save every step, durable every 3rd, peer replicas on the other
node), then copies the folders and damages them as a failure would, and a resume checks every
copy: a restart resumes the last step with nothing from ``save_dir``; a lost node (its
``local_dir`` wiped) is rebuilt from its peers' replicas; both nodes lost falls back to the newest
durable step; a damaged copy is detected and another source used. Every resumed state is compared
bit for bit with the state of the step it names.

A 4-rank launch costs more than the work it runs, so the scenarios share their launches
(:func:`tiers`): one launch trains both models, one is the job killed while it replicates, and
one resumes all ten copies; each test then checks its own scenario's part. Under pytest-xdist the
tests that use the fixture go to one worker (tests/conftest.py groups a module fixture's tests),
so the launches run once per session. The two 2-rank scenarios (a ``local_dir`` shared between
nodes, files between two ranks) share one 2-rank launch too (:func:`pair`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from _torchrun import TorchrunResult, run_torchrun, start_torchrun

pytestmark = pytest.mark.dist

TIMEOUT = 240.0
RANKS = 4
#: The trainings of the shared launch: ``(name, kind, steps, config fields)``.
TRAININGS = (
    ("replicated", "replicated", 5, ()),
    ("fsdp", "fsdp", 5, ("plugins=pinned_staging", "incremental=1")),
)


def _launch(*args: str) -> dict[int, list[Any]]:
    run = run_torchrun("tiers.py", *args, nproc=RANKS, timeout=TIMEOUT)
    assert run.returncode == 0, run.describe()
    results = run.results()
    assert sorted(results) == list(range(RANKS)), run.describe()
    return results


def _copy(trained: Path, into: Path, *wipe: str) -> Path:
    shutil.copytree(trained, into, symlinks=True)
    for node in wipe:
        shutil.rmtree(into / node)
    return into


def _flip(path: Path) -> None:
    """One byte of ``path`` changed in place, its size kept (what only a checksum catches)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _sources(reports: list[dict[str, Any]]) -> list[set[str]]:
    return [set(r["by_source"]) for r in reports]


def _taken(results: list[dict[str, Any]]) -> list[set[str]]:
    """:func:`_sources`, with a rank that took its part from a peer counted as ``{"peer"}``: it also
    links the files its node holds with the same bytes, such as its rng/ file where nothing drew
    from the generators between two steps (``local`` beside ``peer``)."""
    return [s - {"local"} if "peer" in s else s for s in _sources(results)]


def _train_all(root: Path) -> dict[str, list[dict[str, Any]]]:
    """Both models trained in one launch; each training's reports by rank."""
    specs = []
    for name, kind, steps, extra in TRAININGS:
        (root / name / "trained").mkdir(parents=True)
        specs.append(":".join((str(root / name / "trained"), kind, str(steps), *extra)))
    results = _launch("trains", *specs)
    out: dict[str, list[dict[str, Any]]] = {}
    for rank in range(RANKS):
        for report in results[rank]:
            out.setdefault(Path(report["base"]).parent.name, []).append(report)
    return out


def _kill_while_replicating(base: Path) -> None:
    """The whole job SIGKILLed while step 4 replicates (slowly: throttled)."""
    base.mkdir(parents=True)
    args = ["train", str(base), "fsdp", "3", "hold=1", "peer_bandwidth_mb_s=0.02", "chunk_bytes=2048"]
    # Steps 1 to 3 must all reach the peers: on this slow link the default (skip) would leave
    # step 3 unreplicated, and a node loss would then find no copy of step 3 to resume.
    args.append("replication_when_behind=wait")
    with start_torchrun("tiers.py", *args, nproc=RANKS) as job:
        try:
            deadline = time.monotonic() + TIMEOUT
            in_flight: list[Path] = []
            while not in_flight:  # progress-bounded: the job reports each stage through the files it makes
                assert job.poll() is None, job.stdout.read()[-4000:] if job.stdout else ""
                assert time.monotonic() < deadline, "step 4 never started to replicate"
                in_flight = [p for p in base.glob("node1/rank_0000[01]/.iter_000000004.partial") if p.is_dir()]
                time.sleep(0.05)
        finally:
            _kill_job(job, base)


def _kill_job(job: Any, base: Path) -> None:
    """SIGKILL the ranks and torchrun at once. torchrun starts each rank in a session of its own,
    so killing its process group leaves the ranks running (replicating into ``base`` while the
    test copies it, then holding for minutes); each rank wrote its pid for this."""
    ranks = [int(p.read_text()) for p in base.glob("pid_*")]
    for pid in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    for pid in ranks:  # gone, or a zombie nobody reaps: either way it writes nothing more
        while _running(pid):
            time.sleep(0.01)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _damage_replicated(trained: Path, into: Path) -> list[Path]:
    """The replicated model's copies: restart, node 1 lost, both nodes lost, and two damaged."""
    restart = _copy(trained, into / "restart")
    node_lost = _copy(trained, into / "node_lost", "node1")
    both_lost = _copy(trained, into / "both_lost", "node0", "node1")
    damaged_own = _copy(trained, into / "damaged_own")
    # Rank 0's own copy of the last step damaged (its node holds no other copy of it), resumed
    # with verify: checksums: rank 0 takes its part from the replica on node 1.
    _flip(damaged_own / "node0/rank_00000/iter_000000005/model/__0_0.distcp")
    (damaged_own / "resume.json").write_text('{"verify": "checksums"}')
    damaged_replica = _copy(trained, into / "damaged_replica", "node1")
    # Node 1 lost and the only replica of rank 3's last step damaged: its checksums fail on
    # arrival, that step is complete for no rank set any more, so the step before it is resumed,
    # rank 3's from its older replica.
    replica_file = damaged_replica / "node0/rank_00003/iter_000000005/trainer/__0_0.distcp"
    replica_file.write_bytes(replica_file.read_bytes())  # its own inode: the damage stays in the replica
    _flip(replica_file)
    return [restart, node_lost, both_lost, damaged_own, damaged_replica]


def _run_scenarios(root: Path) -> dict[str, Any]:
    """Every scenario's launches: the trainings, the killed job, then one resume of every copy."""
    trained = _train_all(root)
    _kill_while_replicating(root / "killed" / "trained")
    replicated = _damage_replicated(root / "replicated" / "trained", root / "replicated")
    fsdp = root / "fsdp" / "trained"
    targets = [("replicated", b) for b in replicated]
    targets += [
        ("fsdp", _copy(fsdp, root / "fsdp" / "restart")),
        ("fsdp", _copy(fsdp, root / "fsdp" / "node_lost", "node1")),
    ]
    targets += [("replicated", _copy(fsdp, root / "fsdp" / "resharded"))]
    killed = root / "killed" / "trained"
    targets += [
        ("fsdp", _copy(killed, root / "killed" / "restart")),
        ("fsdp", _copy(killed, root / "killed" / "node_lost", "node1")),
    ]
    results = _launch("resume", *(f"{kind}:{base}" for kind, base in targets))
    resumed: dict[str, list[dict[str, Any]]] = {}
    for rank in range(RANKS):
        for report in results[rank]:
            base = Path(report["base"])
            resumed.setdefault(f"{base.parent.name}/{base.name}", []).append(report)
    return {"root": str(root), "trained": trained, "resumed": resumed}


@pytest.fixture(scope="module")
def tiers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reports of every scenario (``trained[name]``, ``resumed["name/copy"]``, each by rank)
    and ``root``, their folders."""
    return _run_scenarios(tmp_path_factory.mktemp("tiers"))


def test_replicated_model_restart_node_loss_both_nodes_and_damaged_copies(tiers: dict[str, Any]) -> None:
    root = Path(tiers["root"]) / "replicated"
    trained = root / "trained"
    ranks = tiers["trained"]["replicated"]
    assert [s["tier"] for s in ranks[0]["saves"]] == ["local", "local", "durable", "local", "local"]
    # A data-parallel replica holds the same bytes: the data files of rank 0's replica on node 1
    # are rank 2's own files, linked (the same inode), never sent. (Each .metadata names its save;
    # rng/ holds each rank's own generators, which differ.)
    own = trained / "node1/rank_00002/iter_000000005"
    data = sorted(p.relative_to(own) for p in own.glob("*/*.distcp") if p.parent.name != "rng")
    assert len(data) >= 3
    for rel in data:
        assert (own / rel).stat().st_ino == (trained / "node1/rank_00000/iter_000000005" / rel).stat().st_ino, rel

    got = {
        name: tiers["resumed"][f"replicated/{name}"]
        for name in ("restart", "node_lost", "both_lost", "damaged_own", "damaged_replica")
    }
    for name, reports in got.items():
        assert all(r["same"] for r in reports), (name, reports)

    assert [r["iteration"] for r in got["restart"]] == [5] * RANKS
    assert _sources(got["restart"]) == [{"local"}] * RANKS  # 0 bytes from save_dir

    assert [r["iteration"] for r in got["node_lost"]] == [5] * RANKS
    assert _taken(got["node_lost"]) == [{"local"}, {"local"}, {"peer"}, {"peer"}]
    for rank in (2, 3):  # node 1's tier is rebuilt: its own step, committed again on its node
        assert (root / f"node_lost/node1/rank_0000{rank}/iter_000000005/ckpt_engine_manifest.json").is_file()

    assert [r["iteration"] for r in got["both_lost"]] == [3] * RANKS
    assert _sources(got["both_lost"]) == [{"durable"}] * RANKS

    assert [r["iteration"] for r in got["damaged_own"]] == [5] * RANKS
    assert _taken(got["damaged_own"]) == [{"peer"}, {"local"}, {"local"}, {"local"}]

    assert [r["iteration"] for r in got["damaged_replica"]] == [4] * RANKS
    assert _taken(got["damaged_replica"]) == [{"local"}, {"local"}, {"peer"}, {"peer"}]


def test_fsdp2_async_incremental_restart_node_loss_and_a_resume_onto_another_sharding(tiers: dict[str, Any]) -> None:
    """FSDP2 (a shard of its own on every rank) saved through pinned_staging's writer process,
    incrementally: the local tier's writes run there too."""
    ranks = tiers["trained"]["fsdp"]
    assert [s["tier"] for s in ranks[0]["saves"]] == ["local", "local", "durable", "local", "local"]
    restart, node_lost, resharded = (tiers["resumed"][f"fsdp/{n}"] for n in ("restart", "node_lost", "resharded"))
    assert [(r["iteration"], r["same"]) for r in restart] == [(5, True)] * RANKS
    assert _sources(restart) == [{"local"}] * RANKS
    assert [(r["iteration"], r["same"]) for r in node_lost] == [(5, True)] * RANKS
    assert _taken(node_lost) == [{"local"}, {"local"}, {"peer"}, {"peer"}]
    # Each rank's local copy holds its FSDP shard only: a plain (unsharded) model needs every
    # element, which the local tier does not hold on any one rank, so save_dir reshards.
    assert [r["iteration"] for r in resharded] == [3] * RANKS
    assert _sources(resharded) == [{"durable"}] * RANKS


def test_a_job_killed_while_it_replicates_resumes_the_last_complete_step(tiers: dict[str, Any]) -> None:
    """The whole job SIGKILLed while step 4 replicates (slowly: throttled), then a restart, and a
    restart after node 1 was lost too: step 4's replicas are not committed, so the node loss
    resumes step 3 from the replicas of step 3, never a half-copied step."""
    restart, node_lost = (tiers["resumed"][f"killed/{n}"] for n in ("restart", "node_lost"))
    assert [(r["iteration"], r["same"]) for r in restart] == [(4, True)] * RANKS
    assert [(r["iteration"], r["same"]) for r in node_lost] == [(3, True)] * RANKS
    assert _taken(node_lost) == [{"local"}, {"local"}, {"peer"}, {"peer"}]


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[TorchrunResult, Path]:
    """The 2-rank scenarios, ``shared`` then ``transfer``, in one 2-rank launch (``tiers.py pair``)."""
    base = tmp_path_factory.mktemp("pair")
    return run_torchrun("tiers.py", "pair", str(base), nproc=2, timeout=TIMEOUT), base


def _scenario(run: TorchrunResult, name: str, rank: int) -> list[dict[str, Any]]:
    """What ``rank`` reported under scenario ``name`` of the shared 2-rank launch."""
    return [r for r in run.results().get(rank, []) if r["scenario"] == name]


def test_files_between_two_ranks_are_checked_on_arrival(pair: tuple[TorchrunResult, Path]) -> None:
    run, base = pair
    assert run.returncode == 0, run.describe()
    (r0, limit0), (r1, limit1) = (_scenario(run, "transfer", r) for r in (0, 1))
    assert (r0["message"], r1["message"]) == ("", "hello from rank 0")
    assert r0["files"] == {"bad": {}, "same": True, "received": 3000, "sent": 2510}
    assert r1["files"] == {"bad": {}, "same": True, "received": 2510, "sent": 3000}
    assert (base / "transfer/into1/model/empty").read_bytes() == b""
    assert r1["changed"]["bad"] == {"late.distcp": "its checksum does not match the manifest's"}
    assert r0["changed"]["bad"] == {}
    assert "gone.distcp" in r0["unreadable"]["unsent"]
    assert "gone.distcp" in r1["unreadable"]["bad"]
    assert limit1["limit"] == "rank 0 announced a message of 500 bytes; at most 10 are allowed"
    assert limit0["limit"] in (None, "sender cut off")  # its send may have completed first


def test_a_local_dir_shared_between_nodes_is_refused_at_the_first_save(pair: tuple[TorchrunResult, Path]) -> None:
    run, _ = pair
    assert run.returncode == 0, run.describe()
    for rank in (0, 1):
        (outcome,) = _scenario(run, "shared", rank)
        assert outcome["raised"] == "CheckpointSaveError", outcome
        assert (
            "is not node-local as ranks_per_node=1 says: rank 0 sees the local_dir of ranks [0, 1]"
            in outcome["message"]
        )
