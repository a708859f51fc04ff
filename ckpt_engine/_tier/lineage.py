"""Which of the node-local tier's copies a resume may take: those of ``save_dir``'s run that
descend from its latest step (DESIGN section 12), and the reasons the others are set aside.

Every committed step records its :class:`~ckpt_engine._format.manifest.Lineage`: the run, the
save that made it and the durable step it descends from. A copy in the tier (a rank's own, or a
peer's replica) is taken only when

* ``save_dir`` has a latest step (an empty ``save_dir`` is a fresh start, whatever the tier holds);
* it belongs to the run of ``save_dir``'s latest (another job's folders, a reused ``local_dir``);
* it is that latest step's own save (at the same iteration), or a newer step whose parent is that
  save (a ``save_dir`` rolled back, or replaced by another run's checkpoints, is not descended from);
* no copy made by the same engine instance descends from a durable step newer than ``save_dir``'s
  latest (that instance's later saves show ``save_dir`` was rolled back past them).

Copies without a lineage (written before lineages were recorded) are judged by iteration alone,
as before, when ``save_dir``'s latest has none either; otherwise they are set aside.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._format.manifest import Lineage

__all__ = ["Announced", "Durable", "admissible", "describe_set_aside"]


@dataclass(frozen=True)
class Durable:
    """``save_dir``'s latest step as one rank sees it: its iteration and lineage."""

    iteration: int
    lineage: Lineage | None


@dataclass(frozen=True)
class Announced:
    """One copy a rank holds: rank ``holder``'s copy of rank ``owner``'s ``iteration``."""

    holder: int
    owner: int
    iteration: int
    lineage: Lineage | None

    @property
    def save_id(self) -> str | None:
        return None if self.lineage is None else self.lineage.save_id


def admissible(durable: Durable | None, copies: list[Announced]) -> tuple[list[Announced], dict[str, list[Announced]]]:
    """The copies a resume may take given ``save_dir``'s latest ``durable``, and the others, set
    aside, by reason (copies older than ``durable`` are neither: they are simply not wanted)."""
    if durable is None:
        return [], ({"save_dir holds no checkpoint (a fresh start)": list(copies)} if copies else {})
    kept: list[Announced] = []
    aside: dict[str, list[Announced]] = {}
    rolled_back = _rolled_back_instances(durable, copies)
    for copy in copies:
        if copy.iteration < durable.iteration:
            continue
        reason = _reason(durable, copy, rolled_back)
        if reason is None:
            kept.append(copy)
        else:
            aside.setdefault(reason, []).append(copy)
    return kept, aside


def _rolled_back_instances(durable: Durable, copies: list[Announced]) -> set[str]:
    """Engine instances of ``durable``'s run that committed a durable step newer than it."""
    if durable.lineage is None:
        return set()
    return {
        c.lineage.instance
        for c in copies
        if c.lineage is not None
        and c.lineage.run_id == durable.lineage.run_id
        and c.lineage.parent_iteration is not None
        and c.lineage.parent_iteration > durable.iteration
    }


def _reason(durable: Durable, copy: Announced, rolled_back: set[str]) -> str | None:
    """Why ``copy`` (at least as new as ``durable``) may not be taken, or ``None``."""
    ours, theirs = durable.lineage, copy.lineage
    if ours is None or theirs is None:
        if ours is None and theirs is None:
            return None
        return "save_dir's latest records no run" if ours is None else "it records no run"
    if theirs.run_id != ours.run_id:
        return "another run"
    if copy.iteration == durable.iteration:
        return None if theirs.save_id == ours.save_id else "another save of save_dir's latest step"
    if theirs.instance in rolled_back:
        return "save_dir was rolled back past its saves"
    if theirs.parent_save_id != ours.save_id:
        return "it does not descend from save_dir's latest"
    return None


def describe_set_aside(aside: dict[str, list[Announced]]) -> str:
    """One line naming the copies set aside and why."""
    parts = []
    for reason, copies in sorted(aside.items()):
        its = ", ".join(map(str, sorted({c.iteration for c in copies})))
        owners = ", ".join(map(str, sorted({c.owner for c in copies})))
        replicas = sum(c.holder != c.owner for c in copies)
        parts.append(
            f"{reason}: {len(copies)} copies ({replicas} of them replicas) of iteration(s) {its} of rank(s) {owners}"
        )
    return "; ".join(parts)
