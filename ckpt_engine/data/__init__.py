"""Data loading that resumes mid-epoch: a ``DistributedSampler`` whose place in the epoch a checkpoint saves.

:class:`ResumableDistributedSampler` takes the constructor, ``set_epoch``, ``__iter__`` and
``__len__`` of :class:`torch.utils.data.DistributedSampler` and adds ``state_dict`` /
``load_state_dict`` (DCP's ``Stateful``), so it goes in a checkpoint as an extra component and
resumes the epoch on any number of ranks::

    sampler = ResumableDistributedSampler(dataset, seed=0)
    loader = DataLoader(dataset, batch_size=8, sampler=sampler, num_workers=2)
    step = engine.load(model=model, extra={"sampler": sampler}).iteration
    for epoch in range(sampler.epoch, epochs):
        sampler.set_epoch(epoch)          # the loaded epoch keeps its place in it
        for batch in loader:
            ...
            sampler.advance(batch_size)   # what this rank consumed (prefetched batches are not)
            engine.save(step, model=model, extra={"sampler": sampler})

docs/data.md shows the whole training loop and what padding does.
"""

from __future__ import annotations

from .sampler import ResumableDistributedSampler

__all__ = ["ResumableDistributedSampler"]
