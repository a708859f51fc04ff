"""The node-local tier as this node holds it (``local_dir``): one row per iteration with the ranks
whose checkpoints are here (their own, and the replicas this node keeps), its size, whether each
copy is complete, whether ``save_dir`` holds that iteration too (durable), and which step a resume
takes, from which tier, by the resume's own rule (:mod:`.._tier.lineage`): what
``ckpt-engine ls SAVE_DIR --local-dir LOCAL_DIR`` adds under ``save_dir``'s table."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from .._engine.resave import newest_unnamed
from .._format.manifest import lookup_manifest
from .._format.names import parse_rank_dirname
from .._storage.store import open_store
from .._tier.lineage import Announced, Committed, Durable, admissible, durable_view, node_committed, place_of
from ..errors import CkptEngineError
from .files import human_bytes, table
from .listing import SaveDirListing, list_save_dir

__all__ = ["LocalTierListing", "list_local_tier", "local_tier_table"]


@dataclass
class LocalTierListing:
    """The iterations of one node's ``local_dir``, oldest first."""

    local_dir: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: The step a resume takes and from which tier (:func:`resume_plan`).
    resume: dict[str, Any] = field(default_factory=dict)
    #: The copies a resume sets aside: ``{"iteration", "rank", "reason"}`` each.
    set_aside: list[dict[str, Any]] = field(default_factory=list)

    @property
    def problem(self) -> bool:
        return bool(self.warnings) or any(r["incomplete"] for r in self.rows)


def list_local_tier(local_dir: str, durable: SaveDirListing | None, *, verify: bool = False) -> LocalTierListing:
    """Every ``rank_*`` folder of ``local_dir`` listed as a save folder, grouped by iteration;
    an iteration is durable where ``durable`` (``save_dir``'s listing) has it committed whole."""
    listing = LocalTierListing(local_dir)
    if not os.path.isdir(local_dir):
        listing.warnings.append(f"warning: {local_dir} does not exist")
        listing.resume, listing.set_aside = resume_plan(_durable(durable, local_dir), [], {})
        return listing
    safe = {r["iteration"] for r in durable.rows if r["status"] in ("verified", "complete")} if durable else set()
    by_iteration: dict[int, dict[str, Any]] = {}
    copies: list[Announced] = []
    worlds: dict[tuple[int, int], int] = {}
    for name in sorted(os.listdir(local_dir)):
        rank = parse_rank_dirname(name)
        if rank is None or not os.path.isdir(os.path.join(local_dir, name)):
            continue
        folder = list_save_dir(os.path.join(local_dir, name), verify=verify)
        listing.warnings += [f"rank {rank}: {w}" for w in folder.warnings]
        for r in folder.rows:
            row = by_iteration.setdefault(
                r["iteration"], {"iteration": r["iteration"], "ranks": [], "bytes": 0, "incomplete": []}
            )
            if r["status"] in ("verified", "complete"):
                row["ranks"].append(rank)
                row["bytes"] += r["bytes"]
                copies += _announced(rank, r["iteration"], r["path"], worlds)
            elif r["status"] != "uncommitted":
                row["incomplete"].append({"rank": rank, "status": r["status"], "problems": r["problems"][:1]})
            else:
                row.setdefault("in_flight", []).append(rank)
    listing.resume, listing.set_aside = resume_plan(
        _durable(durable, local_dir), copies, worlds, node_committed(local_dir)
    )
    for it in sorted(by_iteration):
        row = by_iteration[it]
        row["durable"] = it in safe
        row.setdefault("in_flight", [])
        row["resume"] = listing.resume.get("tier") == "local" and listing.resume["iteration"] == it
        row["set_aside"] = sorted({a["rank"] for a in listing.set_aside if a["iteration"] == it})
        listing.rows.append(row)
    return listing


def _announced(rank: int, iteration: int, path: str, worlds: dict[tuple[int, int], int]) -> list[Announced]:
    """Rank ``rank``'s committed copy at ``path`` as the recovery planner announces it, with its
    lineage (none: a copy the planner would not use, its manifest naming another rank); the world
    size its manifest records goes into ``worlds``."""
    try:
        manifest = lookup_manifest(path).manifest
    except (OSError, CkptEngineError):
        return []
    if manifest is None or manifest.rank != rank or manifest.iteration != iteration or manifest.algorithm is None:
        return []
    worlds[(rank, iteration)] = manifest.world_size
    # This node's folder of ``rank``: its own copy or a replica; either serves a resume alike.
    return [Announced(rank, rank, iteration, manifest.lineage)]


def _durable(listing: SaveDirListing | None, local_dir: str) -> Durable | None:
    """``save_dir``'s latest step as a resume with this ``local_dir`` sees it (the loader's rule)."""
    if listing is None:
        return None
    store = open_store(listing.save_dir)
    try:
        unnamed = newest_unnamed(listing.save_dir, store, listing.latest)
    except (OSError, CkptEngineError):
        unnamed = None
    return durable_view(listing.save_dir, store, (listing.latest, unnamed), place_of(listing.save_dir, local_dir))


def resume_plan(
    durable: Durable | None,
    copies: list[Announced],
    worlds: dict[tuple[int, int], int],
    committed: Iterable[Committed] = (),
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The step a resume takes given ``save_dir``'s latest ``durable`` and this node's ``copies``,
    and the copies it sets aside, by :func:`~.._tier.lineage.admissible` (the resume's rule): the
    newest save of ``save_dir``'s run descending from its latest, from the local tier, if every
    rank's part of it is held (the ranks this node lacks must be on the others: the planner agrees
    across all ranks); with none, ``save_dir``'s latest, or a fresh start."""
    kept, aside = admissible(durable, copies, committed)
    set_aside = sorted(
        ({"iteration": c.iteration, "rank": c.owner, "reason": reason} for reason, cs in aside.items() for c in cs),
        key=lambda a: (a["iteration"], a["rank"]),
    )
    if kept:
        newest = max((c.iteration, c.save_id or "") for c in kept)
        ranks = sorted({c.owner for c in kept if (c.iteration, c.save_id or "") == newest})
        world = max(worlds.get((r, newest[0]), 1) for r in ranks)
        return {
            "tier": "local",
            "iteration": newest[0],
            "save_id": newest[1] or None,
            "ranks_here": ranks,
            "world_size": world,
            "other_ranks": [r for r in range(world) if r not in ranks],
            "save_dir_iteration": None if durable is None else durable.iteration,
        }, set_aside
    if durable is None or durable.iteration is None:
        return {"tier": None, "iteration": None}, set_aside
    return {"tier": "save_dir", "iteration": durable.iteration}, set_aside


def _ranks(ranks: list[int]) -> str:
    """``0-3, 6`` for ``[0, 1, 2, 3, 6]``."""
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs) or "-"


def local_tier_table(listing: LocalTierListing) -> list[str]:
    """The rows as a text table under a heading naming the folder, the step a resume takes and the
    copies it sets aside."""
    lines = [f"local tier in {listing.local_dir} (this node: its ranks' own checkpoints and the replicas it keeps)"]
    if not listing.rows:
        return [*lines, "no checkpoints", *_resume_lines(listing), *listing.warnings]
    body = []
    for r in listing.rows:
        status = "complete"
        if r["incomplete"]:
            status = "INCOMPLETE: rank " + _ranks([i["rank"] for i in r["incomplete"]])
        elif r["in_flight"]:
            status = "in flight: rank " + _ranks(r["in_flight"])
        mark = "<- resume" if r["resume"] else ""
        if r["set_aside"]:
            mark = ", ".join(filter(None, [mark, "set aside: rank " + _ranks(r["set_aside"])]))
        body.append(
            [
                str(r["iteration"]),
                _ranks(r["ranks"]),
                human_bytes(r["bytes"]),
                status,
                "yes" if r["durable"] else "no",
                mark,
            ]
        )
    lines += table(body, ["iteration", "ranks here", "size", "status", "durable", ""], right=(0, 2))
    return [*lines, *_resume_lines(listing), *listing.warnings]


def _resume_lines(listing: LocalTierListing) -> list[str]:
    """Which step a resume takes and from which tier, and the copies it sets aside, and why."""
    plan = listing.resume
    if plan.get("tier") == "local":
        lines = [f"resume -> iteration {plan['iteration']} from the local tier"]
        if plan["other_ranks"]:
            durable = plan["save_dir_iteration"]
            fallback = "a fresh start" if durable is None else f"save_dir's iteration {durable}"
            lines[0] += (
                f" if every rank holds its part: this node holds rank(s) {_ranks(plan['ranks_here'])} of "
                f"{plan['world_size']}; rank(s) {_ranks(plan['other_ranks'])} must be on other nodes (the ranks "
                f"agree on the newest step held for every rank; else an older one of the tier, or {fallback})"
            )
        else:
            lines[0] += f" (this node holds every rank's part: {_ranks(plan['ranks_here'])})"
    elif plan.get("tier") == "save_dir":
        lines = [
            f"resume -> iteration {plan['iteration']} from save_dir: the local tier holds no step of "
            "save_dir's run at least as new that descends from it"
        ]
    else:
        lines = ["resume -> a fresh start: save_dir holds no checkpoint and no run"]
    by_reason: dict[str, list[dict[str, Any]]] = {}
    for a in listing.set_aside:
        by_reason.setdefault(a["reason"], []).append(a)
    for reason, copies in sorted(by_reason.items()):
        its = ", ".join(map(str, sorted({a["iteration"] for a in copies})))
        ranks = _ranks(sorted({a["rank"] for a in copies}))
        lines.append(f"set aside ({reason}): iteration(s) {its} of rank(s) {ranks}")
    return lines
