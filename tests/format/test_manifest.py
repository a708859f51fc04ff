"""The manifest (``ckpt_engine/_format/manifest.py``): the file list a checkpoint is committed with,
each file's size and checksum, plain DCP still reading every component, and old checkpoints
without one still loading."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from _small_checkpoints import _ckpt, _load, _save, _state

from ckpt_engine import CheckpointEngine
from ckpt_engine._format.manifest import MANIFEST_FILE
from ckpt_engine._format.verify import verify_checkpoint
from ckpt_engine.testing import assert_state_dicts_equal


def test_manifest_lists_every_file_with_size_and_checksum(save_dir: str) -> None:
    state = _state(3)
    CheckpointEngine({"save_dir": save_dir, "rng": False}).save(3, **state.objects(), extra={"rng": _Rng()})
    ckpt = _ckpt(save_dir, 3)
    doc = json.loads((ckpt / MANIFEST_FILE).read_text())
    on_disk = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    assert sorted(doc["files"]) == on_disk
    assert "model/.metadata" in doc["files"] and "rng/__0_0.distcp" in doc["files"]
    for rel, entry in doc["files"].items():
        data = (ckpt / rel).read_bytes()
        assert entry["size"] == len(data), rel
        assert entry["checksum"] == xxhash.xxh3_64(data).hexdigest(), rel  # an independent recomputation
    assert doc["checksum_algorithm"] == "xxh3_64"
    assert doc["iteration"] == 3 and doc["world_size"] == 1
    assert doc["components"] == ["model", "optim", "scheduler", "trainer", "rng"]
    assert doc["torch_version"] == torch.__version__ and doc["engine_version"]
    assert doc["total_bytes"] == sum(e["size"] for e in doc["files"].values())


class _Rng:
    def state_dict(self) -> dict[str, Any]:
        return {"state": torch.arange(5)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        pass


def test_manifest_never_breaks_plain_dcp_and_old_checkpoints_still_load(save_dir: str, caplog: Any) -> None:
    saved = _save(save_dir, 4)
    ckpt = _ckpt(save_dir, 4)
    # Each component folder is still exactly a DCP checkpoint: plain dcp.load reads it.
    sd = {k: torch.zeros_like(v) for k, v in saved[4].items()}
    dcp.load(sd, checkpoint_id=str(ckpt / "model"))
    assert_state_dicts_equal(sd, saved[4])
    # The same checkpoint without a manifest (as plain DCP or the original checkpointer write it)
    # loads, reported and logged as unverified, at verify='sizes'; verify='checksums' fails closed
    # unless allow_unverified says that is fine (tests/adversarial/test_adv_checksums.py).
    result, _ = _load(save_dir)
    assert result.verified
    (ckpt / MANIFEST_FILE).unlink()
    for config in ({"verify": "sizes"}, {"verify": "checksums", "allow_unverified": True}):
        with caplog.at_level(logging.INFO, logger="ckpt_engine"):
            result, fresh = _load(save_dir, **config)
        assert result.iteration == 4 and not result.verified
        assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[4])
    assert "unverified: no ckpt_engine_manifest.json" in caplog.text


def test_save_checksums_off_records_sizes_only(save_dir: str) -> None:
    _save(save_dir, 2, save_checksums=False)
    doc = json.loads((_ckpt(save_dir, 2) / MANIFEST_FILE).read_text())
    assert doc["checksum_algorithm"] is None
    assert all(e["checksum"] is None and e["size"] > 0 for e in doc["files"].values())
    assert _load(save_dir, verify="sizes")[0].verified
    assert not _load(save_dir, verify="checksums", allow_unverified=True)[0].verified  # cannot claim checksums
    report = verify_checkpoint(str(_ckpt(save_dir, 2)), "checksums")
    assert report.ok and not report.verified and "sizes only" in (report.unverified_reason or "")


def test_the_components_saved_per_rank_round_trip_and_a_bad_list_is_refused() -> None:
    from ckpt_engine._format.manifest import FileEntry, new_manifest, parse_manifest

    manifest = new_manifest(6, 2, ("model", "loader"), None, {"model/a.distcp": FileEntry(4)}, rank=1)
    assert parse_manifest(manifest.to_json().encode(), "m").per_rank == ()
    per_rank = new_manifest(
        6, 2, ("model", "loader"), None, {"model/a.distcp": FileEntry(4)}, rank=1, per_rank=["loader"]
    )
    assert parse_manifest(per_rank.to_json().encode(), "m").per_rank == ("loader",)
    for bad in (["optim"], "loader", [1]):  # not one of its components, not a list
        doc = json.loads(per_rank.to_json())
        doc["per_rank"] = bad
        with pytest.raises(Exception, match="per_rank"):
            parse_manifest(json.dumps(doc).encode(), "m")
