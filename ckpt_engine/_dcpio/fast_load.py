"""The engine's DCP load: every rank plans its own reads, with no gather or scatter of plans.

``dcp.load`` runs the planner and storage-reader protocol (``read_metadata``,
``set_up_planner``, ``set_up_storage_reader``, ``create_local_plan``, ``prepare_local_plan``,
``create_global_plan``, ``prepare_global_plan``, ``finish_plan``, ``read_data``), which is
public API, between three collectives: a gather of the local plans to rank 0, a scatter of the
final ones and an all-gather after reading. For DCP's default load planner the global step
changes nothing (``create_default_global_load_plan`` returns the plans it is given: "the default
load behavior involved no global coordination"), and the engine's storage readers'
``prepare_global_plan`` is the identity too. So :func:`load_state_dict` runs the same protocol
with the same planner and storage reader on each rank alone (a rank's plan needs nothing from
the others: ``.metadata``, handed over by the caller, and its own state dict), and what must stay
collective is settled in messages of a fixed size (:meth:`~ckpt_engine._dcpio.coordination.Comm.settle`):
one small int per rank after planning and one after reading, so rank 0 handles O(ranks) bytes
whatever the number of tensors; the failing rank with the lowest number then broadcasts its
error, raised on every rank as DCP's ``CheckpointException`` (the strict-mode error a rank
found, the same on every rank). A planner or reader that does override a global step gets DCP's
protocol unchanged: gather, global plan on rank 0, scatter.

Inside an engine load each collective is preceded by a bounded barrier (``collective_timeout_s``),
so a rank stuck in a hook (``remap_keys``, ``pre_load_plan``) or a read is named instead of
holding the others forever. With ``dedup_reads`` the read step first reads the stored items
several ranks need once, striped across them, and broadcasts them
(:mod:`~ckpt_engine._dcpio.dedup_read`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader

from .coordination import Comm, check_plans_agree
from .dedup_read import SharedReads, dedup_wanted
from .fast_read import FastFileSystemReader
from .hf_read import SafetensorsReader
from .object_read import ObjectStoreReader
from .planner import EngineLoadPlanner
from .watch import phase

__all__ = ["LoadStats", "load_state_dict", "plans_locally"]

#: Types no value of which is ``Stateful``: checked by ``type()`` first, because
#: ``isinstance(v, Stateful)`` (a runtime protocol) costs about 50 microseconds a value.
_NEVER_STATEFUL = frozenset({torch.Tensor, dict, list, tuple, int, float, str, bytes, bool, type(None)})
#: ``prepare_global_plan`` implementations that return the plans they are given.
_IDENTITY_GLOBAL = frozenset(
    {FileSystemReader.prepare_global_plan, ObjectStoreReader.prepare_global_plan, SafetensorsReader.prepare_global_plan}
)


def _is_stateful(value: Any) -> bool:
    return type(value) not in _NEVER_STATEFUL and isinstance(value, Stateful)


@dataclasses.dataclass
class LoadStats:
    """What one :func:`load_state_dict` did on this rank."""

    #: Bytes of data files this rank read from storage.
    bytes_read: int = 0
    #: Bytes this rank received from other ranks' reads instead (``dedup_reads``).
    bytes_received: int = 0
    #: Whether the plans went through rank 0 (a planner or reader with a global step of its own).
    central: bool = False


def plans_locally(planner: LoadPlanner, reader: StorageReader) -> bool:
    """Whether ``planner`` and ``reader`` leave DCP's global load step as the identity, so that
    each rank's local plan is its final plan (see the module docstring)."""
    return (
        type(planner).create_global_plan is DefaultLoadPlanner.create_global_plan
        and type(reader).prepare_global_plan in _IDENTITY_GLOBAL
    )


def _settle_plan(comm: Comm, planner: LoadPlanner, local_plan: LoadPlan) -> LoadPlan:
    """Each rank's own plan is its final one: settle the outcome, and (the engine's planner, with
    several ranks) that the ranks reading the same stored keys planned them alike."""
    if not isinstance(planner, EngineLoadPlanner) or comm.world == 1:
        return comm.settle("plan", local_plan)
    final, digests = comm.settle_with("plan", local_plan, planner.digest)
    check_plans_agree(comm, planner.component, planner.checkpoint_dir, digests, planner.plan_rows)
    return final


def load_state_dict(
    state_dict: dict[str, Any],
    *,
    storage_reader: StorageReader,
    planner: LoadPlanner,
    process_group: Any = None,
    dedup_reads: str = "off",
) -> LoadStats:
    """``dcp.load(state_dict, storage_reader=..., planner=..., process_group=...)``: loads in place.

    ``dedup_reads`` (``on``, ``off`` or ``auto``; see ``EngineConfig.dedup_reads``): read what
    several ranks need once and share it by broadcast."""
    comm = Comm(process_group)
    coordinator = comm.rank == 0
    keys = sorted(state_dict)  # as dcp.load: every rank plans its keys in the same order
    target = {k: (v.state_dict() if _is_stateful(v) else v) for k in keys for v in (state_dict[k],)}
    stats = LoadStats(central=not plans_locally(planner, storage_reader))

    def local_step() -> LoadPlan:
        phase("read metadata")
        metadata = storage_reader.read_metadata()
        phase("plan")
        planner.set_up_planner(target, metadata, coordinator)
        storage_reader.set_up_storage_reader(metadata, coordinator)
        plan = storage_reader.prepare_local_plan(planner.create_local_plan())
        return plan if stats.central else planner.finish_plan(plan)

    local_plan = comm.step("plan", local_step)
    if stats.central:

        def global_step(plans: list[LoadPlan]) -> list[LoadPlan]:
            return storage_reader.prepare_global_plan(planner.create_global_plan(plans))

        final = planner.finish_plan(comm.gather_scatter("plan", local_plan, global_step))
    else:
        final = _settle_plan(comm, planner, local_plan)

    shared = SharedReads(comm, storage_reader, dedup_wanted(dedup_reads, storage_reader, comm.world))

    def read_step() -> None:
        phase("read")
        if isinstance(storage_reader, (FastFileSystemReader, ObjectStoreReader)):  # shared reads leave the plan
            storage_reader.check_whole_files(final.items)
        # A broadcast that fails (a peer died or stopped) is held like any read error: the
        # closing agreement's bounded barrier then names the rank that is gone.
        rest = shared.read(final, planner)
        reads = storage_reader.read_data(rest, planner)
        reads.wait()

    comm.step("read", read_step)
    comm.settle("read", None)
    stats.bytes_read = shared.bytes_read + int(getattr(storage_reader, "bytes_read", 0))
    stats.bytes_received = shared.bytes_received
    for key in keys:  # as dcp.load: a Stateful loads in place, anything else is replaced
        value = state_dict[key]
        if _is_stateful(value):
            value.load_state_dict(target[key])
        else:
            state_dict[key] = target[key]
    return stats
