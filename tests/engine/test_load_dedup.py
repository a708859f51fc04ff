"""Loads without a central plan, and ``dedup_reads``: what several ranks need is read once, then broadcast.

Real ``torchrun``/gloo ranks on real checkpoints (local files and the S3-protocol server of
tests/_s3.py): 4 ranks loading a checkpoint one process wrote read it once between them
(``bytes_read`` sums to its data files' size; without ``dedup_reads`` each rank reads all of
it), bit-exact; a strict mismatch raises the same error on every rank; a rank SIGKILLed or
SIGSTOPped between two broadcasts of the shared reads is named by the others (no hang); FSDP2
resharding (4 -> 2, 2 -> 4) is unchanged with ``dedup_reads: on`` and HSDP replicas read their
shards once, also right after an FSDP2 load in the same process group. The S3 loads run with
``CKPT_ENGINE_SLOW_TESTS=1``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import dedup_load  # the torchrun script: its model and hashing, used here to compute the expected values
import pytest
import torch
from _torchrun import run_ranks, run_torchrun

from ckpt_engine import CheckpointEngine, EngineConfig
from ckpt_engine._dcpio.coordination import Comm
from ckpt_engine._dcpio.dedup_read import BATCH_BYTES, dedup_wanted, sharing_sets, stripe
from ckpt_engine._dcpio.fast_read import FastFileSystemReader
from ckpt_engine._dcpio.object_read import ObjectStoreReader
from ckpt_engine._format.metadata import read_metadata
from ckpt_engine._format.metadata_parser import parse_metadata

SLOW = os.environ.get("CKPT_ENGINE_SLOW_TESTS") == "1"
ITERATION = 4


def _saved_state(seed: int = 5) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, optim = dedup_load.replicated_state()
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    return model, optim


def _data_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*.distcp"))


def _unread_bytes(metadata: Any) -> int:
    """The stored bytes of the optimizer's component that no load reads: the hyper-parameters of
    every parameter but the first (``0.weight``) of its one group, which torch never uses."""
    return sum(
        info.length
        for index, info in metadata.storage_data.items()
        if index.fqn.startswith("param_groups.") and not index.fqn.startswith("param_groups.0.weight.")
    )


def _read_bytes(folder: Path) -> int:
    """The bytes a load of the checkpoint in ``folder`` reads: its data files but :func:`_unread_bytes`."""
    return _data_bytes(folder) - _unread_bytes(read_metadata(str(folder / "optim")))


def _check_replicated(results: dict[int, list[Any]], expected: dict[str, str], total: int, world: int) -> None:
    assert sorted(results) == list(range(world))
    got = [results[r][0] for r in range(world)]
    for rank, out in enumerate(got):
        for mode in ("off", "on"):
            assert out[mode]["iteration"] == ITERATION, (rank, mode)
            assert out[mode]["hashes"] == expected, (rank, mode)  # bit-exact, every tensor
        assert out["off"]["bytes_read"] >= total, rank  # alone, each rank reads all a load reads
        assert out["on"]["bytes_read"] < total, rank  # shared: a share of it
    assert sum(out["on"]["bytes_read"] for out in got) == total  # every byte a load reads, once
    assert sum(1 for out in got if out["on"]["bytes_read"]) >= 2  # striped over the ranks
    strict = [out["strict"] for out in got]
    assert strict[0]["type"] == "LoadStrictnessError" and strict[0]["typed"], strict[0]
    assert "4.weight" in strict[0]["message"] and "4.bias" in strict[0]["message"]
    assert all(s["type"] == strict[0]["type"] and s["message"] == strict[0]["message"] for s in strict)


@pytest.mark.dist
def test_four_ranks_read_a_one_process_checkpoint_once_between_them(tmp_path: Path) -> None:
    model, optim = _saved_state()
    with CheckpointEngine({"save_dir": str(tmp_path / "ck")}) as engine:
        engine.save(ITERATION, model=model, optimizer=optim)
    folder = tmp_path / "ck" / f"iter_{ITERATION:09}"
    config = {"save_dir": str(tmp_path / "other"), "load_path": str(folder), "load_training_state": True}
    run = run_torchrun("dedup_load.py", json.dumps({"mode": "replicated", "config": config}), nproc=4, timeout=180)
    assert run.returncode == 0, run.describe()
    _check_replicated(run.results(), dedup_load.hashes(model, optim), _read_bytes(folder), 4)


@pytest.mark.dist
def test_shared_reads_of_a_checkpoint_with_whole_file_digests_only_are_checked(tmp_path: Path) -> None:
    """A manifest from before per-block digests: each file is checked by its whole-file digest
    where the load reads at least half of it. Reads shared between ranks left the plan the reader
    was given, and each shared range was checked alone, which never covers a file: a flipped byte
    loaded on every rank. Both ranks now refuse it, naming the file."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Linear(256, 512), torch.nn.Linear(512, 64))
    with CheckpointEngine({"save_dir": str(tmp_path / "ck")}) as engine:
        engine.save(1, model=model).result()
    folder = tmp_path / "ck" / "iter_000000001"
    manifest = folder / "ckpt_engine_manifest.json"
    doc = json.loads(manifest.read_text())
    for entry in doc["files"].values():
        entry.pop("blocks", None)
    manifest.write_text(json.dumps(doc))
    data = folder / "model" / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    run = run_torchrun("dedup_whole_file.py", str(folder), str(tmp_path / "other"), nproc=2, timeout=120)
    assert run.returncode == 0, run.describe()
    for rank, (got,) in sorted(run.results().items()):
        assert got["raised"] == "CorruptCheckpointError", (rank, got)
        assert f"model/__0_0.distcp is damaged: bytes 0-{len(raw)}" in got["message"], (rank, got)


@pytest.mark.dist
@pytest.mark.skipif(not SLOW, reason="4 ranks against the S3 server; CKPT_ENGINE_SLOW_TESTS=1")
def test_s3_loads_read_each_byte_once(s3_bucket: Any, tmp_path: Path) -> None:
    model, optim = _saved_state(seed=6)
    config: dict[str, Any] = {"save_dir": s3_bucket.url, "storage": {**s3_bucket.storage}}
    with CheckpointEngine(config) as engine:
        engine.save(ITERATION, model=model, optimizer=optim)
    prefix = f"iter_{ITERATION:09}/"
    fs = s3_bucket.fs()
    total = sum(
        int(fs.info(f"{s3_bucket.name}/run/{key}")["size"])
        for key in s3_bucket.objects()
        if key.startswith(prefix) and key.endswith(".distcp")
    )
    total -= _unread_bytes(parse_metadata(fs.cat(f"{s3_bucket.name}/run/{prefix}optim/.metadata")))
    assert total > 0
    run = run_torchrun("dedup_load.py", json.dumps({"mode": "replicated", "config": config}), nproc=4, timeout=240)
    assert run.returncode == 0, run.describe()
    _check_replicated(run.results(), dedup_load.hashes(model, optim), total, 4)


@pytest.mark.dist
@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_a_rank_lost_between_broadcasts_is_named(tmp_path: Path, sig: str) -> None:
    model, optim = _saved_state()
    with CheckpointEngine({"save_dir": str(tmp_path / "ck")}) as engine:
        engine.save(ITERATION, model=model, optimizer=optim)
    timeout_s = 6
    config = {
        "save_dir": str(tmp_path / "other"),
        "load_path": str(tmp_path / "ck" / f"iter_{ITERATION:09}"),
        "load_training_state": True,
        "collective_timeout_s": timeout_s,
    }
    spec = {"mode": "fault", "config": config, "victim": 2, "at": 2, "signal": sig, "work": str(tmp_path)}
    run = run_ranks("dedup_load.py", json.dumps(spec), nproc=4, timeout=180)
    results = run.results()
    named = []
    for rank in (0, 1, 3):
        assert rank in results, run.describe()
        got = results[rank][0]["load"]
        assert got["typed"], got
        assert got["type"] in ("CollectiveTimeoutError", "ProcessGroupError"), got
        named.append("rank 2" in got["message"])
    # Named within the timeout of the moment it was lost, not a whole timeout after the failed
    # broadcast (1.5x the timeout before the roll call counted the broadcast's wait): a rank whose
    # broadcast failed calls the roll with what was left of the broadcast's deadline, and the others
    # stop waiting when it gives up. With STOP the broadcast waited out its half of the timeout, so
    # at most the other half is left; a SIGKILL breaks it at once, leaving less than a whole timeout.
    waits = [w for rank in (0, 1, 3) for w in results[rank][0]["roll_waits"]]
    assert waits, "no rank called the roll with the failed broadcast's deadline"
    assert all(0 < w <= (timeout_s / 2 if sig == "STOP" else timeout_s - 1e-3) for w in waits), waits
    # The lost rank is named. After a SIGKILL, the rank whose broadcast connection to it closed may
    # report its own failed collective first (the process group is broken either way); the others'
    # roll call names it.
    assert all(named) if sig == "STOP" else any(named), [results[r][0]["load"]["message"] for r in (0, 1, 3)]
    if sig == "STOP":  # woken after the others gave up: it raises too, instead of hanging
        assert 2 in results, run.describe()
        assert results[2][0]["load"]["typed"], results[2]


@pytest.mark.dist  # in CI: its HSDP load is the regression test of the sharing groups' names
def test_fsdp2_resharding_is_unchanged_with_dedup_reads(tmp_path: Path) -> None:
    def launch(world: int, *steps: tuple[str, str, Path, int, bool]) -> dict[str, dict[int, dict[str, Any]]]:
        """``(name, mode, save_dir, seed, hsdp)`` steps in one launch of ``world`` ranks: each step's
        report by rank (a launch costs more than a step)."""
        specs = [
            {
                "name": name,
                "mode": mode,
                "config": {"save_dir": str(save_dir), "dedup_reads": "on"},
                "seed": seed,
                "iteration": ITERATION,
                "hsdp": hsdp,
            }
            for name, mode, save_dir, seed, hsdp in steps
        ]
        run = run_torchrun("dedup_load.py", *map(json.dumps, specs), nproc=world, timeout=240)
        assert run.returncode == 0, run.describe()
        out: dict[str, dict[int, dict[str, Any]]] = {}
        for rank, reports in run.results().items():
            for report in reports:
                out.setdefault(report["name"], {})[rank] = report
        assert all(sorted(by_rank) == list(range(world)) for by_rank in out.values()), run.describe()
        return out

    # 3 launches for the 5 steps: the 4-rank load of the 2-rank save, the HSDP load of it and the
    # 4-rank save share one. The HSDP load after the FSDP2 load is the regression test of the
    # sharing groups' names: members that had joined different sharing groups before named one
    # group differently (torch counts a rank's groups into the name of a locally made group) and
    # waited for each other until the timeout.
    w2, w4 = tmp_path / "w2", tmp_path / "w4"
    saved_at = {2: launch(2, ("save", "fsdp_save", w2, 1, False))["save"][0]}
    four = launch(
        4,
        ("load", "fsdp_load", w2, 2, False),
        ("hsdp", "fsdp_load", w2, 3, True),
        ("save", "fsdp_save", w4, 1, False),
    )
    saved_at[4] = four["save"][0]
    loaded_at = {(2, 4): four["load"], (4, 2): launch(2, ("load", "fsdp_load", w4, 2, False))["load"]}
    for saver, loader in ((2, 4), (4, 2)):
        save_dir = tmp_path / f"w{saver}"
        saved = saved_at[saver]
        loaded = loaded_at[saver, loader]
        for rank in range(loader):
            got = loaded[rank]
            assert got["params"] == saved["params"], (saver, loader, rank)
            assert got["exp_avg"] == saved["exp_avg"], (saver, loader, rank)
        if saver == 2:  # HSDP: 2 replicas of the 2-rank sharding; each pair of replicas reads its shards once
            hsdp = four["hsdp"]
            assert all(hsdp[r]["params"] == saved["params"] for r in range(4))
            folder = save_dir / f"iter_{ITERATION:09}"
            total = sum(_data_bytes(folder / name) for name in hsdp[0]["components"])
            total -= _unread_bytes(read_metadata(str(folder / "optim")))
            read = sum(hsdp[r]["bytes_read"] for r in range(4))
            # no byte read twice; what is not read at all are the archives of empty shards (the
            # 1-row layers saved as 1 + 0 rows), which no rank needs: 6 items of about 1.3 KiB
            assert total - 6 * 1400 <= read <= total, (read, total)


# -- the parts, in one process ------------------------------------------------------------------


def test_every_rank_finds_every_sharing_set_in_one_order() -> None:
    """The groups of all sharing sets are made on every rank, in the order this gives: ranks that
    shared with different ranks before must still agree on each group's name."""
    a, b, c = b"a" * 16, b"b" * 16, b"c" * 16
    # class 0 (plain values): ranks 0-3 alike; class 1 (shards): 0 and 1 alike, 2 alone, 3 none
    table = [(a, b), (a, b), (a, c), (a, b"")]
    assert sharing_sets(table) == [(0, 1, 2, 3), (0, 1)]
    assert sharing_sets([(a, b), (a, b)]) == [(0, 1)]  # one set shared by both classes: one group
    assert sharing_sets([(b"", b"")] * 3) == [] and sharing_sets([]) == []


def test_stripe_gives_every_item_to_one_member_in_runs_of_about_equal_bytes() -> None:
    keys = [("__0_0.distcp", i * 1000, 100 + i) for i in range(10)] + [("__1_0.distcp", 0, 5000)]
    batches = stripe(keys, 3)
    assert stripe(list(reversed(keys)), 3) == batches  # the same answer whatever the order given
    owned = [[k for b in member for k in b.keys] for member in batches]
    assert [k for member in owned for k in member] == sorted(keys)  # each item once, runs in file order
    loads = [sum(k[2] for k in member) for member in owned]
    total = sum(loads)
    assert all(abs(load - total / 3) <= max(k[2] for k in keys) for load in loads), loads
    assert [len(stripe(keys[:2], 4)[m]) for m in range(4)] == [1, 1, 0, 0]  # fewer items than members
    big = stripe([("f", 0, BATCH_BYTES), ("f", BATCH_BYTES, 10), ("f", BATCH_BYTES + 10, 10)], 1)[0]
    assert [b.nbytes for b in big] == [BATCH_BYTES, 20]  # batches are cut at BATCH_BYTES


def test_dedup_reads_auto_is_on_for_object_stores_and_for_several_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    local = FastFileSystemReader.__new__(FastFileSystemReader)
    remote = ObjectStoreReader.__new__(ObjectStoreReader)
    assert EngineConfig(save_dir="x").dedup_reads == "auto"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert dedup_wanted("auto", remote, 4) and not dedup_wanted("auto", local, 4)
    assert dedup_wanted("auto", local, 8)  # 8 ranks, 4 per host: a shared filesystem over the network
    assert dedup_wanted("on", local, 4) and not dedup_wanted("off", remote, 4)
    assert not dedup_wanted("on", local, 1) and not dedup_wanted("on", object(), 4)


def test_one_process_settle_returns_the_value_or_raises_the_held_error() -> None:
    from torch.distributed.checkpoint.api import CheckpointException

    comm = Comm()
    assert comm.settle("plan", 7) == 7
    with pytest.raises(CheckpointException) as info:
        comm.step("plan", lambda: 1 / 0)
    err, _trace = info.value.failures[0]  # DCP's form: (error, traceback summary), which its str() formats
    assert isinstance(err, ZeroDivisionError) and "ZeroDivisionError" in str(info.value)


def test_a_one_process_load_reports_the_bytes_it_read(tmp_path: Path) -> None:
    model, optim = _saved_state()
    with CheckpointEngine({"save_dir": str(tmp_path / "ck")}) as engine:
        engine.save(ITERATION, model=model, optimizer=optim)
        fresh, fresh_optim = dedup_load.replicated_state()
        result = engine.load(model=fresh, optimizer=fresh_optim)
    assert dedup_load.hashes(fresh, fresh_optim) == dedup_load.hashes(model, optim)
    total = _read_bytes(tmp_path / "ck" / f"iter_{ITERATION:09}")
    # every item a load reads once, plus the archive headers the direct path reads ahead of large items
    assert total <= result.bytes_read < total + 2 * 4096 * 40
