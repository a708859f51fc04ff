"""The compact index of ``.metadata`` (``_format/metadata_index``): the writer leaves one beside
every ``.metadata``; a load builds the records from it only where it describes exactly the
``.metadata`` bytes it read, and otherwise parses them, with the same result either way.

Every test here uses real checkpoints the engine wrote; the hostile cases craft indexes whose
header digests are right, so that only the bounds and the checks of the decoder stand between
them and the load.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import ckpt_engine._format.metadata_read as metadata_read
from ckpt_engine._format.metadata_index import _digest, decode_index, encode_index, metadata_from_index, read_index
from ckpt_engine._format.metadata_read import indexed_metadata, metadata_from_bytes, read_metadata
from ckpt_engine._format.metadata_types import current_types, plain_types, records_without_dcp
from ckpt_engine._format.names import METADATA_FILE, METADATA_INDEX_FILE
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal, make_engine


class _Position:
    """A ``Stateful`` extra with nested non-tensor values (bytes items in the ``.metadata``)."""

    def __init__(self, epoch: int = 0) -> None:
        self.epoch, self.order = epoch, [3, 1, 2]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "order": list(self.order), "nested": {"name": "shard-7", "done": False}}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.order = sd["epoch"], list(sd["order"])


def _from_index(index_path: str, data: bytes) -> Any:
    raw = read_index(index_path, data)
    return None if raw is None else metadata_from_index(raw, data)


@pytest.fixture(autouse=True)
def _nothing_recalled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load in this process would take the metadata this process wrote from memory."""
    monkeypatch.setattr(metadata_read, "recall_metadata", lambda _: None)
    monkeypatch.setattr("ckpt_engine._format.layout.recall_metadata", lambda _: None)


def _saved(root: pathlib.Path) -> tuple[TinyTrainingState, str]:
    state = TinyTrainingState.create(seed=3)
    with make_engine(root) as engine:
        engine.save(4, **state.objects(), extra={"position": _Position(5)})
    return state, str(root / "iter_000000004")


def _components(ckpt: str) -> Iterator[str]:
    for name in sorted(os.listdir(ckpt)):
        if os.path.isdir(os.path.join(ckpt, name)):
            yield os.path.join(ckpt, name)


def _same_records(a: Any, b: Any) -> None:
    """``a`` and ``b`` hold the same records, in the same order, shared where ``a``'s are."""
    assert a == b
    assert list(a.state_dict_metadata) == list(b.state_dict_metadata)
    assert list(a.planner_data or ()) == list(b.planner_data or ())
    # MetadataIndex compares without its ``index``: compare it, and the order, explicitly
    assert [(k.fqn, k.offset, k.index) for k in a.storage_data] == [(k.fqn, k.offset, k.index) for k in b.storage_data]
    assert [type(v) for v in a.storage_data.values()] == [type(v) for v in b.storage_data.values()]
    shared_a = [id(v) for v in a.state_dict_metadata.values()]
    shared_b = [id(v) for v in b.state_dict_metadata.values()]
    assert [shared_a.index(i) for i in shared_a] == [shared_b.index(i) for i in shared_b]
    assert type(a.storage_meta.checkpoint_id) is type(b.storage_meta.checkpoint_id)


def test_every_component_gets_an_index_that_gives_the_records_of_its_metadata(tmp_path: pathlib.Path) -> None:
    _, ckpt = _saved(tmp_path)
    manifest = json.loads(pathlib.Path(ckpt, "ckpt_engine_manifest.json").read_text())
    folders = list(_components(ckpt))
    assert {os.path.basename(f) for f in folders} >= {"model", "optim", "position", "trainer"}
    for folder in folders:
        data = pathlib.Path(folder, METADATA_FILE).read_bytes()
        got = _from_index(os.path.join(folder, METADATA_INDEX_FILE), data)
        assert got is not None, folder
        _same_records(metadata_from_bytes(data, folder), got)
        # listed in the manifest like every file of the checkpoint: copies carry it, verify checks it
        assert f"{os.path.basename(folder)}/{METADATA_INDEX_FILE}" in manifest["files"]


def test_the_plain_records_of_ls_come_from_the_index_too(tmp_path: pathlib.Path) -> None:
    _, ckpt = _saved(tmp_path)
    folder = os.path.join(ckpt, "optim")
    data = pathlib.Path(folder, METADATA_FILE).read_bytes()
    with records_without_dcp():
        got = _from_index(os.path.join(folder, METADATA_INDEX_FILE), data)
        want = metadata_from_bytes(data, folder)
    assert got is not None and type(got) is plain_types().Metadata
    _same_records(want, got)


def _parses(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the parses of ``.metadata`` (the load's other way to its records)."""
    calls: list[int] = []
    real = metadata_read.parse_metadata

    def counted(data: bytes, types: Any) -> Any:
        calls.append(len(data))
        return real(data, types)

    monkeypatch.setattr(metadata_read, "parse_metadata", counted)
    return calls


def _load(root: pathlib.Path, **config: Any) -> TinyTrainingState:
    state = TinyTrainingState.create(seed=9)
    with make_engine(root, **config) as engine:
        result = engine.load(**state.objects(), extra={"position": _Position()})
    assert result.iteration == 4
    return state


def test_a_load_reads_the_index_instead_of_parsing_and_restores_the_same_state(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    saved, _ = _saved(tmp_path)
    parses = _parses(monkeypatch)
    loaded = _load(tmp_path)
    assert parses == []
    assert_state_dicts_equal(loaded.model.state_dict(), saved.model.state_dict())
    assert_state_dicts_equal(loaded.optimizer.state_dict(), saved.optimizer.state_dict())


@pytest.mark.parametrize("damage", ["flipped byte", "another checkpoint's index", "truncated", "newer version"])
def test_an_index_that_does_not_describe_its_metadata_exactly_is_passed_over(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, damage: str
) -> None:
    saved, ckpt = _saved(tmp_path / "a")
    index = pathlib.Path(ckpt, "optim", METADATA_INDEX_FILE)
    raw = index.read_bytes()
    size = len(raw)
    if damage == "flipped byte":  # in the body: one position of one storage entry
        at = raw.rindex(b'"pos":[') + 10
        raw = raw[:at] + bytes([raw[at] ^ 0x01]) + raw[at + 1 :]
    elif damage == "another checkpoint's index":
        other = TinyTrainingState.create(seed=4, hidden=24)
        with make_engine(tmp_path / "b") as engine:
            engine.save(4, **other.objects())
        raw = pathlib.Path(tmp_path, "b", "iter_000000004", "optim", METADATA_INDEX_FILE).read_bytes()
    elif damage == "truncated":
        raw = raw[: len(raw) // 2]
    else:
        raw = raw.replace(b'"version":1,', b'"version":2,', 1)
    index.write_bytes(raw)
    parses = _parses(monkeypatch)
    # the manifest lists the index like every file: "sizes" refuses one of another size, as any file
    loaded = _load(tmp_path / "a", verify="sizes" if len(raw) == size else "off")
    assert parses, "the optimizer's .metadata was not parsed"
    assert_state_dicts_equal(loaded.optimizer.state_dict(), saved.optimizer.state_dict())


def test_a_damaged_metadata_is_refused_as_before_whatever_its_index_says(tmp_path: pathlib.Path) -> None:
    """The index names the digest of the bytes it describes: damage to ``.metadata`` is not hidden."""
    _, ckpt = _saved(tmp_path)
    path = pathlib.Path(ckpt, "optim", METADATA_FILE)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    data = path.read_bytes()
    assert _from_index(str(path.with_name(METADATA_INDEX_FILE)), data) is None
    from ckpt_engine.errors import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError, match=r"optim/\.metadata"):
        _load(tmp_path)


def _crafted(doc_change: Any, data: bytes, raw: bytes) -> bytes:
    """``raw`` with its body changed by ``doc_change(doc)`` and both digests right again."""
    head, body = raw.split(b"\n", 1)
    doc = json.loads(body)
    new_body = doc_change(doc) if callable(doc_change) else doc_change
    if not isinstance(new_body, bytes):
        new_body = json.dumps(doc, separators=(",", ":")).encode()
    header = json.loads(head)
    header["metadata"] = [len(data), _digest(data)]
    header["body"] = [len(new_body), _digest(new_body)]
    return json.dumps(header).encode() + b"\n" + new_body


def _set(path: str, value: Any) -> Any:
    def change(doc: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        if isinstance(node, list):
            node[int(last)] = value
        else:
            node[last] = value

    return change


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(_set("kinds.0", -2), id="a description before the table"),
        pytest.param(_set("kinds.0", 10**6), id="a description past the table"),
        pytest.param(_set("storage.key.0", -1), id="a negative key position"),
        pytest.param(_set("storage.file.0", 7), id="a file past the table"),
        pytest.param(_set("storage.pos.0", "12"), id="an offset that is a string"),
        pytest.param(_set("storage.pos.0", True), id="an offset that is a bool"),
        pytest.param(_set("storage.offset.1", ["0"]), id="a chunk offset of strings"),
        pytest.param(_set("keys.1", 5), id="a key that is a number"),
        pytest.param(_set("props.0.0", "not_a_dtype"), id="an unknown dtype"),
        pytest.param(_set("props.0.3", 99), id="an unknown memory format"),
        pytest.param(_set("planner.paths.0", False), id="a planner path that is false"),
        pytest.param(_set("planner.paths.0", 2), id="a planner path of an unknown kind"),
        pytest.param(_set("planner.order", [0] * 20), id="a planner order naming one key twice"),
        pytest.param(_set("storage_meta.0", ["url", "x"]), id="an unknown checkpoint id"),
        pytest.param(lambda doc: doc["storage"]["length"].pop(), id="columns of different lengths"),
        pytest.param(lambda doc: doc["keys"].__setitem__(1, doc["keys"][0]), id="a key twice"),
        pytest.param(b"[" * 50 + b"]" * 50, id="nested deeper than any index"),
        pytest.param(b'{"keys":[' + b"1" * 5000 + b"]}", id="an integer of thousands of digits"),
        pytest.param(b"not json", id="not JSON"),
    ],
)
def test_a_crafted_index_with_right_digests_gives_no_records(tmp_path: pathlib.Path, change: Any) -> None:
    """Each position is checked before it is used (a negative one would index from the end), every
    value's type, and the text's nesting and integers before it is parsed."""
    _, ckpt = _saved(tmp_path)
    folder = os.path.join(ckpt, "optim")
    data = pathlib.Path(folder, METADATA_FILE).read_bytes()
    raw = pathlib.Path(folder, METADATA_INDEX_FILE).read_bytes()
    assert decode_index(_crafted(lambda doc: None, data, raw), data, current_types()) is not None
    assert decode_index(_crafted(change, data, raw), data, current_types()) is None


def test_an_index_far_larger_than_its_metadata_is_not_read(tmp_path: pathlib.Path) -> None:
    _, ckpt = _saved(tmp_path)
    folder = os.path.join(ckpt, "trainer")
    data = pathlib.Path(folder, METADATA_FILE).read_bytes()
    index = pathlib.Path(folder, METADATA_INDEX_FILE)
    index.write_bytes(_crafted(lambda doc: doc.update(pad="x" * (1 << 20)), data, index.read_bytes()))
    assert decode_index(index.read_bytes(), data, current_types()) is not None  # well-formed, but
    assert read_index(str(index), data) is None  # four times the .metadata and more: not read
    assert read_metadata(folder) == metadata_from_bytes(data, folder)


def test_records_the_index_cannot_describe_exactly_get_none(tmp_path: pathlib.Path) -> None:
    """The writer then writes no index, and loads parse the ``.metadata``."""
    _, ckpt = _saved(tmp_path)
    folder = os.path.join(ckpt, "optim")
    data = pathlib.Path(folder, METADATA_FILE).read_bytes()
    assert encode_index(metadata_from_bytes(data, folder), data) is not None
    for change in (
        lambda md: setattr(next(iter(md.storage_data.values())), "transform_descriptors", ["zstd"]),
        lambda md: md.planner_data.update({"not a key": ("x",)}),
        lambda md: setattr(md, "planner_data", {k: [k] for k in md.planner_data}),
        lambda md: setattr(md, "version", 1),
        lambda md: md.state_dict_metadata.update({("a", "tuple"): md.state_dict_metadata.popitem()[1]}),
    ):
        md = metadata_from_bytes(data, folder)
        change(md)
        assert encode_index(md, data) is None


def test_a_save_writes_the_index_beside_a_metadata_plain_dcp_reads(tmp_path: pathlib.Path) -> None:
    """Plain ``dcp.load`` of the engine's checkpoint, index and all: DCP ignores the file."""
    import torch.distributed.checkpoint as dcp

    model = nn.Linear(3, 2)
    with make_engine(tmp_path) as engine:
        engine.save(1, model=model)
    folder = tmp_path / "iter_000000001" / "model"
    assert (folder / METADATA_INDEX_FILE).is_file()
    target = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    dcp.load(target, checkpoint_id=str(folder))
    assert all(torch.equal(target[k], v) for k, v in model.state_dict().items())


def test_records_from_an_index_that_fail_validation_are_left_to_the_parse(tmp_path: pathlib.Path) -> None:
    """A crafted index whose records are well-typed but impossible (a chunk's bytes longer than its
    storage entry): the records are refused and the ``.metadata``'s own are read."""
    _, ckpt = _saved(tmp_path)
    folder = os.path.join(ckpt, "model")
    data = pathlib.Path(folder, METADATA_FILE).read_bytes()
    raw = pathlib.Path(folder, METADATA_INDEX_FILE).read_bytes()
    crafted = _crafted(lambda doc: doc["storage"]["length"].__setitem__(0, 1), data, raw)
    assert decode_index(crafted, data, current_types()) is not None  # well-formed ...
    assert indexed_metadata(crafted, data, folder) is None  # ... but impossible
    assert indexed_metadata(raw, data, folder) == metadata_from_bytes(data, folder)


def test_ranks_that_get_the_metadata_from_rank_0_read_its_index_too(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With several ranks, rank 0 sends every rank the bytes of each ``.metadata`` and its index
    (``metadata_bytes``); the others build the records from the index (``parse_shared_metadata``)."""
    from ckpt_engine._engine.load_guard import metadata_bytes, parse_shared_metadata
    from ckpt_engine._format.layout import check_complete
    from ckpt_engine._storage.store import store_for

    _, ckpt = _saved(tmp_path)
    sent = metadata_bytes(check_complete(ckpt), {}, store_for(ckpt))
    assert all(index is not None for _, index in sent.values())
    want = {name: metadata_from_bytes(data, name) for name, (data, _) in sent.items()}
    parses: list[int] = []
    monkeypatch.setattr("ckpt_engine._engine.load_guard.parse_metadata", lambda data: parses.append(len(data)))
    for name, (data, index) in sent.items():
        assert parse_shared_metadata(os.path.join(ckpt, name, METADATA_FILE), data, index) == want[name]
    assert parses == []


def test_saves_that_reuse_the_last_metadata_bytes_write_an_index_of_them(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save of the same structure patches the previous ``.metadata``'s bytes instead of pickling
    again (``finish_reused``): its index must describe the bytes written, new ``storage_meta``
    included, not the previous save's."""
    from ckpt_engine._dcpio.fast_write import FastFileSystemWriter

    reused: list[str] = []
    real = FastFileSystemWriter.finish_reused

    def counted(self: Any, metadata: Any, previous: Any) -> bool:
        done = real(self, metadata, previous)
        if done:
            reused.append(str(self.path))
        return done

    monkeypatch.setattr(FastFileSystemWriter, "finish_reused", counted)
    state = TinyTrainingState.create(seed=5)
    with make_engine(tmp_path, incremental=True) as engine:
        for it in (1, 2, 3):
            state.train(1, seed=it)
            engine.save(it, **state.objects())
    assert reused, "no save reused the previous .metadata's bytes"
    save_ids: dict[str, set[str]] = {}
    for it in (1, 2, 3):
        for folder in _components(str(tmp_path / f"iter_{it:09}")):
            data = pathlib.Path(folder, METADATA_FILE).read_bytes()
            got = _from_index(os.path.join(folder, METADATA_INDEX_FILE), data)
            assert got is not None, folder
            _same_records(metadata_from_bytes(data, folder), got)
            save_ids.setdefault(os.path.basename(folder), set()).add(got.storage_meta.save_id)
    assert all(len(ids) == 3 for ids in save_ids.values()), save_ids  # each save's own storage_meta


def test_planner_data_in_another_order_than_the_keys_keeps_its_order(tmp_path: pathlib.Path) -> None:
    """Per-rank state (the ``rng`` component of several ranks) writes ``planner_data`` in another
    order than ``state_dict_metadata``, with paths cut at the dots: both kept exactly."""
    _, ckpt = _saved(tmp_path)
    folder = os.path.join(ckpt, "optim")
    data = pathlib.Path(folder, METADATA_FILE).read_bytes()
    md = metadata_from_bytes(data, folder)
    md.planner_data = {k: tuple(k.split(".")) if i % 2 else (k,) for i, k in enumerate(reversed(md.planner_data))}
    raw = encode_index(md, data)
    assert raw is not None
    got = decode_index(raw, data, current_types())
    assert got is not None
    _same_records(md, got)


def test_a_string_strict_utf8_cannot_hold_gets_no_index(tmp_path: pathlib.Path) -> None:
    """The parser refuses a lone surrogate (it reads strings as strict UTF-8), and JSON would join
    an escaped pair into another character: such records get no index, so the index never loads
    what the ``.metadata`` does not say."""
    _, ckpt = _saved(tmp_path)
    folder = os.path.join(ckpt, "position")
    data = pathlib.Path(folder, METADATA_FILE).read_bytes()
    for odd in ("lone\ud800", "pair\ud83d\ude00"):
        md = metadata_from_bytes(data, folder)
        md.version = odd
        assert encode_index(md, data) is None
        md = metadata_from_bytes(data, folder)
        md.state_dict_metadata = {odd if i == 0 else k: v for i, (k, v) in enumerate(md.state_dict_metadata.items())}
        md.planner_data = {odd if i == 0 else k: v for i, (k, v) in enumerate(md.planner_data.items())}
        assert encode_index(md, data) is None
    md = metadata_from_bytes(data, folder)
    md.version = "ünïcode 😀"  # any string UTF-8 holds is fine
    raw = encode_index(md, data)
    assert raw is not None and decode_index(raw, data, current_types()).version == "ünïcode 😀"


def test_a_save_into_a_folder_named_like_a_partial_one_patches_no_shared_string(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``finish_reused`` patched the one copy of the old checkpoint folder's name in the previous
    ``.metadata``; where ``save_dir`` holds a part of the same name, pickle wrote it once and
    referred back to it, so both changed and the file named a folder that never existed (and its
    index, encoded from the records, disagreed with it). Such a save now pickles afresh."""
    root = tmp_path / ".iter_000000001.partial"
    state = TinyTrainingState.create(seed=5)
    with make_engine(root, incremental=True) as engine:
        for it in (1, 2):
            state.train(1, seed=it)
            engine.save(it, **state.objects())
    folder = root / "iter_000000002" / "model"
    data = (folder / METADATA_FILE).read_bytes()
    parsed = metadata_from_bytes(data, str(folder))
    assert parsed.storage_meta.checkpoint_id == root / ".iter_000000002.partial" / "model"
    got = _from_index(str(folder / METADATA_INDEX_FILE), data)
    assert got is not None
    _same_records(parsed, got)


def test_a_description_shared_by_many_keys_earns_its_validation_budget_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The budget of the chunk-overlap sweep grows with the coordinates stored; a description many
    keys share is checked once, so it must count once, or a small crafted file (a pickle's memo
    reference, an index's position) buys a budget many times its size."""
    types = plain_types()
    size = types.vocab.size_type
    chunks = [types.ChunkStorageMetadata(offsets=size((i, 0)), sizes=size((1, 4))) for i in range(10)]
    shared = types.TensorStorageMetadata(properties=types.TensorProperties(), size=size((10, 4)), chunks=chunks)
    keys = [f"k{i}" for i in range(5)]
    storage = {
        types.MetadataIndex(fqn=k, offset=c.offsets): types.StorageInfo("__0_0.distcp", 0, 16)
        for k in keys
        for c in chunks
    }
    md = types.Metadata(state_dict_metadata=dict.fromkeys(keys, shared), storage_data=storage)
    budgets: list[int] = []
    real = metadata_read._check_chunks

    def seen(key: str, item: Any, path: str, budget: list[int], partial: bool = False) -> None:
        budgets.append(budget[0])
        real(key, item, path, budget, partial)

    monkeypatch.setattr(metadata_read, "_MIN_COMPARISONS", 0)
    monkeypatch.setattr(metadata_read, "_check_chunks", seen)
    metadata_read.validate_metadata(md, "crafted/.metadata")
    assert budgets == [metadata_read._COMPARISONS_PER_COORD * 10 * 2]  # one description, 10 chunks of 2 dims


def test_a_planner_order_naming_a_key_many_times_is_refused_before_any_path_is_built(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A key cut at its dots costs its length; named n times in the order, n times its length (a
    crafted 300 KB index took 23 s). The order must be a permutation, checked first."""
    import ckpt_engine._format.metadata_index as metadata_index

    _, ckpt = _saved(tmp_path)
    folder = os.path.join(ckpt, "optim")
    data = pathlib.Path(folder, METADATA_FILE).read_bytes()
    raw = pathlib.Path(folder, METADATA_INDEX_FILE).read_bytes()
    built: list[Any] = []

    def counted(items: Any = ()) -> tuple[Any, ...]:
        built.append(items)
        return tuple(items)

    monkeypatch.setattr(metadata_index, "tuple", counted, raising=False)  # the module's paths

    def repeat(doc: dict[str, Any]) -> None:
        n = len(doc["keys"])
        doc["planner"] = {"order": [0] * n, "paths": [1] * n}

    assert decode_index(_crafted(repeat, data, raw), data, current_types()) is None
    assert built == []
    cut = _crafted(lambda doc: doc["planner"].update(paths=[1] * len(doc["keys"])), data, raw)
    assert decode_index(cut, data, current_types()) is not None and built  # a permutation is built so
