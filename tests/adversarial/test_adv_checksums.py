"""``verify: checksums`` fails closed: a load that cannot check checksums is refused, saying why."""

from __future__ import annotations

from typing import Any

import pytest

from adversarial._adv import ckpt, edit_manifest, flip_byte, load, save
from ckpt_engine import UnverifiableCheckpointError
from ckpt_engine._format.manifest import MANIFEST_FILE
from ckpt_engine.cli import main

TAMPERINGS: dict[str, tuple[Any, str]] = {
    "manifest deleted": (lambda c: (c / MANIFEST_FILE).unlink(), "no ckpt_engine_manifest.json"),
    "newer version": (lambda c: edit_manifest(c, version=99), "manifest version 99"),
    "no algorithm": (lambda c: edit_manifest(c, checksum_algorithm=None), "sizes only"),
    "unknown algorithm": (lambda c: edit_manifest(c, checksum_algorithm="sha3_999"), "'sha3_999' is not available"),
}


@pytest.mark.parametrize("case", sorted(TAMPERINGS))
def test_unverifiable_checksums_refuse_the_load(case: str, save_dir: str, capsys: Any) -> None:
    tamper, why = TAMPERINGS[case]
    save(save_dir, 2)
    checkpoint = ckpt(save_dir, 2)
    flip_byte(checkpoint / "model" / "__0_0.distcp")  # wrong data the checksums would have caught
    tamper(checkpoint)
    with pytest.raises(UnverifiableCheckpointError, match=why) as info:
        load(save_dir, verify="checksums")
    assert "allow_unverified" in str(info.value) and str(checkpoint) in str(info.value)
    # The flipped byte is invisible without checksums: verify says so (exit code 3), never "ok".
    assert main(["verify", str(checkpoint)]) == 3
    out = capsys.readouterr().out
    assert out.startswith(f"UNVERIFIED {checkpoint}") and why in out and "no checksums to check" in out


def test_allow_unverified_loads_a_legacy_checkpoint_reported_as_unverified(save_dir: str) -> None:
    saved = save(save_dir, 2)
    (ckpt(save_dir, 2) / MANIFEST_FILE).unlink()  # as plain DCP or the original checkpointer write it
    result, state = load(save_dir, verify="checksums", allow_unverified=True)
    assert result.iteration == 2 and not result.verified
    assert all(state.model.state_dict()[k].equal(v) for k, v in saved[2].items())
    assert main(["verify", str(ckpt(save_dir, 2)), "--allow-unverified"]) == 0
