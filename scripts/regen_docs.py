"""Regenerate the output shown under every ``$ ckpt-engine ...`` example of the docs, by running it.

    python scripts/regen_docs.py               # rewrite the output blocks that drifted, in place
    python scripts/regen_docs.py --check       # change nothing; exit 1 and show what drifted
    python scripts/regen_docs.py --skip-demo   # leave the `ckpt-engine demo` sample alone (it takes a minute)

The pages are README.md and docs/*.md. For each page with ``$ ckpt-engine`` lines in its
```` ```console ```` blocks, in a fresh scratch folder (so the paths printed are the relative ones
the page shows):

1. the page's ```` ```python ```` blocks run in order, in one namespace (a block whose first line
   is ``# not run``, ``# torchrun`` or ``# template`` is skipped): they build the example
   checkpoints, deterministically (the blocks seed torch themselves);
2. each ``$ ckpt-engine ARGS`` line runs, in this process, through ``ckpt_engine.cli.main``,
   stdout and stderr together, as a terminal shows them; its exit code must be the one its
   ``# exit code N`` comment gives (0 without one);
3. the lines under it (up to the next ``$`` line or the end of the block) are compared with
   what it printed, and replaced when they differ.

Only what is inherently variable is normalised before comparing (see ``NORMALISE``): durations
(``in 0.0s``, ``71 ms``, ``(3.6s)``), file checksums (every ``torch.save`` archive in a data file
holds a random serialization id, so no two saves have the same bytes), and in the demo's sample
what the SIGKILL catches of the save it interrupts (how many files, how many bytes) and its
``Plot:`` line (a path, or why there is no plot: matplotlib is an optional extra). A block
that matches after normalising is left exactly as it is, so a rerun changes nothing when
nothing but these moved.

An output line that is ``...`` alone (any indentation) elides lines: it matches any number of
lines of the real output. A drifted block with elisions is regenerated as the real output's first
lines (as many as the page showed before the first ``...``), the ``...`` line, and its last lines
(as many as the page showed after the last ``...``).

tests/project/test_docs_drift.py runs :func:`check` on every page (the demo sample only with
``CKPT_ENGINE_SLOW_TESTS=1``) and fails when a block drifted: rerun this script after changing
what a command prints.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: (pattern, replacement, why it varies) applied to both the page and the real output before
#: comparing. Nothing else is normalised.
NORMALISE: list[tuple[re.Pattern[str], str, str]] = [
    (re.compile(r"(?<![\w.])\d+(?:\.\d+)? ?(?:ms|s)\b"), "<duration>", "durations: the machine's speed and load"),
    (
        re.compile(r"checksum [0-9a-f]+ != [0-9a-f]+"),
        "checksum <digest> != <digest>",
        "checksums of data files: each torch.save archive in them carries a random serialization id",
    ),
    (
        re.compile(r"\(\d+ data file\(s\) on disk\)"),
        "(<n> data file(s) on disk)",
        "demo: how far the killed save got when the SIGKILL landed",
    ),
    (
        re.compile(r"(\.iter_\d+\.partial +\S+ +)\d+(?:\.\d+)? \S?i?B +\d+( +uncommitted)"),
        r"\1<size> <files>\2",
        "demo: the bytes and files of the killed save",
    ),
    (
        re.compile(r"^Plot: .*$", re.M),
        "Plot: <plot>",
        "demo: whether matplotlib (the `demo` extra, which scripts/demo.sh installs) is installed",
    ),
]

SKIPPED_BLOCKS = ("# not run", "# torchrun", "# template")


def normalise(text: str) -> str:
    for pattern, replacement, _ in NORMALISE:
        text = pattern.sub(replacement, text)
    return "\n".join(line.rstrip() for line in text.splitlines())


@dataclass
class Example:
    """One ``$ ckpt-engine`` line of a console block and the output the page shows under it."""

    command: str
    shown: list[str]
    #: Line numbers (0-based, in the page) of the shown output: [start, end).
    start: int
    end: int
    actual: list[str] = field(default_factory=list)
    code: int = 0

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command.partition("#")[0])[1:]

    @property
    def expected_code(self) -> int:
        m = re.search(r"exit code (\d+)", self.command.partition("#")[2])
        return int(m.group(1)) if m else 0

    @property
    def is_demo(self) -> bool:
        return self.argv[:1] == ["demo"]


def examples(lines: list[str]) -> list[Example]:
    """The ``$ ckpt-engine`` lines of the page's console blocks, with the output under each."""
    found: list[Example] = []
    in_block = False
    current: Example | None = None
    for i, line in enumerate(lines):
        if not in_block:
            in_block = line.strip() == "```console"
            continue
        if line.strip() == "```" or line.startswith("$ "):
            if current is not None:
                current.end = i
                found.append(current)
                current = None
            if line.strip() == "```":
                in_block = False
            elif line.startswith("$ ckpt-engine "):
                current = Example(command=line[2:], shown=[], start=i + 1, end=i + 1)
            continue
        if current is not None:
            current.shown.append(line)
    return found


def _matches(shown: list[str], actual: list[str]) -> bool:
    """Whether ``shown`` (with ``...`` lines eliding any run of lines) is ``actual``, normalised."""
    want = [normalise(line) for line in shown]
    got = normalise("\n".join(actual)).split("\n") if actual else []

    def match(i: int, j: int) -> bool:
        if i == len(want):
            return j == len(got)
        if want[i].strip() == "...":
            return any(match(i + 1, k) for k in range(j, len(got) + 1))
        return j < len(got) and want[i] == got[j] and match(i + 1, j + 1)

    return match(0, 0)


def regenerated(shown: list[str], actual: list[str]) -> list[str]:
    """The lines to show: ``actual``, elided as ``shown`` was (see the module docstring)."""
    dots = [i for i, line in enumerate(shown) if line.strip() == "..."]
    if not dots:
        return actual
    head, tail = dots[0], len(shown) - dots[-1] - 1
    if head + tail >= len(actual):
        return actual
    return [*actual[:head], shown[dots[0]], *(actual[len(actual) - tail :] if tail else [])]


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    """A fresh current folder, importable (``plan --model my_models:build``), left as it was."""
    old_cwd, old_path, old_modules = os.getcwd(), list(sys.path), set(sys.modules)
    with tempfile.TemporaryDirectory(prefix="ckpt-docs-") as tmp:
        os.chdir(tmp)
        sys.path.insert(0, tmp)
        try:
            yield Path(tmp)
        finally:
            os.chdir(old_cwd)
            sys.path[:] = old_path
            for name in set(sys.modules) - old_modules:  # the page's modules (my_models), not cached
                if (getattr(sys.modules[name], "__file__", None) or "").startswith(tmp):
                    del sys.modules[name]


def _run(argv: list[str]) -> tuple[int, list[str]]:
    from ckpt_engine.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    return code, [line.rstrip() for line in out.getvalue().splitlines()]


def run_page(path: Path, demo: bool = True) -> list[Example]:
    """Run ``path``'s set-up blocks and every ``$ ckpt-engine`` example (the demo when ``demo``);
    returns the examples with what each printed (``actual``) and its exit code."""
    text = path.read_text()
    found = [e for e in examples(text.splitlines()) if demo or not e.is_demo]
    if not found:
        return []
    with _scratch():
        namespace: dict[str, object] = {"__name__": f"doc_{path.stem}"}
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
            if not block.startswith(SKIPPED_BLOCKS):
                exec(compile(block, f"{path.name}[block {i}]", "exec"), namespace)
        for example in found:
            example.code, example.actual = _run(example.argv)
    return found


def drifted(example: Example) -> str | None:
    """What is wrong with ``example`` after it ran: None when the page shows what it printed."""
    if example.code != example.expected_code:
        return f"exit code {example.code}, the page says {example.expected_code}"
    if not _matches(example.shown, example.actual):
        diff = difflib.unified_diff(example.shown, example.actual, "shown", "printed", lineterm="", n=1)
        return "output differs:\n" + "\n".join(diff)
    return None


def pages() -> list[Path]:
    return sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def check(path: Path, demo: bool = True) -> list[str]:
    """Every drift of ``path``: ``"<page>: $ <command>: <what>"``; empty when none."""
    return [
        f"{path.name}: $ {e.command}: {problem}" for e in run_page(path, demo) if (problem := drifted(e)) is not None
    ]


def rewrite(path: Path, demo: bool = True) -> int:
    """Replace the drifted output blocks of ``path``; returns how many were replaced. An example
    whose exit code differs from the page's comment is an error, never rewritten."""
    lines = path.read_text().splitlines()
    replaced = 0
    for example in reversed(run_page(path, demo)):  # from the end: earlier line numbers stay valid
        if example.code != example.expected_code:
            raise SystemExit(f"{path.name}: $ {example.command}: {drifted(example)}; fix the page or the code")
        if drifted(example) is not None:
            lines[example.start : example.end] = regenerated(example.shown, example.actual)
            replaced += 1
    if replaced:
        path.write_text("\n".join(lines) + "\n")
    return replaced


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block drifted")
    parser.add_argument("--skip-demo", action="store_true", help="leave the `ckpt-engine demo` sample alone")
    parser.add_argument("pages", nargs="*", type=Path, help="pages (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    demo = not args.skip_demo
    targets = [p.resolve() for p in args.pages] or pages()
    if args.check:
        problems = [problem for page in targets for problem in check(page, demo)]
        print("\n".join(problems) if problems else "every example prints what the docs show")
        return 1 if problems else 0
    for page in targets:
        n = rewrite(page, demo)
        if n:
            print(f"{page.relative_to(ROOT)}: {n} output block(s) regenerated")
    return 0


if __name__ == "__main__":
    sys.exit(main())
