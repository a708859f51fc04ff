"""``ckpt_engine.data.ResumableDistributedSampler``: ``DistributedSampler``'s order, a state that
is the same on every rank, and a mid-epoch resume on any world size that sees every sample of the
epoch once. Ranks are simulated with explicit ``num_replicas`` and ``rank``; the torchrun run of the
same through the engine is tests/distributed/test_data_sampler_dist.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from ckpt_engine import ArgumentTypeError, CheckpointEngine, InvalidArgumentError
from ckpt_engine.data import ResumableDistributedSampler

N = 120  # divisible by 2, 3, 4, 5 and 6: the resumes below divide evenly
BATCH = 6


def _samplers(world: int, n: int = N, **kwargs: Any) -> list[ResumableDistributedSampler]:
    return [ResumableDistributedSampler(range(n), world, rank, seed=7, **kwargs) for rank in range(world)]


def _run(samplers: list[ResumableDistributedSampler], steps: int | None, batch: int = BATCH) -> list[int]:
    """``steps`` steps of ``batch`` samples on every rank in step (all of the pass with ``None``),
    each rank reporting what it consumed; the indices the ranks consumed."""
    iterators = [iter(s) for s in samplers]
    seen: list[int] = []
    step = 0
    while steps is None or step < steps:
        batches = [[i for _, i in zip(range(batch), it, strict=False)] for it in iterators]
        if not batches[0]:
            break
        for s, b in zip(samplers, batches, strict=True):
            seen += b
            s.advance(len(b))
        step += 1
    return seen


@pytest.mark.parametrize("n", [0, 1, 10, 13])
@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_pass_from_the_start_is_distributed_samplers(n: int, world: int, drop_last: bool, shuffle: bool) -> None:
    """A drop-in: the same indices and length as ``DistributedSampler`` on every rank and epoch."""
    for rank in range(world):
        ours = ResumableDistributedSampler(range(n), world, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        theirs = DistributedSampler(range(n), world, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        assert isinstance(ours, DistributedSampler)
        for epoch in (0, 5):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs)
            assert len(ours) == len(theirs)


#: (ranks that save, ranks that resume, steps before the save): each leaves a rest the resuming ranks divide.
RESIZES = [(4, 2, 3), (2, 3, 4), (4, 3, 2), (1, 4, 6), (3, 5, 5), (6, 1, 2)]


@pytest.mark.parametrize(("before", "after", "steps"), RESIZES)
def test_a_resume_on_another_world_size_sees_every_sample_once(before: int, after: int, steps: int) -> None:
    first = _samplers(before)
    seen = _run(first, steps)
    states = [s.state_dict() for s in first]
    assert all(st == states[0] for st in states), "the state differs across ranks"
    assert states[0]["position"] == steps * BATCH * before
    assert (N - states[0]["position"]) % after == 0  # the case the guarantee covers
    second = _samplers(after)
    for s in second:
        s.load_state_dict(states[0])
    assert [len(s) for s in second] == [(N - states[0]["position"]) // after] * after
    seen += _run(second, None)
    assert sorted(seen) == list(range(N))
    assert all(s.state_dict()["position"] == N for s in second)


def test_a_resume_on_the_same_world_size_is_the_uninterrupted_run_batch_for_batch() -> None:
    """Also where padding repeats samples at the end: 13 samples on 4 ranks pad 3."""
    for drop_last in (False, True):
        uninterrupted = [list(s) for s in _samplers(4, n=13, drop_last=drop_last)]
        first = _samplers(4, n=13, drop_last=drop_last)
        _run(first, 1, batch=2)
        second = _samplers(4, n=13, drop_last=drop_last)
        for s in second:
            s.load_state_dict(first[0].state_dict())
        assert [list(s) for s in second] == [u[2:] for u in uninterrupted]


def test_padding_repeats_the_epochs_first_samples_and_drop_last_drops_the_tail() -> None:
    """10 samples, 4 ranks consume 4, 4 ranks resume on the other 6: padded to 8 with the
    epoch's first 2 samples (seen twice), or cut to 4 (2 never seen this epoch)."""
    first = _samplers(4, n=10)
    seen = _run(first, 1, batch=1)
    second = _samplers(4, n=10)
    for s in second:
        s.load_state_dict(first[0].state_dict())
    seen += _run(second, None, batch=1)
    counts = Counter(seen)
    assert set(counts) == set(range(10))
    assert {i for i, c in counts.items() if c == 2} == set(list(_samplers(1, n=10)[0])[:2])

    first = _samplers(4, n=10, drop_last=True)
    seen = _run(first, 1, batch=1)
    second = _samplers(4, n=10, drop_last=True)
    for s in second:
        s.load_state_dict(first[0].state_dict())
    seen += _run(second, None, batch=1)
    assert len(seen) == len(set(seen)) == 8


def test_prefetched_batches_are_not_consumed_with_workers() -> None:
    """``num_workers=2`` draws 4 batches ahead: without ``advance`` they count as consumed (the
    documented case for loaders that do not read ahead), with it only the trained ones do, and a
    resume from that state is the rest of the uninterrupted run."""
    dataset = list(range(N))

    def loader(sampler: ResumableDistributedSampler) -> DataLoader[Any]:
        return DataLoader(dataset, batch_size=BATCH, sampler=sampler, num_workers=2)

    reporting, silent = _samplers(2)[0], _samplers(2)[0]
    batches, states = [], []
    for step, (batch, _) in enumerate(zip(loader(reporting), loader(silent), strict=True), 1):
        batches.append(batch.tolist())
        reporting.advance(len(batch))
        if step == 3:
            states = [reporting.state_dict(), silent.state_dict()]
    assert states[0]["position"] == 3 * BATCH * 2
    assert states[1]["position"] > states[0]["position"]  # the prefetched batches
    resumed = _samplers(2)[0]
    resumed.load_state_dict(states[0])
    assert [b.tolist() for b in loader(resumed)] == batches[3:]


def test_advance_counts_no_more_than_was_handed_out() -> None:
    """A short last batch reported as a full one: the epoch is complete, not past its end."""
    s = _samplers(2, n=10)[0]
    assert [len(b) for b in DataLoader(range(10), batch_size=4, sampler=s)] == [4, 1]
    for _ in range(2):
        s.advance(4)
    assert s.state_dict()["position"] == 10
    with pytest.raises(InvalidArgumentError, match="forward"):
        s.advance(-1)
    with pytest.raises(ArgumentTypeError, match="num_samples"):
        s.advance(2.0)  # type: ignore[arg-type]


def test_set_epoch_keeps_the_loaded_epochs_place_and_starts_others_at_their_start() -> None:
    saved = _samplers(2)
    _run(saved, 2)
    state = saved[0].state_dict()
    s = _samplers(2)[1]
    s.load_state_dict(state)
    s.set_epoch(0)  # the loaded epoch: the training loop's `for epoch in range(sampler.epoch, ...)`
    resumed = list(s)
    assert resumed == list(_samplers(2)[1])[2 * BATCH :]
    assert list(s) == list(_samplers(2)[1])  # the pass after a resumed one: the whole epoch again
    s.load_state_dict(state)
    s.set_epoch(1)
    assert s.state_dict()["position"] == 0
    other = _samplers(2)[1]
    other.set_epoch(1)
    assert list(s) == list(other)


def test_len_is_the_remainder_during_the_resumed_pass_and_the_whole_epoch_after_it() -> None:
    """docs/data.md: ``len(sampler)`` says what the first pass after a load yields; later passes
    are the whole epoch, as ``DistributedSampler``'s. After the resumed pass it still said the
    remainder (7, then a pass of 12)."""
    saved = _samplers(2)
    _run(saved, 2)
    s = _samplers(2)[1]
    s.load_state_dict(saved[0].state_dict())
    whole = len(_samplers(2)[1])
    remainder = len(s)
    assert remainder < whole
    it = iter(s)
    first = [next(it)]
    assert len(s) == remainder  # during the pass: the pass's length
    first += list(it)
    assert len(first) == remainder
    assert len(s) == whole  # the pass ran out: the next is the whole epoch
    assert len(list(s)) == whole == len(s)
    assert s.state_dict()["position"] == N  # the epoch is complete


def test_a_state_saved_at_the_end_of_an_epoch_resumes_with_nothing_left() -> None:
    for drop_last in (False, True):
        saved = _samplers(4, n=10, drop_last=drop_last)
        _run(saved, None, batch=1)
        state = saved[0].state_dict()
        assert state["position"] == 10
        for world in (3, 4):
            s = _samplers(world, n=10, drop_last=drop_last)[0]
            s.load_state_dict(state)
            assert (len(s), list(s)) == (0, [])


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"seed": 8}, "seed=8"),
        ({"shuffle": False}, "shuffle=False"),
        ({"dataset_len": 121}, "dataset_len=121"),
        ({"position": 121}, "'position' 121"),
        ({"position": -1}, "'position' -1"),
        ({"epoch": "1"}, "'epoch'"),
        ({"position": True}, "'position'"),
        ({"seed": None}, "'seed'"),
    ],
)
def test_a_state_of_another_order_is_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    state = {**_samplers(2)[0].state_dict(), **change}
    s = _samplers(2)[0]
    with pytest.raises(InvalidArgumentError, match=field):
        s.load_state_dict(state)


def test_the_engine_saves_the_sampler_as_an_extra_and_resumes_it_on_another_world_size(tmp_path: Path) -> None:
    """A real checkpoint on disk: the state saved at 4 ranks is loaded by the samplers of 3."""
    first = _samplers(4)
    seen = _run(first, 2)
    model = nn.Linear(2, 2)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.save(2, model=model, extra={"sampler": first[0]})
    second = _samplers(3)
    for s in second:
        s.set_epoch(4)  # overwritten by the load
        with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
            assert engine.load(model=model, extra={"sampler": s}).iteration == 2
    assert second[0].state_dict() == first[0].state_dict()
    seen += _run(second, None)
    assert sorted(seen) == list(range(N))


@pytest.mark.full  # over 2 s on 2 cores: DataLoader worker processes
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch 2.13
def test_statefuldataloader_with_workers_resumes_through_its_own_state_or_the_samplers(tmp_path: Path) -> None:
    """torchdata's ``StatefulDataLoader`` (``num_workers=2``): saved through the engine as the
    loader, it resumes batch for batch on the same world size although the loop calls
    ``advance`` (its state takes the sampler's iterator's, drawn with each batch); the sampler
    saved beside it resumes on another world size."""
    pytest.importorskip("torchdata")  # the `test` extra installs it
    from torchdata.stateful_dataloader import StatefulDataLoader

    def loader(sampler: ResumableDistributedSampler) -> Any:
        return StatefulDataLoader(list(range(N)), batch_size=BATCH, sampler=sampler, num_workers=2)

    samplers = _samplers(2)
    loaders = [loader(s) for s in samplers]
    batches: list[list[list[int]]] = [[], []]
    model = nn.Linear(2, 2)
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        for step, pair in enumerate(zip(*loaders, strict=True), 1):
            for rank, batch in enumerate(pair):
                batches[rank].append(batch.tolist())
                samplers[rank].advance(len(batch))
            if step == 8:  # past the 4 batches drawn ahead at the start
                engine.save(step, model=model, extra={"loader": loaders[0], "sampler": samplers[0]})
    again = loader(_samplers(2)[0])
    with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
        engine.load(model=model, extra={"loader": again})
    assert [b.tolist() for b in again] == batches[0][8:]

    seen = [i for rank in batches for b in rank[:8] for i in b]
    for s in _samplers(3):
        with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
            engine.load(model=model, extra={"sampler": s})
        assert s.state_dict()["position"] == 8 * BATCH * 2
        seen += [i for b in loader(s) for i in b.tolist()]
    assert sorted(seen) == list(range(N))


def _docs_loop(save_dir: Path, stop: int | None, *, loader_generator: bool) -> dict[str, Any]:
    """docs/data.md's training loop (a model with dropout, which draws from the global torch RNG
    at every step), stopped after ``stop`` steps with a save, or run to its end; the final state."""
    import torch

    torch.manual_seed(0)
    dataset = torch.utils.data.TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
    sampler = ResumableDistributedSampler(dataset, num_replicas=1, rank=0, seed=0)
    generator = torch.Generator() if loader_generator else None
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, generator=generator)
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CheckpointEngine({"save_dir": str(save_dir)}) as engine:
        step = engine.load(model=model, optimizer=opt, extra={"sampler": sampler}).iteration
        for epoch in range(sampler.epoch, 2):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sampler.advance(len(x))
                step += 1
                if step == stop:
                    engine.save(step, model=model, optimizer=opt, extra={"sampler": sampler})
                    return {}
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("loader_generator", [True, False], ids=["loader_generator", "global_rng"])
def test_the_documented_loop_resumes_mid_epoch_exactly_with_its_loaders_own_generator(
    tmp_path: Path, loader_generator: bool
) -> None:
    """A ``DataLoader`` without a generator draws each pass's seed from the global torch RNG when
    the pass starts: the resumed run starts one pass more (after the load restored the RNG), so
    every dropout mask after it moved, and the docs' loop was not exact. The docs give the loader
    a generator of its own; without one the runs differ (what this test shows as its control)."""
    import torch

    whole = _docs_loop(tmp_path / "whole", None, loader_generator=loader_generator)
    _docs_loop(tmp_path / "resumed", 3, loader_generator=loader_generator)  # mid-epoch: 6 steps an epoch
    resumed = _docs_loop(tmp_path / "resumed", None, loader_generator=loader_generator)
    exact = all(torch.equal(whole[k], resumed[k]) for k in whole)
    assert exact == loader_generator
