"""Command-line defects a new user hit: unreadable values in ``inspect``/``diff``, ``plan``'s
validation and rules, ``plugins --config`` imports, ``ls`` exit codes and counts, nested ``convert``."""

from __future__ import annotations

import io
import json
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _cli import Run
from torch import nn

from ckpt_engine import CheckpointEngine
from ckpt_engine.errors import CkptEngineError
from ckpt_engine.testing import TinyTrainingState


class ExtraState(nn.Module):
    """A layer whose extra state is a ``BytesIO``, as the original checkpointer's Transformer
    Engine layers store it: a value ``weights_only=True`` refuses."""

    def __init__(self, payload: int) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.payload = payload

    def get_extra_state(self) -> Any:
        buf = io.BytesIO()
        torch.save(torch.arange(self.payload), buf)
        buf.seek(0)
        return buf

    def set_extra_state(self, state: Any) -> None:
        pass


@pytest.fixture(scope="module")
def extra_state(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("extra")
    out = {}
    for name, payload in (("a", 3), ("same", 3), ("other", 5)):
        torch.manual_seed(0)
        with CheckpointEngine({"save_dir": str(root / name)}) as engine:
            engine.save(1, model=ExtraState(payload))
        out[name] = root / name / "iter_000000001"
    return out


# -- 6, 7: values weights_only cannot read ---------------------------------------------------------


def test_diff_compares_unreadable_values_by_their_stored_bytes(cli: Run, extra_state: dict[str, Path]) -> None:
    code, out, _ = cli("diff", str(extra_state["a"]), str(extra_state["a"]))
    assert code == 0 and "model: identical" in out and out.rstrip().endswith("the checkpoints are identical")
    code, out, _ = cli("diff", str(extra_state["a"]), str(extra_state["same"]), "--json")
    assert code == 0 and json.loads(out)["identical"] is True
    code, out, _ = cli("diff", str(extra_state["a"]), str(extra_state["other"]), "--component", "model")
    assert code == 1 and "differs: _extra_state:" in out
    assert "\x1b" not in out and "Weights only load failed" not in out


def test_inspect_shows_a_short_placeholder_and_trust_reads_the_value(cli: Run, extra_state: dict[str, Path]) -> None:
    code, out, _ = cli("inspect", str(extra_state["a"]))
    assert code == 0
    line = next(line for line in out.splitlines() if line.strip().startswith("_extra_state"))
    assert "<not readable with weights_only: _io.BytesIO; --trust reads it>" in line
    assert "\x1b" not in out and "Weights only load failed" not in out and "pytorch.org" not in out
    code, out, _ = cli("inspect", str(extra_state["a"]), "--json")
    value = json.loads(out)["components"]["model"]["keys"]
    shown = {k["key"]: k.get("value") for k in value}
    assert shown["_extra_state"] == "<not readable with weights_only: _io.BytesIO; --trust reads it>"

    code, out, _ = cli("inspect", str(extra_state["a"]), "--trust")
    assert code == 0 and "<_io.BytesIO object" in out and "not readable" not in out
    code, out, _ = cli("diff", str(extra_state["a"]), str(extra_state["other"]), "--trust", "--json")
    changed = json.loads(out)["components"]["model"]["values_changed"]
    assert code == 1 and list(changed) == ["_extra_state"] and "BytesIO" in changed["_extra_state"]["a"]


# -- 9: one import rule for `module:attr` plugins -----------------------------------------------


@pytest.fixture
def plugin_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A plugin module in the current folder, which is not on ``sys.path`` (as under the
    console script); a config that names it by ``module:attr``."""
    (tmp_path / "cwd_remap_plugin.py").write_text(
        "from ckpt_engine import hookimpl\n\n\n"
        "class Remap:\n"
        "    @hookimpl\n"
        "    def remap_keys(self, ctx, key_map):\n"
        "        return key_map\n"
    )
    (tmp_path / "engine.yaml").write_text(
        f"save_dir: {tmp_path / 'ckpt'}\nplugins:\n  - name: mine\n    path: cwd_remap_plugin:Remap\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    yield tmp_path
    sys.modules.pop("cwd_remap_plugin", None)


def test_plugins_config_imports_a_plugin_from_the_current_folder(cli: Run, plugin_in_cwd: Path) -> None:
    code, out, err = cli("plugins", "--config", "engine.yaml")
    assert code == 0, err
    assert "enabled, in fold order: te_extra_state, mine" in out and "remap_keys: mine" in out
    code, out, _ = cli("plugins", "--config", "engine.yaml", "--json")
    assert code == 0 and json.loads(out)["config"]["order"] == ["te_extra_state", "mine"]


# -- 8: plan checks what load() checks, and reads what load() reads ------------------------------


@pytest.fixture
def plan_setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    state = TinyTrainingState.create(seed=0, hidden=8)
    save_dir = tmp_path / "ckpt"
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        engine.save(3, **state.objects())
    (tmp_path / "plan_factories.py").write_text(
        "from ckpt_engine.testing import TinyTrainingState\n\n\n"
        "def build():\n"
        "    return TinyTrainingState.create(seed=1, hidden=8).model\n"
    )
    monkeypatch.chdir(tmp_path)
    yield {"dir": save_dir, "checkpoint": save_dir / "iter_000000003", "root": tmp_path}
    sys.modules.pop("plan_factories", None)


def test_plan_refuses_a_truncated_checkpoint_as_load_does(cli: Run, plan_setup: dict[str, Any]) -> None:
    data = next((plan_setup["checkpoint"] / "model").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:50])
    engine = CheckpointEngine({"save_dir": str(plan_setup["dir"])})
    with pytest.raises(CkptEngineError) as refused:
        engine.load(model=TinyTrainingState.create(seed=1, hidden=8).model)
    engine.close()
    code, out, _ = cli("plan", str(plan_setup["dir"]), "--model", "plan_factories:build")
    assert code == 1 and "FAILED: the load would fail:" in out and "would succeed" not in out
    assert f"  {str(refused.value).splitlines()[0]}" in out.splitlines()
    code, out, _ = cli("plan", str(plan_setup["dir"]), "--model", "plan_factories:build", "--json")
    data_json = json.loads(out)
    assert code == 1 and data_json["ok"] is False and data_json["errors"] == [str(refused.value)]


def test_plan_of_a_load_path_load_reads_only_the_model(cli: Run, plan_setup: dict[str, Any]) -> None:
    config = plan_setup["root"] / "finetune.yaml"
    config.write_text(f"save_dir: {plan_setup['root'] / 'new'}\nload_path: {plan_setup['checkpoint']}\n")
    result = CheckpointEngine(str(config)).load(model=TinyTrainingState.create(seed=1, hidden=8).model)
    assert result.components == ("model",)
    code, out, _ = cli(
        "plan", str(plan_setup["checkpoint"]), "--model", "plan_factories:build", "--config", str(config)
    )
    assert code == 0, out
    assert "model: " in out and "trainer:" not in out and "rule: load_path, model only" in out
    code, out, _ = cli(
        "plan", str(plan_setup["checkpoint"]), "--model", "plan_factories:build", "--config", str(config), "--json"
    )
    assert list(json.loads(out)["report"]) == ["model"]
    # Without the config the checkpoint is planned as a resume: the trainer's iteration too.
    code, out, _ = cli("plan", str(plan_setup["checkpoint"]), "--model", "plan_factories:build")
    assert code == 0 and "trainer: 1 loaded" in out


# -- 12: convert --nested writes what optimizer.load_state_dict takes ----------------------------


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    groups = [
        {"params": list(model[0].parameters()), "lr": 1e-2},
        {"params": list(model[2].parameters()), "lr": 3e-3, "weight_decay": 0.1},
    ]
    return model, torch.optim.AdamW(groups)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, seeds: range) -> list[float]:
    losses = []
    for s in seeds:
        g = torch.Generator().manual_seed(s)
        loss = model(torch.randn(16, 4, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_convert_nested_optimizer_loads_into_the_optimizer_and_resumes_exactly(cli: Run, tmp_path: Path) -> None:
    model, opt = _model_and_optimizer(0)
    _steps(model, opt, range(3))
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}) as engine:
        engine.save(3, model=model, optimizer=opt)
    expected = _steps(model, opt, range(3, 6))

    out = tmp_path / "optim.pt"
    code, stdout, err = cli("convert", str(tmp_path / "ckpt"), str(out), "--component", "optim", "--nested")
    assert code == 0, err
    assert "optimizer.load_state_dict(torch.load(path, weights_only=True))" in stdout
    model2, opt2 = _model_and_optimizer(1)
    model2.load_state_dict(_model_file(cli, tmp_path))
    nested = torch.load(out, weights_only=True)
    assert [len(g["params"]) for g in nested["param_groups"]] == [2, 2]
    opt2.load_state_dict(nested)
    assert _steps(model2, opt2, range(3, 6)) == expected

    code, _, err = cli("convert", str(tmp_path / "ckpt"), str(tmp_path / "m2.pt"), "--nested")
    assert code == 2 and "--nested is for an optimizer component" in err
    assert not (tmp_path / "m2.pt").exists()


def _model_file(cli: Run, tmp_path: Path) -> dict[str, torch.Tensor]:
    code, _, err = cli("convert", str(tmp_path / "ckpt"), str(tmp_path / "m.pt"))
    assert code == 0, err
    loaded: dict[str, torch.Tensor] = torch.load(tmp_path / "m.pt", weights_only=True)
    return loaded


# -- 11: ls exit codes, hints, counts, and a re-save interrupted between its renames -------------


@pytest.fixture
def two_saves(tmp_path: Path) -> Path:
    state = TinyTrainingState.create(seed=0, hidden=8)
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}) as engine:
        for it in (2, 4):
            state.train(1, seed=it)
            engine.save(it, **state.objects())
    return tmp_path / "ckpt"


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_ls_verify_exits_1_when_a_checkpoint_is_corrupt(cli: Run, two_saves: Path) -> None:
    assert cli("ls", str(two_saves), "--verify")[0] == 0
    _flip(next((two_saves / "iter_000000004" / "optim").glob("*.distcp")))  # the latest
    code, out, _ = cli("ls", str(two_saves), "--verify")
    assert code == 1 and re.search(r"iter_000000004 .*CORRUPT", out)
    code, out, _ = cli("ls", str(two_saves), "--verify", "--json")
    assert code == 1 and json.loads(out)["ok"] is False
    assert cli("ls", str(two_saves))[0] == 0  # sizes only: the flipped byte is not seen
    shutil.copytree(two_saves / "iter_000000002", two_saves / "iter_000000001")
    _flip(next((two_saves / "iter_000000001" / "model").glob("*.distcp")))
    (two_saves / "iter_000000004" / "ckpt_engine_manifest.json").unlink()  # latest fine again
    code, out, _ = cli("ls", str(two_saves), "--verify")
    assert code == 1 and re.search(r"iter_000000001 .*CORRUPT", out)


def test_ls_hints_match_what_can_be_checked_and_counts_files_as_verify(cli: Run, two_saves: Path) -> None:
    (two_saves / "iter_000000002" / "ckpt_engine_manifest.json").unlink()
    code, out, _ = cli("ls", str(two_saves))
    assert code == 0
    assert re.search(r"iter_000000002 .*complete", out) and re.search(r"iter_000000004 .*verified", out)
    assert "(complete: no manifest, so no sizes or checksums to compare" in out
    assert "(verified: sizes match the manifest; `ckpt-engine ls --verify` also compares checksums)" in out
    (two_saves / "iter_000000004" / "ckpt_engine_manifest.json").unlink()
    code, out, _ = cli("ls", str(two_saves))
    assert "checksums)" not in out and "--verify" not in out
    ls_rows = {c["name"]: c for c in json.loads(cli("ls", str(two_saves), "--json")[1])["checkpoints"]}
    for name in ("iter_000000002", "iter_000000004"):
        verified = json.loads(cli("verify", str(two_saves / name), "--json")[1])["checkpoints"][0]
        assert (ls_rows[name]["files"], ls_rows[name]["bytes"]) == (verified["files"], verified["bytes"])


def test_ls_after_a_crash_between_the_two_renames_of_a_resave(cli: Run, two_saves: Path) -> None:
    # A re-save of iteration 4 had renamed the old checkpoint aside and not yet put the new one in place.
    shutil.copytree(two_saves / "iter_000000004", two_saves / ".iter_000000004.partial")
    (two_saves / "iter_000000004").rename(two_saves / ".iter_000000004.replaced.12345")
    code, out, _ = cli("ls", str(two_saves))
    assert code == 0 and "no checkpoints" not in out and "does not exist" not in out
    assert re.search(r"^\s*4\s+iter_000000004\s.*verified\s+<- latest$", out, re.M)
    assert "iter_000000004: in .iter_000000004.replaced.12345: a re-save of it was interrupted" in out
    rows = json.loads(cli("ls", str(two_saves), "--json")[1])["checkpoints"]
    assert [(r["name"], r["status"]) for r in rows if r["latest"]] == [("iter_000000004", "verified")]
    # What ls says is what an engine then finds.
    with CheckpointEngine({"save_dir": str(two_saves)}) as engine:
        result = engine.load(**TinyTrainingState.create(seed=1, hidden=8).objects())
    assert result.iteration == 4


def test_plan_json_lists_strict_mismatches_as_mismatched_like_the_text(cli: Run, plan_setup: dict[str, Any]) -> None:
    """``plan --json`` listed a strict load's mismatches as ``skipped ... (strict=False)`` (what
    the lenient re-plan for the report did) where the text says ``MISMATCHED``."""
    (plan_setup["root"] / "wider_factories.py").write_text(
        "from ckpt_engine.testing import TinyTrainingState\n\n\n"
        "def build():\n"
        "    return TinyTrainingState.create(seed=1, hidden=9).model\n"
    )
    try:
        code, text, _ = cli("plan", str(plan_setup["dir"]), "--model", "wider_factories:build")
        code_json, out, _ = cli("plan", str(plan_setup["dir"]), "--model", "wider_factories:build", "--json")
    finally:
        sys.modules.pop("wider_factories", None)
    model = json.loads(out)["report"]["model"]
    assert code == code_json == 1
    assert model["mismatched"] and not any("strict=False" in r["reason"] for r in model["skipped"].values())
    shown = {line.split(": ")[1] for line in text.splitlines() if line.startswith("  MISMATCH: ")}
    assert shown == set(model["mismatched"])


def test_ls_calls_a_damaged_metadata_corrupt_and_a_missing_one_incomplete(cli: Run, tmp_path: Path) -> None:
    """docs/cli.md's statuses: a ``.metadata`` failing its checksum is damage (``CORRUPT``), a
    missing one an interrupted or partial copy (``INCOMPLETE``); ls said INCOMPLETE for both."""
    save_dir = tmp_path / "run"
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        for it in (1, 2):
            engine.save(it, model=TinyTrainingState.create(seed=it, hidden=8).model)
    damaged = save_dir / "iter_000000002" / "model" / ".metadata"
    data = bytearray(damaged.read_bytes())
    data[-5] ^= 0x01
    damaged.write_bytes(bytes(data))
    (save_dir / "iter_000000001" / "model" / ".metadata").unlink()
    code, out, _ = cli("ls", str(save_dir))
    rows = {line.split()[1]: line for line in out.splitlines() if line.strip().startswith(("1 ", "2 "))}
    assert code == 1
    assert "CORRUPT" in rows["iter_000000002"] and "INCOMPLETE" in rows["iter_000000001"], out


def test_inspect_and_diff_call_a_plain_folder_no_checkpoint_as_verify_does(cli: Run, tmp_path: Path) -> None:
    """A folder of data sub-folders was "an interrupted save?" to inspect and a pair of components
    to diff; verify and plan already said what it is."""
    plain = tmp_path / "data"
    (plain / "images").mkdir(parents=True)
    (plain / "labels").mkdir()
    (plain / "images" / "0.png").write_bytes(b"x")
    for args in (["inspect", str(plain)], ["diff", str(plain), str(plain)]):
        code, _, err = cli(*args)
        assert code == 2 and "is not a checkpoint: none of its folders (images, labels)" in err, err
        assert "interrupted save" not in err
    interrupted = tmp_path / "run" / "iter_000000005" / "model"
    interrupted.mkdir(parents=True)
    code, _, err = cli("inspect", str(interrupted.parent))
    assert code == 2 and "interrupted save" in err  # shaped like a checkpoint: still said so


def test_debug_shows_the_traceback_and_keeps_the_exit_code(cli: Run, tmp_path: Path) -> None:
    """``--debug`` turned exit code 2 (an error) into 1 (a problem found) by re-raising."""
    missing = str(tmp_path / "nothing")
    code, _, err = cli("ls", missing)
    code_debug, _, err_debug = cli("ls", missing, "--debug")
    assert code == code_debug == 2
    assert "Traceback (most recent call last)" in err_debug and "Traceback" not in err


@pytest.mark.parametrize("atol", ["-1", "nan", "inf", "x"])
def test_diff_refuses_a_tolerance_that_is_not_a_finite_non_negative_number(cli: Run, tmp_path: Path, atol: str) -> None:
    """``diff --atol -1`` (or nan) made a checkpoint differ from itself."""
    save_dir = tmp_path / "run"
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        engine.save(1, model=TinyTrainingState.create(seed=1, hidden=8).model)
    code, _, err = cli("diff", str(save_dir), str(save_dir), f"--atol={atol}")
    assert code == 2 and "--atol" in err
    assert cli("diff", str(save_dir), str(save_dir), "--atol=0.5")[0] == 0


def test_help_examples_are_indented_one_way(cli: Run) -> None:
    """Every example under ``--help`` is indented by two spaces, as ``ckpt-engine --help``'s own
    are: a command's second and later examples were indented by four."""
    from ckpt_engine.cli import COMMANDS

    helps = {"": cli("--help")[1], **{c.name: cli(c.name, "--help")[1] for c in COMMANDS}}
    for name, text in helps.items():
        section = re.split(r"^examples?:\n", text, flags=re.M)[1].split("\n\n", 1)[0]
        lines = section.splitlines()
        assert lines and all(re.match(r"  ckpt-engine \S", line) for line in lines), (name, lines)


@pytest.mark.parametrize(("out", "to"), [(".", "hf"), (".", "safetensors"), ("..", "hf")])
def test_convert_into_the_current_folder_or_one_holding_it_is_refused(
    cli: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, out: str, to: str
) -> None:
    """``convert SRC . --force`` raised a raw ``OSError [Errno 16]`` (renaming the current folder
    aside); now a usage error names the folder and the fix, and nothing there changes."""
    state = TinyTrainingState.create()
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}) as engine:
        engine.save(1, **state.objects())
    here = tmp_path / "work" / "here"
    here.mkdir(parents=True)
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    code, _, err = cli("convert", str(tmp_path / "ckpt" / "iter_000000001"), out, "--to", to, "--force")
    assert code == 2, err
    assert "current folder" in err and "Errno" not in err and "hf_model" in err
    assert sorted(p.name for p in here.iterdir()) == ["notes.txt"]
