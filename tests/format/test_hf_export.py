"""``convert --to hf --hf-config DIR`` writes a folder that real ``transformers`` loads as printed:
``from_pretrained`` of the output, tensors and a forward pass equal to the model that was saved
through the engine, tied word embeddings written once as ``save_pretrained`` writes them."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers  # the `test` extra installs it: these tests run, never skip
from _cli import Run
from safetensors import safe_open
from torch import nn

from ckpt_engine import CheckpointEngine

GEN = "generation_config.json"


def _stored_keys(folder: Path) -> set[str]:
    keys: set[str] = set()
    for shard in folder.glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            keys |= set(f.keys())
    return keys


def _save_through_engine(model: nn.Module, save_dir: Path) -> None:
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        engine.save(1, model=model)


def _gpt2() -> Any:
    config = transformers.GPT2Config(
        n_layer=2, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


def test_gpt2_with_tied_embeddings_loads_with_from_pretrained(cli: Run, tmp_path: Path) -> None:
    model = _gpt2()
    assert model.lm_head.weight is model.transformer.wte.weight  # a tie, stored under both keys by the engine
    model.save_pretrained(str(tmp_path / "base"))  # the reference: config files, keys written once
    _save_through_engine(model, tmp_path / "run")
    out = tmp_path / "hf_model"
    code, stdout, err = cli(
        "convert", str(tmp_path / "run"), str(out), "--to", "hf", "--hf-config", str(tmp_path / "base"),
        "--max-shard-size", "8KB",
    )  # fmt: skip
    assert code == 0, err
    assert "lm_head.weight left out, it is transformer.wte.weight" in stdout
    assert f"load it with: transformers.GPT2LMHeadModel.from_pretrained({str(out)!r})" in stdout
    # The files save_pretrained writes: the same keys (the tie once), its config files byte for byte.
    assert _stored_keys(out) == _stored_keys(tmp_path / "base")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and len(set(index["weight_map"].values())) > 1
    for name in ("config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tmp_path / "base" / name).read_bytes()

    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    assert type(loaded) is transformers.GPT2LMHeadModel
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # still tied
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    ids = torch.arange(12).reshape(1, 12) % 64
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, model(ids).logits)


def test_llama_tied_and_cast_to_bf16(cli: Run, tmp_path: Path) -> None:
    """Another naming (``model.embed_tokens`` / ``lm_head``), one file, ``--dtype bf16``: the
    copied config says ``bfloat16`` and the loaded model is the saved one cast."""
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=64, max_position_embeddings=32, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(tmp_path / "base"))
    _save_through_engine(model, tmp_path / "run")
    out = tmp_path / "hf_model"
    code, stdout, err = cli(
        "convert", str(tmp_path / "run"), str(out), "--to", "hf", "--hf-config", str(tmp_path / "base"),
        "--dtype", "bf16",
    )  # fmt: skip
    assert code == 0, err
    assert "model.safetensors + config.json + generation_config.json" in stdout
    assert _stored_keys(out) == _stored_keys(tmp_path / "base") and "lm_head.weight" not in _stored_keys(out)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    expected = model.to(torch.bfloat16).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())
    ids = torch.arange(10).reshape(1, 10)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_an_untied_model_keeps_every_key_even_with_equal_bytes(cli: Run, tmp_path: Path) -> None:
    """Only the config's tie merges keys: an untied Llama whose head happens to equal the
    embedding (copied, not tied) keeps both, and loads untied."""
    config = transformers.LlamaConfig(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        vocab_size=64, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(2)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.save_pretrained(str(tmp_path / "base"))
    _save_through_engine(model, tmp_path / "run")
    out = tmp_path / "hf_model"
    code, stdout, err = cli(
        "convert", str(tmp_path / "run"), str(out), "--to", "hf", "--hf-config", str(tmp_path / "base")
    )
    assert code == 0, err
    assert "tied weights" not in stdout and "lm_head.weight" in _stored_keys(out)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    assert loaded.lm_head.weight.data_ptr() != loaded.model.embed_tokens.weight.data_ptr()
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in loaded.state_dict().items())


# -- what is printed, and bad --hf-config folders ----------------------------------------------


@pytest.fixture
def tiny_run(tmp_path: Path) -> Path:
    model = nn.Sequential(nn.Embedding(64, 8), nn.Linear(8, 64))
    with CheckpointEngine({"save_dir": str(tmp_path / "run")}) as engine:
        engine.save(1, model=model, optimizer=torch.optim.AdamW(model.parameters()))
    return tmp_path / "run"


def test_hints_name_only_what_works(cli: Run, tiny_run: Path, tmp_path: Path) -> None:
    code, out, _ = cli("convert", str(tiny_run), str(tmp_path / "plain"), "--to", "hf")
    assert code == 0 and "from_pretrained(" not in out  # no config.json: from_pretrained would fail
    assert not (tmp_path / "plain" / "config.json").exists()
    assert "load_path:" in out and "--hf-config DIR" in out
    code, out, _ = cli("convert", str(tiny_run), str(tmp_path / "optim"), "--to", "hf", "--component", "optim")
    assert code == 0 and "transformers" not in out and "load_path" not in out
    assert "safetensors.torch.load_file" in out


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, r"hf_base does not exist"),
        (lambda d: d.write_text("x"), r"hf_base is a file, not a folder"),
        (lambda d: d.mkdir(), r"hf_base has no config.json"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("{nope")), r"config.json: it is not valid JSON"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text("[1]")), r"config.json holds a JSON list"),
        (lambda d: (d.mkdir(), (d / "config.json").write_text('{"vocab_size": 64}')), r"has no model_type"),
        (
            lambda d: (
                d.mkdir(),
                (d / "config.json").write_text('{"model_type": "gpt2"}'),
                (d / "generation_config.json").write_text("{"),
            ),
            r"generation_config.json: it is not valid JSON .*it is optional",
        ),
        (lambda d: (d.mkdir(), os.mkfifo(d / "config.json")), r"config.json is a FIFO"),
        (
            lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "gpt2"}'), os.mkfifo(d / GEN)),
            r"generation_config.json is a FIFO .*it is optional",
        ),
        (
            lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "gpt2", "x": ' + "[" * 100_000)),
            r"config.json: its JSON nests 100001 deep",
        ),
        (
            lambda d: (d.mkdir(), (d / "config.json").write_text('{"model_type": "gpt2", "n": ' + "7" * 5000 + "}")),
            r"config.json: it holds an integer of 5000 digits",
        ),
    ],
    ids=[
        "missing",
        "file",
        "no-config",
        "bad-json",
        "not-object",
        "no-model-type",
        "bad-generation",
        "fifo-config",
        "fifo-generation",
        "deep",
        "huge-int",
    ],
)
@pytest.mark.timeout(60, method="thread")  # a FIFO read would block: fail, do not hang the run
def test_a_bad_hf_config_is_a_usage_error_naming_the_file(
    cli: Run, tiny_run: Path, tmp_path: Path, setup: Callable[[Path], object], message: str
) -> None:
    base = tmp_path / "hf_base"
    setup(base)
    out = tmp_path / "hf_model"
    code, _, err = cli("convert", str(tiny_run), str(out), "--to", "hf", "--hf-config", str(base))
    assert code == 2 and re.search(message, err), err
    assert err.startswith("ckpt-engine convert: error: ") and "Traceback" not in err
    assert not out.exists()  # refused before anything was written


def test_hf_config_only_for_a_model_folder(cli: Run, tiny_run: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "gpt2"}')
    code, _, err = cli(
        "convert", str(tiny_run), str(tmp_path / "o"), "--to", "hf", "--component", "optim", "--hf-config", str(base)
    )
    assert code == 2 and "component 'optim' is optimizer state" in err
    code, _, err = cli("convert", str(tiny_run), str(tmp_path / "m.pt"), "--hf-config", str(base))
    assert code == 2 and "--hf-config is for --to hf" in err


def test_the_config_json_file_itself_is_accepted(cli: Run, tiny_run: Path, tmp_path: Path) -> None:
    from ckpt_engine._inspect.hf_export import HFConfigError, read_hf_config

    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}')
    assert read_hf_config(str(base / "config.json")).source == str(base)
    with pytest.raises(HFConfigError):  # a CkptEngineError (UsageError) naming the file
        read_hf_config(str(tmp_path / "nowhere"))
    code, out, _ = cli(
        "convert", str(tiny_run), str(tmp_path / "o"), "--to", "hf", "--hf-config", str(base / "config.json")
    )
    assert code == 0 and "transformers.GPT2LMHeadModel.from_pretrained(" in out
    assert json.loads((tmp_path / "o" / "config.json").read_text())["model_type"] == "gpt2"
