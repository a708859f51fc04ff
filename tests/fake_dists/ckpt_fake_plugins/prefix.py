"""A third-party key-remap plugin with options."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from ckpt_engine import RemapContext, hookimpl


class PrefixRemap:
    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)
        prefix: str = "module."

    def __init__(self, options: Options) -> None:
        self.options = options

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> dict[str, str]:
        return {dest: self.options.prefix + storage for dest, storage in key_map.items()}


def not_a_plugin() -> None:
    """An entry point that names a function: the loader must refuse it."""
