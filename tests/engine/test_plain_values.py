"""Non-tensor values read without torch.load: only plain values, never a global, never a storage."""

from __future__ import annotations

import io
import pickle
import zipfile
from typing import Any

import pytest
import torch

from ckpt_engine import CheckpointEngine
from ckpt_engine._dcpio.archive_write import value_archive
from ckpt_engine._dcpio.plain_values import plain_value
from ckpt_engine.testing import TinyTrainingState


def _archive(value: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


@pytest.mark.parametrize(
    "value",
    [0.001, -3, 2**70, (0.9, 0.999), None, "text", True, {"a": [1, 2.0, (None, "x")]}, [], float("inf")],
)
@pytest.mark.parametrize("writer", ["torch.save", "value_archive"])
def test_plain_values_read_as_torch_load_reads_them(value: Any, writer: str) -> None:
    # both layouts: torch.save's streamed one, and the engine's own (sizes in the local headers)
    data = _archive(value) if writer == "torch.save" else value_archive(value)
    assert data is not None
    ok, got = plain_value(data)
    assert ok and got == value and type(got) is type(value)
    assert got == torch.load(io.BytesIO(data), weights_only=True)


# bytes: torch.save pickles them with protocol 2, as a call of codecs.encode (a global)
@pytest.mark.parametrize("value", [torch.tensor(3.0), {"t": torch.zeros(2)}, torch.float32, torch.Size([2]), b"raw"])
def test_anything_with_a_tensor_or_a_global_is_left_to_torch_load(value: Any) -> None:
    assert plain_value(_archive(value)) == (False, None)


def _with_data_pkl(data: bytes, raw: bytes) -> bytes:
    """``data`` (an archive) with its data.pkl record replaced by ``raw``."""
    src, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info, raw if info.filename.endswith("/data.pkl") else src.read(info))
    return out.getvalue()


class _Boom:
    ran = False

    def __reduce__(self) -> Any:
        return (_Boom._run, ())

    @staticmethod
    def _run() -> None:
        _Boom.ran = True


def test_a_global_in_data_pkl_is_never_resolved_or_run() -> None:
    crafted = _with_data_pkl(_archive(1.0), pickle.dumps(_Boom(), protocol=2))
    assert plain_value(crafted) == (False, None)
    assert not _Boom.ran


def test_damaged_or_large_archives_are_left_to_torch_load() -> None:
    data = bytearray(_archive((1.0, 2.0)))
    at = data.find(b"data.pkl") + 40  # inside the record: its CRC no longer matches
    data[at] ^= 0xFF
    assert plain_value(bytes(data)) == (False, None)
    assert plain_value(b"not an archive") == (False, None)
    assert plain_value(_archive("x" * 70_000)) == (False, None)  # over the size limit


def test_an_archive_read_once_is_answered_from_its_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer's hyper-parameters repeat per parameter: each distinct archive is read once,
    and only an immutable answer is kept (a list or dict is read again, never shared)."""
    from ckpt_engine._dcpio import plain_values

    reads: list[int] = []
    real = plain_values._read
    monkeypatch.setattr(plain_values, "_answers", {})
    monkeypatch.setattr(plain_values, "_read", lambda data: (reads.append(len(data)), real(data))[1])
    betas = value_archive((0.9, 0.999))
    assert betas is not None
    answers = [plain_value(betas), plain_value(memoryview(betas)), plain_value(bytearray(betas))]
    assert answers == [(True, (0.9, 0.999))] * 3
    assert len(reads) == 1
    nested = value_archive({"a": [1, 2.0]})
    assert nested is not None
    first, second = plain_value(nested)[1], plain_value(nested)[1]
    assert first == second == {"a": [1, 2.0]} and first is not second and len(reads) == 3
    damaged = bytearray(betas)
    damaged[damaged.find(b"data.pkl") + 40] ^= 0xFF
    assert plain_value(bytes(damaged)) == (False, None)  # other bytes: read, and refused
    monkeypatch.setattr(plain_values, "_CACHED_ENTRIES", 2)
    for v in (1.5, 2.5, 3.5):
        archive = value_archive(v)
        assert archive is not None and plain_value(archive) == (True, v)
    assert len(plain_values._answers) <= 2  # bounded


def test_a_tuple_shared_many_times_is_judged_in_linear_time() -> None:
    """``((t, t), (t, t))`` sixty levels deep: 2**60 leaves from 125 pickle bytes, each tuple one
    object; telling whether the answer may be shared looks at each object once."""
    dag = b"\x80\x02)" + b"2\x86" * 60 + b"."  # EMPTY_TUPLE, then (DUP, TUPLE2) sixty times
    ok, value = plain_value(_with_data_pkl(_archive(1.0), dag))
    assert ok and type(value) is tuple and len(value) == 2 and value[0] is value[1]


def test_an_engine_load_reads_the_optimizer_values_without_torch_load(tmp_path: Any, monkeypatch: Any) -> None:
    state = TinyTrainingState.create(seed=1, steps=2)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(3, **state.objects())
    calls: list[int] = []
    real = torch.load

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", counted)
    fresh = TinyTrainingState.create(seed=2)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        assert engine.load(**fresh.objects()).iteration == 3
    assert calls == []
    assert fresh.optimizer.state_dict()["param_groups"] == state.optimizer.state_dict()["param_groups"]
    for a, b in zip(state.optimizer.state.values(), fresh.optimizer.state.values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)
