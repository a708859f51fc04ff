"""Every ``$ ckpt-engine ...`` example in the docs shows what the command prints: the pages are
checked by running them (scripts/regen_docs.py, which also rewrites them), and fail on drift."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
from _paths import ROOT


def _load_regen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("regen_docs", ROOT / "scripts" / "regen_docs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["regen_docs"] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


regen = _load_regen()
PAGES = [p for p in regen.pages() if regen.examples(p.read_text().splitlines())]
#: The demo's sample (`ckpt-engine demo`, about a minute) is checked in the slow run only.
DEMO = bool(os.environ.get("CKPT_ENGINE_SLOW_TESTS"))


def test_the_pages_with_examples_are_found() -> None:
    assert "cli.md" in {p.name for p in PAGES}


@pytest.mark.full  # over 2 s on 2 cores: runs the examples in new processes
@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_every_example_prints_what_the_page_shows(path: Path) -> None:
    problems = regen.check(path, demo=DEMO)
    assert not problems, "\n\n".join(problems) + "\n\nrun: python scripts/regen_docs.py (then review the diff)"


PAGE = """# A page

```python
import torch
from torch import nn

from ckpt_engine import CheckpointEngine

torch.manual_seed(0)
with CheckpointEngine({"save_dir": "runs/x"}) as engine:
    engine.save(1, model=nn.Linear(2, 2))
```

```console
$ ckpt-engine verify runs/x --level sizes
ok      runs/x/iter_000000001: complete, sizes match the manifest (8 files, 1.0 GiB)
1 of 1 checkpoints ok
$ ckpt-engine verify runs/nothing  # exit code 2
SHOWN
```
"""


def test_a_drifted_block_fails_the_check_and_is_rewritten(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE)
    problems = regen.check(page)
    assert len(problems) == 2 and "1.0 GiB" in problems[0] and "SHOWN" in problems[1], problems
    assert regen.rewrite(page) == 2
    text = page.read_text()
    assert "1.0 GiB" not in text and "SHOWN" not in text
    assert "ckpt-engine verify: error: CheckpointNotFoundError: runs/nothing does not exist" in text
    assert regen.check(page) == []
    assert regen.rewrite(page) == 0 and page.read_text() == text  # a rerun changes nothing


def test_a_wrong_exit_code_is_drift_and_never_rewritten(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(PAGE.replace("runs/nothing  # exit code 2", "runs/nothing"))
    assert any("exit code 2, the page says 0" in p for p in regen.check(page))
    with pytest.raises(SystemExit, match="exit code 2, the page says 0"):
        regen.rewrite(page)


def test_only_durations_and_the_kill_are_normalised() -> None:
    assert regen.normalise("in 0.0s, 71 ms, (3.6s), 19.8 MB, 60 steps") == (
        "in <duration>, <duration>, (<duration>), 19.8 MB, 60 steps"
    )
    row = "   50  .iter_000000050.partial  model     1.2 MiB      3  uncommitted"
    assert regen.normalise(row) == "   50  .iter_000000050.partial  model     <size> <files>  uncommitted"
    assert regen.normalise("121.9 KiB      8  verified") == "121.9 KiB      8  verified"


def test_an_ellipsis_line_elides_and_is_kept() -> None:
    shown = ["{", "  ...", "}"]
    assert regen._matches(shown, ["{", "  a", "  b", "}"]) and not regen._matches(shown, ["[", "  a", "}"])
    assert regen.regenerated(shown, ["[", "  a", "  b", "]"]) == ["[", "  ...", "]"]
    assert regen.regenerated(["a", "b"], ["c"]) == ["c"]
