"""Tied weights: a destination key that is the same tensor as another destination key (the
model ties them, as Hugging Face models with ``tie_word_embeddings`` do) is loaded through its
twin and reported as ``tied``, never as missing, for Hugging Face folders (``save_pretrained``
writes the tied weight once) and engine checkpoints alike."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from ckpt_engine import CheckpointEngine, LoadStrictnessError


class TiedLM(nn.Module):
    """An embedding and an output head that share one weight (GPT-2's ``lm_head``)."""

    def __init__(self, seed: int, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed_tokens = nn.Embedding(32, 8)
        self.norm = nn.LayerNorm(8)
        self.lm_head = nn.Linear(8, 32, bias=False)
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def hf_folder(tmp_path: Path, model: TiedLM) -> Path:
    """What ``save_pretrained`` writes for a tied model: every tensor once, ``lm_head`` left out."""
    folder = tmp_path / "hf"
    folder.mkdir()
    tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_a_tied_head_loads_from_a_hugging_face_folder_and_is_reported_tied(tmp_path: Path) -> None:
    source = TiedLM(seed=0)
    folder = hf_folder(tmp_path, source)
    target = TiedLM(seed=1)
    with CheckpointEngine({"save_dir": str(tmp_path / "run"), "load_path": str(folder)}) as engine:
        result = engine.load(model=target)  # strict by default
    report = result.report["model"]
    assert report.tied == {"lm_head.weight": "embed_tokens.weight"}
    assert "lm_head.weight" not in report.missing and "lm_head.weight" not in report.loaded
    assert torch.equal(target.lm_head.weight, source.embed_tokens.weight)
    assert target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()  # still tied
    assert "1 tied" in report.summary_lines()[0] and "tied: lm_head.weight is embed_tokens.weight" in "\n".join(
        report.summary_lines()
    )
    assert report.to_dict()["tied"] == {"lm_head.weight": "embed_tokens.weight"}


def test_a_tied_key_an_engine_checkpoint_lacks_is_tied_too(tmp_path: Path) -> None:
    """A checkpoint saved from the untied embedding alone (say by an older model definition)
    loads into the tied model: the head comes through its twin."""
    source = TiedLM(seed=0, tied=False)
    with CheckpointEngine({"save_dir": str(tmp_path / "run")}) as engine:
        engine.save(1, model=nn.ModuleDict({"embed_tokens": source.embed_tokens, "norm": source.norm}))
    target = TiedLM(seed=1)
    with CheckpointEngine({"save_dir": str(tmp_path / "run")}) as engine:
        result = engine.load(model=target)
    assert result.report["model"].tied == {"lm_head.weight": "embed_tokens.weight"}
    assert torch.equal(target.lm_head.weight, source.embed_tokens.weight)


def test_an_untied_head_that_is_missing_is_still_missing(tmp_path: Path) -> None:
    """Only a real tie (the same memory) is filled through a twin: an untied head stays missing."""
    folder = hf_folder(tmp_path, TiedLM(seed=0))
    with (
        CheckpointEngine({"save_dir": str(tmp_path / "run"), "load_path": str(folder)}) as engine,
        pytest.raises(LoadStrictnessError, match=r"lm_head\.weight"),
    ):
        engine.load(model=TiedLM(seed=1, tied=False))


def test_a_saved_tied_model_round_trips(tmp_path: Path) -> None:
    source = TiedLM(seed=0)
    with CheckpointEngine({"save_dir": str(tmp_path / "run")}) as engine:
        engine.save(1, model=source)
    target = TiedLM(seed=1)
    with CheckpointEngine({"save_dir": str(tmp_path / "run")}) as engine:
        report = engine.load(model=target).report["model"]
    assert not report.missing and torch.equal(target.lm_head.weight, source.lm_head.weight)
    assert target.lm_head.weight.data_ptr() == target.embed_tokens.weight.data_ptr()


def test_load_path_may_name_the_index_of_a_sharded_folder(tmp_path: Path) -> None:
    """``load_path: .../model.safetensors.index.json`` loads its folder (it said "does not exist")."""
    import json

    source = TiedLM(seed=0, tied=False)
    folder = tmp_path / "hf"
    folder.mkdir()
    sd = {k: v.detach().clone().contiguous() for k, v in source.state_dict().items()}
    save_file({"embed_tokens.weight": sd["embed_tokens.weight"]}, str(folder / "model-00001-of-00002.safetensors"))
    rest = {k: v for k, v in sd.items() if k != "embed_tokens.weight"}
    save_file(rest, str(folder / "model-00002-of-00002.safetensors"))
    weight_map = {
        k: "model-00001-of-00002.safetensors" if k == "embed_tokens.weight" else "model-00002-of-00002.safetensors"
        for k in sd
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    target = TiedLM(seed=1, tied=False)
    index = str(folder / "model.safetensors.index.json")
    with CheckpointEngine({"save_dir": str(tmp_path / "run"), "load_path": index}) as engine:
        engine.load(model=target)
    assert all(torch.equal(v, sd[k]) for k, v in target.state_dict().items())
