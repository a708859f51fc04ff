"""Verification against the manifest (``ckpt_engine/_format/verify.py``): sizes and checksums
checked before any tensor is read, a damaged or newer manifest, and ``verify_checkpoint``'s
report of every problem."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _small_checkpoints import MODEL_FILE, _ckpt, _flip, _load, _save, _state

import ckpt_engine._engine.engine as engine_module
from ckpt_engine import CheckpointEngine, CorruptCheckpointError
from ckpt_engine._format.manifest import MANIFEST_FILE
from ckpt_engine._format.verify import verify_checkpoint
from ckpt_engine.errors import IntegrityError
from ckpt_engine.testing import assert_state_dicts_equal


def test_verify_checksums_catches_a_flipped_byte_before_any_tensor_is_loaded(
    save_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(save_dir, 2)
    victim = _ckpt(save_dir, 2).joinpath(*MODEL_FILE)
    _flip(victim)
    calls: list[Any] = []
    import ckpt_engine._engine.loader as loader_module

    real_load = loader_module.load_state_dict

    def counting_load(*args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(loader_module, "load_state_dict", counting_load)
    fresh = _state(999)
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(IntegrityError, match="checksum") as info:
        CheckpointEngine({"save_dir": save_dir, "verify": "checksums"}).load(**fresh.objects())
    assert str(victim) in str(info.value) and "nothing was loaded" in str(info.value)
    assert calls == []  # DCP never started reading
    assert_state_dicts_equal(dict(fresh.model.state_dict()), before)
    # The default (sizes) does not read the data, so this flip goes unnoticed there.
    result, _ = _load(save_dir, verify="sizes")
    assert result.verified and len(calls) > 0


def test_verify_sizes_catches_a_grown_file_and_off_skips_the_manifest(save_dir: str) -> None:
    saved = _save(save_dir, 2)
    victim = _ckpt(save_dir, 2).joinpath(*MODEL_FILE)
    size = victim.stat().st_size
    with open(victim, "ab") as f:
        f.write(b"\0" * 10)  # complete by DCP's metadata, but not the file that was committed
    with pytest.raises(IntegrityError, match=rf"{size + 10} bytes, ckpt_engine_manifest.json says {size}") as info:
        _load(save_dir)  # default verify="sizes"
    assert str(victim) in str(info.value)
    result, fresh = _load(save_dir, verify="off")
    assert not result.verified
    assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[2])


@pytest.mark.parametrize(
    "damage, error, message",
    [
        (lambda m: m.write_text("{not json"), CorruptCheckpointError, "not valid JSON"),
        (lambda m: m.write_text('{"format": "x"}'), CorruptCheckpointError, "not a ckpt-engine manifest"),
        (
            lambda m: _edit_manifest(m, add={"../../etc/passwd": {"size": 1, "checksum": "00"}}),
            CorruptCheckpointError,
            "not a plain relative path",
        ),
        (
            lambda m: _edit_manifest(m, drop="model/__0_0.distcp"),
            IntegrityError,
            "needed by DCP metadata but not listed",
        ),
        (
            lambda m: _edit_manifest(m, add={"model/extra.bin": {"size": 3, "checksum": "00"}}),
            IntegrityError,
            "extra.bin is missing",
        ),
    ],
    ids=["garbage", "foreign", "path-escape", "omits-a-file", "lists-a-missing-file"],
)
def test_damaged_manifest_is_a_typed_error_naming_the_file(
    save_dir: str, damage: Any, error: type, message: str
) -> None:
    _save(save_dir, 2)
    manifest = _ckpt(save_dir, 2) / MANIFEST_FILE
    damage(manifest)
    with pytest.raises(error, match=message) as info:
        _load(save_dir)
    assert str(_ckpt(save_dir, 2)) in str(info.value)


def _set_field(path: Path, key: str, raw_value: str) -> None:
    """``key`` of the manifest set to the JSON text ``raw_value`` (written as is: hostile text too)."""
    doc = json.loads(path.read_text())
    doc[key] = "@@"
    path.write_text(json.dumps(doc).replace('"@@"', raw_value))


HOSTILE_MANIFESTS = {
    "nested-200k-deep": lambda m: m.write_text("[" * 200_000 + "]" * 200_000),
    "a-5000-digit-int": lambda m: _set_field(m, "iteration", "9" * 5000),
    "iteration-infinity": lambda m: _set_field(m, "iteration", "Infinity"),
    "iteration-a-float": lambda m: _set_field(m, "iteration", "2.9"),
    "iteration-a-string": lambda m: _set_field(m, "iteration", '"2"'),
    "world-size-1e12": lambda m: _set_field(m, "world_size", "1000000000000"),
    "world-size-nan": lambda m: _set_field(m, "world_size", "NaN"),
}


@pytest.mark.parametrize("damage", HOSTILE_MANIFESTS.values(), ids=HOSTILE_MANIFESTS.keys())
def test_a_hostile_manifest_is_refused_typed_and_the_fallback_takes_the_step_before(save_dir: str, damage: Any) -> None:
    """A manifest's JSON is read within the bounds a peer's replica is: a deep nesting, a huge or
    non-finite number, a count of another type, a world size no job has. Each was a bare
    RecursionError, ValueError or OverflowError (or a truncated value taken as the iteration),
    which also defeated ``fallback_to_last_complete`` and made ``verify_checkpoint`` raise."""
    saved = _save(save_dir, 1, 2)
    damage(_ckpt(save_dir, 2) / MANIFEST_FILE)
    with pytest.raises(CorruptCheckpointError) as info:
        _load(save_dir)
    assert str(_ckpt(save_dir, 2) / MANIFEST_FILE) in str(info.value)
    result, fresh = _load(save_dir, fallback_to_last_complete=True)
    assert result.iteration == 1 and result.fell_back_from is not None
    assert_state_dicts_equal(dict(fresh.model.state_dict()), saved[1])
    report = verify_checkpoint(str(_ckpt(save_dir, 2)), "checksums")
    assert not report.ok and MANIFEST_FILE in str(report)


def _edit_manifest(path: Path, *, add: dict[str, Any] | None = None, drop: str | None = None) -> None:
    doc = json.loads(path.read_text())
    doc["files"].update(add or {})
    if drop:
        del doc["files"][drop]
    path.write_text(json.dumps(doc))


def test_newer_manifest_version_loads_unverified(save_dir: str) -> None:
    _save(save_dir, 2)
    manifest = _ckpt(save_dir, 2) / MANIFEST_FILE
    doc = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**doc, "version": 99, "files": "a new layout"}))
    result, _ = _load(save_dir)
    assert result.iteration == 2 and not result.verified


def test_crc32_manifests_verify_too(save_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_module, "DEFAULT_ALGORITHM", "crc32")  # e.g. written without xxhash
    _save(save_dir, 2)
    ckpt = _ckpt(save_dir, 2)
    assert json.loads((ckpt / MANIFEST_FILE).read_text())["checksum_algorithm"] == "crc32"
    assert _load(save_dir, verify="checksums")[0].verified
    _flip(ckpt.joinpath(*MODEL_FILE))
    with pytest.raises(IntegrityError, match="crc32 checksum"):
        _load(save_dir, verify="checksums")


def test_verify_checkpoint_reports_every_problem_and_never_raises(save_dir: str) -> None:
    _save(save_dir, 2)
    ckpt = _ckpt(save_dir, 2)
    seen: list[tuple[int, int]] = []
    report = verify_checkpoint(str(ckpt), "checksums", progress=lambda done, total: seen.append((done, total)))
    assert report.ok and report.verified and report.complete and report.problems == []
    assert report.files == len(json.loads((ckpt / MANIFEST_FILE).read_text())["files"])
    assert report.bytes == sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)
    assert seen[-1] == (report.bytes, report.bytes)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)  # monotonic

    _flip(ckpt.joinpath(*MODEL_FILE))
    _flip(ckpt / "optim" / "__0_0.distcp")
    assert verify_checkpoint(str(ckpt), "sizes").verified  # sizes cannot see flips
    report = verify_checkpoint(str(ckpt), "checksums")
    assert not report.verified and report.complete and len(report.problems) == 2
    assert "model/__0_0.distcp" in report.problems[0] and "optim/__0_0.distcp" in report.problems[1]

    (ckpt / "trainer" / ".metadata").unlink()
    report = verify_checkpoint(str(ckpt), "checksums")
    assert not report.complete and any("trainer/.metadata" in p for p in report.problems)
    report = verify_checkpoint(str(Path(save_dir, "iter_000000077")), "sizes")
    assert not report.complete and not report.ok and "does not exist" in report.problems[0]
