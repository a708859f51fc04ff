"""Two providers of the same hook: enabling both is a config error."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpt_engine import SaveContext, StagedState, hookimpl


class StagerA:
    @hookimpl
    def stage(self, ctx: SaveContext, state: Mapping[str, dict[str, Any]]) -> StagedState:
        return StagedState(components=dict(state), is_copy=False)


class StagerB(StagerA):
    pass
