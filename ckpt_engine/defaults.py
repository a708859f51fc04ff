"""The engine's default ``stage`` and ``write`` providers.

They are implementations of the same hooks a plugin provides, registered in every plugin
manager under :data:`DEFAULT_PLUGIN_NAME`; the engine calls them when no enabled plugin
provides the hook.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._markers import hookimpl
from .storage import write_component
from .types import SaveContext, StagedState, WriteContext, WriteResult

DEFAULT_PLUGIN_NAME = "ckpt_engine.defaults"


class DefaultIO:
    """Synchronous staging and an in-process DCP ``FileSystemWriter`` (the subclass in
    ``_fast_write``, which writes the same format without a ``torch.save`` per tensor), driven
    by ``fast_save`` (DCP's save protocol, planned once per structure)."""

    @hookimpl
    def stage(self, ctx: SaveContext, state: Mapping[str, dict[str, Any]]) -> StagedState:
        # No copy: the default write finishes before save() returns, so the live state is the
        # point-in-time state. DCP itself moves device tensors to host while writing.
        return StagedState(components=dict(state), is_copy=False)

    @hookimpl
    def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> WriteResult:
        return write_component(
            state_dict,
            component=ctx.component,
            path=ctx.path,
            planner=ctx.planner,
            thread_count=ctx.thread_count,
            sync_files=ctx.sync_files,
            carry_over=ctx.carry_over,
            process_group=ctx.process_group,
        )
