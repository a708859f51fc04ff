"""The DCP storage classes the engine itself uses, for write providers that run DCP themselves.

A background ``write`` provider (such as ``pinned_staging``) should write with
:class:`EngineFileSystemWriter` so an async save produces the same files, as fast, as the
engine's synchronous one. Both classes read and write DCP's own on-disk format: every checkpoint
stays loadable by plain ``torch.distributed.checkpoint.load``.

A provider whose own processes form a process group (one writer process per rank) bounds their
collectives as the engine bounds its own (``collective_timeout_s``, given as
``WriteContext.collective_timeout_s``): ``CollectiveWatch.create(timeout, who="writer rank")``
on every process of that group at the same point (it creates a gloo group with that timeout),
then ``with activate_watch(watch): write_component(...)`` (or ``engine_save``). Each process publishes its phase in its
group's store; a process that does not reach a collective in time makes the others raise
:class:`~ckpt_engine.errors.CollectiveTimeoutError` naming it and its last phase. Run a
collective of the provider's own with ``watch.barrier(step)`` first and on ``watch.group``.

With ``EngineConfig.incremental``, ``WriteContext.carry_over`` says what the write may carry over
from the previous checkpoint: ``EngineFileSystemWriter(path, carry_over=ctx.carry_over, ...)``
lays the files out for it and carries unchanged ones over, and :func:`write_result` reports
what it wrote and what it carried over. :func:`write_component` does all of it: one component
written as the engine's own ``write`` writes it, with its ``WriteResult``.

With ``EngineConfig.local_dir``, the engine also asks for rank-local writes
(``WriteContext.rank_local``): ``process_group`` is then :data:`RANK_LOCAL`, and
:func:`write_component` given it writes every item this rank holds, with a ``.metadata`` of its
own, and runs no collective (a provider declares it can: ``ckpt_engine.lifecycle.WritesRankLocal``).
"""

from __future__ import annotations

import time
from typing import Any

from torch.distributed.checkpoint import StorageWriter
from torch.distributed.checkpoint.planner import SavePlanner

from ._dcpio.coordination import RANK_LOCAL
from ._dcpio.dist import quiet_dcp
from ._dcpio.fast_read import FastFileSystemReader as EngineFileSystemReader
from ._dcpio.fast_save import plan_cache, save_state_dict
from ._dcpio.fast_write import FastFileSystemWriter as EngineFileSystemWriter
from ._dcpio.fast_write import write_result
from ._dcpio.watch import CollectiveWatch
from ._dcpio.watch import activate as activate_watch
from .types import WriteResult

__all__ = [
    "RANK_LOCAL",
    "CollectiveWatch",
    "EngineFileSystemReader",
    "EngineFileSystemWriter",
    "activate_watch",
    "engine_save",
    "write_component",
    "write_result",
]


def engine_save(
    state_dict: dict[str, Any], *, storage_writer: StorageWriter, planner: SavePlanner, cache_key: str | None = None
) -> int:
    """``dcp.save(state_dict, storage_writer=..., planner=...)`` as the engine runs it: the plan of an
    unchanged structure is reused from the cache named ``cache_key`` (the key the engine's save
    planner carries); returns the bytes written. Same files and ``.metadata`` as ``dcp.save``."""
    cache = plan_cache(cache_key) if cache_key is not None else None
    return save_state_dict(state_dict, storage_writer=storage_writer, planner=planner, cache=cache).total_bytes


def write_component(
    state_dict: dict[str, Any],
    *,
    component: str,
    path: str,
    planner: SavePlanner,
    thread_count: int = 1,
    sync_files: bool = True,
    carry_over: Any = None,
    storage_writer: StorageWriter | None = None,
    process_group: Any = None,
) -> WriteResult:
    """Write one component as the engine's own ``write`` does and return its ``WriteResult``: into
    ``path`` through an :class:`EngineFileSystemWriter` (or ``storage_writer``, which must write the
    same layout), by :func:`engine_save`'s protocol, DCP's warnings that say nothing to a user
    silenced. The arguments are those of the ``WriteContext`` (``ctx.path``, ``ctx.planner``,
    ``ctx.carry_over``, ...)."""
    start = time.perf_counter()
    writer = storage_writer or EngineFileSystemWriter(
        path,
        thread_count=thread_count,
        sync_files=sync_files,
        overwrite=True,
        carry_over=carry_over,
        rank_local=process_group is RANK_LOCAL,
    )
    key = getattr(planner, "cache_key", None)
    with quiet_dcp():
        cache = plan_cache(key) if key is not None else None
        out = save_state_dict(
            state_dict, storage_writer=writer, planner=planner, process_group=process_group, cache=cache
        )
    return write_result(component, out.total_bytes, writer, time.perf_counter() - start)
