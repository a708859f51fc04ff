"""Tensor subclasses in the saved state (torchao's, real ones): float8 training weights round-trip
bit for bit through the sync save, ``pinned_staging`` and ``overlap``, and a subclass that is not
one tensor (``NF4Tensor``) is refused at save, naming the key, before anything is written."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin
from torch import nn

from ckpt_engine import CheckpointEngine, CheckpointSaveError, UnsupportedTensorError

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

MODES = {
    "sync": lambda: [],
    "pinned_staging": lambda: [PinnedStagingPlugin()],
    "overlap": lambda: [PinnedStagingPlugin(PinnedStagingPlugin.Options(overlap=True))],
}
#: The writer-process modes start a process each: the full tier's.
MODE_PARAMS = [pytest.param(m, marks=[pytest.mark.full] if m != "sync" else []) for m in MODES]


def float8_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 16))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    return model


class QLoRA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Parameter(to_nf4(torch.randn(256, 256, dtype=torch.bfloat16)), requires_grad=False)
        self.adapter = nn.Linear(8, 8)


def _plain(sd: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Each value as the plain tensor holding its bytes (a float8 weight wraps one)."""
    return {k: (v._tensor if type(v) is not torch.Tensor else v).detach().clone() for k, v in sd.items()}


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_float8_training_weights_round_trip_bit_exact(mode: str, tmp_path: Path) -> None:
    model = float8_model(1)
    weight_type = type(model[0].weight)
    assert weight_type.__name__ == "WeightWithDynamicFloat8CastTensor"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():  # one optimizer step, so AdamW has state to save
        p.grad = torch.ones_like(p)
    opt.step()
    with CheckpointEngine({"save_dir": str(tmp_path)}, plugins=MODES[mode]()) as engine:
        engine.save(1, model=model, optimizer=opt).result()
    want_model, want_opt = _plain(model.state_dict()), opt.state_dict()["state"]

    fresh = float8_model(2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=fresh, optimizer=fresh_opt)
    assert type(fresh[0].weight) is weight_type  # still the subclass the training uses
    got = _plain(fresh.state_dict())
    assert want_model.keys() == got.keys()
    for key, value in want_model.items():
        assert torch.equal(got[key], value), key
    for index, state in fresh_opt.state_dict()["state"].items():
        for name, value in state.items():
            ref = want_opt[index][name]
            assert torch.equal(_plain({"v": value})["v"], _plain({"v": ref})["v"]), (index, name)


@pytest.mark.parametrize("mode", MODE_PARAMS)
def test_a_subclass_of_several_tensors_is_refused_at_save_by_key(mode: str, tmp_path: Path) -> None:
    model = QLoRA()
    with CheckpointEngine({"save_dir": str(tmp_path)}, plugins=MODES[mode]()) as engine:
        with pytest.raises(UnsupportedTensorError, match=r"model: 'base' is a NF4Tensor .*quantized_data") as info:
            engine.save(1, model=model)
        assert isinstance(info.value, CheckpointSaveError)
        assert "model=[...]" in str(info.value)  # the fix
        # Nothing was written, and the adapter alone saves.
        assert not list(tmp_path.glob("iter_*"))
        engine.save(2, model=[model.adapter]).result()
    assert (tmp_path / "latest_checkpoint.txt").read_text() == "iter_000000002\n"
