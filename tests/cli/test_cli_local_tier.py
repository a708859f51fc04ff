"""``ckpt-engine ls SAVE_DIR --local-dir LOCAL_DIR``: the node-local tier under save_dir's table,
which iterations it holds for which ranks, which of them are durable, which step a resume takes
from which tier (checked against a real resume), and the copies it sets aside."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from ckpt_engine import CheckpointEngine
from ckpt_engine.testing import TinyTrainingState


def _config(save_dir: str, local_dir: str) -> dict[str, Any]:
    return {"save_dir": save_dir, "local_dir": local_dir, "persist_every": 2, "local_keep_last": 3}


def _saves(tmp_path: Path, steps: int, *, save_dir: str = "durable", local_dir: str = "local") -> tuple[str, str]:
    save_dir, local_dir = str(tmp_path / save_dir), str(tmp_path / local_dir)
    state = TinyTrainingState.create(seed=1)
    with CheckpointEngine(_config(save_dir, local_dir)) as engine:
        for it in range(1, steps + 1):
            engine.save(it, **state.objects())
    return save_dir, local_dir


def _resume(save_dir: str, local_dir: str) -> tuple[int, dict[str, int]]:
    """The iteration a real resume takes, and the bytes it took from each tier."""
    state = TinyTrainingState.create(seed=2)
    with CheckpointEngine(_config(save_dir, local_dir)) as engine:
        result = engine.load(**state.objects())
    return result.iteration, dict(result.bytes_by_source)


def test_ls_lists_the_local_tier_and_which_iterations_are_durable(tmp_path: Path, cli: Any) -> None:
    save_dir, local_dir = _saves(tmp_path, 3)
    code, out, _ = cli("ls", save_dir, "--local-dir", local_dir)
    assert code == 0, out
    table = out.split(f"local tier in {local_dir}", 1)[1].splitlines()[1:]
    assert table[0].split() == ["iteration", "ranks", "here", "size", "status", "durable"]
    rows = [line.split() for line in table[1:4]]
    assert [(r[0], r[1], r[4], r[5]) for r in rows] == [
        ("1", "0", "complete", "no"),
        ("2", "0", "complete", "yes"),
        ("3", "0", "complete", "no"),
    ]


def test_ls_marks_the_newer_local_step_a_resume_takes(tmp_path: Path, cli: Any) -> None:
    """save_dir's latest is iteration 2; the tier holds 3 of its run, descended from it: a resume
    takes 3 from the local tier, and ls says so (not only ``<- latest`` on 2)."""
    save_dir, local_dir = _saves(tmp_path, 3)
    code, out, _ = cli("ls", save_dir, "--local-dir", local_dir)
    assert code == 0, out
    tier = out.split(f"local tier in {local_dir}", 1)[1].splitlines()
    marked = [line.split()[0] for line in tier[2:5] if line.endswith("<- resume")]
    assert marked == ["3"], out
    assert "resume -> iteration 3 from the local tier (this node holds every rank's part: 0)" in out
    assert "set aside" not in out
    code, out, _ = cli("ls", save_dir, "--local-dir", local_dir, "--json")
    doc = json.loads(out)["local_tier"]
    assert doc["resume"]["tier"] == "local" and doc["resume"]["iteration"] == 3 and doc["set_aside"] == []
    assert [r["iteration"] for r in doc["iterations"] if r["resume"]] == [3]
    iteration, by_source = _resume(save_dir, local_dir)
    assert iteration == 3 and set(by_source) == {"local"}


def test_ls_sets_aside_another_runs_copies_and_names_save_dir_as_the_resume(tmp_path: Path, cli: Any) -> None:
    """A ``local_dir`` reused by another run (its own ``save_dir``): its newer steps are not of
    ``save_dir``'s run, so a resume takes ``save_dir``'s latest, and ls sets them aside, saying why."""
    _, local_dir = _saves(tmp_path, 3)
    save_dir, _ = _saves(tmp_path, 2, save_dir="other_durable", local_dir="other_local")
    code, out, _ = cli("ls", save_dir, "--local-dir", local_dir)
    assert code == 0, out
    tier = out.split(f"local tier in {local_dir}", 1)[1].splitlines()
    assert "<- resume" not in out
    assert [line.split()[0] for line in tier[2:5] if line.endswith("set aside: rank 0")] == ["2", "3"], out
    assert "resume -> iteration 2 from save_dir" in out
    assert "set aside (another run): iteration(s) 2, 3 of rank(s) 0" in out
    code, out, _ = cli("ls", save_dir, "--local-dir", local_dir, "--json")
    doc = json.loads(out)["local_tier"]
    assert doc["resume"] == {"tier": "save_dir", "iteration": 2}
    assert doc["set_aside"] == [
        {"iteration": 2, "rank": 0, "reason": "another run"},
        {"iteration": 3, "rank": 0, "reason": "another run"},
    ]
    iteration, by_source = _resume(save_dir, local_dir)
    assert iteration == 2 and set(by_source) == {"durable"}


def test_ls_of_a_copied_save_dir_sets_aside_the_originals_steps(tmp_path: Path, cli: Any) -> None:
    """A copy of ``save_dir`` carries its run but not its place: the tier steps saved for the
    original are set aside for the copy, by ls as by a resume."""
    save_dir, local_dir = _saves(tmp_path, 3)
    copied = str(tmp_path / "copied")
    shutil.copytree(save_dir, copied)
    _, out, _ = cli("ls", copied, "--local-dir", local_dir, "--json")
    doc = json.loads(out)["local_tier"]
    assert doc["resume"] == {"tier": "save_dir", "iteration": 2}, out
    assert {(a["iteration"], a["reason"]) for a in doc["set_aside"]} == {
        (it, f"saved for another save_dir, {os.path.realpath(save_dir)!r} (a copy or a move of this one)")
        for it in (2, 3)
    }
    iteration, by_source = _resume(copied, local_dir)
    assert iteration == 2 and set(by_source) == {"durable"}
    iteration, by_source = _resume(save_dir, local_dir)  # the original resumes its own newer step
    assert iteration == 3 and set(by_source) == {"local"}


def test_ls_json_gives_the_local_tier_and_flags_a_damaged_copy(tmp_path: Path, cli: Any) -> None:
    save_dir, local_dir = _saves(tmp_path, 2)
    data = next(Path(local_dir, "rank_00000", "iter_000000001", "model").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:-1])
    code, out, _ = cli("ls", save_dir, "--local-dir", local_dir, "--json")
    doc = json.loads(out)
    assert code != 0 and doc["ok"] is False
    iterations = {r["iteration"]: r for r in doc["local_tier"]["iterations"]}
    assert iterations[2]["ranks"] == [0] and iterations[2]["durable"] is True
    assert iterations[1]["ranks"] == [] and iterations[1]["incomplete"][0]["rank"] == 0


def test_ls_of_a_missing_local_dir_says_so(tmp_path: Path, cli: Any) -> None:
    save_dir, _ = _saves(tmp_path, 2)
    code, out, _ = cli("ls", save_dir, "--local-dir", str(tmp_path / "nowhere"))
    assert code != 0 and f"warning: {tmp_path / 'nowhere'} does not exist" in out
    assert "resume -> iteration 2 from save_dir" in out


def test_a_step_this_node_holds_for_some_ranks_names_the_ranks_other_nodes_must_hold() -> None:
    """Only this node's copies are visible: ranks 0-1 of 4 hold step 5, descended from save_dir's
    step 4; the resume takes it only if the other nodes hold ranks 2-3 (the planner's agreement)."""
    from ckpt_engine._format.manifest import Lineage
    from ckpt_engine._inspect.tier_listing import LocalTierListing, local_tier_table, resume_plan
    from ckpt_engine._tier.lineage import Announced, Durable

    durable = Durable(4, Lineage("aa", "e1-4", "e1-2", 2))
    copies = [Announced(r, r, 5, Lineage("aa", "e1-5", "e1-4", 4)) for r in (0, 1)]
    copies += [Announced(r, r, 6, Lineage("bb", "e9-6", None, None)) for r in (0, 1)]
    resume, aside = resume_plan(durable, copies, {(r, it): 4 for r in (0, 1) for it in (5, 6)})
    assert (resume["tier"], resume["iteration"], resume["ranks_here"], resume["other_ranks"]) == (
        "local",
        5,
        [0, 1],
        [2, 3],
    )
    assert aside == [{"iteration": 6, "rank": r, "reason": "another run"} for r in (0, 1)]
    lines = local_tier_table(LocalTierListing("/tier", resume=resume, set_aside=aside))
    assert lines[2].startswith(
        "resume -> iteration 5 from the local tier if every rank holds its part: this node holds rank(s) 0-1 "
        "of 4; rank(s) 2-3 must be on other nodes"
    )
    assert lines[2].endswith("else an older one of the tier, or save_dir's iteration 4)")
    assert lines[3] == "set aside (another run): iteration(s) 6 of rank(s) 0-1"
