"""The docs stay in step with the code: hooks documented, code blocks run."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import pytest
from _paths import ROOT

from ckpt_engine.hookspecs import HOOK_KINDS, CkptSpecs

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

#: First lines of blocks :func:`test_doc_code_blocks_run` only compiles.
NOT_RUN_HERE = ("# not run", "# torchrun", "# template")


def _is_training_loop(block: str) -> bool:
    """A block that saves inside a ``for ... in range(...)`` loop: a training loop, which must
    survive being run again (a job restarted on its checkpoints)."""
    return bool(re.search(r"^\s*for .* in range\(", block, re.M)) and ".save(" in block


@pytest.fixture
def loads(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every ``CheckpointEngine.load`` result while the test runs (compat's loads go through it)."""
    from ckpt_engine import CheckpointEngine

    results: list[Any] = []
    original = CheckpointEngine.load

    def recording(self: CheckpointEngine, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        results.append(result)
        return result

    monkeypatch.setattr(CheckpointEngine, "load", recording)
    return results


@pytest.mark.full  # over 2 s on 2 cores: runs a page's code in new processes
@pytest.mark.usefixtures("forked_python")  # those processes forked (tests/_forked_python.py)
@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: p.name)
def test_doc_code_blocks_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loads: list[Any]) -> None:
    """Every ```python block runs, in order, in one namespace per file, in a scratch folder; then
    every training loop runs through a resume.

    A block whose first line is ``# file: NAME.py`` is written to ``NAME.py`` in the scratch folder
    (a module the next blocks import, e.g. in new processes), not run.
    A block whose first line is ``# not run`` is only compiled (e.g. needs a GPU); one whose first
    line is ``# torchrun`` is a whole script, run by :func:`test_doc_torchrun_blocks_run`; one
    whose first line is ``# template`` is run with a job's objects by
    :func:`test_migration_templates_run_through_a_resume`.

    A training loop (:func:`_is_training_loop`) that did not resume from a checkpoint itself (as
    getting-started's ``train(until=20)`` does) runs a second time, in the same folder: the second
    run must load a checkpoint and carry on without an error (a loop that starts at the resumed
    iteration saves it again and fails with ``CheckpointExistsError``).
    """
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict[str, object] = {"__name__": f"doc_{path.stem}"}
    rerun = []
    for i, block in enumerate(_python_blocks(path)):
        code = compile(block, f"{path.name}[block {i}]", "exec")
        if block.startswith(NOT_RUN_HERE):
            continue
        if module := re.match(r"# file: (\w+\.py)\n", block):  # a module the next blocks import
            (tmp_path / module.group(1)).write_text(block)
            continue
        before = len(loads)
        exec(code, namespace)
        if _is_training_loop(block) and not any(r.checkpoint_path for r in loads[before:]):
            rerun.append((i, code))
    for i, code in rerun:
        before = len(loads)
        exec(code, namespace)  # the job again, on the checkpoints of the first run
        resumed = [r for r in loads[before:] if r.checkpoint_path]
        assert resumed, f"{path.name} block {i}: a second run did not resume from the first run's checkpoints"


class _Counter:
    """A job's data-loader state: anything with ``state_dict`` and ``load_state_dict``."""

    def __init__(self) -> None:
        self.position = 0

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = state["position"]


@pytest.mark.parametrize("index", [0, 1], ids=["drop-in", "native"])
def test_migration_templates_run_through_a_resume(
    index: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, loads: list[Any]
) -> None:
    """docs/migration.md's two loops run as a job would: 20 iterations, then the job restarted
    with ``max_iter`` 40 resumes at 20 and saves 30 and 40 (they crashed there with
    ``CheckpointExistsError``, starting at the resumed iteration and saving it again). The
    template's names (``config``, ``model``, ...) are small real objects; the original package
    of the drop-in template's "before" import is a module whose class is the drop-in one."""
    import sys
    import types

    import torch
    from torch import nn

    from ckpt_engine import compat

    blocks = [b for b in _python_blocks(ROOT / "docs" / "migration.md") if b.startswith("# template")]
    assert len(blocks) == 2
    for name in ("imaginaire", "imaginaire.checkpointer", "imaginaire.checkpointer.dcp"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["imaginaire.checkpointer.dcp"].DistributedCheckpointer = compat.DistributedCheckpointer  # type: ignore[attr-defined]
    monkeypatch.chdir(tmp_path)

    def job(max_iter: int) -> None:
        torch.manual_seed(0)
        model = nn.ModuleDict({"net": nn.Linear(4, 4), "net_ema": nn.Linear(4, 4)})  # the native one enables `ema`
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        config = types.SimpleNamespace(
            checkpoint=types.SimpleNamespace(
                load_path="", strict_resume=False, load_ema_to_reg=True, dcp_allow_mismatched_size=True
            ),
            job=types.SimpleNamespace(path_local=str(tmp_path / "job"), path="job"),
        )
        namespace: dict[str, Any] = {
            "__name__": "migration_template",
            "config": config,
            "callbacks": None,
            "model": model,
            "optimizer": optimizer,
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, step_size=10),
            "grad_scaler": torch.amp.GradScaler("cpu"),
            "dataloader_state": _Counter(),
            "max_iter": max_iter,
            "save_iter": 10,
        }
        exec(compile(blocks[index], f"migration.md[template {index}]", "exec"), namespace)

    save_dir = tmp_path / "job" / "checkpoints"
    job(20)
    assert "iter_000000020" in (save_dir / "latest_checkpoint.txt").read_text()
    loads.clear()
    job(40)  # the job restarted on its checkpoints, to run longer
    assert [r.iteration for r in loads if r.checkpoint_path] == [20]
    assert {"iter_000000030", "iter_000000040"} <= {p.name for p in save_dir.glob("iter_*")}
    assert "iter_000000040" in (save_dir / "latest_checkpoint.txt").read_text()


TORCHRUN_BLOCKS = [
    (path, i, block)
    for path in DOC_FILES
    for i, block in enumerate(_python_blocks(path))
    if block.startswith("# torchrun")
]


@pytest.mark.dist
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
        preload = ("lightning",) if "import lightning" in block else ()
        result = run_torchrun(str(script), nproc=2, timeout=180, preload=preload)
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


# -- links and where the benchmark record lives -------------------------------------------------


def _heading_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _without_code(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)


LINKED_PAGES = sorted([*DOC_FILES, *(ROOT / "benchmarks").glob("*.md")])


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves_to_a_file_and_heading(page: Path) -> None:
    """A link to a page or section that moved (the benchmark record went from docs/ to
    benchmarks/) fails here instead of leaving a reader at a missing file or anchor."""
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _without_code(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file) if file else page
        if not path.exists():
            broken.append(f"{target}: no such file")
        elif anchor and path.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", _without_code(path.read_text()), re.M)
            if anchor not in {_heading_slug(h) for h in headings}:
                broken.append(f"{target}: no such heading in {path.name}")
    assert not broken, f"{page.relative_to(ROOT)}:\n" + "\n".join(broken)


def test_benchmark_results_live_beside_the_benchmarks() -> None:
    """docs/ is for users: the runs' JSON and plots are in benchmarks/results/, the long record in
    benchmarks/RESULTS.md and HISTORY.md, and docs/performance.md stays a short page."""
    assert not [p.name for p in (ROOT / "docs").iterdir() if p.suffix in (".json", ".png")]
    assert (ROOT / "benchmarks" / "results" / "performance-peers-results.json").is_file()
    assert (ROOT / "benchmarks" / "RESULTS.md").is_file() and (ROOT / "benchmarks" / "HISTORY.md").is_file()
    short = (ROOT / "docs" / "performance.md").read_text()
    assert short.count("\n") < 200 and "## How to rerun" in short and "## The machine" in short


def test_the_design_sections_the_code_cites_exist() -> None:
    """The code cites the design contract as "docs/design.md, section N"; each N is a heading of
    docs/design.md, so a citation cannot point at a section that is not there."""
    headings = set(re.findall(r"^## (\d+)\. ", (ROOT / "docs" / "design.md").read_text(), re.M))
    cited = {}
    for top in ("ckpt_engine", "plugins", "tests", "docs"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix in (".py", ".md") and "__pycache__" not in path.parts:
                for n in re.findall(r"design\.md, section (\d+)", path.read_text()):
                    cited[n] = path.relative_to(ROOT).as_posix()
    assert cited and set(cited) <= headings, {n: p for n, p in cited.items() if n not in headings}
    assert [str(n) for n in range(1, 13)] == sorted(headings, key=int)


_FIXED_ROW = re.compile(r"^\| `([^`]+)`[^|]*\| ([^|]+) \|", re.MULTILINE)


def _resolve_dotted(path: str) -> Any:
    """``ckpt_engine.a.b.Name``: the longest importable module, then attributes."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def test_every_name_the_design_tables_fix_resolves() -> None:
    """docs/design.md's tables of fixed names (DESIGN's, which users and acceptance checks call):
    each name exported from ``ckpt_engine``, each ``ckpt_engine...`` path, each config field and
    each result or handle attribute exists. ``SnapshotChangedError``, fixed as exported from the
    package, was only in the ``pinned_staging`` plugin's."""
    import ckpt_engine
    from ckpt_engine import EngineConfig, LoadResult, SaveHandle, SaveResult

    owners: dict[str, Any] = {"EngineConfig": EngineConfig, "SaveResult": SaveResult, "LoadResult": LoadResult}
    owners["SaveHandle"] = SaveHandle
    checked, missing = 0, []
    for cell, where in _FIXED_ROW.findall((ROOT / "docs" / "design.md").read_text()):
        name = re.split(r"[(: ]", cell, maxsplit=1)[0]
        head, _, attr = name.partition(".")
        try:
            if head == "ckpt_engine" and attr:
                _resolve_dotted(name)
            elif head in owners and attr:
                owner = owners[head]
                if attr not in getattr(owner, "model_fields", {}) and not hasattr(owner, attr):
                    fields = getattr(owner, "__dataclass_fields__", {})
                    assert attr in fields, f"{head} has no {attr}"
            elif where.strip() == "`ckpt_engine`":
                getattr(ckpt_engine, name)
            else:
                continue  # a hook, a plugin option, a CLI command: checked where they are documented
        except (AttributeError, ImportError, AssertionError) as err:
            missing.append(f"{cell}: {err}")
        checked += 1
    assert checked >= 15, checked  # the parse found the tables
    assert not missing, missing
