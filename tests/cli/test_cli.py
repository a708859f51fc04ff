"""The ``ckpt-engine`` command line against real checkpoints (sync, async, 2 ranks) and bad input."""

from __future__ import annotations

import io
import json
import math
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cli import Run
from _paths import ROOT
from _torchrun import run_torchrun

from ckpt_engine import CheckpointEngine
from ckpt_engine._inspect import reader as cli_read
from ckpt_engine._inspect.describe import config_reference
from ckpt_engine.plugin_manager import installed_plugins
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A save folder with iterations 2 and 4 (sync saves) and the model state at each."""
    root = tmp_path_factory.mktemp("cli")
    save_dir = root / "ckpt"
    state = TinyTrainingState.create(seed=0, hidden=24)
    models = {}
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        for it in (2, 4):
            state.train(2, seed=it)
            engine.save(it, **state.objects())
            models[it] = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
    return {"dir": save_dir, "models": models, "root": root}


def _copy(saved: dict[str, Any], tmp_path: Path) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(saved["dir"], dst)
    return dst


def _data_file(checkpoint: Path, component: str = "model") -> Path:
    return next((checkpoint / component).glob("*.distcp"))


# -- every command ---------------------------------------------------------------------------

COMMANDS = ["ls", "inspect", "verify", "diff", "convert", "plan", "plugins", "demo"]


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_an_example(cli: Run, command: str) -> None:
    code, out, _ = cli(command, "--help")
    assert code == 0
    assert "example:" in out
    assert re.search(rf"^  ckpt-engine {command}\b", out, re.M), out


def test_top_level_help_lists_every_command(cli: Run) -> None:
    code, out, _ = cli("--help")
    assert code == 0
    for command in COMMANDS:
        assert re.search(rf"^    {command}\s", out, re.M), command
    assert "docs-config" not in out  # hidden


def test_no_command_and_unknown_command_are_usage_errors(cli: Run) -> None:
    assert cli()[0] == 2
    code, _, err = cli("frobnicate")
    assert code == 2 and "invalid choice" in err


# -- ls ----------------------------------------------------------------------------------------


def test_ls_lists_checkpoints_with_latest_and_status(cli: Run, saved: dict[str, Any]) -> None:
    code, out, _ = cli("ls", str(saved["dir"]))
    assert code == 0
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*\d+\s+iter_", line)]
    assert [r[0] for r in rows] == ["2", "4"]
    assert all(r[2] == "model,optim,rng,scheduler,trainer" for r in rows)
    assert rows[0][-1] == "verified" and rows[1][-3:] == ["verified", "<-", "latest"]

    code, out, _ = cli("ls", str(saved["dir"]), "--json")
    data = json.loads(out)
    assert code == 0 and data["latest"] == "iter_000000004"
    assert [(c["iteration"], c["status"], c["latest"]) for c in data["checkpoints"]] == [
        (2, "verified", False),
        (4, "verified", True),
    ]
    assert all(c["files"] >= 5 and c["bytes"] > 0 for c in data["checkpoints"])


def test_ls_flags_incomplete_corrupt_uncommitted_and_dangling_latest(
    cli: Run, saved: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = _copy(saved, tmp_path)
    data = _data_file(ckpt / "iter_000000002")
    data.write_bytes(data.read_bytes()[:100])  # truncated
    corrupt = _data_file(ckpt / "iter_000000004", "optim")
    raw = bytearray(corrupt.read_bytes())
    raw[len(raw) // 2] ^= 0xFF  # same size, different bytes: only checksums notice
    corrupt.write_bytes(bytes(raw))
    (ckpt / ".iter_000000006.partial" / "model").mkdir(parents=True)
    (ckpt / "latest_checkpoint.txt").write_text("iter_000000008\n")

    code, out, _ = cli("ls", str(ckpt), "--json")
    rows = {c["name"]: c for c in json.loads(out)["checkpoints"]}
    assert code == 1  # an incomplete checkpoint and a dangling latest are problems
    assert rows["iter_000000002"]["status"] == "INCOMPLETE"
    assert "truncated" in rows["iter_000000002"]["problems"][0]
    assert rows["iter_000000004"]["status"] == "verified"  # sizes only: the flipped byte is not seen
    assert rows[".iter_000000006.partial"]["status"] == "uncommitted"

    code, out, _ = cli("ls", str(ckpt), "--verify")
    assert code == 1
    assert re.search(r"iter_000000004 .*CORRUPT", out)
    assert "names 'iter_000000008', which does not exist" in out


def test_ls_bad_input(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    code, _, err = cli("ls", str(tmp_path / "nope"))
    assert code == 2 and "does not exist" in err
    (tmp_path / "f.txt").write_text("x")
    code, _, err = cli("ls", str(tmp_path / "f.txt"))
    assert code == 2 and "is a file" in err
    code, _, err = cli("ls", str(saved["dir"] / "iter_000000002"))
    assert code == 2 and "is a checkpoint, not a save folder; try: ckpt-engine inspect" in err
    (tmp_path / "empty").mkdir()
    code, out, _ = cli("ls", str(tmp_path / "empty"))
    assert code == 0 and out.startswith("no checkpoints in")


# -- inspect -----------------------------------------------------------------------------------


def test_inspect_reports_every_key_and_values(cli: Run, saved: dict[str, Any]) -> None:
    code, out, _ = cli("inspect", str(saved["dir"]), "--json")  # a save folder: its latest
    assert code == 0
    data = json.loads(out)
    assert data["checkpoint"].endswith("iter_000000004")
    model = data["components"]["model"]
    expected = saved["models"][4]
    assert {k["key"]: (k["dtype"], k["shape"], k["shards"]) for k in model["keys"]} == {
        k: ("float32", list(v.shape), 1) for k, v in expected.items()
    }
    assert model["numel"] == sum(v.numel() for v in expected.values())
    assert model["prefixes"]["0"]["keys"] == 2
    trainer = {k["key"]: k for k in data["components"]["trainer"]["keys"]}
    assert trainer["iteration"]["value"] == "4" and trainer["iteration"]["kind"] == "value"
    assert set(data["components"]) == {"model", "optim", "rng", "scheduler", "trainer"}

    code, out, _ = cli("inspect", str(saved["dir"] / "iter_000000002"), "--component", "model", "--keys", "*.bias")
    assert code == 0
    assert "model: 2 tensors (28 elements), 0 other values matching *.bias" in out
    assert re.search(r"^  0\.bias\s+float32\s+\[24\]\s+1\s", out, re.M)
    assert "0.weight" not in out


def test_inspect_bad_input(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    code, _, err = cli("inspect", str(saved["dir"]), "--component", "ema")
    assert code == 2 and "has no component 'ema'; it has: model, optim, rng, scheduler, trainer" in err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    code, _, err = cli("inspect", str(tmp_path / "notes"))
    assert code == 2 and "is not a checkpoint" in err
    assert err.count("\n") == 1 and "Traceback" not in err
    ckpt = _copy(saved, tmp_path)
    (ckpt / "iter_000000004" / "model" / ".metadata").write_bytes(b"\x80\x04not a pickle")
    code, _, err = cli("inspect", str(ckpt / "iter_000000004"), "--component", "model")
    assert code == 2 and "CorruptCheckpointError" in err and ".metadata" in err


def test_inspect_never_unpickles_code(
    cli: Run, saved: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    class Boom:
        def __reduce__(self) -> tuple[Any, ...]:
            return (os.system, ("touch pwned",))

    ckpt = _copy(saved, tmp_path)
    (ckpt / "iter_000000004" / "model" / ".metadata").write_bytes(pickle.dumps(Boom()))
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("inspect", str(ckpt / "iter_000000004"))
    assert code == 2 and "UnsafeCheckpointError" in err
    assert not (tmp_path / "pwned").exists()


# -- verify ------------------------------------------------------------------------------------


def test_verify_ok_then_each_kind_of_damage(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    code, out, _ = cli("verify", str(saved["dir"] / "iter_000000004"))
    assert code == 0 and out.startswith("ok ") and "checksums match the manifest" in out
    code, out, _ = cli("verify", str(saved["dir"]))
    assert code == 0 and "2 of 2 checkpoints ok" in out

    ckpt = _copy(saved, tmp_path)
    target = _data_file(ckpt / "iter_000000004", "optim")
    raw = bytearray(target.read_bytes())
    raw[-10] ^= 0x01
    target.write_bytes(bytes(raw))
    code, out, _ = cli("verify", str(ckpt / "iter_000000004"))
    assert code == 1 and out.startswith("FAILED") and target.name in out
    code, out, _ = cli("verify", str(ckpt / "iter_000000004"), "--level", "sizes")
    assert code == 0  # sizes still match

    _data_file(ckpt / "iter_000000002").write_bytes(b"")
    code, out, _ = cli("verify", str(ckpt))
    assert code == 1 and "0 of 2 checkpoints ok, 2 failed" in out

    code, out, _ = cli("verify", str(ckpt / "iter_000000002"), "--json")
    data = json.loads(out)
    assert code == 1 and data["ok"] is False and data["checkpoints"][0]["complete"] is False


def test_verify_of_a_folder_whose_latest_names_nothing_does_not_end_all_ok(
    cli: Run, saved: dict[str, Any], tmp_path: Path
) -> None:
    """The checkpoints are intact and ``latest`` names one that does not exist: the last line said
    "2 of 2 checkpoints ok" below the FAILED line (exit 1, rightly)."""
    ckpt = _copy(saved, tmp_path)
    (ckpt / "latest_checkpoint.txt").write_text("iter_000000008\n")
    code, out, _ = cli("verify", str(ckpt))
    assert code == 1 and "names 'iter_000000008', which does not exist" in out
    assert out.rstrip().endswith("2 of 2 checkpoints ok; the folder itself has 1 problem(s) (FAILED above)"), out


def test_verify_bad_input(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    code, _, err = cli("verify", str(tmp_path / "missing"))
    assert code == 2 and "does not exist" in err
    code, _, err = cli("verify", str(saved["dir"] / "iter_000000004" / "model"))
    assert code == 2 and "is one component" in err
    (tmp_path / "empty").mkdir()
    code, _, err = cli("verify", str(tmp_path / "empty"))
    assert code == 2 and "is empty" in err
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("hello")
    code, _, err = cli("verify", str(tmp_path / "notes"))
    assert code == 2 and "is not a checkpoint: it has no component folders" in err
    ckpt = _copy(saved, tmp_path)
    (ckpt / "iter_000000004" / "model" / ".metadata").unlink()
    code, out, _ = cli("verify", str(ckpt / "iter_000000004"))
    assert code == 1 and ".metadata does not exist" in out


# -- diff --------------------------------------------------------------------------------------


def test_diff_identical_and_different(cli: Run, saved: dict[str, Any]) -> None:
    a, b = saved["dir"] / "iter_000000002", saved["dir"] / "iter_000000004"
    code, out, _ = cli("diff", str(a), str(a))
    assert code == 0 and out.rstrip().endswith("the checkpoints are identical")

    code, out, _ = cli("diff", str(a), str(b), "--json")
    data = json.loads(out)
    assert code == 1 and data["identical"] is False
    m2, m4 = saved["models"][2], saved["models"][4]
    expected = {k: float((m2[k].double() - m4[k].double()).abs().max()) for k in m2}
    assert data["components"]["model"]["max_abs_diff"] == pytest.approx(expected, rel=0, abs=0)
    assert data["components"]["trainer"]["values_changed"]["iteration"] == {"a": "2", "b": "4"}

    code, out, _ = cli("diff", str(a), str(b), "--component", "model", "--atol", "1e9")
    assert code == 0 and "model: identical" in out


def test_diff_reports_shape_dtype_and_key_changes(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    torch.manual_seed(0)
    other = torch.nn.Sequential(torch.nn.Linear(8, 30), torch.nn.Tanh(), torch.nn.Linear(30, 4, bias=False))
    other[2].double()
    with CheckpointEngine({"save_dir": str(tmp_path / "other")}) as engine:
        engine.save(1, model=other)
    code, out, _ = cli("diff", str(saved["dir"]), str(tmp_path / "other"), "--component", "model")
    assert code == 1
    assert "model: 1 only in a, 3 shape/dtype changed" in out
    assert "only in a: 2.bias" in out
    assert "changed: 0.weight: float32[24, 8] -> float32[30, 8]" in out
    assert "changed: 2.weight: float32[4, 24] -> float64[4, 30]" in out
    code, out, _ = cli("diff", str(saved["dir"]), str(tmp_path / "other"))
    assert code == 1 and "optim: only in a" in out


def test_diff_and_convert_stream_one_batch_at_a_time(
    cli: Run, saved: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a tiny budget every read holds one tensor: memory is bounded by the largest tensor."""
    batches: list[list[str]] = []
    held: list[int] = []
    real_read = cli_read.ComponentReader.read

    def spy(self: cli_read.ComponentReader, keys: list[str]) -> dict[str, Any]:
        batches.append(list(keys))
        held.append(sum(self.keys[k].nbytes for k in keys))
        return real_read(self, keys)

    monkeypatch.setattr(cli_read.ComponentReader, "read", spy)
    a, b = saved["dir"] / "iter_000000002", saved["dir"] / "iter_000000004"
    code, _, _ = cli("diff", str(a), str(b), "--component", "model", "--budget", "1")
    assert code == 1
    largest = max(v.numel() * 4 for v in saved["models"][4].values())
    assert len(batches) == 2 * len(saved["models"][4]) and max(held) == largest

    batches.clear()
    held.clear()
    code, _, _ = cli("convert", str(b), str(tmp_path / "m.pt"), "--budget", "600")
    assert code == 0 and max(held) <= max(largest, 600) and len(batches) > 1
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in saved["models"][4].items())


# -- convert -----------------------------------------------------------------------------------


def test_convert_torch_equals_the_full_tensors(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "model.pt"
    code, text, _ = cli("convert", str(saved["dir"]), str(out), "--to", "torch")
    assert code == 0 and text.startswith(f"wrote {out} (torch): 4 values of component 'model'")
    loaded = torch.load(out, weights_only=True)
    expected = saved["models"][4]
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
    model = TinyTrainingState.create(seed=5, hidden=24, steps=0).model
    model.load_state_dict(loaded)  # strict: the file is a plain model state dict
    assert not list(tmp_path.glob("*.parts.*")) and not list(tmp_path.glob("*.tmp.*"))

    code, _, err = cli("convert", str(saved["dir"]), str(out))
    assert code == 2 and "exists; pass --force" in err
    code, _, _ = cli(
        "convert", str(saved["dir"] / "iter_000000002"), str(out), "--force", "--dtype", "bfloat16", "--keys", "0.*"
    )
    loaded = torch.load(out, weights_only=True)
    assert code == 0 and sorted(loaded) == ["0.bias", "0.weight"]
    assert loaded["0.weight"].dtype == torch.bfloat16
    assert torch.equal(loaded["0.weight"], saved["models"][2]["0.weight"].bfloat16())


def test_convert_optimizer_keeps_values_in_torch_format(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "optim.pt"
    code, _, _ = cli("convert", str(saved["dir"]), str(out), "--component", "optim")
    loaded = torch.load(out, weights_only=True)
    assert code == 0
    assert loaded["param_groups.0.weight.lr"] == pytest.approx(1e-2 * 0.25)  # StepLR(3, 0.5) after 6 steps
    assert loaded["state.0.weight.exp_avg"].shape == (24, 8)


def test_convert_safetensors(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    import safetensors.torch as safetensors_torch  # in the test extra

    out = tmp_path / "model.safetensors"
    code, _, _ = cli("convert", str(saved["dir"]), str(out))  # format from the suffix
    assert code == 0
    loaded = safetensors_torch.load_file(str(out))
    expected = saved["models"][4]
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())

    out2 = tmp_path / "optim.safetensors"
    code, text, _ = cli("convert", str(saved["dir"]), str(out2), "--component", "optim", "--dtype", "float16")
    assert code == 0
    _, info, _ = cli("inspect", str(saved["dir"]), "--component", "optim", "--json")
    values = [k["key"] for k in json.loads(info)["components"]["optim"]["keys"] if k["kind"] == "value"]
    assert values and all(k.startswith("param_groups.") for k in values)
    assert f"left out {len(values)} non-tensor value(s) (safetensors holds only tensors)" in text
    loaded = safetensors_torch.load_file(str(out2))
    assert loaded["state.0.weight.exp_avg"].dtype == torch.float16
    assert "param_groups.0.weight.lr" not in loaded


def test_convert_without_safetensors_says_how_to_install(
    cli: Run, saved: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "safetensors", None)
    code, _, err = cli("convert", str(saved["dir"]), str(tmp_path / "m.safetensors"), "--to", "safetensors")
    assert code == 2 and "pip install safetensors" in err
    assert not (tmp_path / "m.safetensors").exists()


def test_convert_bad_input(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    code, _, err = cli("convert", str(saved["dir"]), str(tmp_path / "m.bin2"))
    assert code == 2 and "--to torch or --to safetensors" in err
    code, _, err = cli("convert", str(saved["dir"]), str(tmp_path / "m.pt"), "--dtype", "int8")
    assert code == 2 and "not a floating-point torch dtype" in err
    code, _, err = cli("convert", str(saved["dir"]), str(tmp_path / "no" / "m.pt"))
    assert code == 2 and "does not exist" in err
    ckpt = _copy(saved, tmp_path)
    data = _data_file(ckpt / "iter_000000004", "optim")
    data.write_bytes(data.read_bytes()[:50])
    code, _, err = cli("convert", str(ckpt), str(tmp_path / "m.pt"))
    assert code == 2 and "IncompleteCheckpointError" in err and "truncated" in err
    assert not (tmp_path / "m.pt").exists()


def test_convert_corrupt_data_fails_cleanly(cli: Run, saved: dict[str, Any], tmp_path: Path) -> None:
    ckpt = _copy(saved, tmp_path)
    data = _data_file(ckpt / "iter_000000004")
    data.write_bytes(b"\0" * data.stat().st_size)  # right size, garbage content
    code, _, err = cli("convert", str(ckpt / "iter_000000004"), str(tmp_path / "m.pt"))
    assert code == 2 and "CorruptCheckpointError" in err and data.name in err  # its blocks' digests differ
    assert not (tmp_path / "m.pt").exists() and not list(tmp_path.glob("m.pt.*"))


@pytest.mark.parametrize("out", ["m.pt", "m.safetensors", "hf"])
def test_convert_and_diff_check_every_byte_they_read_against_the_manifest(
    cli: Run, saved: dict[str, Any], tmp_path: Path, out: str
) -> None:
    """One flipped byte inside a tensor (the file parses): convert exported the wrong weights with
    exit 0 and `diff A A` said identical, while a load refuses it. Both now check the blocks the
    manifest records, as a load does, and name the file."""
    if out != "m.pt":
        pytest.importorskip("safetensors")
    ckpt = _copy(saved, tmp_path)
    data = _data_file(ckpt / "iter_000000004")
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 2048] ^= 0x01  # in the last tensor's bytes, before the archive's directory
    data.write_bytes(bytes(raw))
    args = ["--to", "hf"] if out == "hf" else []
    code, _, err = cli("convert", str(ckpt / "iter_000000004"), str(tmp_path / out), *args)
    assert code == 2 and "CorruptCheckpointError" in err and data.name in err, err
    assert not (tmp_path / out).exists()
    code, _, err = cli("diff", str(ckpt / "iter_000000004"), str(ckpt / "iter_000000004"))
    assert code == 2 and "CorruptCheckpointError" in err, err


def test_convert_and_diff_take_a_component_folder_named_by_a_relative_path(
    cli: Run, saved: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain DCP folder (no manifest above it) and an engine component named relative to the
    working folder ('plain', '.', 'model'): the reader's look for the manifest one folder up split
    the path on '/' and failed with a bare ValueError."""
    ckpt = _copy(saved, tmp_path)
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path / "plain"))
    monkeypatch.chdir(tmp_path)
    code, _, err = cli("convert", "plain", str(tmp_path / "p.pt"))
    assert code == 0, err
    assert torch.equal(torch.load(tmp_path / "p.pt")["w"], torch.arange(6.0))
    monkeypatch.chdir(tmp_path / "plain")
    assert cli("convert", ".", str(tmp_path / "q.pt"))[0] == 0
    monkeypatch.chdir(ckpt / "iter_000000004")
    code, _, err = cli("convert", "model", str(tmp_path / "m.pt"))
    assert code == 0, err
    assert_state_dicts_equal(torch.load(tmp_path / "m.pt"), saved["models"][4])
    assert cli("diff", "model", "model")[0] == 0


# -- plan --------------------------------------------------------------------------------------

FACTORIES = """
import torch
from torch import nn


def build():
    torch.manual_seed(7)
    return nn.Sequential(nn.Linear(8, 24), nn.Tanh(), nn.Linear(24, 4))


def wider():
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def training():
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return {"model": model, "optimizer": opt, "grad_scaler": torch.amp.GradScaler("cpu")}


def model_and_optimizer():  # docs/getting-started.md's build_wider shape: `return model, optimizer`
    model = build()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def broken():
    raise RuntimeError("no GPU here")


def not_a_model():
    return 42


LAST = []


def remember():
    LAST.append(build())
    return LAST[-1]
"""


@pytest.fixture
def factories(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    name = f"cli_factories_{os.getpid()}_{len(os.listdir(tmp_path))}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    monkeypatch.chdir(tmp_path)  # --model modules are importable from the current folder
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def _tree(path: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(path.rglob("*"))}


def test_plan_prints_the_load_report_and_writes_nothing(cli: Run, saved: dict[str, Any], factories: str) -> None:
    before = _tree(saved["dir"])
    code, out, _ = cli("plan", str(saved["dir"]), "--model", f"{factories}:remember")
    assert code == 0
    assert "plugins (fold order): te_extra_state; strict=True" in out
    assert "model: 4 loaded, 0 overlap, 0 skipped, 0 missing, 0 unexpected" in out
    assert "ok: the load would succeed" in out
    assert _tree(saved["dir"]) == before
    module = sys.modules[factories]
    fresh = module.build()  # same seed: the planned model must still hold its initial values
    assert all(
        torch.equal(a, b)
        for a, b in zip(module.LAST[-1].state_dict().values(), fresh.state_dict().values(), strict=True)
    )

    code, out, _ = cli("plan", str(saved["dir"]), "--model", f"{factories}:training", "--json")
    data = json.loads(out)
    assert code == 0 and data["ok"] is True
    assert set(data["report"]) == {"model", "optim", "trainer"}
    # state (3 each) + the one group's 11 hyper-parameters, under its first parameter (what torch reads)
    assert len(data["report"]["optim"]["loaded"]) == 4 * 3 + 11
    assert sorted(data["report"]["optim"]["unexpected"]) == sorted(
        f"param_groups.{k}.initial_lr" for k in ("0.weight", "0.bias", "2.weight", "2.bias")
    )
    # `return model, optimizer` plans both (it was refused: "model[1] is a AdamW, not a torch.nn.Module")
    code, out, _ = cli("plan", str(saved["dir"]), "--model", f"{factories}:model_and_optimizer", "--json")
    assert code == 0 and {"model", "optim"} <= set(json.loads(out)["report"])
    assert len(json.loads(out)["report"]["optim"]["loaded"]) == 4 * 3 + 11


def test_plan_shows_mismatches_and_plugins_that_resolve_them(
    cli: Run, saved: dict[str, Any], factories: str, tmp_path: Path
) -> None:
    code, out, _ = cli("plan", str(saved["dir"]), "--model", f"{factories}:wider")
    assert code == 1
    assert "model: 1 loaded, 0 overlap, 0 skipped, 0 missing, 0 unexpected, 3 MISMATCHED" in out
    assert "MISMATCH: 0.weight: stored float32[24, 8], target float32[32, 8]" in out
    assert "FAILED: the load would fail:" in out and "3 mismatch(es)" in out

    config = tmp_path / "engine.yaml"
    config.write_text(
        textwrap.dedent(
            f"""
            save_dir: {saved["dir"]}
            plugins:
              - name: size_mismatch
                options: {{policy: overlap, patterns: ["0.*"], rules: [{{pattern: "2.weight", policy: skip}}]}}
            """
        )
    )
    code, out, _ = cli("plan", str(saved["dir"]), "--model", f"{factories}:wider", "--config", str(config))
    assert code == 0, out
    assert "plugins (fold order): te_extra_state, size_mismatch" in out
    assert "overlap: 0.weight saved [24, 8] -> target [32, 8]" in out
    assert "model: 1 loaded, 2 overlap, 1 skipped, 0 missing, 0 unexpected" in out
    assert re.search(r"^  skipped.*2\.weight", out, re.M)
    assert "MISMATCH" not in out


def test_plan_bad_factories(cli: Run, saved: dict[str, Any], factories: str) -> None:
    code, _, err = cli("plan", str(saved["dir"]), "--model", "no_such_package.models:build")
    assert code == 2
    assert "cannot import module 'no_such_package.models'" in err and "ModuleNotFoundError" in err
    assert err.count("\n") == 1
    code, _, err = cli("plan", str(saved["dir"]), "--model", f"{factories}:missing")
    assert code == 2 and f"module '{factories}' has no attribute 'missing'" in err
    code, _, err = cli("plan", str(saved["dir"]), "--model", f"{factories}:broken")
    assert code == 2 and "raised RuntimeError: no GPU here" in err
    code, _, err = cli("plan", str(saved["dir"]), "--model", f"{factories}:not_a_model")
    assert code == 2 and "returned a int" in err
    code, _, err = cli("plan", str(saved["dir"]), "--model", "no_colon")
    assert code == 2 and "must be 'package.module:factory'" in err
    code, _, err = cli("plan", str(saved["dir"] / "nope"), "--model", f"{factories}:build")
    assert code == 2 and "does not exist" in err


# -- plugins -----------------------------------------------------------------------------------


def test_plugins_lists_builtin_and_third_party_with_options(cli: Run) -> None:
    code, out, _ = cli("plugins")
    assert code == 0
    assert re.search(
        r"^te_extra_state  \(ckpt_engine_plugins\.te_extra_state:TeExtraStatePlugin, from ckpt-engine "
        r"[\d.]+\)  \[on by default\]$",
        out,
        re.M,
    )
    assert "  hooks: pre_load_plan (fold)" in out
    assert re.search(r"^    segment\s+string\s+\"_extra_state\"\s+Key segment to skip", out, re.M)
    # Third-party plugins of the fake distribution on the test path:
    assert re.search(r"^fake_prefix  \(ckpt_fake_plugins\.prefix:PrefixRemap, from ckpt-engine-fake 1\.0\)$", out, re.M)
    assert re.search(r"^    prefix\s+string\s+\"module\.\"", out, re.M)
    assert "  cannot import: ImportError: fake_broken cannot be imported (on purpose)" in out
    assert "  names a function, not a plugin" in out

    code, out, _ = cli("plugins", "--json")
    data = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert data["size_mismatch"]["hooks"] == {"pre_load_plan": "fold"}
    assert {o["name"]: o["default"] for o in data["size_mismatch"]["options"]}["policy"] == '"error"'
    assert data["fake_broken"]["error"].startswith("cannot import")
    assert set(data) == set(installed_plugins())


def test_plugins_with_a_config_shows_fold_order_and_providers(cli: Run, tmp_path: Path) -> None:
    config = tmp_path / "engine.toml"
    config.write_text('save_dir = "x"\nplugins = ["size_mismatch", "fake_prefix"]\n')
    code, out, _ = cli("plugins", "--config", str(config))
    assert code == 0
    assert "enabled, in fold order: te_extra_state, size_mismatch, fake_prefix" in out
    assert "pre_load_plan: te_extra_state -> size_mismatch" in out
    assert "remap_keys: fake_prefix" in out and "stage: the engine's default" in out

    config.write_text('save_dir = "x"\nplugins = ["fake_stager_a", "fake_stager_b"]\n')
    code, _, err = cli("plugins", "--config", str(config))
    assert code == 2 and "PluginConflictError" in err and "fake_stager_a" in err and "fake_stager_b" in err
    config.write_text('save_dir = "x"\nplugins = ["fake_broken"]\n')
    code, _, err = cli("plugins", "--config", str(config))
    assert code == 2 and "PluginLoadError" in err


# -- docs --------------------------------------------------------------------------------------


def test_configuration_reference_is_generated_from_the_models(cli: Run) -> None:
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == config_reference(), (
        "docs/configuration.md is stale: run ckpt-engine docs-config -o docs/configuration.md"
    )
    for field in ("save_dir", "strict", "plugins", "keys_not_to_resume"):
        assert f"| `{field}` |" in committed
    for plugin in sorted(p for p, ep in installed_plugins().items() if ep.dist and ep.dist.name == "ckpt-engine"):
        assert f"### {plugin}\n" in committed
    code, out, _ = cli("docs-config", "--check", str(ROOT / "docs" / "configuration.md"))
    assert code == 0 and out == ""


def test_cli_md_documents_every_command_and_its_examples_run(
    cli: Run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Run docs/cli.md's set-up block, then every `$ ckpt-engine ...` line in it, with its documented exit code."""
    text = (ROOT / "docs" / "cli.md").read_text()
    for command in COMMANDS:
        assert re.search(rf"^## `ckpt-engine {command}", text, re.M), command
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    namespace: dict[str, Any] = {"__name__": "cli_md"}
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if not block.startswith("# not run"):
            exec(compile(block, "docs/cli.md", "exec"), namespace)
    ran = 0
    for block in re.findall(r"```console\n(.*?)```", text, re.S):
        for line in block.splitlines():
            if not line.startswith("$ ckpt-engine ") or "demo" in line or "--help" in line:
                continue
            command, _, comment = line[2:].partition("#")
            m = re.search(r"exit code (\d+)", comment)
            code, out, err = cli(*shlex.split(command)[1:])
            assert code == (int(m.group(1)) if m else 0), f"{line}\n{out}\n{err}"
            ran += 1
    assert ran >= len(COMMANDS) - 1


class _Terminal(io.StringIO):
    """What a terminal is to the progress bar: a stream whose isatty() is True."""

    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("drawn_by", ["tqdm", "its own line"])
def test_progress_bar_shows_bytes_items_and_rate_on_a_terminal_only(
    drawn_by: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_engine.cli._output import Progress

    if drawn_by != "tqdm":
        monkeypatch.setitem(sys.modules, "tqdm", None)  # as where tqdm is not installed: import fails
    stream = _Terminal()
    bar = Progress("converting model", 4 << 20, stream=stream, items=4, noun="value", interval=0)
    assert (bar._tqdm is not None) == (drawn_by == "tqdm")
    for _ in range(4):
        bar.advance(1 << 20)
    bar.close()
    text = stream.getvalue()
    assert text.startswith("\rconverting model") and "1/4 values" in text and "4/4 values" in text, text
    if drawn_by == "tqdm":
        assert "1.00M/4.00M" in text and "4.00M/4.00M" in text and re.search(r"[\d.]+[kMG]?B/s", text), text
    else:
        assert " 25% 1.0 MiB/4.0 MiB" in text and "100% 4.0 MiB/4.0 MiB" in text, text
        assert re.search(r"4\.0 MiB/4\.0 MiB [\d.]+ [KMG]?i?B/s, 4/4 values", text), text
    assert text.endswith(("\r", "\r\033[K")), text  # the line is cleared at the end

    quiet = io.StringIO()
    bar = Progress("x", 10, stream=quiet, interval=0)  # a StringIO is not a terminal
    bar.advance(10)
    bar.close()
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("command", ["ls", "verify", "diff", "convert"])
def test_commands_show_progress_on_a_terminal_and_quiet_silences_it(
    command: str, saved: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckpt_engine.cli import main

    ckpt = str(saved["dir"] / "iter_000000004")
    argv = {
        "ls": ["ls", str(saved["dir"])],
        "verify": ["verify", str(saved["dir"])],
        "diff": ["diff", str(saved["dir"] / "iter_000000002"), ckpt],
        "convert": ["convert", ckpt, str(tmp_path / "m.safetensors"), "--force"],
    }[command]
    label = {"ls": "reading ckpt", "verify": "verifying iter_", "diff": "comparing model", "convert": "converting"}
    for quiet in ((), ("--quiet",), ("-q",)):
        terminal = _Terminal()
        monkeypatch.setattr(sys, "stderr", terminal)
        main([*argv, *quiet] if command != "ls" else [*quiet, *argv])  # global or after the command
        text = terminal.getvalue()
        if quiet:
            assert text == "", (quiet, text)
        else:
            assert label[command] in text and "B/s" in text, text
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: nothing
    main(argv)
    assert sys.stderr.getvalue() == ""


def test_config_errors_are_readable(cli: Run, tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("save_dir: x\nstrict: maybe\nstrictt: true\n")
    code, _, err = cli("plugins", "--config", str(tmp_path / "bad.yaml"))
    assert code == 2
    assert err.startswith(f"ckpt-engine plugins: error: ConfigError: invalid config in '{tmp_path / 'bad.yaml'}'")
    assert "strictt: unknown field; did you mean strict?" in err
    assert "https://errors.pydantic.dev" not in err and "Traceback" not in err


# -- errors, --debug, the console script ---------------------------------------------------------


def test_errors_are_one_line_and_debug_shows_the_traceback(cli: Run, tmp_path: Path) -> None:
    code, out, err = cli("inspect", str(tmp_path / "missing"))
    assert code == 2 and out == ""
    assert err == f"ckpt-engine inspect: error: CheckpointNotFoundError: {tmp_path / 'missing'} does not exist\n"
    code, _, err = cli("inspect", str(tmp_path / "missing"), "--debug")
    assert code == 2 and "Traceback (most recent call last)" in err and "CheckpointNotFoundError" in err


def test_console_script_runs_as_a_real_process(saved: dict[str, Any]) -> None:
    script = shutil.which("ckpt-engine", path=os.path.dirname(sys.executable)) or shutil.which("ckpt-engine")
    assert script, "the ckpt-engine console script is not installed (pip install -e .)"
    proc = subprocess.run([script, "ls", str(saved["dir"]), "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["latest"] == "iter_000000004"


# -- async and 2-rank checkpoints --------------------------------------------------------------


@pytest.mark.full  # over 2 s on 2 cores: writer processes
@pytest.mark.skipif("pinned_staging" not in installed_plugins(), reason="the pinned_staging plugin is not installed")
def test_commands_on_an_async_checkpoint(cli: Run, tmp_path: Path) -> None:
    state = TinyTrainingState.create(seed=3, hidden=16)
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt"), "plugins": ["pinned_staging"]}) as engine:
        handle = engine.save(5, **state.objects())
        expected = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
        state.train(1)  # mutate right away: the checkpoint holds the point-in-time state
        handle.result()
    code, out, _ = cli("ls", str(tmp_path / "ckpt"))
    assert code == 0 and re.search(r"5\s+iter_000000005 .*verified\s+<- latest", out)
    assert cli("verify", str(tmp_path / "ckpt"))[0] == 0
    code, _, _ = cli("convert", str(tmp_path / "ckpt"), str(tmp_path / "m.pt"))
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert code == 0 and all(torch.equal(loaded[k], v) for k, v in expected.items())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    save_dir = tmp_path_factory.mktemp("cli2r") / "ckpt"
    local_dir = save_dir.parent / "local"  # each rank's part of every save too: the node-local tier
    run = run_torchrun("cli_sharded_save.py", str(save_dir), str(local_dir), timeout=180)
    assert run.returncode == 0, run.describe()
    return {"dir": save_dir, "local": local_dir, "params": run.results()[0][0]}


@pytest.mark.dist
def test_commands_on_a_two_rank_fsdp2_checkpoint(cli: Run, sharded: dict[str, Any], tmp_path: Path) -> None:
    save_dir = sharded["dir"]
    code, out, _ = cli("inspect", str(save_dir), "--component", "model", "--json")
    keys = {k["key"]: k for k in json.loads(out)["components"]["model"]["keys"]}
    assert code == 0 and {k["shards"] for k in keys.values()} == {2}
    assert keys["3.weight"]["shape"] == [1, 5]

    assert cli("verify", str(save_dir))[0] == 0
    for fmt in ("pt", "safetensors"):
        code, _, _ = cli("convert", str(save_dir / "iter_000000001"), str(tmp_path / f"m.{fmt}"))
        assert code == 0
    expected = {k: torch.tensor(v) for k, v in sharded["params"]["1"].items()}
    loaded = torch.load(tmp_path / "m.pt", weights_only=True)
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())  # assembled from both ranks' shards
    import safetensors.torch as safetensors_torch  # in the test extra

    loaded = safetensors_torch.load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(loaded[k], v) for k, v in expected.items())

    code, out, _ = cli("diff", str(save_dir / "iter_000000001"), str(save_dir / "iter_000000002"), "--json")
    diffs = json.loads(out)["components"]["model"]["max_abs_diff"]
    after = {k: torch.tensor(v) for k, v in sharded["params"]["2"].items()}
    assert code == 1
    assert diffs == {
        k: float((expected[k].double() - after[k].double()).abs().max())
        for k in expected
        if not torch.equal(expected[k], after[k])
    }


@pytest.mark.dist
def test_a_rank_local_checkpoint_is_one_ranks_part_never_the_whole_model(
    cli: Run, sharded: dict[str, Any], tmp_path: Path
) -> None:
    parts = [sharded["local"] / f"rank_0000{r}" / "iter_000000001" for r in (0, 1)]
    out = tmp_path / "m.pt"
    code, _, err = cli("convert", str(parts[1]), str(out))
    assert code == 2 and "PartialCheckpointError" in err and "rank 1's part (of 2 ranks)" in err and not out.exists()

    code, text, _ = cli("verify", str(parts[1]))
    assert code == 0 and "rank 1's part (of 2 ranks) of a rank-local checkpoint" in text and "complete" not in text
    held: dict[str, int] = {}
    for rank, part in enumerate(parts):
        code, text, _ = cli("inspect", str(part), "--component", "model", "--json")
        model = json.loads(text)["components"]["model"]
        assert (
            code == 0
            and model["part"]["rank"] == rank
            and model["part"]["world_size"] == 2
            and model["part"]["held"] < model["numel"]
        )
        for key in model["keys"]:
            held[key["key"]] = held.get(key["key"], 0) + key.get("held", math.prod(key["shape"]))
    expected = {k: torch.tensor(v) for k, v in sharded["params"]["1"].items()}
    assert held == {k: v.numel() for k, v in expected.items()}  # the two parts hold every element once

    code, text, _ = cli("diff", str(parts[0]), str(sharded["dir"] / "iter_000000001"), "--component", "model")
    assert code == 1 and "a is rank 0's part (of 2 ranks)" in text and "not compared: 0.weight" in text


@pytest.mark.dist
def test_a_rank_local_part_converts_only_where_it_is_the_whole_model(
    cli: Run, sharded: dict[str, Any], tmp_path: Path
) -> None:
    """A data-parallel job's part holds the whole model; a pipeline stage's holds its own layers
    only, and a part with state saved per rank holds that rank's copy: both were converted as the
    whole model (exit 0, a quarter of a model presented as all of it)."""
    part = "rank_00000/iter_000000001"
    replicated = tmp_path / "replicated.pt"
    code, _, err = cli("convert", f"{sharded['local']}_replicated/{part}", str(replicated))
    assert code == 0, err
    assert set(torch.load(replicated, weights_only=True)) == {"weight", "bias"}
    for case, message in (
        ("pipeline", r"rank 1's part of the same step holds other keys \(they differ in 4, e\.g\. 'stage0\.bias'\)"),
        (
            "experts",
            r"component 'model' is rank 0's part \(of 2 ranks\), and holds state that differed across the ranks",
        ),
    ):
        out_file = tmp_path / f"{case}.pt"
        code, _, err = cli("convert", f"{sharded['local']}_{case}/{part}", str(out_file))
        assert code == 2 and "PartialCheckpointError" in err and not out_file.exists(), err
        assert re.search(message, err), err


@pytest.mark.dist
def test_plan_of_a_sharded_checkpoint_into_one_process(
    cli: Run, sharded: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "twolayer.py").write_text(
        "import torch\n"
        "def build():\n"
        "    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 5),"
        " torch.nn.Linear(5, 1))\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, out, _ = cli("plan", str(sharded["dir"]), "--model", "twolayer:build")
    assert code == 0 and "model: 6 loaded, 0 overlap, 0 skipped, 0 missing, 0 unexpected" in out
