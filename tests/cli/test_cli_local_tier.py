"""``ckpt-engine ls SAVE_DIR --local-dir LOCAL_DIR``: the node-local tier under save_dir's table,
which iterations it holds for which ranks, and which of them are durable."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ckpt_engine import CheckpointEngine
from ckpt_engine.testing import TinyTrainingState


def _saves(tmp_path: Path, steps: int) -> tuple[str, str]:
    save_dir, local_dir = str(tmp_path / "durable"), str(tmp_path / "local")
    state = TinyTrainingState.create(seed=1)
    config = {"save_dir": save_dir, "local_dir": local_dir, "persist_every": 2, "local_keep_last": 3}
    with CheckpointEngine(config) as engine:
        for it in range(1, steps + 1):
            engine.save(it, **state.objects())
    return save_dir, local_dir


def test_ls_lists_the_local_tier_and_which_iterations_are_durable(tmp_path: Path, cli: Any) -> None:
    save_dir, local_dir = _saves(tmp_path, 3)
    code, out, _ = cli("ls", save_dir, "--local-dir", local_dir)
    assert code == 0, out
    table = out.split(f"local tier in {local_dir}", 1)[1].splitlines()[1:]
    assert table[0].split() == ["iteration", "ranks", "here", "size", "status", "durable"]
    rows = [line.split() for line in table[1:]]
    assert [(r[0], r[1], r[-2], r[-1]) for r in rows] == [
        ("1", "0", "complete", "no"),
        ("2", "0", "complete", "yes"),
        ("3", "0", "complete", "no"),
    ]


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
