"""The load report: what happened to every key of every component."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ComponentReport", "LoadReport", "OverlapRecord", "SkipRecord", "collapse_keys"]


@dataclass(frozen=True, slots=True, kw_only=True)
class SkipRecord:
    reason: str
    #: The plugin that decided to skip, or ``None`` for the engine (non-strict mode).
    plugin: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class OverlapRecord:
    saved_shape: tuple[int, ...]
    target_shape: tuple[int, ...]
    plugin: str | None = None
    reason: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class ComponentReport:
    """Per-key outcome of loading one component.

    Every destination key is in exactly one of ``loaded``, ``overlap``, ``skipped``, ``missing``,
    ``tied``; every storage key is read by some entry or listed in ``unexpected``, but for those
    the load never asks for (an optimizer's hyper-parameters under all but each group's first
    parameter, which torch does not use: ``_engine.state.load_template``).
    """

    component: str
    checkpoint_dir: str
    loaded: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()
    unexpected: tuple[str, ...] = ()
    skipped: Mapping[str, SkipRecord] = field(default_factory=dict)
    overlap: Mapping[str, OverlapRecord] = field(default_factory=dict)
    #: destination key -> storage key, for every entry whose keys differ.
    renamed: Mapping[str, str] = field(default_factory=dict)
    #: destination key -> (stored dtype, target dtype), for values cast on load.
    cast: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    #: What plugins said about this load (``RemapContext.note``), each prefixed with the plugin's name.
    notes: tuple[str, ...] = ()
    #: destination key -> its twin, for keys the checkpoint lacks that are the same tensor as a key
    #: it loads (a tie in the model, e.g. ``lm_head.weight`` is ``embed_tokens.weight``): filled
    #: through the twin, never missing.
    tied: Mapping[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "component": self.component,
            "checkpoint_dir": self.checkpoint_dir,
            "loaded": list(self.loaded),
            "missing": list(self.missing),
            "unexpected": list(self.unexpected),
            "skipped": {k: {"reason": v.reason, "plugin": v.plugin} for k, v in self.skipped.items()},
            "overlap": {
                k: {
                    "saved_shape": list(v.saved_shape),
                    "target_shape": list(v.target_shape),
                    "plugin": v.plugin,
                    "reason": v.reason,
                }
                for k, v in self.overlap.items()
            },
            "renamed": dict(self.renamed),
            "cast": {k: list(v) for k, v in self.cast.items()},
            "notes": list(self.notes),
            "tied": dict(self.tied),
        }

    def summary_lines(self, threshold: int = 8) -> list[str]:
        head = (
            f"{self.component}: {len(self.loaded)} loaded, {len(self.overlap)} overlap, "
            f"{len(self.skipped)} skipped, {len(self.missing)} missing, {len(self.unexpected)} unexpected"
        )
        if self.tied:
            head += f", {len(self.tied)} tied"
        lines = [head]
        lines += [f"  note: {n}" for n in self.notes]
        if self.renamed:
            pairs = sorted({_rename_rule(d, s) for d, s in self.renamed.items()})
            lines += [f"  renamed {p}" for p in pairs[:threshold]]
            if len(pairs) > threshold:
                lines.append(f"  ... and {len(pairs) - threshold} more rename patterns")
        # Skips are grouped by who decided; a large group is one line with a count and an example
        # (reasons often differ per key only in the shapes they quote).
        by_plugin: dict[str, list[str]] = {}
        for key, rec in self.skipped.items():
            by_plugin.setdefault(rec.plugin or "engine", []).append(key)
        for who, keys in sorted(by_plugin.items()):
            keys.sort()
            patterns = index_patterns(keys)
            if len(keys) > threshold:
                example = keys[0]
                collapsed = collapse_keys(keys, threshold)
                if len(collapsed) > threshold:  # many top-level keys (a Sequential): one pattern per layer kind
                    collapsed = [f"{p} ({len(m)} keys)" if len(m) > 1 else p for p, m in patterns.items()]
                    collapsed = collapsed[:threshold] + (
                        [f"... {len(collapsed) - threshold} more"] * (len(collapsed) > threshold)
                    )
                groups = ", ".join(collapsed)
                lines.append(
                    f"  skipped by {who}: {len(keys)} keys ({groups}); e.g. {example}: {self.skipped[example].reason}"
                )
                continue
            for pattern, members in patterns.items():
                first = members[0]
                if len(members) == 1:
                    lines.append(f"  skipped by {who}: {first}: {self.skipped[first].reason}")
                else:  # the same key in every layer: one line
                    reason = self.skipped[first].reason
                    lines.append(f"  skipped by {who}: {pattern} ({len(members)} keys); e.g. {first}: {reason}")
        overlaps = sorted(self.overlap.items())
        shown = overlaps if len(overlaps) <= threshold else overlaps[:threshold]
        for key, ov in shown:
            lines.append(f"  overlap: {key} saved {list(ov.saved_shape)} -> target {list(ov.target_shape)}")
        if len(overlaps) > len(shown):
            lines.append(f"  ... and {len(overlaps) - len(shown)} more overlap-loaded keys")
        lines += [f"  tied: {dest} is {twin}" for dest, twin in sorted(self.tied.items())[:threshold]]
        if len(self.tied) > threshold:
            lines.append(f"  ... and {len(self.tied) - threshold} more tied keys")
        lines += [f"  missing: {g}" for g in collapse_keys(self.missing, threshold)]
        lines += [f"  unexpected: {g}" for g in collapse_keys(self.unexpected, threshold)]
        if self.cast:
            casts: dict[tuple[str, str], list[str]] = {}
            for key, pair in self.cast.items():
                casts.setdefault(pair, []).append(key)
            for (src, dst), keys in sorted(casts.items()):
                lines += [f"  cast {src} -> {dst}: {g}" for g in collapse_keys(keys, threshold)]
        return lines


def _rename_rule(dest: str, storage: str) -> str:
    """Collapse ``net.a.b <- net_ema.a.b`` into ``net.* <- net_ema.*`` where the suffixes agree."""
    d_parts, s_parts = dest.split("."), storage.split(".")
    common = 0
    while common < min(len(d_parts), len(s_parts)) - 1 and d_parts[-1 - common] == s_parts[-1 - common]:
        common += 1
    if common == 0:
        return f"{dest} <- {storage}"
    return f"{'.'.join(d_parts[:-common])}.* <- {'.'.join(s_parts[:-common])}.*"


_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")


def index_patterns(keys: Iterable[str]) -> dict[str, list[str]]:
    """Keys grouped by their shape with numeric segments as ``*`` (``layers.3._extra_state`` ->
    ``layers.*._extra_state``), in the order of their first key."""
    groups: dict[str, list[str]] = {}
    for key in keys:
        groups.setdefault(_INDEX.sub("*", key), []).append(key)
    return groups


def collapse_keys(keys: Iterable[str], threshold: int = 8) -> list[str]:
    """Group keys by their first dotted segment; groups larger than ``threshold`` become one line."""
    groups: dict[str, list[str]] = {}
    for key in sorted(keys):
        groups.setdefault(key.split(".", 1)[0], []).append(key)
    out: list[str] = []
    for prefix, members in groups.items():
        if len(members) > threshold:
            out.append(f"{prefix}.* ({len(members)} keys)")
        else:
            out.extend(members)
    return out


class LoadReport(Mapping[str, ComponentReport]):
    """``report[component]`` -> :class:`ComponentReport`, in load order."""

    def __init__(self, components: Mapping[str, ComponentReport] | None = None) -> None:
        self._components: dict[str, ComponentReport] = dict(components or {})

    def __getitem__(self, component: str) -> ComponentReport:
        return self._components[component]

    def __iter__(self) -> Iterator[str]:
        return iter(self._components)

    def __len__(self) -> int:
        return len(self._components)

    def __repr__(self) -> str:
        return f"LoadReport({list(self._components)})"

    def summary(self, threshold: int = 8) -> str:
        if not self._components:
            return "nothing loaded"
        return "\n".join(line for rep in self._components.values() for line in rep.summary_lines(threshold))

    def to_dict(self) -> dict[str, Any]:
        return {name: rep.to_dict() for name, rep in self._components.items()}
