"""The built-in plugins under ``torchrun``: 2 gloo ranks on CPU, FSDP2 and DTensor models.

One launch (``tests/dist_scripts/plugins_sharded.py``) runs every scenario; the tests below check
its per-rank results against values computed here from the same model builders, bit-exact.
The one-rank checkpoint of the ``dtensor_overlap`` scenario is written by this process, without
a process group, so it is loaded with a different world size than it was saved with.
"""

from __future__ import annotations

from typing import Any

import plugins_sharded as ps
import pytest
import torch
from _torchrun import run_torchrun
from torch import nn

from ckpt_engine import CheckpointEngine

pytestmark = pytest.mark.dist

WORLD = 2
TIMEOUT = 120.0


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[int, dict[str, Any]]]:
    """scenario -> rank -> payload, from one torchrun launch."""
    work = tmp_path_factory.mktemp("plugins_dist")
    one_rank_dir = work / "one_rank"
    with CheckpointEngine({"save_dir": str(one_rank_dir)}) as engine:
        engine.save(1, model=ps.one_rank_source())
    run = run_torchrun(
        "plugins_sharded.py", str(work), str(one_rank_dir / "iter_000000001"), nproc=WORLD, timeout=TIMEOUT
    )
    assert run.returncode == 0, run.describe()
    out: dict[str, dict[int, dict[str, Any]]] = {}
    for rank, payloads in run.results().items():
        for payload in payloads:
            assert payload["rank"] == rank and payload["world"] == WORLD
            out.setdefault(payload["scenario"], {})[rank] = payload
    assert set(out) == {"ema", "fsdp_overlap", "ema_error", "dtensor_overlap"}, run.describe()
    for scenario, by_rank in out.items():
        assert sorted(by_rank) == list(range(WORLD)), f"{scenario}: not every rank reported\n{run.describe()}"
    return out


def state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.named_parameters()}


def assert_params(got: dict[str, Any], expected: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(expected), what
    for name, value in expected.items():
        actual = torch.tensor(got[name], dtype=value.dtype)
        assert actual.shape == value.shape, f"{what}: {name} shape {tuple(actual.shape)} != {tuple(value.shape)}"
        assert torch.equal(actual, value), f"{what}: {name} differs"


def same_on_every_rank(by_rank: dict[int, dict[str, Any]], key: str) -> Any:
    values = [by_rank[r][key] for r in range(WORLD)]
    assert all(v == values[0] for v in values), f"ranks disagree on {key!r}"
    return values[0]


def test_ema_fills_both_networks_of_an_fsdp2_model(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    src = state(ps.ema_source())
    by_rank = {r: p["with_ema"] for r, p in results["ema"].items()}
    ema = {k.removeprefix("net_ema."): v for k, v in src.items() if k.startswith("net_ema.")}
    expected = {f"net.{k}": v for k, v in ema.items()} | {f"net_ema.{k}": v for k, v in ema.items()}
    expected["logvar"] = src["logvar"]
    for rank, payload in by_rank.items():
        assert_params(payload["params"], expected, f"rank {rank}")
        # the module's own extra state (size 5) is kept; the checkpoint's (size 3) is skipped
        assert payload["extra"] == [list(range(5)), list(range(5))]
        reads = payload["reads"]
        assert not [k for k in reads if k.startswith("net.")], "the checkpoint's regular weights must not be read"
        assert all(n == 1 for n in reads.values()), f"rank {rank} read a storage key more than once: {reads}"
    # every net_ema.* parameter is read somewhere (a rank whose shard is empty reads nothing)
    read_anywhere = set().union(*(set(p["reads"]) for p in by_rank.values()))
    assert {f"net_ema.{k}" for k in ema} <= read_anywhere
    rep = same_on_every_rank({r: {"report": p["report"]} for r, p in by_rank.items()}, "report")
    assert set(rep["skipped"]) == {"net.te._extra_state", "net_ema.te._extra_state"}
    assert all(plugin == "te_extra_state" for _, plugin in rep["skipped"].values())
    assert rep["missing"] == [] and rep["overlap"] == {}
    assert rep["renamed"] == {f"net.{k}": f"net_ema.{k}" for k in ema} | {
        "net.te._extra_state": "net_ema.te._extra_state"
    }
    assert set(rep["unexpected"]) == {k for k in src if k.startswith("net.")} | {"net.te._extra_state"}


def test_ema_into_fsdp2_model_without_ema_copy(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    src = state(ps.ema_source())
    expected = {k.replace("net_ema.", "net.", 1): v for k, v in src.items() if k.startswith("net_ema.")}
    expected["logvar"] = src["logvar"]
    for rank, payload in results["ema"].items():
        assert_params(payload["without_ema"]["params"], expected, f"rank {rank}")
        assert payload["without_ema"]["report"]["missing"] == []


def test_ema_error_reaches_every_rank(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    for rank, payload in results["ema_error"].items():
        assert payload["error"] == "EmaKeysNotFoundError", f"rank {rank}: {payload}"
        assert "no key under 'net_ema.'" in payload["message"]


def test_size_mismatch_overlap_on_fsdp2(results: dict[str, dict[int, dict[str, Any]]]) -> None:
    src = state(ps.vision_source())
    target = state(ps.poison(ps.Vision(in_ch=6, head=12)))
    expected = dict(src)
    expected["stem.weight"] = target["stem.weight"].clone()
    expected["stem.weight"][:, :4] = src["stem.weight"]  # the new input channels keep the poison
    expected["head.weight"] = target["head.weight"].clone()
    expected["head.weight"][:10] = src["head.weight"]  # the sharded dim grew: rows 10, 11 keep the poison
    expected["head.bias"] = target["head.bias"].clone()
    expected["head.bias"][:10] = src["head.bias"]
    by_rank = results["fsdp_overlap"]
    for rank, payload in by_rank.items():
        assert_params(payload["params"], expected, f"rank {rank}")
        assert payload["head_local_rows"] == 6  # Shard(0): rank 1 holds rows 6..11, partly saved, partly new
    rep = same_on_every_rank(by_rank, "report")
    assert rep["overlap"] == {
        "head.bias": [[10], [12], "size_mismatch"],
        "head.weight": [[10, 8], [12, 8], "size_mismatch"],
        "stem.weight": [[8, 4, 3, 3], [8, 6, 3, 3], "size_mismatch"],
    }
    assert rep["skipped"] == {} and rep["missing"] == []


def test_size_mismatch_overlap_into_dtensors_sharded_on_dim1_from_another_world_size(
    results: dict[str, dict[int, dict[str, Any]]],
) -> None:
    src = state(ps.one_rank_source())
    expected = {}
    for name, shape in ps.TARGET_SHAPES.items():
        value = torch.full(shape, ps.POISON)
        region = tuple(slice(0, min(a, b)) for a, b in zip(shape, ps.ONE_RANK_SHAPES[name], strict=True))
        value[region] = src[name][region]
        expected[name] = value
    by_rank = results["dtensor_overlap"]
    for rank, payload in by_rank.items():
        assert_params(payload["params"], expected, f"rank {rank}")
    # w (8, 7) and v (5, 9) are split by columns: 4 + 3 and 5 + 4; u (9,) by rows: 5 + 4
    assert by_rank[0]["local_shapes"] == {"u": [5], "v": [5, 5], "w": [8, 4]}
    assert by_rank[1]["local_shapes"] == {"u": [4], "v": [5, 4], "w": [8, 3]}
    rep = same_on_every_rank(by_rank, "report")
    assert rep["overlap"] == {
        name: [list(ps.ONE_RANK_SHAPES[name]), list(ps.TARGET_SHAPES[name]), "size_mismatch"]
        for name in ps.TARGET_SHAPES
    }
