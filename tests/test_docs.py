"""The docs stay in step with the code: hooks documented, code blocks run."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from ckpt_engine.hookspecs import HOOK_KINDS, CkptSpecs

ROOT = Path(__file__).resolve().parents[1]
HOOKS = [name for name, _ in inspect.getmembers(CkptSpecs, inspect.isfunction)]


def test_every_hook_is_specified() -> None:
    assert sorted(HOOKS) == ["on_save_done", "pre_load_plan", "remap_keys", "stage", "write"]


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_documented_with_its_signature(hook: str) -> None:
    params = [p for p in inspect.signature(getattr(CkptSpecs, hook)).parameters if p != "self"]
    heading = f"## {hook}({', '.join(params)})"
    assert heading in (ROOT / "docs" / "hooks.md").read_text().splitlines()


def test_every_hook_has_one_kind() -> None:
    assert sorted(HOOK_KINDS) == sorted(HOOKS)


@pytest.mark.parametrize("hook", HOOKS)
def test_hooks_md_states_the_kind(hook: str) -> None:
    """docs/hooks.md says, under each hook's heading, the kind HOOK_KINDS gives it."""
    text = (ROOT / "docs" / "hooks.md").read_text()
    section = text.split(f"## {hook}(", 1)[1].split("\n## ", 1)[0]
    assert f"Kind: **{HOOK_KINDS[hook]}**." in section


@pytest.mark.parametrize("hook", HOOKS)
def test_hookspec_docstring_states_kind_ranks_errors(hook: str) -> None:
    doc = inspect.getdoc(getattr(CkptSpecs, hook)) or ""
    assert re.search(rf"^Kind: {HOOK_KINDS[hook]}\.", doc, re.M), doc  # the docstring agrees with HOOK_KINDS
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


# -- pages that say what the code does ----------------------------------------------------------


def test_plugins_md_lists_every_builtin_plugin() -> None:
    from ckpt_engine.plugin_manager import installed_plugins

    text = (ROOT / "docs" / "plugins.md").read_text()
    builtins = sorted(n for n, ep in installed_plugins().items() if ep.dist and ep.dist.name == "ckpt-engine")
    for name in builtins:
        assert f"| [`{name}`](#{name}) |" in text and f"\n## {name}\n" in text, name
    words = {3: "Three", 4: "Four", 5: "Five", 6: "Six"}
    assert f"{words[len(builtins)]} plugins ship" in text


def test_docs_cite_no_style_guide_outside_the_repository() -> None:
    for path in DOC_FILES:
        assert "the style guide" not in path.read_text(), path.name


def test_migration_md_agrees_with_itself_on_object_storage() -> None:
    text = (ROOT / "docs" / "migration.md").read_text()
    assert "save_to_object_store" in text
    paragraph = text[text.index("**Object storage.**") :].split("\n\n", 1)[0]
    assert "not supported" not in paragraph.lower() and "storage.md" in paragraph


def test_testing_page_documents_every_helper() -> None:
    import ckpt_engine.testing as testing

    text = (ROOT / "docs" / "testing.md").read_text()
    for name in testing.__all__:
        assert f"`{name}" in text, name
    assert "(testing.md)" in (ROOT / "docs" / "index.md").read_text()


def test_demo_help_states_the_kill_point_it_uses() -> None:
    import argparse

    from ckpt_engine.demo import FAST, Settings, add_demo_arguments, settings_from_args

    parser = argparse.ArgumentParser()
    add_demo_arguments(parser)
    help_text = " ".join(parser.format_help().split())
    default = settings_from_args(parser.parse_args([])).kill_at
    fast = settings_from_args(parser.parse_args(["--fast"])).kill_at
    assert f"{default} for the defaults" in help_text and f"--fast: {fast}" in help_text
    assert (Settings().kill_at, FAST.kill_at) == (default, fast)
