"""The node-local tier as this node holds it (``local_dir``): one row per iteration with the ranks
whose checkpoints are here (their own, and the replicas this node keeps), its size, whether each
copy is complete, and whether ``save_dir`` holds that iteration too (durable): what
``ckpt-engine ls SAVE_DIR --local-dir LOCAL_DIR`` adds under ``save_dir``'s table."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .._format.names import parse_rank_dirname
from .files import human_bytes, table
from .listing import SaveDirListing, list_save_dir

__all__ = ["LocalTierListing", "list_local_tier", "local_tier_table"]


@dataclass
class LocalTierListing:
    """The iterations of one node's ``local_dir``, oldest first."""

    local_dir: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def problem(self) -> bool:
        return bool(self.warnings) or any(r["incomplete"] for r in self.rows)


def list_local_tier(local_dir: str, durable: SaveDirListing | None, *, verify: bool = False) -> LocalTierListing:
    """Every ``rank_*`` folder of ``local_dir`` listed as a save folder, grouped by iteration;
    an iteration is durable where ``durable`` (``save_dir``'s listing) has it committed whole."""
    listing = LocalTierListing(local_dir)
    if not os.path.isdir(local_dir):
        listing.warnings.append(f"warning: {local_dir} does not exist")
        return listing
    safe = {r["iteration"] for r in durable.rows if r["status"] in ("verified", "complete")} if durable else set()
    by_iteration: dict[int, dict[str, Any]] = {}
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
            elif r["status"] != "uncommitted":
                row["incomplete"].append({"rank": rank, "status": r["status"], "problems": r["problems"][:1]})
            else:
                row.setdefault("in_flight", []).append(rank)
    for it in sorted(by_iteration):
        row = by_iteration[it]
        row["durable"] = it in safe
        row.setdefault("in_flight", [])
        listing.rows.append(row)
    return listing


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
    """The rows as a text table under a heading naming the folder."""
    lines = [f"local tier in {listing.local_dir} (this node: its ranks' own checkpoints and the replicas it keeps)"]
    if not listing.rows:
        return [*lines, "no checkpoints", *listing.warnings]
    body = []
    for r in listing.rows:
        status = "complete"
        if r["incomplete"]:
            status = "INCOMPLETE: rank " + _ranks([i["rank"] for i in r["incomplete"]])
        elif r["in_flight"]:
            status = "in flight: rank " + _ranks(r["in_flight"])
        body.append(
            [str(r["iteration"]), _ranks(r["ranks"]), human_bytes(r["bytes"]), status, "yes" if r["durable"] else "no"]
        )
    lines += table(body, ["iteration", "ranks here", "size", "status", "durable"], right=(0, 2))
    return [*lines, *listing.warnings]
