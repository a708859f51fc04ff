"""``size_mismatch``: what to do with a tensor whose stored shape differs from the model's.

Policies (the original's ``dcp_allow_mismatched_size`` is ``overlap``):

* ``error`` (default): leave the entry unresolved; a strict load fails with every such key listed
  in one error, a non-strict load skips and reports it;
* ``skip``: read nothing; the destination keeps its current (initial) values;
* ``overlap``: read the region both shapes share (index 0 up to the smaller extent in every
  dimension); the rest of the destination keeps its values. A conv that gained input channels
  keeps the old channels' weights. Works for DTensor destinations sharded on any dimension and
  for checkpoints written by another world size. Only possible between two tensors with the
  same number of dimensions; otherwise the entry is skipped and the reason says why.

The policy can depend on the key: ``rules`` are ``{pattern, policy}`` pairs (``fnmatch`` globs on
the destination key), tried in order, the first match wins; a key no rule matches gets ``policy``
if it matches ``patterns`` (empty: every key), else ``error``. So ``{policy: overlap, patterns:
["*.stem.weight"]}`` limits overlap to the stem.

Only shape (and tensor-versus-value) mismatches are this plugin's business. A dtype difference
with equal shapes is loaded and cast to the destination dtype by the engine, and listed under
``cast`` in the load report; overlap reads are cast the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from fnmatch import fnmatchcase
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ckpt_engine import Decision, LoadContext, PlanEntry, hookimpl

__all__ = ["Policy", "SizeMismatchPlugin", "SizeMismatchRule"]

Policy = Literal["error", "skip", "overlap"]


class SizeMismatchRule(BaseModel):
    """One per-key rule: destination keys matching ``pattern`` get ``policy``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    pattern: str = Field(min_length=1, description="fnmatch glob on the destination key, e.g. '*.stem.weight'.")
    policy: Policy


class SizeMismatchPlugin:
    """Resolve shape mismatches by policy, optionally per key pattern."""

    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid", frozen=True)

        policy: Policy = Field(default="error", description="Policy for mismatched keys that no rule matches.")
        patterns: tuple[str, ...] = Field(
            default=(), description="Globs limiting `policy` to matching destination keys; empty: every key."
        )
        rules: tuple[SizeMismatchRule, ...] = Field(
            default=(), description="Per-pattern policies, tried in order before `policy`; first match wins."
        )
        components: tuple[str, ...] = Field(
            default=("model",), description="Components it applies to (e.g. add 'optim' for optimizer state)."
        )

    def __init__(self, options: Options) -> None:
        self.options = options

    def policy_for(self, key: str) -> Policy:
        """The policy that applies to destination key ``key``."""
        for rule in self.options.rules:
            if fnmatchcase(key, rule.pattern):
                return rule.policy
        patterns = self.options.patterns
        if not patterns or any(fnmatchcase(key, p) for p in patterns):
            return self.options.policy
        return "error"

    @hookimpl
    def pre_load_plan(self, ctx: LoadContext, entries: tuple[PlanEntry, ...]) -> Sequence[PlanEntry] | None:
        if ctx.component not in self.options.components:
            return None
        return [self._decide(e) if e.decision is Decision.MISMATCH else e for e in entries]

    def _decide(self, entry: PlanEntry) -> PlanEntry:
        policy = self.policy_for(entry.dest_key)
        if policy == "error":
            return entry
        stored, target = entry.stored, entry.target
        if stored is None:  # not a shape mismatch: the key is missing, which is not this plugin's call
            return entry
        shapes = f"saved {stored}, target {target}"
        if policy == "skip":
            return entry.skip(f"size_mismatch policy 'skip': {shapes}")
        if not (stored.is_tensor and target.is_tensor):
            return entry.skip(
                f"size_mismatch policy 'overlap' needs two tensors; {shapes}: skipped, the destination keeps its value"
            )
        if len(stored.shape or ()) != len(target.shape or ()):
            return entry.skip(
                f"size_mismatch policy 'overlap' needs the same number of dimensions; {shapes}: skipped, "
                "the destination keeps its values"
            )
        return entry.overlap(f"size_mismatch policy 'overlap': {shapes}")
