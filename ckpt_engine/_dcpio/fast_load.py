"""The engine's DCP load: DCP's load protocol, with its collectives bounded and observed.

``dcp.load`` runs the planner and storage-reader protocol (``read_metadata``,
``set_up_planner``, ``set_up_storage_reader``, ``create_local_plan``, ``prepare_local_plan``,
``create_global_plan``, ``prepare_global_plan``, ``finish_plan``, ``read_data``), which is
public API, between three collectives it runs itself: a gather of the local plans, a scatter of
the final ones and an all-gather after reading. :func:`load_state_dict` runs the same protocol
with the same planner and storage reader, and the collectives through
:class:`~ckpt_engine._dcpio.coordination.Comm`: inside an engine load each is preceded by a
bounded barrier, so a rank stuck in a hook (``remap_keys``, ``pre_load_plan``) or a read is
named within ``collective_timeout_s`` instead of holding the others forever. Errors of any rank
are raised on every rank as DCP's ``CheckpointException``, as ``dcp.load`` does.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.checkpoint.storage import StorageReader

from .coordination import Comm
from .watch import phase

__all__ = ["load_state_dict"]

#: Types no value of which is ``Stateful``: checked by ``type()`` first, because
#: ``isinstance(v, Stateful)`` (a runtime protocol) costs about 50 microseconds a value.
_NEVER_STATEFUL = frozenset({torch.Tensor, dict, list, tuple, int, float, str, bytes, bool, type(None)})


def _is_stateful(value: Any) -> bool:
    return type(value) not in _NEVER_STATEFUL and isinstance(value, Stateful)


def load_state_dict(
    state_dict: dict[str, Any],
    *,
    storage_reader: StorageReader,
    planner: LoadPlanner,
    process_group: Any = None,
) -> None:
    """``dcp.load(state_dict, storage_reader=..., planner=..., process_group=...)``: loads in place."""
    comm = Comm(process_group)
    coordinator = comm.rank == 0
    keys = sorted(state_dict)  # as dcp.load: every rank plans its keys in the same order
    target = {k: (v.state_dict() if _is_stateful(v) else v) for k in keys for v in (state_dict[k],)}

    def local_step() -> LoadPlan:
        phase("read metadata")
        metadata = storage_reader.read_metadata()
        phase("plan")
        planner.set_up_planner(target, metadata, coordinator)
        storage_reader.set_up_storage_reader(metadata, coordinator)
        return storage_reader.prepare_local_plan(planner.create_local_plan())

    def global_step(plans: list[LoadPlan]) -> list[LoadPlan]:
        return storage_reader.prepare_global_plan(planner.create_global_plan(plans))

    local_plan = comm.step("plan", local_step)
    central = comm.gather_scatter("plan", local_plan, global_step)

    def read_step() -> None:
        phase("read")
        reads = storage_reader.read_data(planner.finish_plan(central), planner)
        reads.wait()

    comm.step("read", read_step)
    comm.all_gather("read", None)
    for key in keys:  # as dcp.load: a Stateful loads in place, anything else is replaced
        value = state_dict[key]
        if _is_stateful(value):
            value.load_state_dict(target[key])
        else:
            state_dict[key] = target[key]
