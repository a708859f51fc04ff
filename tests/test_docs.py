"""The docs stay in step with the code: hooks documented, code blocks run."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from ckpt_engine.hookspecs import CkptSpecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [name for name, _ in inspect.getmembers(CkptSpecs, inspect.isfunction)]


def test_every_hook_is_specified() -> None:
    assert sorted(HOOKS) == ["on_save_done", "pre_load_plan", "remap_keys", "stage", "write"]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_documented_with_its_signature(hook: str) -> None:
    params = [p for p in inspect.signature(getattr(CkptSpecs, hook)).parameters if p != "self"]
    heading = f"## {hook}({', '.join(params)})"
    assert heading in (ROOT / "docs" / "hooks.md").read_text().splitlines()


@pytest.mark.parametrize("hook", HOOKS)
def test_hookspec_docstring_states_kind_ranks_errors(hook: str) -> None:
    doc = inspect.getdoc(getattr(CkptSpecs, hook)) or ""
    assert re.search(r"^Kind: (fold|provider|observer)\.", doc, re.M), doc
    assert re.search(r"^Ranks: ", doc, re.M) and re.search(r"^Errors: ", doc, re.M)


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), re.S)


DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_doc_code_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every ```python block runs, in order, in one namespace per file, in a scratch folder.

    A block whose first line is ``# not run`` is only compiled (e.g. needs a GPU); one whose first
    line is ``# torchrun`` is a whole script, run by :func:`test_doc_torchrun_blocks_run`.
    """
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": f"doc_{path.stem}"}
    for i, block in enumerate(_python_blocks(path)):
        code = compile(block, f"{path.name}[block {i}]", "exec")
        if block.startswith(("# not run", "# torchrun")):
            continue
        exec(code, namespace)


TORCHRUN_BLOCKS = [
    (path, i, block)
    for path in DOC_FILES
    for i, block in enumerate(_python_blocks(path))
    if block.startswith("# torchrun")
]


@pytest.mark.parametrize(("path", "index", "block"), TORCHRUN_BLOCKS, ids=lambda v: getattr(v, "name", str(v)))
def test_doc_torchrun_blocks_run(
    path: Path, index: int, block: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``# torchrun`` block runs as a script on 2 gloo ranks, twice (the second run resumes)."""
    from _torchrun import run_torchrun

    monkeypatch.chdir(tmp_path)
    script = tmp_path / f"{path.stem}_block{index}.py"
    script.write_text(block)
    for _ in range(2):
        result = run_torchrun(str(script), nproc=2, timeout=180)
        assert result.returncode == 0, result.describe()
    assert any(p.name == "latest_checkpoint.txt" for p in tmp_path.rglob("*")), "the script saved nothing"


def test_getting_started_has_a_torchrun_block() -> None:
    assert any(p.name == "getting-started.md" for p, _, _ in TORCHRUN_BLOCKS)
