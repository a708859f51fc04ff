"""``te_extra_state``: skip Transformer-Engine ``_extra_state`` entries on load.

Transformer Engine keeps FP8 metadata in ``<module>._extra_state``; its size changes between TE
versions and breaks strict loads. The original checkpointer always skipped these entries, so
this plugin is on by default; list it with ``enabled: false`` to load extra state like any
other value. Dict-valued extra state, which DCP flattens to ``x._extra_state.<field>``, is
skipped too. The module keeps its own extra state.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from ckpt_engine import Decision, LoadContext, PlanEntry, hookimpl


class TeExtraStatePlugin:
    """Mark every entry with an ``_extra_state`` path segment as skipped."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        segment: str = Field(default="_extra_state", min_length=1, description="Key segment to skip.")
        components: tuple[str, ...] = Field(default=("model",), description="Components it applies to.")

    def __init__(self, options: Options) -> None:
        self.options = options

    def _matches(self, key: str) -> bool:
        return self.options.segment in key.split(".")

    @hookimpl
    def pre_load_plan(self, ctx: LoadContext, entries: tuple[PlanEntry, ...]) -> Sequence[PlanEntry] | None:
        if ctx.component not in self.options.components:
            return None
        reason = "Transformer-Engine extra state is not restored (te_extra_state)"
        return [e.skip(reason) if e.decision is not Decision.SKIP and self._matches(e.dest_key) else e for e in entries]
