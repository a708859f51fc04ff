"""``bounded_json.nesting``: the plain loop (short texts, no numpy import) and the vectorised pass
(long texts) count the same depth, brackets inside strings and escapes included."""

from __future__ import annotations

import json
import random

import pytest

from ckpt_engine._format import bounded_json


def _both(raw: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    loop = bounded_json.nesting(raw)
    monkeypatch.setattr(bounded_json, "_SCALAR_LIMIT", -1)  # every text takes the vectorised pass
    vectorised = bounded_json.nesting(raw)
    monkeypatch.undo()
    return loop, vectorised


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"{}", 1),
        (b"3", 0),
        (b'{"a": [1, [2, {"b": "]]]"}]]}', 4),
        (b'{"a\\"[": "\\\\", "b": [[]]}', 3),
        (b'["\\\\\\"[[["]', 1),
        (b"[" * 40 + b"]" * 40, 40),
    ],
)
def test_the_loop_and_the_vectorised_pass_agree(raw: bytes, depth: int, monkeypatch: pytest.MonkeyPatch) -> None:
    assert _both(raw, monkeypatch) == (depth, depth)


def test_they_agree_on_random_json(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(0)

    def value(d: int) -> object:
        kind = rng.randrange(5 if d < 8 else 2)
        if kind == 0:
            return "".join(rng.choice('ab"\\[]{}') for _ in range(rng.randrange(5)))
        if kind == 1:
            return rng.randrange(100)
        if kind in (2, 3):
            return [value(d + 1) for _ in range(rng.randrange(3))]
        return {str(value(d + 1)): value(d + 1) for _ in range(rng.randrange(3))}

    for _ in range(300):
        raw = json.dumps(value(0)).encode()
        loop, vectorised = _both(raw, monkeypatch)
        assert loop == vectorised, raw


def test_deep_nesting_is_refused_by_either_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000  # past the loop's limit: the vectorised pass
    with pytest.raises(bounded_json.JSONRefused, match="nest"):
        bounded_json.loads(deep, max_depth=32, max_int_digits=20)
    with pytest.raises(bounded_json.JSONRefused, match="nest"):
        bounded_json.loads(b"[" * 100 + b"]" * 100, max_depth=32, max_int_digits=20)
