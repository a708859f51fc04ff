"""``ema``: load EMA weights into the regular weights (the original's ``load_ema_to_reg``).

Diffusion training keeps an exponential moving average of the network next to it, under its own
prefix (``net.*`` and ``net_ema.*``); the EMA weights are usually the better starting point.
This plugin edits the key map of the ``model`` component on load:

* **model without an EMA copy** (no destination key under ``ema_prefix``): ``net.X`` is read
  from the checkpoint's ``net_ema.X``;
* **model with an EMA copy** (its state dict has keys under ``ema_prefix``): only ``net_ema.X``
  is read, into both ``net.X`` and ``net_ema.X``. The engine reads each storage key once and
  copies it to every destination; the checkpoint's ``net.*`` keys are reported as unexpected.

``direction: reg_to_ema`` does the reverse, for starting an EMA from a pretrained model: the
EMA copy ``net_ema.X`` is read from the checkpoint's ``net.X`` (and ``net.X`` from ``net.X``).

A checkpoint without a single key under the prefix it reads from is an error naming that prefix:
silently loading the regular weights instead of the EMA ones would go unnoticed.

It applies on a warm start only (``RemapContext.warm_start``: a load by the ``load_path`` rule),
as the original's: a resume of the run from its own checkpoints restores the regular weights as
they were saved (with their optimizer state), never the EMA copy over them. ``when: every_load``
applies it to every load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckpt_engine import CheckpointLoadError, RemapContext, hookimpl

__all__ = ["EmaKeysNotFoundError", "EmaPlugin"]


class EmaKeysNotFoundError(CheckpointLoadError):
    """The checkpoint (or the model) has no key under the prefix the ``ema`` plugin needs."""


class EmaPlugin:
    """Remap ``net.*`` <-> ``net_ema.*`` on load."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        reg_prefix: str = Field(default="net.", min_length=1, description="Prefix of the regular weights.")
        ema_prefix: str = Field(default="net_ema.", min_length=1, description="Prefix of the EMA weights.")
        direction: Literal["ema_to_reg", "reg_to_ema"] = Field(
            default="ema_to_reg",
            description="`ema_to_reg`: the regular weights (and the EMA copy, if any) are read from the "
            "checkpoint's EMA weights. `reg_to_ema`: the EMA copy is read from the regular weights.",
        )
        components: tuple[str, ...] = Field(default=("model",), description="Components it applies to.")
        when: Literal["warm_start", "every_load"] = Field(
            default="warm_start",
            description="`warm_start`: only a load by the `load_path` rule (a resume restores the weights as saved). "
            "`every_load`: resumes too.",
        )

        @model_validator(mode="after")
        def _distinct_prefixes(self) -> EmaPlugin.Options:
            reg, ema = self.reg_prefix, self.ema_prefix
            if reg.startswith(ema) or ema.startswith(reg):
                raise ValueError(
                    f"reg_prefix {reg!r} and ema_prefix {ema!r} overlap (one starts with the other), so a key "
                    "cannot be told apart; end both with '.', e.g. 'net.' and 'net_ema.'"
                )
            return self

    def __init__(self, options: Options) -> None:
        self.options = options

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> dict[str, str] | None:
        if ctx.direction != "load" or ctx.component not in self.options.components:
            return None
        if not ctx.warm_start and self.options.when == "warm_start":
            ctx.note("not applied: this load resumes the run (applies on a load_path warm start; when: every_load)")
            return None
        storage_keys = ctx.storage_keys or frozenset()
        reg, ema = self.options.reg_prefix, self.options.ema_prefix
        rewrite: tuple[str, ...]
        if self.options.direction == "ema_to_reg":
            # Destinations under either prefix read the EMA weights.
            source, rewrite = ema, (reg, ema)
        else:
            # The EMA copy reads the regular weights; the regular weights stay as they are.
            source, rewrite = reg, (ema,)
        where = f"component {ctx.component!r} of {ctx.checkpoint_path}"
        if not any(k.startswith(source) for k in storage_keys):
            raise EmaKeysNotFoundError(
                f"plugin 'ema' ({self.options.direction}): the checkpoint ({where}) has no key under "
                f"{source!r}, so there are no {'EMA' if source == ema else 'regular'} weights to load; "
                f"its keys start with {_prefixes(storage_keys)}. Set the plugin's "
                f"{'ema_prefix' if source == ema else 'reg_prefix'} option, or disable the plugin"
            )
        if not any(dest.startswith(rewrite) for dest in key_map):
            wanted = " or ".join(repr(p) for p in rewrite)
            raise EmaKeysNotFoundError(
                f"plugin 'ema' ({self.options.direction}): the model has no key under {wanted} ({where}); "
                f"its keys start with {_prefixes(key_map)}. Set the plugin's prefixes to the model's, "
                "or disable the plugin"
            )
        out: dict[str, str] = {}
        for dest, storage in key_map.items():
            for prefix in rewrite:
                if storage.startswith(prefix):
                    storage = source + storage[len(prefix) :]
                    break
            out[dest] = storage
        return out


def _prefixes(keys: frozenset[str] | Mapping[str, str], limit: int = 6) -> str:
    firsts = sorted({k.split(".", 1)[0] + "." for k in keys})
    if not firsts:
        return "(nothing: it is empty)"
    shown = ", ".join(repr(p) for p in firsts[:limit])
    return shown + (f" and {len(firsts) - limit} more" if len(firsts) > limit else "")
