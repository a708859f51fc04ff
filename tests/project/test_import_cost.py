"""What ``import ckpt_engine`` and the command line's start-up may import.

``import ckpt_engine`` resolves its public names lazily (PEP 562), so it, ``ckpt_engine.cli`` and
``ckpt-engine --help`` start without torch (seconds on a loaded machine); each command imports its
heavy code when it runs. Every check runs in a fresh interpreter, because this test process has
long imported torch. No wall-clock assertion: ``benchmarks/cli_bench.py`` measures the times
(benchmarks/RESULTS.md, "Command-line start-up").
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import ckpt_engine

#: Never imported by ``import ckpt_engine``, ``import ckpt_engine.cli`` or ``ckpt-engine --help``.
HEAVY = ("torch", "torch.distributed.checkpoint", "numpy", "pydantic")


def _loaded_after(code: str) -> dict[str, bool]:
    """Which of :data:`HEAVY` are in ``sys.modules`` after ``code`` runs in a fresh interpreter."""
    probe = (
        "import json, sys\n"
        "try:\n" + "".join(f"    {line}\n" for line in code.splitlines()) + "except SystemExit:\n    pass\n"
        f"print(json.dumps({{m: m in sys.modules for m in {HEAVY!r}}}), file=sys.__stderr__)\n"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    loaded: dict[str, bool] = json.loads(proc.stderr.strip().splitlines()[-1])
    return loaded


@pytest.mark.parametrize(
    "code",
    [
        "import ckpt_engine",
        "import ckpt_engine.cli",
        "import ckpt_engine.errors",
        "from ckpt_engine import hookimpl, __version__, PROJECT_NAME",
        "import ckpt_engine\nckpt_engine.__version__\ndir(ckpt_engine)",
    ],
)
def test_importing_the_package_leaves_torch_out(code: str) -> None:
    loaded = _loaded_after(code)
    assert not any(loaded.values()), f"{code!r} imported {[m for m, on in loaded.items() if on]}"


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["--version"],
        [],
        *([name, "--help"] for name in ("ls", "inspect", "verify", "diff", "convert", "plan", "plugins", "demo")),
        ["docs-config", "--help"],
    ],
    ids=lambda argv: " ".join(argv) or "no-arguments",
)
def test_help_and_version_do_not_import_torch(argv: list[str]) -> None:
    """``ckpt-engine --help``, ``--version`` and ``COMMAND --help`` parse only: nothing heavy loads."""
    loaded = _loaded_after(f"from ckpt_engine.cli import main\nmain({argv!r})")
    assert not any(loaded.values()), f"ckpt-engine {' '.join(argv)} imported {[m for m, on in loaded.items() if on]}"


@pytest.mark.full  # over 2 s on 2 cores: new interpreters
def test_a_lazy_name_imports_what_it_needs() -> None:
    """The first use of ``CheckpointEngine`` imports the engine (and DCP) behind it."""
    loaded = _loaded_after("import ckpt_engine\nckpt_engine.CheckpointEngine")
    assert loaded["torch"] and loaded["torch.distributed.checkpoint"]


def test_every_public_name_resolves_and_dir_lists_it() -> None:
    assert len(ckpt_engine.__all__) == len(set(ckpt_engine.__all__))
    listed = dir(ckpt_engine)
    for name in ckpt_engine.__all__:
        assert name in listed, name
        assert getattr(ckpt_engine, name) is not None, name
    # the table names exactly the lazy names, each defined where the table says
    lazy = ckpt_engine._LAZY
    assert set(lazy) == set(ckpt_engine.__all__) - {"PROJECT_NAME", "__version__", "hookimpl"}
    for name, module in lazy.items():
        target = sys.modules[f"ckpt_engine{module}"]
        assert getattr(ckpt_engine, name) is getattr(target, name), name


@pytest.mark.full  # over 2 s on 2 cores: new interpreters
def test_from_import_of_every_public_name_in_a_fresh_process() -> None:
    """``from ckpt_engine import NAME`` works for every name, first thing in a new interpreter."""
    names = ", ".join(ckpt_engine.__all__)
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from ckpt_engine import {names}\nimport ckpt_engine\nprint(ckpt_engine.CheckpointEngine)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ckpt_engine._engine.engine.CheckpointEngine" in proc.stdout


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'NoSuchName'"):
        ckpt_engine.NoSuchName  # noqa: B018
    assert not hasattr(ckpt_engine, "hookspec")  # private marker, not re-exported


def test_public_errors_keep_their_module_and_pickle() -> None:
    """Lazy names are the classes themselves: ``__module__`` and pickles are what they were."""
    for name in ckpt_engine.__all__:
        obj = getattr(ckpt_engine, name)
        if isinstance(obj, type) and issubclass(obj, ckpt_engine.CkptEngineError):
            assert obj.__module__ == "ckpt_engine.errors" or name == "RngWorldSizeError", name
    err = ckpt_engine.LoadStrictnessError("model", ["a"], ["b"])
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is ckpt_engine.LoadStrictnessError and back.missing == ("a",) and str(back) == str(err)
    assert pickle.loads(pickle.dumps(ckpt_engine.ConfigError("x"))).args == ("x",)


@pytest.fixture(scope="module")
def holdings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An engine save folder, its exports (safetensors file, sharded Hugging Face folder, torch.save
    file) and a DCP folder of ``dcp.save``: what users point the command line at."""
    import torch
    import torch.distributed.checkpoint as dcp

    from ckpt_engine import CheckpointEngine
    from ckpt_engine.cli import main
    from ckpt_engine.testing import TinyTrainingState

    root = tmp_path_factory.mktemp("holdings")
    with CheckpointEngine({"save_dir": str(root / "ckpt")}) as engine:
        engine.save(1, **TinyTrainingState.create().objects())
    out = {"ckpt": root / "ckpt", "checkpoint": root / "ckpt" / "iter_000000001"}
    tiered = {"save_dir": str(root / "tiered"), "local_dir": str(root / "local")}
    with CheckpointEngine(tiered) as engine:
        engine.save(1, **TinyTrainingState.create().objects())
    out["tiered"], out["local"], out["rank_folder"] = root / "tiered", root / "local", root / "local" / "rank_00000"
    for name, extra in (("model.safetensors", []), ("hf", ["--to", "hf", "--max-shard-size", "1KB"]), ("model.pt", [])):
        assert main(["convert", str(root / "ckpt"), str(root / name), *extra]) == 0
        out[name] = root / name
    torch.save({"model": torch.nn.Linear(2, 2).state_dict(), "epoch": 3}, root / "train.pt")
    dcp.save({"w": torch.ones(2), "n": 5}, checkpoint_id=root / "dcp")
    out["train.pt"], out["dcp"] = root / "train.pt", root / "dcp"
    return out


#: What runs without torch: listing, keys and headers, sizes. Values (diff, convert, plan,
#: ``inspect --trust``, a value stored as a tensor or an object) import it when they run.
TORCH_FREE = [
    ("ls", "ckpt"),
    ("ls", "ckpt", "--verify", "--json"),
    ("ls", "tiered", "--local-dir", "local"),  # the node-local tier, rank-local metadata included
    ("ls", "rank_folder"),
    ("inspect", "ckpt"),
    ("inspect", "checkpoint", "--json"),
    ("verify", "ckpt", "--level", "sizes"),
    ("verify", "checkpoint"),  # checksums against the manifest: xxhash, no torch
    *(
        (command, name)
        for name in ("model.safetensors", "hf", "model.pt", "train.pt", "dcp")
        for command in ("inspect",)
    ),
    *(("verify", name, "--level", "sizes") for name in ("model.safetensors", "hf", "model.pt", "train.pt", "dcp")),
    ("verify", "train.pt"),  # a torch.save file's CRC-32 checksums
]


@pytest.mark.parametrize("argv", TORCH_FREE, ids=" ".join)
def test_listing_keys_headers_and_sizes_never_import_torch(holdings: dict[str, Path], argv: tuple[str, ...]) -> None:
    """``ls``, ``inspect`` and ``verify --level sizes`` of engine checkpoints and of every other format
    read metadata into torch-free records, headers and ``data.pkl`` with the safe interpreter."""
    args = [str(holdings[a]) if a in holdings else a for a in argv]
    loaded = _loaded_after(f"from ckpt_engine.cli import main\nassert main({args!r}) == 0")
    assert not loaded["torch"] and not loaded["torch.distributed.checkpoint"], (argv, loaded)


@pytest.mark.full  # over 2 s on 2 cores: new interpreters
def test_diff_imports_torch_to_compare_values(holdings: dict[str, Path]) -> None:
    """The decision, pinned: comparing values needs torch (tensors are compared as tensors)."""
    args = [str(holdings["checkpoint"]), str(holdings["hf"])]
    loaded = _loaded_after(f"from ckpt_engine.cli import main\nassert main(['diff', *{args!r}]) == 0")
    assert loaded["torch"]


@pytest.mark.full  # over 2 s on 2 cores: new interpreters
def test_ls_does_not_import_torch(tmp_path: Path) -> None:
    """``ckpt-engine ls`` reads every ``.metadata`` into stand-in records with torch-free dtypes: it
    never imports torch (seconds on a loaded machine; benchmarks/RESULTS.md, "Command-line start-up")."""
    save_dir = tmp_path / "checkpoints"
    make = (
        "import sys, torch\nfrom ckpt_engine import CheckpointEngine\n"
        "with CheckpointEngine({'save_dir': sys.argv[1]}) as e:\n"
        "    e.save(1, model=torch.nn.Linear(4, 2))\n"
    )
    subprocess.run([sys.executable, "-c", make, str(save_dir)], check=True, timeout=300)
    for argv in (["ls", str(save_dir)], ["ls", str(save_dir), "--verify", "--json"]):
        loaded = _loaded_after(f"from ckpt_engine.cli import main\nassert main({argv!r}) == 0")
        assert not loaded["torch"] and not loaded["torch.distributed.checkpoint"], (argv, loaded)
