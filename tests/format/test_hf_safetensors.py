"""Hugging Face safetensors: ``load_path`` reads them (file, folder, shards), ``convert --to hf`` writes them."""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _torchrun import run_torchrun
from hypothesis import given
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ckpt_engine import (
    CheckpointEngine,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    LoadStrictnessError,
)
from ckpt_engine._dcpio.hf_read import _runs, read_index
from ckpt_engine.cli import main
from ckpt_engine.testing import assert_state_dicts_equal


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(6, 6)
        self.mlp = nn.Linear(6, 12)
        self.register_buffer("scale", torch.arange(3, dtype=torch.int64))


class Tiny(nn.Module):
    """An HF-like layout: ``embed``, ``layers.<i>.*``, ``norm``."""

    def __init__(self, seed: int, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(10, 6)
        self.layers = nn.ModuleList(Block() for _ in range(layers))
        self.norm = nn.LayerNorm(6)


def weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors (non-tensor extra state left out), copied."""
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def write_sharded(folder: Path, sd: dict[str, torch.Tensor], shards: int, prefix: str = "") -> dict[str, str]:
    """An HF folder as ``save_pretrained`` writes it: shards plus ``model.safetensors.index.json``."""
    folder.mkdir(parents=True, exist_ok=True)
    keys = sorted(sd)
    weight_map: dict[str, str] = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {prefix + k: sd[k].contiguous() for k in keys[i::shards]}
        save_file(part, str(folder / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, name)
    total = sum(v.numel() * v.element_size() for v in sd.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return weight_map


def load_into(model: nn.Module, load_path: Path, tmp_path: Path, **config: Any) -> Any:
    with CheckpointEngine({"save_dir": str(tmp_path / "run"), "load_path": str(load_path), **config}) as engine:
        return engine.load(model=model)


# -- load_path = safetensors ---------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["file", "folder"])
def test_single_file_loads_exactly_at_iteration_zero(tmp_path: Path, layout: str) -> None:
    src = weights(Tiny(seed=0))
    if layout == "file":
        path = tmp_path / "weights.safetensors"
    else:
        (tmp_path / "hf").mkdir()
        path = tmp_path / "hf" / "model.safetensors"
    save_file(src, str(path), metadata={"format": "pt"})
    model = Tiny(seed=1)
    result = load_into(model, path if layout == "file" else path.parent, tmp_path)
    assert (result.iteration, result.source, result.components) == (0, "safetensors", ("model",))
    assert set(result.report["model"].loaded) == set(src) and not result.report["model"].cast
    assert_state_dicts_equal(weights(model), src)


def test_sharded_folder_with_index(tmp_path: Path) -> None:
    src = weights(Tiny(seed=0))
    weight_map = write_sharded(tmp_path / "hf", src, shards=3)
    assert len(set(weight_map.values())) == 3
    model = Tiny(seed=1)
    result = load_into(model, tmp_path / "hf", tmp_path)
    assert result.checkpoint_path == str(tmp_path / "hf")
    assert set(result.report["model"].loaded) == set(src)
    assert_state_dicts_equal(weights(model), src)


def test_a_folder_with_both_the_single_file_and_an_index_loads_what_from_pretrained_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """transformers' ``from_pretrained`` reads ``model.safetensors`` where a folder has it and the
    index too: ``load_path``, ``inspect`` and ``diff`` read that file as well; naming the index
    itself reads the shards it names."""
    sharded, single = weights(Tiny(seed=0)), weights(Tiny(seed=2))
    folder = tmp_path / "hf"
    write_sharded(folder, sharded, shards=2)
    save_file(single, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = Tiny(seed=1)
    load_into(model, folder, tmp_path)
    assert_state_dicts_equal(weights(model), single)
    load_into(model, folder / "model.safetensors.index.json", tmp_path / "by_index")
    assert_state_dicts_equal(weights(model), sharded)
    assert main(["diff", str(folder), str(folder / "model.safetensors")]) == 0
    capsys.readouterr()


def test_bf16_weights_into_fp32_model_are_cast_and_reported(tmp_path: Path) -> None:
    src = weights(Tiny(seed=0))
    bf16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in src.items()}
    write_sharded(tmp_path / "hf", bf16, shards=2)
    model = Tiny(seed=1)
    rep = load_into(model, tmp_path / "hf", tmp_path).report["model"]
    floats = {k for k, v in src.items() if v.is_floating_point()}
    assert dict(rep.cast) == dict.fromkeys(floats, ("bfloat16", "float32"))
    got = weights(model)
    for k, v in bf16.items():
        assert got[k].dtype == src[k].dtype and torch.equal(got[k], v.to(src[k].dtype)), k


def test_plugins_and_strictness_apply(tmp_path: Path) -> None:
    src = weights(Tiny(seed=0))
    del src["norm.bias"]
    write_sharded(tmp_path / "hf", src, shards=2, prefix="model.")  # HF keys: model.layers.0...
    rename = {"name": "rename", "options": {"rules": [{"checkpoint": "model.", "model": ""}]}}
    with pytest.raises(LoadStrictnessError) as info:
        load_into(Tiny(seed=1), tmp_path / "hf", tmp_path, plugins=[rename])
    assert info.value.missing == ("norm.bias (reads model.norm.bias)",)

    model = Tiny(seed=1)
    before = model.norm.bias.detach().clone()
    rep = load_into(model, tmp_path / "hf", tmp_path, plugins=[rename], strict=False).report["model"]
    assert rep.missing == ("norm.bias",) and rep.renamed["embed.weight"] == "model.embed.weight"
    assert torch.equal(model.norm.bias, before)
    got = weights(model)
    for k, v in src.items():
        assert torch.equal(got[k], v), k

    # size_mismatch resolves a changed vocabulary (overlap)
    bigger = {**src, "embed.weight": torch.randn(12, 6)}
    save_file(bigger, str(tmp_path / "big.safetensors"))
    model = Tiny(seed=1)
    plugins = [{"name": "size_mismatch", "options": {"policy": "overlap"}}]
    rep = load_into(model, tmp_path / "big.safetensors", tmp_path, plugins=plugins, strict=False).report["model"]
    assert rep.overlap["embed.weight"].saved_shape == (12, 6)
    assert torch.equal(model.embed.weight, bigger["embed.weight"][:10])


def test_missing_shard_is_a_clear_error(tmp_path: Path) -> None:
    weight_map = write_sharded(tmp_path / "hf", weights(Tiny(seed=0)), shards=3)
    lost = sorted(set(weight_map.values()))[1]
    (tmp_path / "hf" / lost).unlink()
    model = Tiny(seed=1)
    before = weights(model)
    with pytest.raises(IncompleteCheckpointError, match=lost) as info:
        load_into(model, tmp_path / "hf", tmp_path)
    assert "model.safetensors.index.json" in str(info.value) and "again" in str(info.value)
    assert_state_dicts_equal(weights(model), before)  # nothing was loaded


def test_truncated_or_lying_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "w.safetensors"
    save_file(weights(Tiny(seed=0)), str(path))
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 10])
    with pytest.raises(CorruptCheckpointError, match="data_offsets"):
        load_into(Tiny(seed=1), path, tmp_path)
    path.write_bytes((10**12).to_bytes(8, "little") + data[8:])
    with pytest.raises(CorruptCheckpointError, match="header length"):
        load_into(Tiny(seed=1), path, tmp_path)


@pytest.mark.dist
def test_two_rank_fsdp2_load_reads_only_local_shards(tmp_path: Path) -> None:
    res = run_torchrun("hf_fsdp_load.py", str(tmp_path))
    assert res.returncode == 0, res.describe()
    results = res.results()
    assert sorted(results) == [0, 1]
    for rank, (r,) in results.items():
        assert r["exact"], (rank, r)
        assert r["source"] == "safetensors" and r["cast"] == r["floats"]
        # each rank read only its shards' bytes: about half, nowhere near all of it
        assert r["bytes_read"] <= 0.6 * r["total"], r
        assert r["rchar"] < 0.75 * r["total"], r
        # the ranks planned the weights differently: refused on every rank, nothing loaded
        assert r["diverged"] == "CheckpointDisagreementError" and r["diverged_unchanged"], r
    assert sum(r["bytes_read"] for (r,) in results.values()) == results[0][0]["total"]
    # the 2-rank DCP checkpoint it saved, consolidated into an HF folder, matches the full weights
    code = main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--to", "hf", "--max-shard-size", "1KB"])
    assert code == 0
    full = torch.load(tmp_path / "full.pt", weights_only=True)
    got: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "out").glob("*.safetensors")):
        got |= load_file(str(f))
    assert_state_dicts_equal(got, full)


# -- convert --to hf ---------------------------------------------------------------------------


class WithExtra(Tiny):
    def get_extra_state(self) -> dict[str, int]:
        return {"version": 3}

    def set_extra_state(self, state: Any) -> None:
        self.version = state


def test_convert_to_hf_shards_and_round_trips_bit_exact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = WithExtra(seed=0, layers=4)
    src = weights(model)
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}) as engine:
        engine.save(7, model=model)
    out = tmp_path / "hf"
    code = main(["convert", str(tmp_path / "ckpt"), str(out), "--to", "hf", "--max-shard-size", "600B"])
    assert code == 0
    printed = capsys.readouterr().out
    assert "left out 1 non-tensor value(s)" in printed and "_extra_state.version" in printed

    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert set(index["weight_map"]) == set(src) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in src.values())
    got: dict[str, torch.Tensor] = {}
    for name in shards:
        with safe_open(str(out / name), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
            assert {k: index["weight_map"][k] for k in f.keys()} == dict.fromkeys(f.keys(), name)  # noqa: SIM118
        part = load_file(str(out / name))
        sizes = sum(v.numel() * v.element_size() for v in part.values())
        assert sizes <= 600 or len(part) == 1
        got |= part
    assert_state_dicts_equal(got, src)  # bit-exact, dtypes included

    back = WithExtra(seed=1, layers=4)
    result = load_into(back, out, tmp_path)
    assert_state_dicts_equal(weights(back), src)
    assert result.report["model"].skipped  # _extra_state: te_extra_state skips it, as on any load


def test_convert_to_hf_single_shard_dtype_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = weights(Tiny(seed=0))
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}) as engine:
        engine.save(1, model=Tiny(seed=0))
    out = tmp_path / "hf"
    assert main(["convert", str(tmp_path / "ckpt"), str(out), "--to", "hf", "--dtype", "bf16"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    got = load_file(str(out / "model.safetensors"))
    for k, v in src.items():
        want = v.to(torch.bfloat16) if v.is_floating_point() else v
        assert got[k].dtype == want.dtype and torch.equal(got[k], want), k
    capsys.readouterr()
    assert main(["convert", str(tmp_path / "ckpt"), str(out), "--to", "hf"]) != 0
    assert "exists" in capsys.readouterr().err
    assert main(["convert", str(tmp_path / "ckpt"), str(out), "--to", "hf", "--force"]) == 0
    assert load_file(str(out / "model.safetensors"))["embed.weight"].dtype == torch.float32
    assert not list(tmp_path.glob("hf.*"))  # no temporary folder left behind


@st.composite
def regions(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=0, max_size=4)))
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    lengths = tuple(draw(st.integers(0, s - o)) for s, o in zip(shape, offsets, strict=True))
    return shape, offsets, lengths


@given(region=regions(), dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.bool]))
def test_any_region_is_read_exactly(region: tuple[Any, Any, Any], dtype: torch.dtype) -> None:
    """Any sub-box of a stored tensor (a DTensor shard on any dimension, an overlap read) comes
    back exactly, through the contiguous runs the reader preads."""
    shape, offsets, lengths = region
    full = (torch.arange(math.prod(shape)).reshape(shape) % 7).to(dtype)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "t.safetensors")
        save_file({"t": full}, path)
        entry = read_index(path).tensors["t"]
        data = Path(path).read_bytes()
    got = b"".join(data[off : off + n] for off, n in _runs(entry, offsets, lengths))
    box = full[tuple(slice(o, o + n) for o, n in zip(offsets, lengths, strict=True))]
    assert got == box.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
