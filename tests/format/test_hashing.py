"""``_format/hashing``: the one loop that reads a file for its checksum, and the file hashers on
top of it, agree with hashing the same bytes in memory; no other module reads and hashes a file."""

from __future__ import annotations

import ast
import io
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from _paths import ROOT

from ckpt_engine._engine.rank_views import file_view
from ckpt_engine._format import hashing
from ckpt_engine._format.hashing import DEFAULT_ALGORITHM, hash_bytes, hash_file, hash_files, hash_stream, new_hasher
from ckpt_engine._storage.store import LocalStore
from ckpt_engine.errors import CkptEngineError, CorruptCheckpointError

DATA = bytes(range(256)) * 40_000  # 10 MB: more than one read of the loop


@pytest.mark.parametrize("algorithm", sorted({"crc32", DEFAULT_ALGORITHM}))
def test_a_file_hashes_as_its_bytes_do(tmp_path: Path, algorithm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashing, "_CHUNK", 1 << 20)  # ten reads, the last one short
    path = tmp_path / "f.distcp"
    path.write_bytes(DATA)
    seen: list[int] = []
    entry = hash_file(str(path), algorithm, seen.append)
    assert entry.size == len(DATA) and sum(seen) == len(DATA) and len(seen) == 10
    assert entry.checksum == hash_bytes(DATA, algorithm)
    if algorithm == "crc32":
        assert entry.checksum == f"{zlib.crc32(DATA):08x}"
    assert hash_file(str(path), None).checksum is None


def test_a_limit_stops_the_read_where_it_says(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ranged read (a zip record): exactly ``limit`` bytes from where the file stands, fewer
    where the file ends first; the file is left right after them."""
    monkeypatch.setattr(hashing, "_CHUNK", 4096)
    f = io.BytesIO(DATA)
    f.seek(100)
    h = new_hasher("crc32")
    assert h is not None
    assert hash_stream(f, h, limit=10_000) == 10_000 and f.tell() == 10_100
    assert h.hexdigest() == f"{zlib.crc32(DATA[100:10_100]):08x}"
    f.seek(len(DATA) - 5)
    h = new_hasher("crc32")
    assert h is not None
    assert hash_stream(f, h, limit=10_000) == 5  # truncated: the caller sees the shortfall
    assert hash_stream(io.BytesIO(b""), h, limit=0) == 0


def test_hash_files_hashes_each_file_on_several_threads(tmp_path: Path) -> None:
    for i in range(5):
        (tmp_path / "model").mkdir(exist_ok=True)
        (tmp_path / "model" / f"__{i}_0.distcp").write_bytes(DATA[: 1000 * (i + 1)])
    rels = [f"model/__{i}_0.distcp" for i in range(5)]
    got = hash_files(tmp_path, rels, "crc32", threads=3)
    assert sorted(got) == rels
    for i, rel in enumerate(rels):
        assert got[rel].size == 1000 * (i + 1) and got[rel].checksum == hash_bytes(DATA[: 1000 * (i + 1)], "crc32")


def test_what_cannot_be_hashed_is_a_typed_error(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpointError, match="is not a regular file"):
        hash_file(str(tmp_path), "crc32")
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(CkptEngineError, match="'md5' is not available here"):
        hash_file(str(tmp_path / "f"), "md5")
    assert hash_bytes(b"x", "md5") is None


def test_the_view_of_a_pth_is_its_files_digest(tmp_path: Path) -> None:
    """What the ranks compare before they load one ``.pth``: the digest of all its bytes, equal
    for a copy, different after one flipped byte, "unreadable" for a missing file."""
    a, b = tmp_path / "a.pth", tmp_path / "b.pth"
    a.write_bytes(DATA)
    b.write_bytes(DATA)
    store = LocalStore()
    view = file_view(str(a), store)
    assert (
        view.content == f"file {hash_bytes(DATA, DEFAULT_ALGORITHM)}"
        and view.content == file_view(str(b), store).content
    )
    with b.open("r+b") as f:
        f.seek(len(DATA) // 2)
        f.write(b"\xff" if DATA[len(DATA) // 2] != 0xFF else b"\x00")
    assert file_view(str(b), store).content != view.content
    assert file_view(str(tmp_path / "gone.pth"), store).content.startswith("unreadable")


#: Loops outside ``_format/hashing.py`` that read and hash, each with why it is not a file's checksum.
OTHER_HASHING_LOOPS = {
    "ckpt_engine/_format/verify.py::check_read": "checks one block of a load's read from the bytes already "
    "read, reading only the gaps between them",
}


def _reads_and_hashes(loop: ast.AST) -> bool:
    names = {
        n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
        for n in ast.walk(loop)
        if isinstance(n, ast.Call)
    }
    return bool(names & {"read", "readinto", "pread"}) and bool(names & {"update", "crc32"})


def _hashing_loops(tree: ast.AST, rel: str, where: str = "") -> Iterator[str]:
    """``rel::function`` of every loop in ``tree`` that reads and hashes (``where``: the function)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _hashing_loops(node, rel, node.name)
        elif isinstance(node, (ast.While, ast.For)) and _reads_and_hashes(node):
            yield f"{rel}::{where}"
        else:
            yield from _hashing_loops(node, rel, where)


def test_files_are_read_for_their_checksum_in_one_place() -> None:
    """Every loop that reads bytes and hashes them is :func:`hash_stream` (or listed above): a
    second copy of the loop would be a second place for buffer sizes and short reads to differ."""
    found = set()
    for top in (ROOT / "ckpt_engine", ROOT / "plugins" / "ckpt_engine_plugins"):
        for path in sorted(top.rglob("*.py")):
            rel, text = path.relative_to(ROOT).as_posix(), path.read_text()
            if "update(" in text or "crc32(" in text:  # nothing to parse in a module that hashes nothing
                found.update(_hashing_loops(ast.parse(text, rel), rel))
    assert found - set(OTHER_HASHING_LOOPS) == {"ckpt_engine/_format/hashing.py::hash_stream"}
    assert set(OTHER_HASHING_LOOPS) <= found, "listed but gone: remove from OTHER_HASHING_LOOPS"
