"""A stored item that names a blocked global is UnsafeCheckpointError naming it, for tensor items and
non-tensor values, never corruption and never torch's advice to switch weights_only off."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from adversarial._adv import ckpt, load, rehash, save
from ckpt_engine import UnsafeCheckpointError
from ckpt_engine._format.metadata import read_metadata
from ckpt_engine.cli import main

ADVICE = "weights_only` set to `False`"


class _System:
    """Pickles as ``posix.system("true")``: torch 2.13 blocks the module outright."""

    def __reduce__(self) -> Any:
        return (os.system, ("true",))


def _replace_item(component: Path, key: str, payload: bytes) -> None:
    """Overwrite the stored item of ``key`` in place with ``payload`` (padded to its length)."""
    md = read_metadata(component)
    index = MetadataIndex(key) if isinstance(md.state_dict_metadata[key], BytesStorageMetadata) else None
    assert md.storage_data is not None
    info = md.storage_data[index] if index is not None else next(v for k, v in md.storage_data.items() if k.fqn == key)
    assert len(payload) <= info.length, (len(payload), info.length)
    path = component / info.relative_path
    data = bytearray(path.read_bytes())
    data[info.offset : info.offset + info.length] = payload.ljust(info.length, b"\0")
    path.write_bytes(bytes(data))
    rehash(component.parent)


def _archive(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _hostile_checkpoint(save_dir: str, component: str, key: str) -> Path:
    save(save_dir, 1)
    checkpoint = ckpt(save_dir, 1)
    _replace_item(checkpoint / component, key, _archive(_System()))
    return checkpoint


@pytest.mark.parametrize(
    ("component", "key"), [("model", "0.bias"), ("trainer", "iteration")], ids=["tensor item", "value"]
)
def test_blocked_global_is_unsafe_and_named_without_torch_advice(
    component: str, key: str, save_dir: str, capsys: Any
) -> None:
    checkpoint = _hostile_checkpoint(save_dir, component, key)
    with pytest.raises(UnsafeCheckpointError) as info:
        load(save_dir, verify="checksums")
    message = str(info.value)
    assert "posix.system" in message and ADVICE not in message and "trust_checkpoint=True or" in message
    # OUT outside the run: convert refuses to write inside what it reads
    code = main(["convert", str(checkpoint), str(Path(save_dir).parent / "out.pt"), "--component", component])
    err = capsys.readouterr().err
    assert code != 0 and "UnsafeCheckpointError" in err and "posix.system" in err and ADVICE not in err


def test_blocked_global_detection_reads_both_torch_wordings() -> None:
    from ckpt_engine._dcpio.unsafe import blocked_global

    new = pickle.UnpicklingError("Trying to load unsupported GLOBAL posix.system whose module posix is blocked.")
    old = pickle.UnpicklingError("Unsupported global: GLOBAL fractions.Fraction was not an allowed global")
    assert blocked_global(new, blocked_only=True) == "posix.system"
    assert blocked_global(old) == "fractions.Fraction" and blocked_global(old, blocked_only=True) is None
