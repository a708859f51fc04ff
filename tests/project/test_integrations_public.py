"""The training integrations (``ckpt_engine/integrations/``) use the library as a user's own
integration would: through its public modules, with the few internal ones listed below, each
with the reason no public name does the job."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from _paths import ROOT

PACKAGE = ROOT / "ckpt_engine"
INTEGRATIONS = PACKAGE / "integrations"

#: Internal modules an integration may import, and why (the list only shrinks).
INTERNAL_ALLOWED = {
    "ckpt_engine._dcpio.dist": "the engine's bounded collectives (collective_timeout_s, errors naming the rank) "
    "for the rank-0 decisions every rank must share",
    "ckpt_engine._engine.rng": "EngineTrainer's rng component is the engine's own rng: true format (RngState)",
    "ckpt_engine._format.bounded_json": "pointers and trainer state are JSON from files, parsed within the "
    "engine's bounds on depth and number size",
    "ckpt_engine._storage.store": "pointers and folders on an object store are read through the engine's "
    "stores, configured by EngineConfig.storage",
    "ckpt_engine._storage.urls": "whether a path is a URL, as the engine decides it",
    "ckpt_engine._storage.paths": "whether a pointer names this run's save_dir: one folder rule with the "
    "engine's resume (symlinked spellings, file:// URLs)",
}


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _exists(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").is_file() or (ROOT / rel / "__init__.py").is_file()


def internal_imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every import of a private ``ckpt_engine._*`` module in ``path``
    (inside functions and under ``TYPE_CHECKING`` too); ``from .._x import y`` names the module
    ``ckpt_engine._x.y`` where ``y`` is one."""
    package = _module(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            for alias in node.names:
                full = f"{target}.{alias.name}"
                yield node.lineno, full if _exists(full) else target
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)


def _private(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "ckpt_engine" and len(parts) > 1 and parts[1].startswith("_")


def test_the_checker_resolves_relative_imports() -> None:
    found = dict(internal_imports(INTEGRATIONS / "lightning.py"))
    assert "ckpt_engine._storage.urls" in found.values() and "ckpt_engine" in found.values()
    assert not _private("ckpt_engine.checkpoints") and _private("ckpt_engine._format.pointer")


def test_integrations_import_only_public_modules_or_the_listed_internal_ones() -> None:
    used: set[str] = set()
    bad: set[str] = set()
    for path in sorted(INTEGRATIONS.glob("*.py")):
        for line, name in internal_imports(path):
            if not _private(name):
                continue
            used.add(name)
            if name not in INTERNAL_ALLOWED:
                bad.add(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, "integrations use the public surface (ckpt_engine, .checkpoints, ...):\n" + "\n".join(sorted(bad))
    stale = sorted(set(INTERNAL_ALLOWED) - used)
    assert not stale, f"no integration imports these any more; remove them from INTERNAL_ALLOWED: {stale}"
    assert all(reason.strip() for reason in INTERNAL_ALLOWED.values())
