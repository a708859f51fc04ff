"""Which of the node-local tier's copies a resume may take: those of ``save_dir``'s run that
descend from its latest step (DESIGN section 12), and the reasons the others are set aside.

Every committed step records its :class:`~ckpt_engine._format.manifest.Lineage`: the run, the
save that made it and the durable step it descends from. A copy in the tier (a rank's own, or a
peer's replica) is taken only when

* ``save_dir`` has a latest step, or at least the run's id (:data:`RUN_FILE`, written by the
  run's first save): an empty ``save_dir`` is a fresh start, whatever the tier holds;
* it belongs to the run of ``save_dir``'s latest (another job's folders, a reused ``local_dir``);
* it was not saved into this ``local_dir`` for another ``save_dir`` (:func:`place_of`, as rank 0
  names the two folders): a job started from a copy of another job's ``save_dir`` carries that
  job's run, and does not take the steps the other job saved past the copy into the ``local_dir``
  they share (a ``save_dir`` moved alone is another place too: its tier steps are set aside, never
  mixed in; one moved or copied with its ``local_dir`` is judged by its run, as before);
* it is that latest step's own save (at the same iteration), or a newer step whose parent is that
  save or that is a later save of the engine instance that made it (a ``save_dir`` rolled back, or
  replaced by another run's checkpoints, is not descended from); with no durable step yet, any
  step of the run that descends from none;
* no copy made by the same engine instance descends from a durable step newer than ``save_dir``'s
  latest, and rank 0 recorded no such commit of that instance (:data:`COMMITTED_FILE`, written in
  its folder after a durable commit): either shows ``save_dir`` was rolled back past that
  instance's saves. The record covers the instance's last durable step, which no later copy
  descends from (a job whose last save was durable, then ``save_dir`` rolled back); without it a
  step whose durable commit did not finish (a crash while it was written) is still resumed;
* no later engine instance of the run went on from an older step (a fork, :data:`RUN_FILE`) and
  saved a step of its own (a copy, or ``save_dir``'s latest): an engine records, at its first save
  and before it commits anything, the step it went on from (the one it resumed, else the one before
  its first save). A copy of an earlier instance newer than such a fork's step is a future that
  training abandoned (a fork of a job that committed nothing, or an instance whose own record could
  not be written, changes nothing): a job resumed on fewer ranks from
  ``save_dir`` (the tier's newer steps did not fit it) that saved steps of its own, then came back
  on the old ranks, took the abandoned steps back and discarded its own training.

Copies without a lineage (written before lineages were recorded) are judged by iteration alone,
as before, when ``save_dir``'s latest has none either; otherwise they are set aside.

The rule imports no torch: ``ckpt-engine ls --local-dir`` applies it to one node's copies to say
which step a resume takes (``_inspect/tier_listing``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from .._format import bounded_json
from .._format.manifest import Lineage, Place, lookup_manifest
from .._format.names import parse_iteration, parse_rank_dirname
from .._storage.store import Store
from .._storage.urls import is_url, local_path
from ..errors import CkptEngineError, clip

__all__ = [
    "COMMITTED_FILE",
    "RUN_FILE",
    "Announced",
    "Committed",
    "Durable",
    "abandoned",
    "admissible",
    "describe_set_aside",
    "durable_view",
    "node_committed",
    "note_committed",
    "place_of",
    "read_committed",
    "read_run",
    "read_run_record",
    "saved_elsewhere",
    "write_run",
]

#: The run's id in ``save_dir``, written by the run's first save (before any durable step exists:
#: a run that has saved only to the tier so far is still known by ``save_dir``), and its forks:
#: ``[engine instance, the step it went on from]``, oldest first, one per engine that saved.
RUN_FILE = ".ckpt_engine_run.json"
_RUN_ID = re.compile(r"^[0-9a-f]{1,64}$")
#: Forks the run file keeps (the newest); an instance whose fork was dropped is judged as one
#: that recorded none (:func:`abandoned`).
_MAX_FORKS = 64
_MAX_RUN_BYTES = 16 << 10


#: In rank 0's ``local_dir`` folder (rank 0 makes every durable commit): the newest durable step
#: each engine instance of a run committed, written after the commit (:func:`note_committed`).
COMMITTED_FILE = ".ckpt_engine_committed.json"
#: Instances a record keeps (the newest); each is about 120 bytes.
_MAX_COMMITTED = 16
_MAX_COMMITTED_BYTES = 64 << 10


@dataclass(frozen=True)
class Committed:
    """A durable step engine instance ``instance`` of run ``run_id`` committed."""

    run_id: str
    instance: str
    iteration: int


def note_committed(folder: str, lineage: Lineage, iteration: int) -> None:
    """Record in ``folder`` (a rank's ``local_dir`` folder) that ``lineage``'s engine instance
    committed durable step ``iteration``: the file is replaced whole (a crash leaves the old one)."""
    kept = {c.instance: c for c in read_committed(folder) if c.instance != lineage.instance}
    entries = [*kept.values(), Committed(lineage.run_id, lineage.instance, iteration)][-_MAX_COMMITTED:]
    doc = {"committed": [{"run_id": c.run_id, "instance": c.instance, "iteration": c.iteration} for c in entries]}
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, COMMITTED_FILE)
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "w") as f:
        json.dump(doc, f)
    os.replace(partial, path)


def read_committed(folder: str) -> list[Committed]:
    """The records :func:`note_committed` left in ``folder`` (none where it is missing, too
    large or not such a record: an aid to the rule, never a reason to fail a resume)."""
    try:
        with open(os.path.join(folder, COMMITTED_FILE), "rb") as f:
            raw = f.read(_MAX_COMMITTED_BYTES + 1)
        doc = bounded_json.loads(raw, max_depth=4, max_int_digits=24) if len(raw) <= _MAX_COMMITTED_BYTES else None
    except (OSError, ValueError):  # bounded_json.JSONRefused is a ValueError
        return []
    entries = doc.get("committed") if isinstance(doc, dict) else None
    out = []
    for e in entries[:_MAX_COMMITTED] if isinstance(entries, list) else []:
        if not isinstance(e, dict):
            continue
        run, instance, iteration = e.get("run_id"), e.get("instance"), e.get("iteration")
        if isinstance(run, str) and isinstance(instance, str) and type(iteration) is int:
            out.append(Committed(run, instance, iteration))
    return out


def node_committed(local_dir: str) -> list[Committed]:
    """The records in every rank folder of this node's ``local_dir`` (a replaced node's ranks
    have none; the others', gathered, cover them)."""
    try:
        names = sorted(os.listdir(local_dir))
    except OSError:
        return []
    return [c for n in names if parse_rank_dirname(n) is not None for c in read_committed(os.path.join(local_dir, n))]


def place_of(save_dir: str, local_dir: str) -> Place:
    """Where a save is made, as a lineage records it: each folder's URL without its trailing
    ``/``, else its absolute path (a ``file://`` URL's too) and its real path (symbolic links
    resolved)."""

    def where(folder: str) -> tuple[str, str]:
        if is_url(folder):
            return folder.rstrip("/"), folder.rstrip("/")
        spelled = os.path.abspath(local_path(folder))
        return spelled, os.path.realpath(spelled)

    (save, real_save), (local, real_local) = where(save_dir), where(local_dir)
    return Place(save, local, real_save, real_local)


@dataclass(frozen=True)
class Durable:
    """``save_dir``'s latest step as one rank sees it: its iteration and lineage; or, where it
    holds no checkpoint yet, only its run (``iteration`` ``None``, from :data:`RUN_FILE`); and
    where ``save_dir`` and ``local_dir`` are (:func:`place_of`, rank 0's; ``None``: not known)."""

    iteration: int | None
    lineage: Lineage | None
    run_only: str | None = None
    place: Place | None = None
    #: The run's forks (:data:`RUN_FILE`), oldest first: ``(instance, the step it went on from)``.
    forks: tuple[tuple[str, int], ...] = ()

    @property
    def run_id(self) -> str | None:
        return self.lineage.run_id if self.lineage is not None else self.run_only


def read_run(save_dir: str, store: Store) -> str | None:
    """The run id :data:`RUN_FILE` in ``save_dir`` records (``None``: none, or not readable)."""
    return read_run_record(save_dir, store)[0]


def read_run_record(save_dir: str, store: Store) -> tuple[str | None, tuple[tuple[str, int], ...]]:
    """The run id and the forks :data:`RUN_FILE` in ``save_dir`` records (``(None, ())``: none, or
    not readable; a malformed fork is left out)."""
    try:
        raw = store.read_bytes(store.join(save_dir, RUN_FILE), _MAX_RUN_BYTES)
        doc = bounded_json.loads(raw, max_depth=4, max_int_digits=24)
    except Exception:  # missing, unreadable or not (bounded) JSON: no run recorded
        return None, ()
    run = doc.get("run_id") if isinstance(doc, dict) else None
    if not (isinstance(run, str) and _RUN_ID.fullmatch(run)):
        return None, ()
    entries = doc.get("forks")
    forks = tuple(
        (e[0], e[1])
        for e in (entries[-_MAX_FORKS:] if isinstance(entries, list) else [])
        if isinstance(e, list)
        and len(e) == 2
        and isinstance(e[0], str)
        and _RUN_ID.fullmatch(e[0])
        and type(e[1]) is int
    )
    return run, forks


def write_run(save_dir: str, store: Store, run_id: str, fork: tuple[str, int] | None = None) -> None:
    """Record ``run_id`` as ``save_dir``'s run (:data:`RUN_FILE`), and ``fork`` after the forks it
    records for that run."""
    run, forks = read_run_record(save_dir, store)
    kept = list(forks) if run == run_id else []
    if fork is not None:
        kept.append(fork)
    if store.capabilities.local_files:
        os.makedirs(save_dir, exist_ok=True)
    doc = {"run_id": run_id, "forks": [list(f) for f in kept[-_MAX_FORKS:]]}
    store.write_bytes(store.join(save_dir, RUN_FILE), json.dumps(doc).encode())


def abandoned(
    forks: tuple[tuple[str, int], ...], instance: str, iteration: int, live: Iterable[str] | None = None
) -> bool:
    """Whether step ``iteration`` saved by engine ``instance`` is of a future training abandoned:
    an instance recorded after it went on from an older step and saved a step of its own (one of
    ``live``, the instances with a copy or ``save_dir``'s latest; ``None``: any). A fork of a job
    that committed nothing (it stopped in its first save) abandons nothing; an instance the forks
    do not record (its record could not be written, or it saved before forks were recorded) is
    judged by the other rules alone."""
    mine = next((k for k in range(len(forks) - 1, -1, -1) if forks[k][0] == instance), None)
    if mine is None:
        return False
    saved = None if live is None else set(live)
    return any(start < iteration and (saved is None or inst in saved) for inst, start in forks[mine + 1 :])


def durable_view(
    load_dir: str, store: Store, names: Iterable[str | None], place: Place | None = None
) -> Durable | None:
    """``save_dir``'s latest step among the checkpoint folders ``names`` (``latest``, a committed
    one it does not name yet), with the lineage its manifest records; without one, the run its
    first save recorded (``None``: neither, a fresh start). ``place``: where ``save_dir`` and the
    tier are, as rank 0 names them (every rank must judge by the same names).
    A manifest that cannot be read counts as one without a lineage: the load from ``save_dir``
    reports what is wrong with it."""
    found = [(it, n) for n in names if n is not None and (it := parse_iteration(n)) is not None]
    run, forks = read_run_record(load_dir, store)
    if not found:  # no step yet: the run, if one has saved to its tier
        return None if run is None else Durable(None, None, run, place, forks)
    iteration, name = max(found)
    try:
        manifest = lookup_manifest(store.join(load_dir, name), store).manifest
    except (OSError, CkptEngineError):
        manifest = None
    lineage = None if manifest is None else manifest.lineage
    same_run = lineage is None or run == lineage.run_id
    return Durable(iteration, lineage, place=place, forks=forks if same_run else ())


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


def admissible(
    durable: Durable | None, copies: list[Announced], committed: Iterable[Committed] = ()
) -> tuple[list[Announced], dict[str, list[Announced]]]:
    """The copies a resume may take given ``save_dir``'s latest ``durable`` and the durable steps
    the ranks recorded as ``committed``, and the others, set aside, by reason (copies older than
    ``durable`` are neither: they are simply not wanted)."""
    if durable is None:
        return [], ({"save_dir holds no checkpoint and no run (a fresh start)": list(copies)} if copies else {})
    kept: list[Announced] = []
    aside: dict[str, list[Announced]] = {}
    rolled_back = _rolled_back_instances(durable, copies, committed)
    live = {c.lineage.instance for c in copies if c.lineage is not None}
    if durable.lineage is not None:
        live.add(durable.lineage.instance)
    for copy in copies:
        if durable.iteration is not None and copy.iteration < durable.iteration:
            continue
        reason = _reason(durable, copy, rolled_back, live)
        if reason is None:
            kept.append(copy)
        else:
            aside.setdefault(reason, []).append(copy)
    return kept, aside


def _rolled_back_instances(durable: Durable, copies: list[Announced], committed: Iterable[Committed]) -> set[str]:
    """Engine instances of ``durable``'s run that committed a durable step newer than it (any, where
    ``save_dir`` holds none): a copy descends from one, or a rank recorded its commit."""
    if durable.run_id is None:
        return set()

    def newer(iteration: int) -> bool:
        return durable.iteration is None or iteration > durable.iteration

    return {
        c.lineage.instance
        for c in copies
        if c.lineage is not None
        and c.lineage.run_id == durable.run_id
        and c.lineage.parent_iteration is not None
        and newer(c.lineage.parent_iteration)
    } | {c.instance for c in committed if c.run_id == durable.run_id and newer(c.iteration)}


_ABANDONED = "a later job of the run went on from an older step (this step's future was abandoned)"


def _reason(durable: Durable, copy: Announced, rolled_back: set[str], live: set[str]) -> str | None:
    """Why ``copy`` (at least as new as ``durable``) may not be taken, or ``None``."""
    ours, theirs = durable.lineage, copy.lineage
    if durable.iteration is None:  # the run is known, none of its steps is durable yet
        if theirs is None or theirs.run_id != durable.run_id:
            return "another run"
        if _elsewhere(durable, theirs):
            return _elsewhere_reason(theirs)
        if abandoned(durable.forks, theirs.instance, copy.iteration, live):
            return _ABANDONED
        return "save_dir was rolled back past its saves" if theirs.instance in rolled_back else None
    if ours is None or theirs is None:
        if ours is None and theirs is None:
            return None
        return "save_dir's latest records no run" if ours is None else "it records no run"
    if theirs.run_id != ours.run_id:
        return "another run"
    if _elsewhere(durable, theirs):
        return _elsewhere_reason(theirs)
    if abandoned(durable.forks, theirs.instance, copy.iteration, live):
        return _ABANDONED
    if copy.iteration == durable.iteration:
        return None if theirs.save_id == ours.save_id else "another save of save_dir's latest step"
    if theirs.instance in rolled_back:
        return "save_dir was rolled back past its saves"
    if theirs.parent_save_id != ours.save_id and not _later_save(ours, theirs):
        return "it does not descend from save_dir's latest"
    return None


def saved_elsewhere(theirs: Place | None, ours: Place | None) -> bool:
    """Whether a step saved at ``theirs`` was saved into the ``local_dir`` of ``ours`` for another
    ``save_dir``. A tier moved or copied with its ``save_dir`` (its own ``local_dir`` elsewhere),
    and steps that record no place (saved before places were recorded), are judged by their run
    alone."""
    if ours is None or theirs is None:
        return False
    return theirs.same_local_dir(ours) and not theirs.same_save_dir(ours)


def _elsewhere(durable: Durable, theirs: Lineage) -> bool:
    return saved_elsewhere(theirs.place, durable.place)


def _elsewhere_reason(theirs: Lineage) -> str:
    assert theirs.place is not None
    return f"saved for another save_dir, {clip(theirs.place.save_dir, 200)} (a copy or a move of this one)"


def _later_save(ours: Lineage, theirs: Lineage) -> bool:
    """Whether ``theirs`` is a later save of the engine instance that made ``ours``: its saves
    follow one another, so it descends from ``ours`` whatever parent it recorded. A save begun
    while the durable commit of ``ours`` was still running (an asynchronous save with two staging
    buffers) recorded the durable step before it."""
    if theirs.instance != ours.instance:
        return False
    mine, later = ours.save_id.rsplit("-", 1)[-1], theirs.save_id.rsplit("-", 1)[-1]
    return mine.isdigit() and later.isdigit() and int(later) > int(mine)


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
