"""EngineConfig: construction from kwargs, dicts and files; errors that name the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ckpt_engine import CheckpointEngine, ConfigError, EngineConfig, PluginEntry


def test_defaults() -> None:
    cfg = EngineConfig(save_dir="ck")
    assert cfg.resolved_load_dir == "ck"
    assert cfg.strict is True and cfg.strict_unexpected is False and cfg.trust_checkpoint is False
    assert [e.name for e in cfg.plugins] == ["te_extra_state"]  # on by default, as in the original


def test_default_plugin_can_be_disabled_and_keeps_user_order() -> None:
    cfg = EngineConfig(save_dir="ck", plugins=["ema", {"name": "te_extra_state", "enabled": False}])
    assert [(e.name, e.enabled) for e in cfg.plugins] == [("ema", True), ("te_extra_state", False)]
    assert [e.name for e in cfg.enabled_plugins()] == ["ema"]
    cfg2 = EngineConfig(save_dir="ck", plugins=["ema"])
    assert [e.name for e in cfg2.plugins] == ["te_extra_state", "ema"]


def test_plugin_string_forms() -> None:
    cfg = EngineConfig(save_dir="ck", plugins=["size_mismatch", "my_pkg.remap:StripPrefix"])
    assert cfg.plugins[1] == PluginEntry(name="size_mismatch")
    assert cfg.plugins[2] == PluginEntry(name="my_pkg.remap:StripPrefix", path="my_pkg.remap:StripPrefix")


@pytest.mark.parametrize(
    ("fields", "field_name"),
    [
        ({"save_dir": "ck", "stict": True}, "stict"),
        ({"save_dir": ""}, "save_dir"),
        ({}, "save_dir"),
        ({"save_dir": "ck", "strict": "maybe"}, "strict"),
        ({"save_dir": "ck", "thread_count": 0}, "thread_count"),
        ({"save_dir": "ck", "keys_not_to_resume": ["../model"]}, "keys_not_to_resume"),
        ({"save_dir": "ck", "plugins": [{"name": "x", "optons": {}}]}, "optons"),
        ({"save_dir": "ck", "plugins": [{"name": "x", "path": "no colon"}]}, "path"),
        ({"save_dir": "ck", "plugins": ["ema", "ema"]}, "listed more than once"),
        ({"save_dir": "ck", "load_training_state": True, "only_load_scheduler_state": True}, "set only one"),
    ],
)
def test_bad_values_name_the_field(fields: dict[str, object], field_name: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.model_validate(fields)
    assert field_name in str(info.value)


def test_config_is_frozen_and_setting_a_field_is_a_config_error() -> None:
    """Every config error is a ``ConfigError`` (a ``CkptEngineError``): setting a field raised
    pydantic's ``ValidationError``, which a caller catching the engine's errors let through."""
    cfg = EngineConfig(save_dir="ck", storage={"endpoint_url": "http://localhost:9000"}, plugins=["ema"])
    for target, field in ((cfg, "strict"), (cfg.storage, "endpoint_url"), (cfg.plugins[-1], "name")):
        with pytest.raises(ConfigError, match=rf"is frozen: '{field}' cannot be set .*model_copy"):
            setattr(target, field, "x")
    changed = cfg.model_copy(update={"strict": False})
    assert (changed.strict, cfg.strict) == (False, True)


YAML = """
ckpt_engine:
  save_dir: runs/exp1/checkpoints
  strict: false
  keys_not_to_resume: [optim]
  plugins:
    - name: size_mismatch
      options: {policy: overlap, patterns: ["*.stem.weight"]}
"""

TOML = """
save_dir = "runs/exp1/checkpoints"
strict = false
keys_not_to_resume = ["optim"]

[[plugins]]
name = "size_mismatch"
options = { policy = "overlap", patterns = ["*.stem.weight"] }
"""


@pytest.mark.parametrize(("suffix", "text"), [(".yaml", YAML), (".toml", TOML), (".json", None)])
def test_from_file(tmp_path: Path, suffix: str, text: str | None) -> None:
    if text is None:
        text = json.dumps(
            {
                "save_dir": "runs/exp1/checkpoints",
                "strict": False,
                "keys_not_to_resume": ["optim"],
                "plugins": [{"name": "size_mismatch", "options": {"policy": "overlap", "patterns": ["*.stem.weight"]}}],
            }
        )
    path = tmp_path / f"engine{suffix}"
    path.write_text(text)
    for cfg in (EngineConfig.from_file(path), EngineConfig.coerce(str(path))):
        assert cfg.save_dir == "runs/exp1/checkpoints" and cfg.strict is False
        assert cfg.keys_not_to_resume == ("optim",)
        assert cfg.plugins[1].options == {"policy": "overlap", "patterns": ["*.stem.weight"]}


def test_engine_accepts_a_config_path(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text(f"save_dir: {tmp_path / 'ck'}\n")
    assert CheckpointEngine(path).save_dir == str(tmp_path / "ck")


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("c.yaml", "save_dir: [unclosed", "cannot parse"),
        ("c.toml", "save_dir = ", "cannot parse"),
        ("c.json", "[1, 2]", "must hold a mapping"),
        ("c.ini", "save_dir=x", "unknown suffix '.ini'"),
        ("c.yaml", "save_dir: ck\nstrikt: true\n", "strikt"),
    ],
)
def test_bad_files_are_config_errors_naming_the_file(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as info:
        EngineConfig.from_file(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        EngineConfig.from_file(tmp_path / "nope.yaml")


def test_coerce_rejects_other_types() -> None:
    with pytest.raises(ConfigError, match="got int"):
        EngineConfig.coerce(3)  # type: ignore[arg-type]
