"""``overlap``: every kind of edit made between ``save()`` and the background copy, and what each
does (the table in docs/async.md). No edit may commit a torn checkpoint: it is either caught (the
save fails with ``SnapshotChangedError``) or it never reaches the copy.

The copy thread is held at a gate until the edit is done, so "the edit came before the copy" is
the schedule every run, not a race the test hopes to win; the gate only delays the plugin's real
copy thread.
"""

from __future__ import annotations

import fractions
import io
import pickle
import threading
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from ckpt_engine_plugins.pinned_staging import PinnedStagingPlugin, SnapshotChangedError, collect, copies
from test_overlap import Trainer, loaded
from torch import nn
from torch.distributed.checkpoint import FileSystemReader

from ckpt_engine import CheckpointEngine, CheckpointSaveError
from ckpt_engine.testing import assert_state_dicts_equal


@pytest.fixture
def engine(tmp_path: Path) -> Iterator[CheckpointEngine]:
    plugin = PinnedStagingPlugin(PinnedStagingPlugin.Options(overlap=True, close_timeout_s=60))
    with CheckpointEngine({"save_dir": str(tmp_path / "ckpt")}, plugins=[plugin]) as eng:
        yield eng


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Holds every overlap copy thread until the test sets the event."""
    event = threading.Event()
    run = copies.Snapshot._run

    def held(self: copies.Snapshot) -> None:
        assert event.wait(60), "the test never opened the gate"
        run(self)

    monkeypatch.setattr(copies.Snapshot, "_run", held)
    return event


def weight(t: Trainer) -> torch.Tensor:
    w: torch.Tensor = t.model[0].weight
    return w


def exp_avg(t: Trainer) -> torch.Tensor:
    state: torch.Tensor = t.optim.state[weight(t)]["exp_avg"]
    return state


#: edit -> (the edit, the key the error names). Each changes the state after save() and before
#: the copy; the first two move the version counter, the others go through an alias that does not.
CAUGHT: dict[str, tuple[Callable[[Trainer], Any], str]] = {
    "in-place op under no_grad": (lambda t: weight(t).mul_(2.0), "model: 0.weight was changed in place"),
    "copy_ into the parameter": (lambda t: weight(t).copy_(torch.zeros_like(weight(t))), "model: 0.weight"),
    "param.data.add_()": (lambda t: weight(t).data.add_(1.0), "model: 0.weight was changed after save()"),
    "optimizer state .data.add_()": (lambda t: exp_avg(t).data.add_(1.0), "optim: state.0.weight.exp_avg"),
    "numpy view write": (lambda t: weight(t).detach().numpy().__iadd__(1.0), "model: 0.weight"),
    "untyped_storage().copy_()": (
        lambda t: weight(t).untyped_storage().copy_(torch.full_like(weight(t), 3.0).untyped_storage()),
        "model: 0.weight",
    ),
    "clamp_ through .data": (lambda t: weight(t).data.clamp_(-1e-3, 1e-3), "model: 0.weight"),
    "one sampled element through .data": (
        lambda t: weight(t).data.view(-1)[0].add_(1.0),
        "model: 0.weight",
    ),
    "last element through .data": (lambda t: weight(t).data.view(-1)[-1].add_(1.0), "model: 0.weight"),
}

#: Sparse edits of at least one contiguous 4 KiB page (copies.SAMPLE_SPAN), on a model whose
#: weight rows are 1,024 fp32 (one page each, as an embedding row of that width): what
#: sparse-embedding optimizers and a manual EMA of a few rows do. None moves a version counter.
PAGE_RUNS: dict[str, tuple[Callable[[Trainer], Any], str]] = {
    "one row through .data": (lambda t: weight(t).data[5].add_(1.0), "model: 0.weight"),
    "index_add_ of two rows into .data": (
        lambda t: weight(t).data.index_add_(0, torch.tensor([3, 17]), torch.ones(2, 1024)),
        "model: 0.weight",
    ),
    "one page not aligned to a row": (lambda t: weight(t).data.view(-1)[700:1724].sub_(0.5), "model: 0.weight"),
    "an exp_avg row through .data": (lambda t: exp_avg(t).data[9].add_(1.0), "optim: state.0.weight.exp_avg"),
    "a row through a numpy view": (lambda t: weight(t).detach().numpy()[11].__iadd__(1.0), "model: 0.weight"),
    "a manual EMA of two rows": (
        lambda t: weight(t).data[20:22].mul_(0.9).add_(0.1 * torch.randn(2, 1024)),
        "model: 0.weight",
    ),
}


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
@pytest.mark.parametrize(("name", "width"), [(name, 128) for name in CAUGHT] + [(name, 1024) for name in PAGE_RUNS])
def test_an_edit_before_the_copy_fails_the_save_never_tears_it(
    engine: CheckpointEngine, gate: threading.Event, tmp_path: Path, name: str, width: int
) -> None:
    edit, named = CAUGHT[name] if width == 128 else PAGE_RUNS[name]
    trainer = Trainer(width=width)
    trainer.step()
    gate.set()
    engine.save(1, **trainer.objects()).result()
    gate.clear()
    handle = engine.save(2, **trainer.objects())
    with torch.no_grad():
        edit(trainer)
    gate.set()
    with pytest.raises(CheckpointSaveError) as info:
        handle.result()
    assert isinstance(info.value.__cause__, SnapshotChangedError), info.value
    assert named in str(info.value)
    assert (tmp_path / "ckpt" / "latest_checkpoint.txt").read_text() == "iter_000000001\n"
    assert not (tmp_path / "ckpt" / "iter_000000002").exists()
    with pytest.raises(CheckpointSaveError):
        engine.wait()
    trainer.step()  # training goes on; the next save is exact
    want = trainer.snapshot()
    engine.save(3, **trainer.objects()).result()
    assert_state_dicts_equal(loaded(tmp_path / "ckpt" / "iter_000000003", tmp_path, width), want)


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_a_single_unsampled_element_is_the_documented_limit(
    engine: CheckpointEngine, gate: threading.Event, tmp_path: Path
) -> None:
    """One element between two sampled ones, changed through ``.data``: nothing sees it (the
    table's one uncaught row). The save commits, holding the edit or not: this test keeps the
    documentation honest, and fails if the limit is ever closed without updating it."""
    trainer = Trainer(width=1024)
    trainer.step()
    before = weight(trainer).detach().clone()
    handle = engine.save(1, **trainer.objects())
    stride = copies._sample_step(weight(trainer).numel(), 4)
    with torch.no_grad():
        weight(trainer).data.view(-1)[stride // 2].add_(1.0)
    gate.set()
    assert handle.result().succeeded
    saved = loaded(tmp_path / "ckpt" / "iter_000000001", tmp_path, 1024)["model"]["0.weight"]
    assert torch.equal(saved, before) or torch.equal(saved, weight(trainer).detach())


@pytest.mark.parametrize(("numel", "dtype"), [(1 << 20, torch.float32), (3 << 19, torch.bfloat16), (5000, torch.int64)])
def test_any_contiguous_page_holds_a_sampled_element(numel: int, dtype: torch.dtype) -> None:
    """Exhaustively: every run of ``SAMPLE_SPAN`` bytes, wherever it starts, changes the sample."""
    per_page = copies.SAMPLE_SPAN // torch.empty((), dtype=dtype).element_size()
    index = copies._sample_index(numel, torch.empty((), dtype=dtype).element_size())
    gaps = index[1:] - index[:-1]
    assert index[0] == 0 and index[-1] == numel - 1 and gaps.max() <= per_page
    t = torch.zeros(numel, dtype=dtype)
    first = copies._sample(t)
    for start in (0, 1, per_page // 2, numel // 3, numel - per_page):
        edited = t.clone()
        edited[start : start + per_page] = 1
        assert not copies._same_bits(first, copies._sample(edited)), start


#: edits that cannot tear the checkpoint: they never touch the memory being copied.
HARMLESS: dict[str, Callable[[Trainer], Any]] = {
    # a new tensor for the parameter: the copy still reads the memory save() saw
    "param.data = new tensor": lambda t: setattr(weight(t), "data", torch.full_like(weight(t), 5.0)),
    "a new optimizer state tensor": lambda t: t.optim.state[weight(t)].__setitem__("exp_avg", torch.ones(1)),
}


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
@pytest.mark.parametrize("name", list(HARMLESS))
def test_an_edit_that_replaces_the_tensor_leaves_the_checkpoint_exact(
    engine: CheckpointEngine, gate: threading.Event, tmp_path: Path, name: str
) -> None:
    trainer = Trainer(width=128)
    trainer.step()
    want = trainer.snapshot()
    handle = engine.save(1, **trainer.objects())
    with torch.no_grad():
        HARMLESS[name](trainer)
    gate.set()
    assert handle.result().succeeded
    assert_state_dicts_equal(loaded(tmp_path / "ckpt" / "iter_000000001", tmp_path, 128), want)


def test_the_sample_takes_the_first_and_last_element_and_every_step_between() -> None:
    t = torch.arange(1000, dtype=torch.float32)
    sample = torch.as_tensor(copies._sample(t))
    step = copies._sample_step(1000, 4)
    assert sample[0] == 0 and sample[-1] == 999
    assert torch.equal(sample[:-1], t[::step])
    assert len(sample) <= 2 * copies.SAMPLES + 1
    small = torch.arange(10.0)
    assert torch.equal(torch.as_tensor(copies._sample(small))[:-1], small)  # a small tensor: all of it
    nan = torch.tensor([float("nan")] * 3)
    assert copies._same_bits(copies._sample(nan), copies._sample(nan.clone()))
    # The torch path (CUDA tensors take it) samples the same elements as the numpy one.
    assert copies._same_bits(copies._sample(t), torch.cat((t[::step], t[-1:])))


@pytest.mark.parametrize("numel", [0, 1, 2, 63, 64, 65, 1000, 4097, 1 << 20])
def test_the_numpy_sample_takes_the_elements_of_the_torch_path(numel: int) -> None:
    # The CPU path takes cached indices per size; CUDA tensors slice with torch: they must agree,
    # or a copy sampled one way and its source the other would fail every save.
    t = torch.randn(numel)
    sample = copies._sample(t)
    assert not isinstance(sample, torch.Tensor)  # the numpy path was taken
    expected = torch.cat((t[:: copies._sample_step(numel, 4)], t[-1:])) if numel else t
    assert copies._same_bits(sample, expected)
    if numel:
        with pytest.raises(ValueError):  # the cached indices are shared by every tensor of the size
            copies._sample_index(numel, 4)[0] = 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.uint8])
def test_every_dtype_is_sampled_and_a_changed_element_changes_the_sample(dtype: torch.dtype) -> None:
    t = (torch.arange(300) % 7).to(dtype)
    param = torch.nn.Parameter(t.clone(), requires_grad=dtype.is_floating_point)
    first = copies._sample(param)
    assert copies._same_bits(first, copies._sample(t.clone()))
    with torch.no_grad():
        param.data[-1] = 0 if bool(param.data[-1]) else 1  # the last element is sampled
    assert not copies._same_bits(first, copies._sample(param))


# -- optimizers without state, and no optimizer -----------------------------------------------


class SgdTrainer:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.steps_run = 0
        self.optim.register_step_pre_hook(lambda *a: setattr(self, "steps_run", self.steps_run + 1))

    def step(self) -> None:
        self.model(torch.randn(8, 64)).square().mean().backward()
        self.optim.step()
        self.optim.zero_grad()


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_a_stateless_optimizer_is_not_stepped_by_later_saves_and_overlap_defers_its_parameters(
    engine: CheckpointEngine, tmp_path: Path
) -> None:
    """DCP's state initialisation ran a fake ``step()`` of plain SGD in every save: zero grads for
    every parameter, the step hooks, every version counter bumped, and (with overlap) a save()
    that blocked longer than one without it."""
    trainer = SgdTrainer()
    trainer.step()
    engine.save(1, model=trainer.model, optimizer=trainer.optim).result()  # proves SGD stateless
    for i in range(2, 5):
        trainer.step()
        steps, versions = trainer.steps_run, [p._version for p in trainer.model.parameters()]
        want = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        result = engine.save(i, model=trainer.model, optimizer=trainer.optim).result()
        assert trainer.steps_run == steps, "save() stepped the optimizer"
        assert [p._version for p in trainer.model.parameters()] == versions
        assert all(p.grad is None for p in trainer.model.parameters())
        assert result.background_copy_seconds > 0, "the parameters were not copied in the background"
        fresh = SgdTrainer()
        with CheckpointEngine({"save_dir": str(tmp_path / "x"), "load_path": str(tmp_path / "ckpt")}) as eng:
            eng.load(model=fresh.model, optimizer=fresh.optim)
        assert_state_dicts_equal(fresh.model.state_dict(), want)
        assert fresh.optim.state_dict()["param_groups"] == trainer.optim.state_dict()["param_groups"]


def test_a_stateful_optimizer_that_never_stepped_saves_its_groups_and_stays_unstepped(tmp_path: Path) -> None:
    """DCP's fake step is never run by a save: a fresh AdamW is saved as it is (its groups, no
    state: the step it would record was never taken) and comes out of save() without state."""
    model = nn.Linear(8, 8)
    optim = torch.optim.AdamW(model.parameters())
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(1, model=model, optimizer=optim)
    from ckpt_engine._format.metadata import read_metadata

    keys = set(read_metadata(tmp_path / "iter_000000001" / "optim").state_dict_metadata)
    assert "param_groups.weight.lr" in keys and not any(k.startswith("state.") for k in keys)
    assert not optim.state and all(p.grad is None for p in model.parameters())


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_overlap_without_an_optimizer_warns_once_and_copies_in_save(engine: CheckpointEngine) -> None:
    model = nn.Linear(32, 32)
    with pytest.warns(UserWarning, match="got no optimizer"):
        result = engine.save(1, model=model).result()
    assert result.background_copy_seconds == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine.save(2, model=model).result()


# -- skeletons pickled off save()'s path ------------------------------------------------------


class LiveCounter:
    """Extra state whose ``state_dict()`` is its own live dict, as some user classes return."""

    def __init__(self) -> None:
        self.d: dict[str, Any] = {"count": 1, "name": "run", "betas": (0.9, 0.99)}

    def state_dict(self) -> dict[str, Any]:
        return self.d

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.d = dict(sd)


@pytest.mark.full  # over 2 s on 2 cores: training with the overlapped copy
def test_flat_skeletons_are_pickled_after_save_and_hold_the_values_of_save(
    engine: CheckpointEngine, gate: threading.Event, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    real = collect.Skeleton.pickled

    def spy(self: collect.Skeleton) -> bytes:
        calls.append(threading.current_thread().name)
        return real(self)

    monkeypatch.setattr(collect.Skeleton, "pickled", spy)
    trainer = Trainer(width=128)
    trainer.step()
    want = trainer.snapshot()
    counter = LiveCounter()
    handle = engine.save(1, **trainer.objects(), extra={"counter": counter})
    # save() returned with the copy held: nothing was pickled for the writer yet (the model, the
    # optimizer and the counter are flat; the scheduler and trainer state were pickled in save()).
    assert calls == []
    counter.d["count"] = 2  # changes to the live dict after save() must not reach the checkpoint
    counter.d["added"] = 3
    gate.set()
    assert handle.result().succeeded
    assert "pinned-staging-overlap-copy" in calls
    path = tmp_path / "ckpt" / "iter_000000001"
    saved = FileSystemReader(str(path / "counter")).read_metadata().state_dict_metadata
    assert sorted(saved) == ["betas", "count", "name"]
    fresh, restored = Trainer(seed=123, width=128), LiveCounter()
    restored.d = {"count": 0, "name": "", "betas": (0.0, 0.0)}
    config = {"save_dir": str(tmp_path / "unused"), "load_path": str(path), "load_training_state": True}
    with CheckpointEngine(config) as loader:
        loader.load(**fresh.objects(), extra={"counter": restored})
    assert restored.d == {"count": 1, "name": "run", "betas": (0.9, 0.99)}
    assert_state_dicts_equal(fresh.snapshot(), want)


def test_a_flat_skeleton_unpickles_as_the_generic_one(one_rank_mesh: Any) -> None:
    # The writer unpickles both kinds alike: same keys, values and persistent ids in the same order.
    from ckpt_engine_plugins.pinned_staging.ipc import SkeletonUnpickler
    from torch.distributed.tensor import DTensor, Replicate

    shared = torch.randn(3)
    sd = {
        "w": shared,
        "alias": shared,
        "d": DTensor.from_local(torch.randn(4), one_rank_mesh, [Replicate()]),
        "lr": 0.1,
        "betas": (0.9, 0.99),
        "n": None,
        "flag": True,
        "s": "text",
        "step": 7,
    }
    flat_collector, generic_collector = collect.Collector(), collect.Collector()
    flat = collect.Skeleton.of(sd, flat_collector)
    buf = io.BytesIO()
    collect.SkeletonPickler(buf, generic_collector).dump(sd)
    pids: list[Any] = []
    got = SkeletonUnpickler(flat.pickled(), lambda pid: pids.append(pid) or f"slot{pid[1]}").load()
    generic_pids: list[Any] = []
    expected = SkeletonUnpickler(buf.getvalue(), lambda pid: generic_pids.append(pid) or f"slot{pid[1]}").load()
    assert list(got.items()) == list(expected.items()) and pids == generic_pids
    assert got["alias"] == got["w"] == "slot0" and flat_collector.signature() == generic_collector.signature()
    views = [torch.zeros(3), torch.zeros(4)]
    tree = flat.tree(views)
    assert tree["w"] is views[0] and tree["d"] is views[1] and tree["betas"] == (0.9, 0.99)
    # Anything but tensors and immutable values is pickled at once (a deep copy of it).
    for nested in ({"a": [1]}, {"a": {"b": 1}}, {1: 2}, {"f": fractions.Fraction(1, 2)}, {"t": (1, [2])}):
        skeleton = collect.Skeleton.of(nested, collect.Collector())
        assert skeleton._flat is None and pickle.loads(skeleton.pickled()) == nested
