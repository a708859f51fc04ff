"""Errors a new user meets: every one a CkptEngineError that names the cause and the fix."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from ckpt_engine import (
    ArgumentTypeError,
    CheckpointEngine,
    CheckpointExistsError,
    CkptEngineError,
    ConfigError,
    EngineConfig,
    InvalidArgumentError,
    LoadStrictnessError,
    NotACheckpointError,
    SaveDirError,
)
from ckpt_engine.report import ComponentReport, SkipRecord

# -- item 1: one error family ------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda: EngineConfig(save_dir="ck", keep_lst=2),  # type: ignore[call-arg]
        lambda: EngineConfig.model_validate({"save_dir": "ck", "keep_lst": 2}),
        lambda: EngineConfig.coerce({"save_dir": "ck", "keep_lst": 2}),
        lambda: CheckpointEngine({"save_dir": "ck", "keep_lst": 2}),
    ],
    ids=["keywords", "model_validate", "coerce", "engine-dict"],
)
def test_unknown_field_is_a_config_error_with_a_suggestion(make: object) -> None:
    with pytest.raises(ConfigError, match=r"keep_lst: unknown field; did you mean keep_last\?"):
        make()  # type: ignore[operator]


def test_unknown_field_in_a_file_suggests_too(tmp_path: Path) -> None:
    path = tmp_path / "engine.yaml"
    path.write_text("save_dir: ck\nstorage:\n  regoin: eu-west-1\n")
    with pytest.raises(
        ConfigError, match=r"in '.*engine.yaml'.*\n.*storage.regoin: unknown field; did you mean region\?"
    ):
        EngineConfig.from_file(path)


def test_unknown_plugin_option_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"polcy: unknown field; did you mean policy\?"):
        CheckpointEngine({"save_dir": "ck", "plugins": [{"name": "size_mismatch", "options": {"polcy": "skip"}}]})


@pytest.mark.parametrize("field", ["keep_last", "keep_every", "thread_count"])
def test_true_is_not_a_count(field: str) -> None:
    fields: dict[str, object] = {"save_dir": "ck", field: True}
    if field == "keep_every":
        fields["keep_last"] = 2
    with pytest.raises(ConfigError, match=f"{field}: expected a whole number, got true"):
        EngineConfig.model_validate(fields)
    assert EngineConfig(save_dir="ck", keep_last=3).keep_last == 3


def test_wrong_arguments_are_engine_errors_with_builtin_mixins(tmp_path: Path) -> None:
    model = nn.Linear(2, 2)
    engine = CheckpointEngine({"save_dir": str(tmp_path / "ck")})
    with pytest.raises(ArgumentTypeError, match=r"optimizer\[0\] is a Linear") as info:
        engine.save(1, model=model, optimizer=model)  # type: ignore[arg-type]
    assert isinstance(info.value, TypeError) and isinstance(info.value, CkptEngineError)
    with pytest.raises(InvalidArgumentError, match="non-negative") as info2:
        engine.save(-1, model=model)
    assert isinstance(info2.value, ValueError)


def test_a_too_long_save_dir_name_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(SaveDirError, match="longer than the filesystem allows"):
        CheckpointEngine({"save_dir": str(tmp_path / ("a" * 300))})


# -- item 2: ~ and relative paths --------------------------------------------------------------


def test_tilde_is_the_home_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "engine.yaml").write_text("save_dir: ~/ckpt\nload_path: ~/init/iter_000000001\n")
    config = EngineConfig.from_file(tmp_path / "engine.yaml")
    assert config.save_dir == str(tmp_path / "home" / "ckpt")
    assert config.load_path == str(tmp_path / "home" / "init" / "iter_000000001")
    with CheckpointEngine(config) as engine:
        engine.save(1, model=nn.Linear(2, 2))
    assert (tmp_path / "home" / "ckpt" / "iter_000000001").is_dir()
    assert not (tmp_path / "~").exists()


# -- item 3: errors that name the real cause ---------------------------------------------------


def test_save_dir_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(SaveDirError, match=r"'.*notes.txt' is a file"):
        CheckpointEngine({"save_dir": str(tmp_path / "notes.txt")})
    with pytest.raises(SaveDirError, match=r"is below .*notes.txt', which is a file"):
        CheckpointEngine({"save_dir": str(tmp_path / "notes.txt" / "ck")})


def _saved(tmp_path: Path) -> tuple[nn.Module, Path]:
    save_dir = tmp_path / "run" / "checkpoints"
    model = nn.Linear(3, 2)
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        engine.save(4, model=model)
    return model, save_dir


def test_load_path_may_name_a_save_folder_meaning_its_latest(tmp_path: Path) -> None:
    model, save_dir = _saved(tmp_path)
    fresh = nn.Linear(3, 2)
    with CheckpointEngine({"save_dir": str(tmp_path / "new"), "load_path": str(save_dir)}) as engine:
        result = engine.load(model=fresh)
    assert result.checkpoint_path == str(save_dir / "iter_000000004")
    assert torch.equal(fresh.weight, model.weight)


def test_parent_of_a_save_folder_is_not_an_interrupted_save(tmp_path: Path) -> None:
    _, save_dir = _saved(tmp_path)
    with (
        CheckpointEngine({"save_dir": str(tmp_path / "new"), "load_path": str(save_dir.parent)}) as engine,
        pytest.raises(NotACheckpointError, match=r"holds the save folder .*checkpoints; did you mean") as info,
    ):
        engine.load(model=nn.Linear(3, 2))
    assert "interrupted" not in str(info.value)


def test_save_folder_without_latest_names_its_checkpoints(tmp_path: Path) -> None:
    _, save_dir = _saved(tmp_path)
    (save_dir / "latest_checkpoint.txt").unlink()
    with (
        CheckpointEngine({"save_dir": str(tmp_path / "new"), "load_path": str(save_dir)}) as engine,
        pytest.raises(NotACheckpointError, match=r"save folder without latest_checkpoint\.txt.*iter_000000004"),
    ):
        engine.load(model=nn.Linear(3, 2))


def test_folder_of_something_else(tmp_path: Path) -> None:
    (tmp_path / "data" / "images").mkdir(parents=True)
    with (
        CheckpointEngine({"save_dir": str(tmp_path / "new"), "load_path": str(tmp_path / "data")}) as engine,
        pytest.raises(NotACheckpointError, match=r"none of its folders \(images\) holds a .metadata"),
    ):
        engine.load(model=nn.Linear(3, 2))


def test_a_component_without_metadata_is_still_an_interrupted_save(tmp_path: Path) -> None:
    from ckpt_engine import IncompleteCheckpointError

    _, save_dir = _saved(tmp_path)
    (save_dir / "iter_000000004" / "model" / ".metadata").unlink()
    with (
        CheckpointEngine({"save_dir": str(save_dir)}) as engine,
        pytest.raises(IncompleteCheckpointError, match="never committed") as info,
    ):
        engine.load(model=nn.Linear(3, 2))
    assert not isinstance(info.value, NotACheckpointError)


# -- item 4: an optimizer built for other parameters -------------------------------------------


def test_optimizer_of_other_parameters_is_named(tmp_path: Path) -> None:
    model, other = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with CheckpointEngine({"save_dir": str(tmp_path / "ck")}) as engine:
        with pytest.raises(
            InvalidArgumentError, match=r"optimizer\[0\] updates 2 of its 2 parameter\(s\).*after sharding"
        ):
            engine.save(1, model=model, optimizer=opt)
        with pytest.raises(InvalidArgumentError, match="not parameters of model"):
            engine.load(model=model, optimizer=opt)
        engine.save(1, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


# -- item 5: fix lines that help, and collapsed skip lines -------------------------------------


def test_missing_keys_fix_names_what_resolves_them() -> None:
    err = LoadStrictnessError("model", missing=["head.w"], mismatched=[])
    fixes = [line for line in str(err).splitlines() if line.startswith("fix:")]
    assert len(fixes) == 1
    assert "rename" in fixes[0] and "keys_not_to_resume" in fixes[0] and "strict: false" in fixes[0]
    assert "size_mismatch" not in fixes[0]
    both = LoadStrictnessError("model", missing=["a"], mismatched=["b: stored [1], target [2]"])
    assert any("size_mismatch" in line for line in str(both).splitlines() if line.startswith("fix:"))


def test_strict_load_of_a_model_with_missing_keys(tmp_path: Path) -> None:
    with CheckpointEngine({"save_dir": str(tmp_path / "ck")}) as engine:
        engine.save(1, model=nn.Sequential(nn.Linear(2, 2)))
        with pytest.raises(LoadStrictnessError) as info:
            engine.load(model=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert "keys_not_to_resume" in str(info.value) and "size_mismatch" not in str(info.value)


@pytest.mark.parametrize("layers", [4, 100])
def test_te_extra_state_skips_are_one_line(layers: int) -> None:
    skipped = {
        f"{i}._extra_state": SkipRecord(reason="Transformer-Engine extra state", plugin="te_extra_state")
        for i in range(layers)
    }
    lines = ComponentReport(component="model", checkpoint_dir="x", skipped=skipped).summary_lines()
    te = [line for line in lines if "te_extra_state" in line]
    assert len(te) == 1 and len(te[0]) < 200, te
    assert f"*._extra_state ({layers} keys)" in te[0]


class _TeLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Linear(2, 2)

    def get_extra_state(self) -> io.BytesIO:
        return io.BytesIO(b"fp8-meta")

    def set_extra_state(self, state: object) -> None:
        pass


def test_load_summary_of_a_te_model(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Sequential(*[_TeLayer() for _ in range(6)])
    with CheckpointEngine({"save_dir": os.fspath(tmp_path / "ck")}) as engine:
        engine.save(1, model=model)
        with caplog.at_level("INFO", logger="ckpt_engine"):
            engine.load(model=model)
    lines = [line for r in caplog.records for line in r.getMessage().splitlines() if "te_extra_state" in line]
    assert lines == [
        "  skipped by te_extra_state: *._extra_state (6 keys); e.g. 0._extra_state: "
        "Transformer-Engine extra state is not restored (te_extra_state)"
    ]


def test_a_load_dir_that_does_not_exist_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    from ckpt_engine import CheckpointNotFoundError
    from ckpt_engine.testing import TinyTrainingState

    state = TinyTrainingState.create()
    config = {"save_dir": str(tmp_path / "run"), "load_dir": str(tmp_path / "typo")}
    with pytest.raises(CheckpointNotFoundError, match=r"load_dir '.*typo' does not exist.*fix load_dir"):
        CheckpointEngine(config).load(**state.objects())
    # load_dir naming the (not yet created) save_dir is a fresh run, as without load_dir
    same = {"save_dir": str(tmp_path / "run"), "load_dir": str(tmp_path / "run") + "/"}
    assert CheckpointEngine(same).load(**state.objects()).source == "scratch"


@pytest.mark.parametrize("field", ["keep_last", "keep_every", "thread_count"])
def test_a_count_given_as_a_string_is_refused(tmp_path: Path, field: str) -> None:
    extra = {"keep_last": 3} if field == "keep_every" else {}
    with pytest.raises(ConfigError, match=rf"{field}.*the string '2'.*without quotes"):
        EngineConfig(save_dir=str(tmp_path), **{**extra, field: "2"})


@pytest.mark.full  # over 2 s on 2 cores: a new process
def test_a_save_dir_under_the_home_folder_is_expanded_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save_dir: ~/ckpt`` is the home folder's ``ckpt``, for saves, loads and async saves alike."""
    from ckpt_engine.testing import TinyTrainingState

    monkeypatch.setenv("HOME", str(tmp_path))
    state = TinyTrainingState.create()
    for i, plugins in enumerate(([], ["pinned_staging"]), 1):
        with CheckpointEngine({"save_dir": "~/ckpt", "plugins": plugins}) as engine:
            assert engine.save(i, **state.objects()).result().succeeded
    assert (tmp_path / "ckpt" / "iter_000000002").is_dir()
    result = CheckpointEngine({"save_dir": "/unused", "load_dir": "~/ckpt"}).load(**state.objects())
    assert result.iteration == 2


@pytest.mark.parametrize(
    ("iteration", "error"), [("10", TypeError), (2.0, TypeError), (True, TypeError), (-1, ValueError)]
)
def test_a_wrong_iteration_is_a_type_error_or_a_value_error(tmp_path: Path, iteration: object, error: type) -> None:
    """The README's rule: a wrong argument type is a TypeError (``ArgumentTypeError``), a wrong
    value a ValueError; both are ``CkptEngineError``s naming the argument."""
    with (
        CheckpointEngine({"save_dir": str(tmp_path)}) as engine,
        pytest.raises(error, match="iteration must be") as info,
    ):
        engine.save(iteration, model=nn.Linear(2, 2))  # type: ignore[arg-type]
    assert isinstance(info.value, CkptEngineError)
    assert isinstance(info.value, ArgumentTypeError) == (error is TypeError)


def test_a_refused_save_is_raised_not_also_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The error of a synchronous save reaches the caller once, as the exception: logging the
    same text at ERROR as well printed it twice in every training log."""
    model = nn.Linear(4, 4)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=model)
        with caplog.at_level("DEBUG", logger="ckpt_engine"), pytest.raises(CheckpointExistsError) as info:
            engine.save(1, model=model)
    assert "refusing to replace it" in str(info.value)
    assert not [r for r in caplog.records if r.levelname == "ERROR"], [r.getMessage() for r in caplog.records]
