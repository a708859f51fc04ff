"""The torch-free stand-ins of ``.metadata``'s torch values are torch's, name for name.

``ckpt-engine ls``, ``inspect`` and ``verify --level sizes`` read ``.metadata`` into stand-ins
(:func:`ckpt_engine._format.metadata_types.plain_types`) so that they never import torch; the
completeness check multiplies by each dtype's item size. These tests pin the table against the
installed torch, so a torch that adds or resizes a dtype fails here, not in a user's listing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpt_engine._format import metadata_parser as mp
from ckpt_engine._format import metadata_types as mt


def _torch_values(kind: type) -> dict[str, object]:
    return {n: v for n in dir(torch) if isinstance(v := getattr(torch, n, None), kind)}


def test_every_torch_dtype_has_its_stand_in_with_the_same_size_and_kind() -> None:
    dtypes = _torch_values(torch.dtype)
    assert len(dtypes) > 40
    for name, real in dtypes.items():
        plain = mt.plain_dtype(name)
        assert plain is not None, name
        assert (str(plain), plain.itemsize, plain.is_floating_point, plain.is_complex) == (
            str(real),
            real.itemsize,  # type: ignore[attr-defined]
            real.is_floating_point,  # type: ignore[attr-defined]
            real.is_complex,  # type: ignore[attr-defined]
        ), name
    # and the table names nothing torch lacks
    assert set(mt.DTYPE_ITEMSIZES) | set(mt.DTYPE_ALIASES) == set(dtypes)


def test_layouts_and_memory_formats_read_as_torch_writes_them() -> None:
    plain, real = mt.plain_types().vocab, mt.dcp_types().vocab
    for name in _torch_values(torch.layout):
        assert str(plain.value(name)) == str(real.value(name)), name
        assert str(plain.layout(f"torch.{name}")) == str(real.layout(f"torch.{name}")), name
    assert {k: str(v) for k, v in plain.memory_formats.items()} == {k: str(v) for k, v in real.memory_formats.items()}
    assert plain.value("no_such_dtype") is None and plain.value("Tensor") is None and plain.layout("os.system") is None


def test_the_size_stand_in_is_what_torch_size_is_when_built() -> None:
    """A tuple of ints, equal and hashing as the tuple; out-of-range ints are kept for
    ``validate_metadata`` to refuse, as ``torch.Size`` keeps them."""
    for dims in ((2, 3), (), (1 << 63, 2), (-(1 << 70),)):
        assert mt.Size(dims) == dims == torch.Size(dims) and hash(mt.Size(dims)) == hash(torch.Size(dims)) == hash(dims)
        assert tuple(mt.Size(dims)) == tuple(torch.Size(dims))


def test_a_dtype_missing_from_the_table_is_asked_of_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A newer torch's dtype: the listing asks torch instead of calling the file damaged."""
    dcp.save({"w": torch.zeros(3, dtype=torch.float8_e5m2)}, checkpoint_id=tmp_path / "c")
    data = (tmp_path / "c" / ".metadata").read_bytes()
    monkeypatch.delitem(mt.DTYPE_ITEMSIZES, "float8_e5m2")
    mt.plain_dtype.cache_clear()
    mt._plain_value.cache_clear()
    try:
        md = mp.parse_metadata(data, mt.plain_types())
    finally:
        mt.plain_dtype.cache_clear()
        mt._plain_value.cache_clear()
    dtype = md.state_dict_metadata["w"].properties.dtype
    assert (str(dtype), dtype.itemsize) == ("torch.float8_e5m2", 1)


def test_plain_and_dcp_records_of_a_checkpoint_agree_field_by_field(tmp_path: Path) -> None:
    state = {
        "bf16": torch.zeros(4, 2, dtype=torch.bfloat16),
        "c64": torch.zeros(3, dtype=torch.complex64),
        "cl": torch.zeros(1, 3, 2, 2).to(memory_format=torch.channels_last),
        "n": 7,
    }
    dcp.save(state, checkpoint_id=tmp_path / "c")
    data = (tmp_path / "c" / ".metadata").read_bytes()
    plain, real = mp.parse_metadata(data, mt.plain_types()), mp.parse_metadata(data)
    for key, item in real.state_dict_metadata.items():
        other = plain.state_dict_metadata[key]
        assert type(other).__name__ == type(item).__name__, key
        if hasattr(item, "properties"):
            assert str(other.properties) == str(item.properties), key
            assert other.size == item.size and [vars(c) for c in other.chunks] == [vars(c) for c in item.chunks]
    assert {(i.fqn, i.offset): vars(v) for i, v in plain.storage_data.items()} == {
        (i.fqn, i.offset): vars(v) for i, v in real.storage_data.items()
    }
