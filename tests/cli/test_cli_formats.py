"""``inspect``, ``verify`` and ``diff`` on the files users hold: safetensors files, sharded Hugging Face
folders, ``torch.save`` files and DCP folders the engine did not write, the engine's own ``convert``
output among them; damaged and hostile ones get typed errors, and nothing in a file is ever run."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _cli import Run

from ckpt_engine import CheckpointEngine
from ckpt_engine._format import safe_pickle
from ckpt_engine._format.metadata_parser import PickleMalformed, PickleRefused
from ckpt_engine._inspect.pt_file import decode_value
from ckpt_engine.testing import TinyTrainingState


class Pwn:
    """An object whose unpickling would run a shell command."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An engine save folder (trained) and what users hold next to it: its exports, a training
    checkpoint saved with torch.save, a DCP folder of dcp.save."""
    root = tmp_path_factory.mktemp("formats")
    state = TinyTrainingState.create(seed=1, hidden=24, steps=3)
    with CheckpointEngine({"save_dir": str(root / "ckpt")}) as engine:
        engine.save(3, **state.objects())
    from ckpt_engine.cli import main

    ckpt = root / "ckpt"
    for argv in (
        ["convert", str(ckpt), str(root / "model.safetensors")],
        ["convert", str(ckpt), str(root / "hf"), "--to", "hf", "--max-shard-size", "1KB"],
        ["convert", str(ckpt), str(root / "bf16"), "--to", "hf", "--dtype", "bf16"],
        ["convert", str(ckpt), str(root / "model.pt")],
        ["convert", str(ckpt), str(root / "optim.pt"), "--component", "optim"],
    ):
        assert main(argv) == 0, argv
    model = state.model.state_dict()
    training = {
        "model": model,
        "tied": {"a": model["0.weight"], "b": model["0.weight"]},  # one storage under two keys
        "view": torch.arange(10.0)[2:8:2],  # a strided view into a larger storage
        "param": torch.nn.Parameter(torch.ones(2)),
        "u16": torch.arange(3, dtype=torch.int32).to(torch.uint16),  # rebuilt by _rebuild_tensor_v3
        "epoch": 3,
        "hparams": {"lr": 0.01, "betas": (0.9, 0.999), "name": "run", "dtype": torch.bfloat16},
        "args": argparse.Namespace(lr=0.01),
        "pwn": Pwn(root / "pwned"),
    }
    torch.save(training, root / "train.pt")
    dcp.save({"w": torch.arange(6.0).reshape(2, 3), "nested": {"n": 5, "b": torch.ones(2)}}, checkpoint_id=root / "dcp")
    return {"root": root, "ckpt": ckpt, "model": model, "training": training}


def _keys(cli: Run, path: Path, *extra: str) -> dict[str, Any]:
    code, out, err = cli("inspect", str(path), "--json", *extra)
    assert code == 0, err
    data = json.loads(out)
    return {k["key"]: k for c in data["components"].values() for k in c["keys"]}


# -- inspect -------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["model.safetensors", "hf", "model.pt"])
def test_inspect_reads_the_exports_with_the_checkpoints_keys(cli: Run, files: dict[str, Any], name: str) -> None:
    keys = _keys(cli, files["root"] / name)
    assert {k: (v["dtype"], v["shape"]) for k, v in keys.items()} == {
        k: ("float32", list(t.shape)) for k, t in files["model"].items()
    }
    assert all(v["bytes"] == files["model"][k].numel() * 4 for k, v in keys.items())
    _, out, _ = cli("inspect", str(files["root"] / name))
    kind = {"hf": "a Hugging Face safetensors folder", "model.pt": "a torch.save file"}.get(name, "a safetensors file")
    assert out.startswith(f"checkpoint {files['root'] / name} ({kind})\n")


def test_the_sharded_export_is_read_through_its_index(files: dict[str, Any]) -> None:
    hf = files["root"] / "hf"
    assert (hf / "model.safetensors.index.json").is_file() and len(list(hf.glob("model-*.safetensors"))) > 1


def test_inspect_of_a_torch_save_file_never_constructs_its_objects(cli: Run, files: dict[str, Any]) -> None:
    root, training = files["root"], files["training"]
    keys = _keys(cli, root / "train.pt")
    assert keys["tied.a"]["shape"] == keys["tied.b"]["shape"] == list(training["model"]["0.weight"].shape)
    assert (keys["view"]["dtype"], keys["view"]["shape"]) == ("float32", [3])
    assert (keys["u16"]["dtype"], keys["param"]["dtype"]) == ("uint16", "float32")
    assert keys["epoch"]["value"] == "3"
    assert keys["hparams.betas"]["value"] == "(0.9, 0.999)" and keys["hparams.dtype"]["value"] == "torch.bfloat16"
    assert keys["args"]["value"] == "<not readable with weights_only: argparse.Namespace; --trust reads it>"
    assert keys["pwn"]["value"] == f"<not readable with weights_only: {os.system.__module__}.system; --trust reads it>"
    assert not (root / "pwned").exists()


def test_inspect_of_a_dcp_folder_the_engine_did_not_write(cli: Run, files: dict[str, Any]) -> None:
    keys = _keys(cli, files["root"] / "dcp")
    assert (keys["w"]["shape"], keys["nested.b"]["dtype"], keys["nested.n"]["value"]) == ([2, 3], "float32", "5")
    code, out, _ = cli("inspect", str(files["root"] / "dcp"))
    assert code == 0 and out.startswith(f"checkpoint {files['root'] / 'dcp'} (a DCP checkpoint folder)")
    assert "warning" not in out


# -- verify ----------------------------------------------------------------------------------------


def test_verify_passes_every_intact_format_at_what_it_can_check(cli: Run, files: dict[str, Any]) -> None:
    root = files["root"]
    for name in ("model.safetensors", "hf", "model.pt", "train.pt", "dcp"):
        code, out, _ = cli("verify", str(root / name), "--level", "sizes")
        assert code == 0 and out.startswith(f"ok      {root / name}: complete"), out
    code, out, _ = cli("verify", str(root / "train.pt"))  # checksums: the zip's CRC-32 of every record
    assert code == 0 and "every record matches the CRC-32 of its zip directory" in out
    for name in ("model.safetensors", "hf", "dcp"):  # no checksums in the format: unverified, not damaged
        code, out, _ = cli("verify", str(root / name))
        assert code == 3 and out.startswith(f"UNVERIFIED {root / name}: complete, sizes and structure check"), out
        assert "no checksums to check its content against" in out and "--allow-unverified" in out
        assert "FAILED" not in out
        code, out, _ = cli("verify", str(root / name), "--json")
        assert code == 3 and json.loads(out)["verdict"] == "unverified"
        assert json.loads(out)["checkpoints"][0]["verdict"] == "unverified"
        code, out, _ = cli("verify", str(root / name), "--allow-unverified", "--json")
        data = json.loads(out)
        assert code == 0 and data["ok"] and data["checkpoints"][0]["format"] in ("safetensors", "hf", "dcp")
        assert data["verdict"] == "unverified"  # accepted, still named for what it is


def test_verify_of_a_damaged_format_without_checksums_is_damaged_not_unverified(
    cli: Run, files: dict[str, Any], tmp_path: Path
) -> None:
    """Damage that sizes and structure show (a cut shard, a cut DCP data file) stays exit code 1,
    whatever the format lacks in checksums."""
    root = files["root"]
    hf, dcp_copy = tmp_path / "hf", tmp_path / "dcp"
    shutil.copytree(root / "hf", hf)
    shutil.copytree(root / "dcp", dcp_copy)
    shard = sorted(hf.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1])
    data = next(dcp_copy.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:10])
    single = tmp_path / "model.safetensors"
    single.write_bytes((root / "model.safetensors").read_bytes()[:-4])
    for path in (hf, dcp_copy, single):
        for extra in ((), ("--allow-unverified",)):
            code, out, _ = cli("verify", str(path), *extra)
            assert code == 1 and out.startswith(f"FAILED  {path}") and "UNVERIFIED" not in out, (path, out)
        code, out, _ = cli("verify", str(path), "--json")
        assert code == 1 and json.loads(out)["verdict"] == "damaged"


def test_verify_of_a_save_folder_exits_with_its_worst_verdict(cli: Run, tmp_path: Path) -> None:
    """A checkpoint without its manifest is unverified (3); a damaged one next to it makes it 1."""
    state = TinyTrainingState.create(seed=2, hidden=8, steps=1)
    save = tmp_path / "ckpt"
    with CheckpointEngine({"save_dir": str(save)}) as engine:
        engine.save(1, **state.objects())
        engine.save(2, **state.objects())
    code, out, _ = cli("verify", str(save))
    assert code == 0 and out.rstrip().endswith("2 of 2 checkpoints ok"), out
    (save / "iter_000000001" / "ckpt_engine_manifest.json").unlink()
    code, out, _ = cli("verify", str(save))
    assert code == 3 and f"UNVERIFIED {save / 'iter_000000001'}: complete" in out, out
    assert out.rstrip().endswith("1 of 2 checkpoints ok, 1 unverified"), out
    assert cli("verify", str(save), "--allow-unverified")[0] == 0
    assert cli("verify", str(save), "--level", "sizes")[0] == 0
    model = save / "iter_000000002" / "model" / "__0_0.distcp"
    model.write_bytes(model.read_bytes()[:100])
    code, out, _ = cli("verify", str(save), "--json")
    data = json.loads(out)
    assert code == 1 and data["verdict"] == "damaged", out
    assert [c["verdict"] for c in data["checkpoints"]] == ["unverified", "damaged"]
    code, out, _ = cli("verify", str(save), "--allow-unverified")
    assert code == 1 and out.rstrip().endswith("1 of 2 checkpoints ok, 1 failed"), out


@pytest.mark.parametrize("name", ["model.safetensors", "model.pt"])
def test_verify_reports_a_truncated_file_invalid(cli: Run, files: dict[str, Any], tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    data = (files["root"] / name).read_bytes()
    for cut in (len(data) - 1, len(data) // 2, 12):
        path.write_bytes(data[:cut])
        code, out, _ = cli("verify", str(path), "--level", "sizes")
        assert code == 1 and out.startswith(f"FAILED  {path}"), (cut, out)
        code, _, err = cli("inspect", str(path))
        assert code == 2 and "CorruptCheckpointError" in err and err.count("\n") == 1, (cut, err)


def test_verify_finds_a_flipped_bit_in_a_torch_save_file_by_its_crc(
    cli: Run, files: dict[str, Any], tmp_path: Path
) -> None:
    path = tmp_path / "model.pt"
    raw = bytearray((files["root"] / "model.pt").read_bytes())
    raw[raw.index(b"data/0") + 200] ^= 1  # inside the first storage record's bytes
    path.write_bytes(bytes(raw))
    code, _, _ = cli("verify", str(path), "--level", "sizes")
    assert code == 0
    code, out, _ = cli("verify", str(path))
    assert code == 1 and "fails its CRC-32 check" in out


def test_verify_of_damaged_hugging_face_folders(cli: Run, files: dict[str, Any], tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    shutil.copytree(files["root"] / "hf", hf)
    shard = sorted(hf.glob("model-*.safetensors"))[-1]
    shard.unlink()
    code, out, _ = cli("verify", str(hf), "--level", "sizes")
    assert code == 1 and f"names 1 shard file(s) that {hf} does not have: '{shard.name}'" in out
    shutil.copy(files["root"] / "model.safetensors", shard)  # a shard of another export: holds more than named
    code, out, _ = cli("verify", str(hf), "--level", "sizes")
    assert code == 1 and "which the index does not name" in out


# -- diff ------------------------------------------------------------------------------------------


def test_diff_of_a_checkpoint_and_its_exports_reports_equal_values_equal(cli: Run, files: dict[str, Any]) -> None:
    root, ckpt = files["root"], files["ckpt"]
    for name in ("hf", "model.safetensors", "model.pt"):
        code, out, _ = cli("diff", str(ckpt), str(root / name))
        assert code == 0, out
        assert "model: identical (4 of 4 common keys equal)" in out
        assert "optim: only in a; not compared (b is " in out
        assert out.rstrip().endswith("(not compared: optim, rng, scheduler, trainer)")
    code, out, _ = cli("diff", str(root / "hf"), str(root / "model.pt"))
    assert code == 0 and out.rstrip().endswith("the checkpoints are identical")
    code, out, _ = cli("diff", str(ckpt), str(root / "optim.pt"), "--component", "optim")
    assert code == 0 and "optim: identical" in out


def test_diff_across_formats_finds_what_differs(cli: Run, files: dict[str, Any], tmp_path: Path) -> None:
    root, ckpt = files["root"], files["ckpt"]
    code, out, _ = cli("diff", str(ckpt), str(root / "bf16"), "--component", "model")
    assert code == 1 and "changed: 0.weight: float32[24, 8] -> bfloat16[24, 8]" in out
    st = tmp_path / "model.safetensors"
    raw = bytearray((root / "model.safetensors").read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    begin = 8 + n + header["2.bias"]["data_offsets"][0]
    raw[begin : begin + 4] = struct.pack("<f", struct.unpack("<f", raw[begin : begin + 4])[0] + 0.5)
    st.write_bytes(bytes(raw))
    code, out, _ = cli("diff", str(ckpt), str(st), "--json")
    diffs = json.loads(out)["components"]["model"]["max_abs_diff"]
    assert code == 1 and list(diffs) == ["2.bias"] and diffs["2.bias"] == pytest.approx(0.5)


def test_a_file_with_objects_compares_its_tensors_and_plain_values(
    cli: Run, files: dict[str, Any], tmp_path: Path
) -> None:
    other = dict(files["training"], epoch=4)
    torch.save(other, tmp_path / "next.pt")
    code, out, _ = cli("diff", str(files["root"] / "train.pt"), str(tmp_path / "next.pt"), "--limit", "0")
    assert code == 1 and "differs: epoch: 3 -> 4" in out
    assert "differs: args:" in out  # objects weights_only refuses compare as unequal, never unpickled
    assert not (files["root"] / "pwned").exists()


# -- convert from every format ----------------------------------------------------------------------


def _safetensors_values(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def test_convert_reads_every_format_the_command_line_reads(cli: Run, files: dict[str, Any], tmp_path: Path) -> None:
    """A dcp.save folder, a Hugging Face folder, torch.save files and a safetensors file convert to
    the other formats, values equal (read back directly and by ``diff``)."""
    root, model = files["root"], files["model"]
    code, out, err = cli("convert", str(root / "dcp"), str(tmp_path / "dcp.safetensors"))
    assert code == 0 and "from " + str(root / "dcp") + " (a DCP checkpoint folder)" in out, err
    assert "left out 1 non-tensor value(s)" in out and "nested.n" in out  # safetensors holds tensors only
    values = _safetensors_values(tmp_path / "dcp.safetensors")
    assert values.keys() == {"w", "nested.b"} and torch.equal(values["w"], torch.arange(6.0).reshape(2, 3))

    code, out, err = cli("convert", str(root / "dcp"), str(tmp_path / "dcp.pt"))
    assert code == 0, err
    assert torch.load(tmp_path / "dcp.pt", weights_only=True)["nested.n"] == 5  # a torch file keeps values

    code, out, err = cli("convert", str(root / "hf"), str(tmp_path / "hf.pt"), "--to", "torch")
    assert code == 0 and "(a Hugging Face safetensors folder)" in out, err
    loaded = torch.load(tmp_path / "hf.pt", weights_only=True)
    assert loaded.keys() == model.keys() and all(torch.equal(loaded[k], v) for k, v in model.items())

    code, out, err = cli("convert", str(root / "model.pt"), str(tmp_path / "pt.safetensors"))
    assert code == 0 and "(a torch.save file)" in out, err
    values = _safetensors_values(tmp_path / "pt.safetensors")
    assert values.keys() == model.keys() and all(torch.equal(values[k], v) for k, v in model.items())

    code, out, err = cli("convert", str(root / "model.safetensors"), str(tmp_path / "st_hf"), "--to", "hf")
    assert code == 0 and "(a safetensors file)" in out, err
    for a, b in ((root / "model.safetensors", tmp_path / "st_hf"), (root / "dcp", tmp_path / "dcp.pt")):
        code, out, _ = cli("diff", str(a), str(b))
        assert code == 0 and out.rstrip().endswith("the checkpoints are identical"), out


def test_convert_of_a_training_torch_save_file_keeps_what_the_format_can_hold(
    cli: Run, files: dict[str, Any], tmp_path: Path
) -> None:
    """A torch.save file of a training run: its nested state flattened as DCP flattens it, a view
    written as its own values, objects never unpickled (left out, named)."""
    training = files["training"]
    code, out, err = cli("convert", str(files["root"] / "train.pt"), str(tmp_path / "t.safetensors"))
    assert code == 0, err
    assert "args" in out and "pwn" in out and not (files["root"] / "pwned").exists()
    values = _safetensors_values(tmp_path / "t.safetensors")
    assert torch.equal(values["view"], training["view"]) and torch.equal(values["u16"], training["u16"])
    assert torch.equal(values["model.0.weight"], training["model"]["0.weight"])
    code, out, err = cli("convert", str(files["root"] / "train.pt"), str(tmp_path / "t.pt"))
    assert code == 0, err
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)
    assert loaded["epoch"] == 3 and loaded["hparams.dtype"] == torch.bfloat16 and "pwn" not in loaded


def test_convert_reads_other_formats_in_bounded_batches(files: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory stays bounded as for a DCP component: values are read a budget of bytes at a time."""
    from ckpt_engine._inspect.sources import BatchedSource, SafetensorsSource, TorchFileSource

    for source in (SafetensorsSource(str(files["root"] / "hf")), TorchFileSource(str(files["root"] / "model.pt"))):
        batched, reads = BatchedSource(source), []

        def counted(keys: Any, read: Any = source.read, reads: list[list[str]] = reads) -> Any:
            reads.append(list(keys))
            return read(keys)

        monkeypatch.setattr(source, "read", counted)
        keys = sorted(batched.keys)
        budget = max(batched.keys[k].nbytes for k in keys)  # the largest tensor: one or two per read
        got = dict(batched.iter_values(keys, budget))
        assert got.keys() == set(keys) and len(reads) > 1
        assert all(sum(batched.keys[k].nbytes for k in r) <= budget or len(r) == 1 for r in reads), reads


# -- bad and hostile input -------------------------------------------------------------------------


def test_files_that_are_no_checkpoint_say_what_reads_them(cli: Run, files: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hello")
    code, _, err = cli("inspect", str(tmp_path / "notes.txt"))
    assert code == 2 and "is a file, not a checkpoint folder" in err
    code, _, err = cli("convert", str(tmp_path / "notes.txt"), str(tmp_path / "x.safetensors"))
    assert code == 2 and "is a file, not a checkpoint folder" in err and not (tmp_path / "x.safetensors").exists()
    torch.save({"w": torch.ones(2)}, tmp_path / "legacy.pt", _use_new_zipfile_serialization=False)
    code, _, err = cli("inspect", str(tmp_path / "legacy.pt"))
    assert code == 2 and "legacy format" in err and "save it again" in err
    code, _, err = cli("ls", str(files["root"] / "model.pt"))
    assert code == 2 and f"to look at it: ckpt-engine inspect {files['root'] / 'model.pt'}" in err
    code, _, err = cli("lss", str(files["ckpt"]))
    assert code == 2 and "did you mean 'ls'?" in err


def _safetensors(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


def _tensor(dtype: str, shape: list[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def test_hostile_safetensors_headers_get_typed_errors(cli: Run, tmp_path: Path) -> None:
    (tmp_path / "huge_header.safetensors").write_bytes(struct.pack("<Q", 1 << 62) + b"{}")
    _safetensors(tmp_path / "deep.safetensors", b"[" * 10_000 + b"]" * 10_000)
    _safetensors(tmp_path / "big_int.safetensors", b'{"w": {"dtype": "U8", "shape": [' + b"9" * 5000 + b"]}}")
    bad_dtype = {"w": _tensor("X9", [1], 0, 1)}
    _safetensors(tmp_path / "bad_dtype.safetensors", json.dumps(bad_dtype).encode(), b"x")
    overlap = {"a": _tensor("U8", [2], 0, 2), "b": _tensor("U8", [2], 1, 3)}
    _safetensors(tmp_path / "overlap.safetensors", json.dumps(overlap).encode(), b"xyz")
    for name in ("huge_header", "deep", "big_int", "bad_dtype", "overlap"):
        path = str(tmp_path / f"{name}.safetensors")
        code, _, err = cli("inspect", path)
        assert code == 2 and "CorruptCheckpointError" in err and err.count("\n") == 1, (name, err)
        code, out, _ = cli("verify", path)
        assert code == 1 and out.startswith(f"FAILED  {path}"), (name, out)


def test_a_fifo_is_refused_without_blocking(cli: Run, tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    code, _, err = cli("inspect", str(tmp_path / "model.safetensors"))
    assert code == 2 and "not a regular file" in err


def _shared(levels: int) -> bytes:
    """A pickle of ``x_n`` where ``x_0 = []`` and ``x_i = [x_(i-1), x_(i-1)]``: ``levels`` lines
    of memo references describe 2**levels lists."""
    out = b"\x80\x02]q\x000"
    for i in range(1, levels + 1):
        out += b"(h" + bytes([i - 1]) + b"h" + bytes([i - 1]) + b"lq" + bytes([i]) + b"0"
    return out + b"h" + bytes([levels]) + b"."


def test_the_pickle_reader_is_linear_on_shared_deep_and_cyclic_values() -> None:
    assert safe_pickle.load(_shared(3)) == [[[[], []], [[], []]], [[[], []], [[], []]]]
    with pytest.raises(safe_pickle.PickleTooLarge, match="builds more than"):
        safe_pickle.load(_shared(60))  # 2**60 lists if expanded
    with pytest.raises(safe_pickle.PickleTooLarge, match="more than 100 deep"):
        safe_pickle.load(b"\x80\x02]q\x00h\x00a.")  # a list holding itself
    with pytest.raises(safe_pickle.PickleTooLarge, match="more than 100 deep"):
        safe_pickle.load(b"\x80\x02" + b"]" * 500 + b"a" * 499 + b".")
    with pytest.raises(PickleRefused, match="integer of"):
        safe_pickle.load(b"\x80\x02\x8b\x00\x01\x00\x00" + b"\x01" * 256 + b".")
    with pytest.raises(PickleRefused, match="EXT1"):
        safe_pickle.load(b"\x80\x02\x82\x01.")
    for truncated in (b"", b"\x80\x02", b"\x80\x02]q", b"\x80\x02X\xff\xff\xff\xffab."):
        with pytest.raises(PickleMalformed):
            safe_pickle.load(truncated)


def test_the_pickle_reader_names_objects_and_calls_nothing(tmp_path: Path) -> None:
    import io
    import pickle

    value = safe_pickle.load(pickle.dumps({"p": Pwn(tmp_path / "pwned"), "o": argparse.Namespace(a=1)}, protocol=2))
    assert value == {
        "p": safe_pickle.Opaque(f"{os.system.__module__}.system"),
        "o": safe_pickle.Opaque("argparse.Namespace"),
    }
    assert not (tmp_path / "pwned").exists()
    buf = io.BytesIO()
    torch.save([1, {"a": (2.5, "x", None)}], buf)
    assert decode_value(buf.getvalue()) == (True, [1, {"a": (2.5, "x", None)}])
    buf = io.BytesIO()
    torch.save(torch.ones(2), buf)
    assert decode_value(buf.getvalue())[0] is False  # a tensor value: torch reads it


def test_trust_reads_the_objects_of_a_torch_save_file(cli: Run, tmp_path: Path) -> None:
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=0.5)}, tmp_path / "run.pt")
    assert _keys(cli, tmp_path / "run.pt")["args"]["value"].startswith("<not readable with weights_only")
    assert _keys(cli, tmp_path / "run.pt", "--trust")["args"]["value"] == "Namespace(lr=0.5)"


@pytest.mark.parametrize(
    "message",
    [
        # Python 3.11's argparse quotes the choices; 3.12.8 and later do not
        "argument COMMAND: invalid choice: 'inspec' (choose from 'ls', 'inspect', 'verify', 'docs-config')",
        "argument COMMAND: invalid choice: 'inspec' (choose from ls, inspect, verify, docs-config)",
    ],
)
def test_did_you_mean_reads_both_forms_of_argparse_messages(message: str) -> None:
    from ckpt_engine.cli import did_you_mean

    assert did_you_mean(message) == "; did you mean 'inspect'?"
    assert did_you_mean(message.replace("'inspec'", "'zzz'").replace(" inspec ", " zzz ")) == ""
    assert did_you_mean("argument --level: invalid choice: 'checksum' (choose from 'sizes', 'checksums')") == (
        "; did you mean 'checksums'?"
    )
    assert did_you_mean("unrecognized arguments: --jsn") == ""


def test_inspect_json_names_the_format(cli: Run, files: dict[str, Any]) -> None:
    formats = {}
    for name in ("ckpt", "model.safetensors", "hf", "model.pt", "dcp"):
        code, out, _ = cli("inspect", str(files["root"] / name), "--json")
        assert code == 0, name
        formats[name] = json.loads(out)["format"]
    assert formats == {
        "ckpt": "engine",
        "model.safetensors": "safetensors",
        "hf": "hf",
        "model.pt": "torch",
        "dcp": "dcp",
    }


@pytest.mark.parametrize(
    ("field", "offset", "value"),
    [
        ("a version zipfile does not know", 6, struct.pack("<H", 0xFF)),
        ("a local header past the end", 42, struct.pack("<I", 0xFFFFFFF0)),
    ],
)
def test_a_damaged_zip_directory_is_a_typed_error(
    cli: Run, files: dict[str, Any], tmp_path: Path, field: str, offset: int, value: bytes
) -> None:
    raw = bytearray((files["root"] / "train.pt").read_bytes())
    entry = raw.index(b"PK\x01\x02")  # the first record of the central directory
    raw[entry + offset : entry + offset + len(value)] = value
    (tmp_path / "x.pt").write_bytes(bytes(raw))
    code, _, err = cli("inspect", str(tmp_path / "x.pt"))
    assert code == 2 and "CorruptCheckpointError" in err and "not a valid torch.save file" in err, (field, err)
    code, out, _ = cli("verify", str(tmp_path / "x.pt"))
    assert code == 1 and out.startswith("FAILED"), field


@pytest.mark.full  # 1,800 damaged files: about 10 s
def test_random_damage_gets_typed_errors_only(files: dict[str, Any]) -> None:
    """Bytes overwritten, cut or moved anywhere in a torch.save or safetensors file: every failure is a
    ``CkptEngineError`` naming the file (zipfile's own errors, a bad seek offset, were once let through)."""
    import random

    from ckpt_engine._format.safetensors_header import read_raw_header
    from ckpt_engine._inspect.pt_file import read_pt_file
    from ckpt_engine.errors import CkptEngineError

    rng = random.Random(0)
    tmp = files["root"] / "damaged"
    tmp.mkdir(exist_ok=True)
    for name, reader in (("train.pt", read_pt_file), ("model.safetensors", read_raw_header)):
        src = (files["root"] / name).read_bytes()
        for trial in range(600):
            b = bytearray(src)
            kind = trial % 3
            if kind == 0:
                for _ in range(rng.randrange(1, 5)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
            elif kind == 1:
                b = b[: rng.randrange(len(b))]
            else:
                i, j = rng.randrange(len(b)), rng.randrange(len(b))
                b[i : i + 8] = src[j : j + 8]
            path = tmp / name
            path.write_bytes(bytes(b))
            try:
                reader(str(path))
            except CkptEngineError as err:
                assert str(path) in str(err), (trial, err)
            if name.endswith(".pt"):
                with contextlib.suppress(CkptEngineError):
                    decode_value(bytes(b))


@pytest.mark.full  # two tiny GPT-2 models built and exported
def test_diff_of_a_model_and_its_save_pretrained_output_compares_tied_weights_as_one(cli: Run, tmp_path: Path) -> None:
    """GPT-2 ties ``lm_head.weight`` to ``transformer.wte.weight``: ``save_pretrained`` stores it once,
    the engine's ``model`` component holds both keys. The two are the same model: no difference,
    with a note; a tied key whose twin differs on its own side is still a key only one side has."""
    import transformers

    config = transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    assert model.lm_head.weight is model.transformer.wte.weight
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}) as engine:
        engine.save(1, model=model)
    model.save_pretrained(tmp_path / "hf")
    code, out, _ = cli("verify", str(tmp_path / "hf"))  # intact, but holds no checksums: unverified, not damaged
    assert code == 3 and out.startswith(f"UNVERIFIED {tmp_path / 'hf'}: complete"), out
    code, out, _ = cli("diff", str(tmp_path / "ckpt" / "iter_000000001"), str(tmp_path / "hf"), "--component", "model")
    assert code == 0, out
    assert "tied: lm_head.weight (only in a) equals transformer.wte.weight there" in out
    assert "only in a: lm_head.weight" not in out and out.rstrip().endswith("the checkpoints are identical")
    code, out, _ = cli("diff", str(tmp_path / "ckpt" / "iter_000000001"), str(tmp_path / "hf"), "--json")
    tied = json.loads(out)["components"]["model"]["tied"]
    assert tied == [{"key": "lm_head.weight", "tied_to": "transformer.wte.weight", "in": "a"}]

    untied = transformers.GPT2LMHeadModel(transformers.GPT2Config(**{**config.to_dict(), "tie_word_embeddings": False}))
    with torch.no_grad():
        untied.lm_head.weight.add_(1.0)  # not equal to the embedding any more
    with CheckpointEngine({"save_dir": str(tmp_path / "untied")}) as engine:
        engine.save(1, model=untied)
    untied.save_pretrained(tmp_path / "hf_untied")
    code, out, _ = cli(
        "diff", str(tmp_path / "untied" / "iter_000000001"), str(tmp_path / "hf"), "--component", "model"
    )
    assert code == 1 and "tied:" not in out


def test_diff_never_takes_a_constant_tensor_for_a_tied_weight(cli: Run, tmp_path: Path) -> None:
    """A layer only A has, whose bias is still at zeros, equals B's zero bias of another layer by
    chance: it was listed as tied and the diff said the checkpoints were identical (exit 0)."""
    common = {"0.weight": torch.randn(4, 4), "0.bias": torch.zeros(4)}
    torch.save({**common, "adapter.weight": torch.randn(4, 4), "adapter.bias": torch.zeros(4)}, tmp_path / "a.pt")
    torch.save(common, tmp_path / "b.pt")
    code, out, _ = cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"))
    assert code == 1 and "only in a: adapter.bias" in out and "tied:" not in out, out


@pytest.mark.parametrize(
    ("a", "b", "dtype"),
    [(2**53, 2**53 + 1, torch.int64), (2**62, 2**62 + 1, torch.int64), (2**63 + 1, 2**63, torch.uint64)],
)
def test_diff_tells_integers_apart_past_float64s_precision(
    cli: Run, tmp_path: Path, a: int, b: int, dtype: torch.dtype
) -> None:
    """Integer tensors were compared as float64, in which 2**53 and 2**53 + 1 are one value: a
    64-bit seed or counter that changed was "identical", even under an ``--atol`` below 1."""
    torch.save({"seed": torch.tensor([a], dtype=dtype)}, tmp_path / "a.pt")
    torch.save({"seed": torch.tensor([b], dtype=dtype)}, tmp_path / "b.pt")
    code, out, _ = cli("diff", str(tmp_path / "a.pt"), str(tmp_path / "b.pt"), "--atol", "0.5")
    assert code == 1 and "identical" not in out, out


def test_a_safetensors_header_length_whose_low_byte_is_0x80_is_safetensors(cli: Run, tmp_path: Path) -> None:
    """One valid file in 256 starts with 0x80 (a pickle's first byte): it is still safetensors."""
    data = torch.arange(6, dtype=torch.float32)
    header = json.dumps({"w": _tensor("F32", [2, 3], 0, data.numel() * 4)}).encode()
    header += b" " * ((0x80 - len(header)) % 256)  # padded, as writers pad it to 8 bytes
    path = _safetensors(tmp_path / "w.bin", header, data.numpy().tobytes())
    assert path.read_bytes()[0] == 0x80
    code, out, err = cli("inspect", str(path))
    assert code == 0 and "a safetensors file" in out and "[2, 3]" in out, err
    code, out, _ = cli("verify", str(path), "--level", "sizes")
    assert code == 0 and out.startswith("ok "), out
    other = tmp_path / "w.pt"
    torch.save({"w": data.reshape(2, 3)}, other)
    code, out, err = cli("diff", str(path), str(other))
    assert code == 0 and "identical" in out, err


def test_stored_names_are_printed_escaped(cli: Run, tmp_path: Path) -> None:
    """A key holding ESC, BEL or CR reaches the terminal as ``\\x1b``, ``\\x07``, ``\\r``, never raw."""
    hostile = "evil\x1b[2J\x07\rname"
    a, b = tmp_path / "a.pt", tmp_path / "b.pt"
    torch.save({hostile: torch.zeros(2), "fine": torch.ones(1)}, a)
    torch.save({hostile: torch.ones(2), "fine": torch.ones(1), f"only\x1b{hostile}": torch.ones(1)}, b)
    escaped = "evil\\x1b[2J\\x07\\rname"
    for argv in (("inspect", str(a)), ("diff", str(a), str(b))):
        code, out, err = cli(*argv)
        assert code in (0, 1), err
        assert escaped in out and not any(c in out for c in "\x1b\x07\r"), (argv, out)
    code, out, _ = cli("inspect", str(a), "--json")
    assert json.loads(out)["components"]["model"]["keys"][0]["key"] == hostile  # JSON keeps the name exact
