"""The resumable sampler: ``DistributedSampler``'s order, a global position in it, passes that start there.

The epoch's global order is ``DistributedSampler``'s (``torch.randperm`` seeded with
``seed + epoch``, or ``range`` without ``shuffle``). The state is that order's epoch, its seed and
the global position: how many samples of the order all ranks together have consumed. It is the
same on every rank, so it does not depend on the world size: after a load, rank ``r`` of ``W``
ranks takes every ``W``-th of the samples that remain, from the ``r``-th on. Where those divide
evenly among the new ranks, every sample of the epoch is seen exactly once; otherwise the tail is
padded (``drop_last=False``: a few samples of the epoch's start again, as ``DistributedSampler``
pads) or dropped (``drop_last=True``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sized
from typing import Any, cast

import torch
from torch.utils.data import Dataset, DistributedSampler

from ..errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["ResumableDistributedSampler"]

#: The keys of :meth:`ResumableDistributedSampler.state_dict`, each with its type.
STATE_KEYS: dict[str, type] = {"epoch": int, "position": int, "seed": int, "shuffle": bool, "dataset_len": int}


class ResumableDistributedSampler(DistributedSampler[int]):
    """``DistributedSampler`` with a ``state_dict`` that resumes mid-epoch on any world size.

    What counts as consumed: the samples this rank reported with :meth:`advance`, or, in a pass
    where :meth:`advance` was never called, every index the iterator handed out. The second is
    exact only when nothing reads ahead: a ``DataLoader`` with ``num_workers=0``, or torchdata's
    ``StatefulDataLoader`` saved as the component (it takes the sampler's state as each batch's
    indices are drawn). A ``DataLoader`` with ``num_workers > 0`` draws
    ``prefetch_factor * num_workers`` batches ahead of the training loop: call :meth:`advance`
    after each step, or a resume skips the batches that were prefetched but never trained on.
    """

    def __init__(
        self,
        dataset: Dataset[Any],
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)
        self._start = 0  # the global position the current (or pending) pass begins at
        self._pending = False  # a loaded position the next __iter__ starts from
        self._pass = 0  # the current pass; iterators of older passes no longer count
        self._yielded = 0  # indices of this pass this rank handed out
        self._consumed = 0  # samples of this pass this rank reported with advance()
        self._reported = False  # advance() was called in this pass
        self._ended = False  # the current pass's iterator ran out: the next pass is the whole epoch

    # -- DistributedSampler's surface ---------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        """This rank's indices of a pass over the epoch: from the loaded position in the first
        pass after :meth:`load_state_dict`, from the epoch's start in every other pass.

        A loaded position stays pending until a pass's iterator is first advanced: a loader
        that makes an iterator and throws it away unused (torchdata's ``BatchSampler`` does,
        when a ``DataLoader`` iterator starts) leaves it for the next one."""
        if not self._pending:
            self._start = 0
        self._new_pass()
        return _Pass(self)

    def __len__(self) -> int:
        """How many indices the current pass yields on this rank (after a resume, this rank's
        share of what remains of the epoch), or, once it ran out, the next pass: the whole epoch."""
        return self._pass_length(0 if self._ended and not self._pending else self._start)

    def set_epoch(self, epoch: int) -> None:
        """Make ``epoch`` the one the next pass iterates. Another epoch than the current one
        starts at its beginning; the current one (e.g. the loaded one) keeps its place."""
        if epoch != self.epoch:
            self.epoch = epoch
            self._start = 0
            self._pending = False
            self._new_pass()

    # -- consumption and state ---------------------------------------------------------------

    def advance(self, num_samples: int) -> None:
        """Report that the training loop consumed ``num_samples`` more of this rank's samples
        (e.g. the batch size, after each step). From the first call of a pass on, only what is
        reported counts as consumed; it never exceeds what the iterator handed out, so a short
        last batch reported as a full one counts what it held."""
        if isinstance(num_samples, bool) or not isinstance(num_samples, int):
            raise ArgumentTypeError(
                f"ResumableDistributedSampler.advance(num_samples): an int is needed, got "
                f"{type(num_samples).__name__}; pass how many samples this rank consumed (e.g. the batch size)"
            )
        if num_samples < 0:
            raise InvalidArgumentError(
                f"ResumableDistributedSampler.advance(num_samples={num_samples}): consumption only moves forward"
            )
        self._reported = True
        self._consumed = min(self._consumed + num_samples, self._yielded)

    @property
    def position(self) -> int:
        """The global position in the epoch: samples of its order consumed by all ranks
        together (the dataset's length once the epoch's pass is complete)."""
        return self._position_after(self._start, self._consumed if self._reported else self._yielded)

    def state_dict(self) -> dict[str, Any]:
        """``epoch``, ``position`` (see :attr:`position`), and what the epoch's order depends on
        (``seed``, ``shuffle``, ``dataset_len``): the same on every rank of a run in step."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "dataset_len": self._dataset_len(),
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the saved epoch from its saved position: the next pass yields this rank's
        share of the samples that remain, for this sampler's ``num_replicas`` and ``rank``."""
        _check_state(state_dict, self.seed, self.shuffle, self._dataset_len())
        self.epoch = state_dict["epoch"]
        self._start = state_dict["position"]
        self._pending = True
        self._new_pass()

    # -- the order -----------------------------------------------------------------------------

    def _new_pass(self) -> None:
        self._pass += 1
        self._yielded = self._consumed = 0
        self._reported = self._ended = False

    def _position_after(self, start: int, consumed: int) -> int:
        """The global position once this rank consumed ``consumed`` indices of a pass from ``start``."""
        if consumed >= self._pass_length(start):
            return self._dataset_len()
        return start + consumed * self.num_replicas

    def _dataset_len(self) -> int:
        return len(cast(Sized, self.dataset))

    def _order(self) -> list[int]:
        """The epoch's global order, as ``DistributedSampler`` draws it."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order: list[int] = torch.randperm(self._dataset_len(), generator=generator).tolist()
            return order
        return list(range(self._dataset_len()))

    def _pass_length(self, start: int) -> int:
        remaining = self._dataset_len() - start
        if self.drop_last:
            return remaining // self.num_replicas
        return math.ceil(remaining / self.num_replicas)

    def _rank_indices(self, start: int) -> list[int]:
        """This rank's share of the order from ``start`` on: every ``num_replicas``-th index,
        after the tail is cut (``drop_last``) or padded with the order's first indices (as
        ``DistributedSampler`` pads) to a multiple of ``num_replicas``."""
        order = self._order()
        rest = order[start:]
        extra = len(rest) % self.num_replicas
        if self.drop_last:
            rest = rest[: len(rest) - extra]
        elif extra:
            padding = self.num_replicas - extra
            rest += (order * math.ceil(padding / len(order)))[:padding]
        return rest[self.rank :: self.num_replicas]


def _check_state(state: Mapping[str, Any], seed: int, shuffle: bool, dataset_len: int) -> None:
    """Raise :class:`InvalidArgumentError` unless ``state`` continues an epoch of this sampler's
    order: every key of the right type, the same seed, shuffle and dataset length, a position
    inside the epoch."""
    where = "ResumableDistributedSampler.load_state_dict"
    for key, kind in STATE_KEYS.items():
        value = state.get(key)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise InvalidArgumentError(
                f"{where}: the state's {key!r} is {value!r}, not an {kind.__name__}; "
                f"pass a state this sampler's state_dict() made (keys: {', '.join(STATE_KEYS)})"
            )
    mine = {"seed": seed, "shuffle": shuffle, "dataset_len": dataset_len}
    for key, value in mine.items():
        if state[key] != value:
            raise InvalidArgumentError(
                f"{where}: the state was saved with {key}={state[key]!r} and this sampler has "
                f"{key}={value!r}, so the saved epoch's order cannot be continued; build the sampler "
                f"as the saving run did ({key}={state[key]!r}) to resume it"
            )
    if not 0 <= state["position"] <= dataset_len:
        raise InvalidArgumentError(
            f"{where}: the state's 'position' {state['position']} is outside the epoch of {dataset_len} samples"
        )


class _Pass(Iterator[int]):
    """The iterator of one pass: this rank's indices from the pass's start on.

    It is ``Stateful`` too: torchdata's ``StatefulDataLoader`` saves the state of the sampler's
    iterator each time it draws a batch's indices and restores it after the sampler's, so a
    loader state resumes right after the batches it delivered, whatever :meth:`advance` counted.
    """

    def __init__(self, sampler: ResumableDistributedSampler) -> None:
        self._sampler = sampler
        self._begin()

    def _begin(self) -> None:
        """Start at the sampler's current pass."""
        self._number = self._sampler._pass
        self._epoch = self._sampler.epoch
        self._start = self._sampler._start
        self._indices = self._sampler._rank_indices(self._start)
        self._next = 0

    def __next__(self) -> int:
        current = self._sampler._pass == self._number  # an iterator of an older pass no longer counts
        if current:
            self._sampler._pending = False  # this pass is under way: the next one starts the epoch over
        if self._next >= len(self._indices):
            if current:
                self._sampler._ended = True
            raise StopIteration
        index = self._indices[self._next]
        self._next += 1
        if current:
            self._sampler._yielded += 1
        return index

    def state_dict(self) -> dict[str, int]:
        """The epoch and the global position after the indices handed out so far."""
        return {"epoch": self._epoch, "position": self._sampler._position_after(self._start, self._next)}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Continue the sampler's epoch from ``state_dict``'s position, as a new pass."""
        sampler = self._sampler
        _check_state({**sampler.state_dict(), **state_dict}, sampler.seed, sampler.shuffle, sampler._dataset_len())
        sampler.epoch, sampler._start = state_dict["epoch"], state_dict["position"]
        sampler._new_pass()
        self._begin()
