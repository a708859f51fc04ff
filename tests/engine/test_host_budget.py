"""``pinned_staging`` with ``max_host_bytes``: a state larger than the budget is staged in windows.

Real writer processes, real DCP checkpoints on disk: every checkpoint is loaded back and compared
bit-exactly with the state at ``save()``, which is changed in place right after ``save()``
returns. The staging memory is what the plugin maps (``buffer_sets()``), not the process RSS.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin, PinnedWriterError
from torch import nn

from ckpt_engine import CheckpointEngine, CheckpointSaveError, PluginConfigError
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal

TIMEOUT = 60.0


class Extra:
    """An ``extra=`` component with tensors of its own, so windows span components."""

    def __init__(self) -> None:
        self.a = torch.arange(3000, dtype=torch.float64)
        self.b = torch.randn(40, 50)
        self.note = "n"

    def state_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "note": self.note}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.a, self.b, self.note = sd["a"], sd["b"], sd["note"]


def snapshot(state: TinyTrainingState, extra: Extra) -> dict[str, Any]:
    return {
        "model": copy.deepcopy(state.model.state_dict()),
        "optim": copy.deepcopy(state.optimizer.state_dict()),
        "extra": copy.deepcopy(extra.state_dict()),
    }


def mutate(state: TinyTrainingState, extra: Extra) -> None:
    """Change every saved tensor in place, as the next steps would."""
    with torch.no_grad():
        for p in state.model.parameters():
            p.add_(100.0)
            for v in state.optimizer.state[p].values():
                v.mul_(3.0)
        extra.a.add_(1.0)
        extra.b.neg_()


def staging_bytes(plugin: PinnedStagingPlugin) -> int:
    return sum(s.nbytes for s in plugin.buffer_sets())


def state_bytes(state: TinyTrainingState, extra: Extra) -> int:
    """The tensor bytes of the state as the plugin lays them out (64-byte aligned)."""
    tensors = [*state.model.state_dict().values(), *extra.state_dict().values()]
    tensors += [v for s in state.optimizer.state.values() for v in s.values()]
    return sum(-(-t.nbytes // 64) * 64 for t in tensors if isinstance(t, torch.Tensor))


def check_loads(path: str, expected: dict[str, Any], tmp_path: Path, hidden: int) -> None:
    fresh, extra = TinyTrainingState.create(seed=999, hidden=hidden, steps=1), Extra()
    config = {"save_dir": str(tmp_path / "loader"), "load_path": path, "load_training_state": True}
    with CheckpointEngine(config) as engine:
        engine.load(**fresh.objects(), extra={"extra": extra})
    assert_state_dicts_equal(fresh.model.state_dict(), expected["model"])
    assert_state_dicts_equal(fresh.optimizer.state_dict(), expected["optim"])
    assert_state_dicts_equal(extra.state_dict(), expected["extra"])


@pytest.mark.full  # over 2 s on 2 cores: writer processes
def test_a_quarter_budget_saves_exactly_in_windows_within_the_budget(tmp_path: Path) -> None:
    state, extra = TinyTrainingState.create(hidden=512, steps=2), Extra()
    total = state_bytes(state, extra)
    budget = total // 4
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(max_host_bytes=budget))
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}, plugins=[plugin]) as engine:
        for it in (10, 20):  # the second save reuses the same buffers
            expected = snapshot(state, extra)
            handle = engine.save(it, **state.objects(), extra={"extra": extra})
            mutate(state, extra)  # save() returned: the checkpoint must not see this
            handle.result(TIMEOUT)
            check_loads(handle.path, expected, tmp_path, hidden=512)
            (info,) = plugin.buffer_sets()
            assert info.windows >= 4
            assert staging_bytes(plugin) <= budget * 1.05, (staging_bytes(plugin), budget)


@pytest.mark.full  # over 2 s on 2 cores: writer processes
def test_no_budget_is_one_window_as_before(tmp_path: Path) -> None:
    state, extra = TinyTrainingState.create(hidden=64, steps=1), Extra()
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(max_host_bytes=1 << 30))
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}, plugins=[plugin]) as engine:
        engine.save(1, **state.objects(), extra={"extra": extra}).result(TIMEOUT)
        (info,) = plugin.buffer_sets()
        assert info.windows == 1


@pytest.mark.full  # over 2 s on 2 cores: writer processes
def test_a_tensor_larger_than_the_budget_gets_a_window_of_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))  # one 256 KiB weight
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    budget = 64 * 1024
    largest = 256 * 256 * 4
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(max_host_bytes=budget))
    with (
        caplog.at_level(logging.WARNING, logger="ckpt_engine.pinned_staging"),
        CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}, plugins=[plugin]) as engine,
    ):
        expected_model = copy.deepcopy(model.state_dict())
        expected_optim = copy.deepcopy(optimizer.state_dict())
        handle = engine.save(5, model=model, optimizer=optimizer)
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        handle.result(TIMEOUT)
        # Documented: the buffer set grows to exactly the largest tensor, never to the state.
        (info,) = plugin.buffer_sets()
        assert info.nbytes == largest
        assert info.windows >= 4  # weight and momentum of the big layer alone, the small ones packed
    assert any("larger than the staging budget" in r.getMessage() for r in caplog.records)
    fresh = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 8))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    config = {"save_dir": str(tmp_path / "loader"), "load_path": handle.path, "load_training_state": True}
    with CheckpointEngine(config) as loader:
        loader.load(model=fresh, optimizer=fresh_opt)
    assert_state_dicts_equal(fresh.state_dict(), expected_model)
    assert_state_dicts_equal(fresh_opt.state_dict(), expected_optim)


@pytest.mark.full  # over 2 s on 2 cores: writer processes
def test_two_buffer_sets_share_the_budget(tmp_path: Path) -> None:
    state, extra = TinyTrainingState.create(hidden=512, steps=1), Extra()
    budget = state_bytes(state, extra) // 2  # each of the two sets gets a quarter of the state
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(max_host_bytes=budget, buffers=2))
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}, plugins=[plugin]) as engine:
        handles = []
        for it in (1, 2, 3):
            expected = snapshot(state, extra)
            handles.append((engine.save(it, **state.objects(), extra={"extra": extra}), expected))
            mutate(state, extra)
        for handle, expected in handles:
            handle.result(TIMEOUT)
            check_loads(handle.path, expected, tmp_path, hidden=512)
        sets = plugin.buffer_sets()
        # The second set exists only if a save was still pending when the next began (timing);
        # whichever sets exist each hold half the budget.
        assert 1 <= len(sets) <= 2
        assert all(s.nbytes <= budget // 2 and s.windows >= 4 for s in sets)
        assert staging_bytes(plugin) <= budget * 1.05


def test_overlap_and_a_budget_are_refused_naming_both() -> None:
    config = {"save_dir": "/nonexistent", "plugins": [{"name": "pinned_staging", "options": {"overlap": True}}]}
    config["plugins"][0]["options"]["max_host_bytes"] = 1 << 20  # type: ignore[index]
    with pytest.raises(PluginConfigError, match=r"overlap: true and max_host_bytes"):
        CheckpointEngine(config)


@pytest.mark.full  # over 2 s on 2 cores: writer processes
def test_a_writer_killed_between_windows_fails_the_save_and_the_next_one_works(tmp_path: Path) -> None:
    state, extra = TinyTrainingState.create(hidden=512, steps=1), Extra()
    budget = state_bytes(state, extra) // 4
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(max_host_bytes=budget))
    engine = CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}, plugins=[plugin])
    try:
        engine.save(1, **state.objects(), extra={"extra": extra}).result(TIMEOUT)
        original = plugin._pool.on_drained  # the buffer pool hears of drained windows

        def kill_on_first_drain(msg: Any) -> None:
            writer = plugin._writer
            assert writer is not None
            writer._on_drained = original
            writer.kill("the test killed it between windows")
            original(msg)

        writer = plugin._writer
        assert writer is not None
        writer._on_drained = kill_on_first_drain
        with pytest.raises((CheckpointSaveError, PinnedWriterError)):
            engine.save(2, **state.objects(), extra={"extra": extra}).result(TIMEOUT)
        assert (tmp_path / "ckpt" / "latest_checkpoint.txt").read_text().strip().endswith("1")
        expected = snapshot(state, extra)
        handle = engine.save(3, **state.objects(), extra={"extra": extra})
        mutate(state, extra)
        handle.result(TIMEOUT)
        check_loads(handle.path, expected, tmp_path, hidden=512)
    finally:
        engine.close()
