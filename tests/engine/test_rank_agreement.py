"""Every rank of a load reads one checkpoint (the rank agreement of ``_engine/rank_views.py``).

Two real gloo ranks under ``torchrun``, each given a folder of its own to stand for what one host
sees: a stale ``latest_checkpoint.txt`` on one host, host-local copies of one iteration that
diverged, a ``load_path`` (folder or ``.pth``) whose copies differ. Before, with ``dedup_reads``
on every rank loaded a mix of two checkpoints and reported one iteration; with it off the ranks
silently loaded different iterations. Now every rank raises the same
``CheckpointDisagreementError`` naming which rank saw what, and identical copies still load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import rank_views  # the torchrun script: its model digest, for the expected values
import torch
from _common import make_model
from _torchrun import run_torchrun

from ckpt_engine import CheckpointEngine
from ckpt_engine._engine.rank_views import CheckpointView, folder_view, require_one_checkpoint
from ckpt_engine._storage.store import LocalStore


def _save_run(folder: Path, seed: int, iterations: tuple[int, ...]) -> dict[int, str]:
    """A run of checkpoints of the script's model; the weights' digest at each iteration."""
    model = make_model(seed=seed)
    out = {}
    with CheckpointEngine({"save_dir": str(folder)}) as engine:
        for it in iterations:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)
            engine.save(it, model=model).result()
            out[it] = rank_views.weights_digest(model)
    return out


def _views(base: Path, name: str, rank0: Path, rank1: Path) -> str:
    """``base/name/rank{0,1}``: copies of two folders, one per rank; the ``{rank}`` template."""
    for r, src in enumerate((rank0, rank1)):
        shutil.copytree(src, base / name / f"rank{r}")
    return str(base / name / "rank{rank}")


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, list[dict[str, Any]]], dict[int, str]]:
    base = tmp_path_factory.mktemp("rank-views")
    run, other = base / "run", base / "other"
    want = _save_run(run, seed=1, iterations=(10, 20))
    _save_run(other, seed=2, iterations=(20,))
    stale = base / "stale"  # the run as one host saw it before iteration 20 was committed
    shutil.copytree(run, stale)
    (stale / "latest_checkpoint.txt").write_text("iter_000000010\n")
    shutil.rmtree(stale / "iter_000000020")
    pointer = base / "pointer"  # a stale pointer only: that host sees the committed iteration 20
    shutil.copytree(run, pointer)
    (pointer / "latest_checkpoint.txt").write_text("iter_000000010\n")
    diverged = base / "diverged"  # the run, with another run's iteration 20
    shutil.copytree(run, diverged)
    shutil.rmtree(diverged / "iter_000000020")
    shutil.copytree(other / "iter_000000020", diverged / "iter_000000020")
    pth = base / "pth"
    for r, seed in enumerate((3, 4)):
        (pth / f"rank{r}").mkdir(parents=True)
        torch.save(make_model(seed=seed).state_dict(), pth / f"rank{r}" / "w.pth")
    out = str(base / "out{rank}")
    cases = []
    for dedup in ("on", "off"):
        for name, rank1 in (("stale", stale), ("diverged", diverged), ("same", run), ("pointer", pointer)):
            load_dir = _views(base, f"{name}-{dedup}", run, rank1)
            cases.append(
                {"name": f"{name}-{dedup}", "config": {"save_dir": out, "load_dir": load_dir, "dedup_reads": dedup}}
            )
    load_path = _views(base, "load-path", run / "iter_000000020", other / "iter_000000020")
    cases.append({"name": "load_path", "config": {"save_dir": out, "load_path": load_path}})
    cases.append({"name": "pth", "config": {"save_dir": out, "load_path": str(pth / "rank{rank}" / "w.pth")}})
    result = run_torchrun("rank_views.py", json.dumps({"cases": cases}), nproc=2, timeout=240)
    assert result.returncode == 0, result.describe()
    by_case: dict[str, list[dict[str, Any]]] = {}
    for rank in (0, 1):
        for entry in result.results()[rank]:
            by_case.setdefault(entry["case"], []).append(entry)
    return by_case, want


def _disagreement(got: list[dict[str, Any]]) -> str:
    assert [g["type"] for g in got] == ["CheckpointDisagreementError"] * 2, got
    assert got[0]["message"] == got[1]["message"]  # one error, raised on every rank
    assert "Nothing was read" in got[0]["message"]
    return str(got[0]["message"])


@pytest.mark.dist
@pytest.mark.parametrize("dedup", ["on", "off"])
def test_a_stale_latest_on_one_host_is_one_error_on_every_rank(outcomes: Any, dedup: str) -> None:
    message = _disagreement(outcomes[0][f"stale-{dedup}"])
    assert "rank 0 sees iter_000000020 (iteration 20)" in message
    assert "rank 1 sees iter_000000010 (iteration 10)" in message
    assert "latest_checkpoint.txt" in message  # the fix


@pytest.mark.dist
@pytest.mark.parametrize("dedup", ["on", "off"])
def test_host_local_copies_of_one_iteration_that_diverged_are_refused(outcomes: Any, dedup: str) -> None:
    message = _disagreement(outcomes[0][f"diverged-{dedup}"])
    assert message.count("iter_000000020 (iteration 20), manifest ") == 2


@pytest.mark.dist
@pytest.mark.parametrize("dedup", ["on", "off"])
def test_identical_copies_on_every_host_still_load(outcomes: Any, dedup: str) -> None:
    by_case, want = outcomes
    got = by_case[f"same-{dedup}"]
    assert [g.get("iteration") for g in got] == [20, 20], got
    assert [g["weights"] for g in got] == [want[20]] * 2


@pytest.mark.dist
@pytest.mark.parametrize("dedup", ["on", "off"])
def test_a_stale_pointer_beside_the_committed_checkpoint_is_adopted_alike(outcomes: Any, dedup: str) -> None:
    """The host whose pointer lags but which sees iteration 20 committed adopts it (a save
    stopped before its pointer moved): the ranks agree, and load it."""
    by_case, want = outcomes
    got = by_case[f"pointer-{dedup}"]
    assert [g.get("iteration") for g in got] == [20, 20], got
    assert [g["weights"] for g in got] == [want[20]] * 2


@pytest.mark.dist
@pytest.mark.parametrize("case", ["load_path", "pth"])
def test_a_load_path_whose_copies_differ_is_refused(outcomes: Any, case: str) -> None:
    message = _disagreement(outcomes[0][case])
    assert "for load_path" in message


def test_the_view_compares_content_not_versions(tmp_path: Path) -> None:
    """A copy of a checkpoint (new inodes, so other recorded versions once re-committed) has the
    view of the original; another iteration's does not. One process: nothing is exchanged."""
    _save_run(tmp_path / "run", seed=1, iterations=(10, 20))
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    store = LocalStore()
    a = folder_view(str(tmp_path / "run" / "iter_000000020"), store)
    b = folder_view(str(tmp_path / "copy" / "iter_000000020"), store)
    c = folder_view(str(tmp_path / "run" / "iter_000000010"), store)
    assert a == b and a != c and a.content.startswith("manifest ")
    missing = folder_view(str(tmp_path / "run" / "iter_000000030"), store)
    assert missing.content.startswith("unreadable")
    require_one_checkpoint(a, "latest")  # one process: never raises
    assert CheckpointView("x", None, "file 00").describe() == "x, file 00"
