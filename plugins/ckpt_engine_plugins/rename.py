"""``rename``: load checkpoint keys under one prefix into model keys under another.

A rule ``{checkpoint: "encoder.", model: "backbone."}`` reads the model's ``backbone.X`` from the
checkpoint's ``encoder.X``. Either prefix may be empty: ``{checkpoint: "module.", model: ""}``
reads a checkpoint written from a DDP-wrapped model (``module.X``) into the bare model (``X``).

One rule renames a model and its optimizer state alike. The ``optim`` component's flattened keys
embed the parameter names (``state.<fqn>.<stat>``, ``param_groups.<fqn>.<option>``), and rules
apply to what follows ``state.`` / ``param_groups.``; other components' keys are matched whole.

* Rules are tried in order; the first whose model side matches a key renames it; keys no rule
  matches keep their name. A rule with equal prefixes (``{checkpoint: "lm_head.", model:
  "lm_head."}``) keeps the keys it matches out of the rules after it.
* A rule may match by regular expression instead: ``{model_regex: "^layers\\.(\\d+)\\.attn\\.",
  checkpoint: "model.layers.\\1.self_attn."}`` replaces the first match (``re.search``) with the
  ``checkpoint`` template (``\\1`` is a group). For ``optim`` keys the pattern sees
  ``<fqn>.<stat>``.
* A rule that renames no key the checkpoint has is reported in the load report's ``notes``; the
  renames themselves are all in ``renamed`` (model key -> checkpoint key). A renamed key the
  checkpoint lacks is an ordinary missing key (``backbone.w (reads encoder.w)``).
* Only loads are renamed; saves keep the model's own keys.
* A resume (``RemapContext.warm_start`` false: the run's own checkpoints) reads a key the
  checkpoint holds under the key's own name as saved, whatever the rules say: the run's saves
  since the rename wrote the new names. So a run started from a checkpoint of the old names
  (``load_path``), or renamed mid-run and resumed once from its own older checkpoint, never reads
  the old names again once it has saved the new ones. A warm start applies every rule.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ckpt_engine import RemapContext, hookimpl

__all__ = ["RenamePlugin", "RenameRule"]

#: Prefixes of the flattened optimizer keys that embed a parameter name.
OPTIM_HEADS = ("state.", "param_groups.")


class RenameRule(BaseModel):
    """Model keys under ``model`` (or matching ``model_regex``) read checkpoint keys from ``checkpoint``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    checkpoint: str = Field(
        description="Checkpoint-side prefix; with `model_regex`, the replacement template (`\\1` for groups)."
    )
    model: str | None = Field(default=None, description="Model-side prefix (may be empty: every key).")
    model_regex: str | None = Field(
        default=None, description="Instead of `model`: a regular expression searched in the model key."
    )

    @model_validator(mode="after")
    def _one_side(self) -> RenameRule:
        if (self.model is None) == (self.model_regex is None):
            raise ValueError("a rule needs exactly one of `model` (a prefix) and `model_regex`")
        if self.model_regex is not None:
            try:
                re.compile(self.model_regex)
            except re.error as err:
                raise ValueError(f"model_regex {self.model_regex!r} is not a valid regular expression: {err}") from err
        elif self.model == "" and self.checkpoint == "":
            raise ValueError("a rule with two empty prefixes renames nothing")
        return self

    def describe(self) -> str:
        if self.model_regex is not None:
            return f"model_regex {self.model_regex!r} -> checkpoint {self.checkpoint!r}"
        return f"model {self.model!r} <- checkpoint {self.checkpoint!r}"

    def apply(self, name: str) -> str | None:
        """The checkpoint name for model-side ``name``, or ``None`` when this rule does not match."""
        if self.model_regex is not None:
            m = re.search(self.model_regex, name)
            if m is None:
                return None
            return name[: m.start()] + m.expand(self.checkpoint) + name[m.end() :]
        assert self.model is not None
        if not name.startswith(self.model):
            return None
        return self.checkpoint + name[len(self.model) :]


class RenamePlugin:
    """Rename keys on load by prefix (or regex) rules, consistently for model and optimizer state."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        rules: tuple[RenameRule, ...] = Field(min_length=1, description="Rename rules, tried in order.")
        components: tuple[str, ...] = Field(
            default=("model", "optim"),
            description="Components it applies to; `optim` keys are renamed through their parameter names.",
        )

    def __init__(self, options: Options) -> None:
        self.options = options

    def _split(self, component: str, key: str) -> tuple[str, str] | None:
        """(head kept as is, the part the rules see), or ``None`` for a key no rule may touch."""
        if component != "optim":
            return "", key
        for head in OPTIM_HEADS:
            if key.startswith(head):
                return head, key[len(head) :]
        return None

    def _first(self, name: str) -> tuple[int, str] | None:
        """The first rule that matches ``name`` (its index) and what it renames it to (``None``:
        none matches)."""
        for i, rule in enumerate(self.options.rules):
            renamed = rule.apply(name)
            if renamed is not None:
                return i, renamed
        return None

    @hookimpl
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> dict[str, str] | None:
        if ctx.direction != "load" or ctx.component not in self.options.components:
            return None
        stored = ctx.storage_keys or frozenset()
        rules = self.options.rules
        matched = [0] * len(rules)  # keys each rule renamed
        found = [0] * len(rules)  # ... that the checkpoint has
        example: list[tuple[str, str] | None] = [None] * len(rules)
        out: dict[str, str] = {}
        as_saved = 0  # keys a resume reads under their own name
        for dest, storage in key_map.items():
            out[dest] = storage
            split = self._split(ctx.component, storage)
            if split is None:
                continue
            head, name = split
            hit = self._first(name)
            if hit is None:
                continue
            i, renamed = hit
            if not ctx.warm_start and storage in stored and renamed != name:
                as_saved += 1  # a resume reads what the run saved under this name
                continue
            out[dest] = head + renamed
            matched[i] += 1
            found[i] += out[dest] in stored
            example[i] = example[i] or (dest, out[dest])
        if as_saved:
            ctx.note(
                f"{as_saved} key(s) of component {ctx.component!r} that the rules match were read under their own "
                "names: this load resumes the run, and its checkpoint holds them as the run saved them"
            )
        for i, rule in enumerate(rules):
            if found[i] or (as_saved and not matched[i]):
                continue
            if not matched[i]:
                ctx.note(f"rule {i + 1} ({rule.describe()}) matched no key of component {ctx.component!r}")
            else:
                dest, storage = example[i] or ("", "")
                ctx.note(
                    f"rule {i + 1} ({rule.describe()}) renamed {matched[i]} key(s) of component {ctx.component!r}, "
                    f"but the checkpoint has none of them (e.g. {dest} reads {storage}); check the checkpoint prefix"
                )
        return out
