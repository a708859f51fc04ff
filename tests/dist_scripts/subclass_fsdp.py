"""2 ranks: an FSDP2 model with torchao float8 training weights (DTensors whose local tensors are
``WeightWithDynamicFloat8CastTensor``), saved with the sync path and with ``pinned_staging``, each
loaded into a fresh sharded model.

argv: base folder. Reports, per save mode, the local tensor's type before and after the load and
whether every local shard came back bit for bit.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from _common import ckpt_test_exit, cpu_mesh, init, report
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin
from torch import nn
from torch.distributed.fsdp import fully_shard

from ckpt_engine import CheckpointEngine

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training


def make(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    mesh = cpu_mesh()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def local_bytes(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in model.state_dict().items():
        local = value.to_local()
        out[key] = (local._tensor if type(local) is not torch.Tensor else local).detach().clone()
    return out


def main() -> None:
    base = sys.argv[1]
    init()
    for mode in ("sync", "pinned_staging"):
        save_dir = os.path.join(base, mode)
        model = make(1)
        local_type = type(model[0].weight.to_local()).__name__
        plugins = [PinnedStagingPlugin()] if mode == "pinned_staging" else []
        with CheckpointEngine({"save_dir": save_dir}, plugins=plugins) as engine:
            engine.save(1, model=model).result()
        want = local_bytes(model)
        fresh = make(2)
        with CheckpointEngine({"save_dir": save_dir}) as engine:
            engine.load(model=fresh)
        got = local_bytes(fresh)
        report(
            {
                "mode": mode,
                "saved_local_type": local_type,
                "loaded_local_type": type(fresh[0].weight.to_local()).__name__,
                "equal": sorted(k for k in want if torch.equal(want[k], got[k])),
                "keys": sorted(want),
                "differed_before_load": sorted(k for k in want if not torch.equal(want[k], local_bytes(make(2))[k])),
            }
        )
    ckpt_test_exit()


if __name__ == "__main__":
    main()
