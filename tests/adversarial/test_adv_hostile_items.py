"""A stored item that names a blocked global is UnsafeCheckpointError naming it, for tensor items and
non-tensor values, never corruption and never torch's advice to switch weights_only off."""

from __future__ import annotations

import io
import os
import pickle
import struct
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
from _paths import TESTS
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


_HUGE_MEMO = textwrap.dedent(
    """
    import resource, sys
    sys.path.insert(0, sys.argv[2])
    from adversarial._adv import load
    result, _ = load(sys.argv[1])
    print(result.iteration, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
    """
)


def _value_archive(pickled: bytes, length: int) -> bytes:
    """A torch.save-like archive holding ``pickled`` as its data.pkl, ``length`` bytes long (a
    padding record makes up the difference)."""

    def build(pad: int) -> bytes:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr("archive/data.pkl", pickled)
            zf.writestr("archive/byteorder", b"little")
            zf.writestr("archive/version", b"3\n")
            zf.writestr("archive/padding", b"\0" * pad)
        return buf.getvalue()

    archive = build(length - len(build(0)))
    assert len(archive) == length
    return archive


@pytest.mark.full  # over 2 s on 2 cores: a bounded-memory load
def test_a_value_whose_pickle_names_a_huge_memo_index_loads_in_bounded_memory(save_dir: str, tmp_path: Path) -> None:
    """12 bytes of ``LONG_BINPUT 2**29`` in a stored value would make the C unpickler allocate
    and zero a 4 GiB memo; the engine leaves such a pickle to torch.load's own unpickler, whose
    memo is a dict. A subprocess loads it and reports its peak memory."""
    save(save_dir, 1)
    component = ckpt(save_dir, 1) / "trainer"
    md = read_metadata(component)
    assert md.storage_data is not None
    info = md.storage_data[MetadataIndex("iteration")]
    pickled = b"\x80\x02K\x01r" + struct.pack("<I", 2**29) + b"."  # the int 1, memoized at 2**29
    _replace_item(component, "iteration", _value_archive(pickled, info.length))
    out = subprocess.run(
        [sys.executable, "-c", _HUGE_MEMO, save_dir, str(TESTS)], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    iteration, peak_mib = map(int, out.stdout.split())
    assert iteration == 1
    assert peak_mib < 2048, f"peak RSS {peak_mib} MiB: the memo was allocated"
