"""The resharding recovery: a resume on another world size, ``ranks_per_node`` or node count from
the node-local tier's surviving copies, resharded into the new layout by DCP's load.

Run by every rank inside a load when :func:`~.recovery.recover` finds no step of this job's shape,
or an older one than the newest of another shape (:func:`survey`, step 1, says which):

1. each rank lists every rank folder on its node (its own copies and the replicas it keeps, of
   any world size) from ``durable`` on; one all-gather gives every rank every copy, and the
   lineage rule (:mod:`.lineage`) sets aside what a resume may not take, and so is a save that
   holds state saved per rank (``Manifest.per_rank``: a data position, expert weights that
   differed across the ranks): merged, every new rank would get the lowest old rank's copy, so
   that resume reads ``save_dir``, whose load refuses it or lets the object re-partition it;
2. the newest save whose every old rank's part has a copy on some node (one save of the step on
   every part, one world size) is chosen, the same on every rank, and each part is served by one
   of the ranks that hold it (:func:`assign_servers`: spread over them);
3. each part's server broadcasts the part's manifest and ``.metadata`` files (raw bytes, checked
   against the manifest's checksums, parsed by the engine's metadata reader, never unpickled);
4. each rank builds its resharded folder (``<local_dir>/.ckpt_engine_reshard/rank_<r>/iter_X``):
   per component the combined ``.metadata`` of the old ranks' parts (every chunk of every global
   tensor once; a value several parts hold from the lowest old rank, as DCP's save keeps it),
   checked as any global checkpoint's is, the parts' data files under new names (a hard link
   where this node holds the part, else a sparse file of its size), and a manifest naming them
   with the parts' sizes and block digests.

The load then reads that folder with DCP's resharding load through
:class:`~.reshard_read.TierReader`, which receives what this node lacks from the servers, once
per byte and rank (:mod:`.reshard_read`). A failure on any rank in steps 3-4 is agreed: every
rank returns ``None`` and the load reads ``save_dir``.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    Metadata,
)

from .._dcpio import dist as _dist
from .._dcpio.torch_private import pickle_metadata
from .._dcpio.watch import active_watch, c10d_failure
from .._format import bounded_json
from .._format.hashing import new_hasher
from .._format.layout import remove_tree
from .._format.manifest import FileEntry, Manifest, new_manifest, parse_manifest, write_manifest
from .._format.metadata_read import read_metadata, validate_metadata
from .._format.names import METADATA_FILE, iter_dirname, parse_rank_dirname, rank_dirname
from ..errors import CkptEngineError, CorruptCheckpointError, clip
from .folders import Held, held_checkpoints
from .lineage import Announced, Durable, admissible, node_committed
from .recovery import Recovered
from .reshard_meta import item_digests, merge_metadata
from .reshard_read import Exchange, PartFile

__all__ = ["RESHARD_DIR", "TierSurvey", "assign_servers", "clear_folder", "reshard", "survey"]

logger = logging.getLogger("ckpt_engine")

#: The folder inside ``local_dir`` that holds each rank's resharded folder while it loads.
RESHARD_DIR = ".ckpt_engine_reshard"
#: The most bytes of manifest and ``.metadata`` one part's server broadcasts.
_MAX_PART_BYTES = 1 << 31


@dataclass(frozen=True)
class _Copy:
    """A copy one rank announces, with the world size of the job that saved it and the
    components it holds per rank (``Manifest.per_rank``)."""

    announced: Announced
    world: int
    per_rank: tuple[str, ...] = ()


@dataclass(frozen=True)
class _Part:
    """One old rank's part as its server sent it."""

    manifest: Manifest
    metadata: dict[str, Metadata]
    #: By component: ``[fqn, offsets, digest]`` of its small items.
    digests: dict[str, list[list[Any]]]


@dataclass(frozen=True)
class _Plan:
    iteration: int
    save_id: str | None
    #: The world size of the job that saved it.
    world: int
    #: Old rank -> the ranks holding a copy of its part.
    holders: dict[int, list[int]]


@dataclass(frozen=True)
class TierSurvey:
    """What :func:`survey` found: this node's copies from ``save_dir``'s latest on, and the save
    a resharding resume takes (``None``: none is held for every rank of the job that made it)."""

    mine: dict[tuple[int, int], Held]
    plan: _Plan | None

    @property
    def newest(self) -> tuple[int, int] | None:
        """The iteration and world size of that save: a resume on this job's shape asks whether a
        newer step of another shape is there (a job that ran on fewer ranks for a while)."""
        return None if self.plan is None else (self.plan.iteration, self.plan.world)


def survey(local_dir: str, durable: Durable | None) -> TierSurvey:
    """The tier's copies of any world size, as :func:`reshard` chooses among them (collective:
    every rank surveys its node; the plan is the same on every rank)."""
    rank = _dist.rank()
    mine = _survey(local_dir, durable)
    announced = [
        _Copy(Announced(rank, h.owner, h.iteration, h.manifest.lineage), h.manifest.world_size, h.manifest.per_rank)
        for h in mine.values()
    ]
    gathered = _dist.all_gather_object((announced, node_committed(local_dir)), step="local tier: reshard holdings")
    copies = [c for held, _ in gathered for c in held]
    kept, _ = admissible(durable, [c.announced for c in copies], [c for _, committed in gathered for c in committed])
    per_rank = {(c.announced.iteration, c.announced.save_id): c for c in copies if c.per_rank}
    if per_rank and rank == 0:
        shown = ", ".join(f"{c.announced.iteration} ({', '.join(c.per_rank)})" for c in per_rank.values())
        logger.warning(
            "local tier: not resharding the steps that hold state saved per rank, step(s) %s: each rank's "
            "part holds its own, which no other layout can split; the resume reads save_dir",
            shown,
        )
    kept = [c for c in kept if (c.iteration, c.save_id) not in per_rank]
    worlds = {(c.announced.holder, c.announced.owner, c.announced.iteration): c.world for c in copies}
    return TierSurvey(mine, _choose(kept, worlds))


def reshard(local_dir: str, found: TierSurvey, *, sync: bool) -> Recovered | None:
    """The step this rank resumes by resharding the local tier's copies :func:`survey` ``found``,
    and its resharded folder, or ``None`` (see the module)."""
    rank = _dist.rank()
    mine, plan = found.mine, found.plan
    if plan is None:
        return None
    servers = assign_servers(plan.holders)
    folder = os.path.join(local_dir, RESHARD_DIR, rank_dirname(rank))
    error: str | None = None
    try:
        clear_folder(folder)
    except OSError as err:
        error = f"cannot clear {folder}: {err}"
    parts, problem = _share_parts(plan, servers, mine, folder)
    error = error or problem
    exchange = None
    if error is None:
        try:
            exchange = _build(folder, plan, parts, mine, servers, sync)
        except (OSError, CkptEngineError) as err:
            error = clip(str(err), 300)
    failed = [(r, e) for r, e in enumerate(_dist.all_gather_object(error, step="local tier: reshard folders")) if e]
    if failed:
        try:
            clear_folder(folder)
        except OSError:  # the next resharding load clears it first
            logger.warning("local tier: could not remove %s", folder, exc_info=True)
        if rank == 0:
            logger.warning(
                "local tier: iteration %d cannot be resharded (rank %d: %s); resuming from save_dir",
                plan.iteration,
                *failed[0],
            )
        return None
    assert exchange is not None
    if rank == 0:
        logger.info(
            "local tier: resharding iteration %d, saved by %d ranks, into %d (parts served by ranks %s)",
            plan.iteration,
            plan.world,
            _dist.world_size(),
            sorted(set(servers.values())),
        )
    return Recovered(plan.iteration, exchange.folder, rank, reshard=exchange)


def clear_folder(folder: str) -> None:
    """Remove ``folder`` (what a killed resharding load left, or a finished one's), if it exists."""
    if os.path.lexists(folder):
        remove_tree(folder)


def _survey(local_dir: str, durable: Durable | None) -> dict[tuple[int, int], Held]:
    """Every committed copy in this node's rank folders from ``durable`` on, of any world size,
    by ``(owner, iteration)``."""
    if durable is None:
        return {}
    try:
        names = sorted(os.listdir(local_dir))
    except OSError:
        return {}
    out: dict[tuple[int, int], Held] = {}
    for name in names:
        owner = parse_rank_dirname(name)
        if owner is not None:
            for held in held_checkpoints(local_dir, owner, None, since=durable.iteration):
                out.setdefault((owner, held.iteration), held)
    return out


def _choose(kept: list[Announced], worlds: dict[tuple[int, int, int], int]) -> _Plan | None:
    """The newest save every old rank's part is held for (one save id, one world size)."""
    saves: dict[tuple[int, str, int], dict[int, set[int]]] = {}
    for c in kept:
        world = worlds[(c.holder, c.owner, c.iteration)]
        if c.owner < world:
            saves.setdefault((c.iteration, c.save_id or "", world), {}).setdefault(c.owner, set()).add(c.holder)
    for (iteration, save_id, world), held in sorted(saves.items(), reverse=True):
        if len(held) == world:
            return _Plan(iteration, save_id or None, world, {o: sorted(h) for o, h in held.items()})
    return None


def assign_servers(holders: dict[int, list[int]]) -> dict[int, int]:
    """Old rank -> the rank that serves its part: of those holding it, the one serving fewest
    parts so far (the lowest rank of a tie), so the reads spread over the nodes that survive."""
    load: Counter[int] = Counter()
    out = {}
    for owner in sorted(holders):
        server = min(holders[owner], key=lambda h: (load[h], h))
        load[server] += 1
        out[owner] = server
    return out


def _share_parts(
    plan: _Plan, servers: dict[int, int], mine: dict[tuple[int, int], Held], folder: str
) -> tuple[dict[int, _Part], str | None]:
    """Every part's manifest and ``.metadata`` files, broadcast by its server (every rank takes
    part in every broadcast, whatever failed here): by old rank, and the first problem here."""
    rank = _dist.rank()
    watch = active_watch()
    group = watch.group if watch is not None else None
    step = "local tier: reshard metadata"
    if watch is not None:
        watch.barrier(step)
    out: dict[int, _Part] = {}
    problem: str | None = None
    for owner in range(plan.world):
        server = servers[owner]
        payload = _payload(mine[(owner, plan.iteration)]) if server == rank else b""
        try:
            data = _broadcast(group, server, payload)
        except Exception as err:
            if watch is not None and c10d_failure(err):
                raise watch.broken(step, err) from err
            raise
        if problem is None:
            try:
                out[owner] = _part(data, owner, plan, os.path.join(folder, "parts", str(owner)))
            except (OSError, CkptEngineError) as err:
                problem = f"the part of rank {owner} sent by rank {server} is refused: {clip(str(err), 200)}"
    return out, problem


def _payload(held: Held) -> bytes:
    """A part's manifest (JSON), its ``.metadata`` files in component order, and its small items'
    digests (JSON, :func:`~.reshard_meta.item_digests`), each length first."""
    algorithm = held.manifest.algorithm
    assert algorithm is not None
    try:
        pieces = [held.manifest.to_json().encode("utf-8")]
        digests = {}
        for component in held.manifest.components:
            with open(os.path.join(held.path, component, METADATA_FILE), "rb") as f:
                pieces.append(f.read())
            folder = os.path.join(held.path, component)
            digests[component] = item_digests(folder, read_metadata(folder), algorithm)
        pieces.append(json.dumps(digests).encode("utf-8"))
    except (OSError, CkptEngineError):
        return b""  # the receivers refuse the empty part; the failure is agreed
    return b"".join(len(p).to_bytes(8, "big") + p for p in pieces)


def _broadcast(group: Any, src: int, data: bytes) -> bytes:
    """``data`` of rank ``src`` on every rank: its length, then its raw bytes (never unpickled)."""
    if not _dist.initialized():
        return data
    root = dist.get_global_rank(group, src) if group is not None else src
    size = torch.tensor([len(data)], dtype=torch.int64)
    dist.broadcast(size, src=root, group=group)
    n = int(size.item())
    if not 0 <= n <= _MAX_PART_BYTES:
        raise CorruptCheckpointError(f"rank {src} announced a part's metadata of {n} bytes; at most {_MAX_PART_BYTES}")
    buf = (
        torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if _dist.rank() == src
        else torch.empty(n, dtype=torch.uint8)
    )
    if n:
        dist.broadcast(buf, src=root, group=group)
    return data if _dist.rank() == src else buf.numpy().tobytes()


def _split(data: bytes) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        n = int.from_bytes(data[at : at + 8], "big")
        if at + 8 + n > len(data):
            raise CorruptCheckpointError("a part's metadata is cut short")
        out.append(data[at + 8 : at + 8 + n])
        at += 8 + n
    return out


def _part(data: bytes, owner: int, plan: _Plan, where: str) -> _Part:
    """Rank ``owner``'s part as its server sent it: the manifest checked against the plan, each
    ``.metadata`` against the manifest's size and checksum, then read by the engine's reader."""
    pieces = _split(data)
    if not pieces:
        raise CorruptCheckpointError("its server could not read it")
    manifest = parse_manifest(pieces[0], f"the manifest of rank {owner}'s iteration {plan.iteration}")
    save_id = None if manifest.lineage is None else manifest.lineage.save_id
    if (manifest.rank, manifest.iteration, manifest.world_size, save_id) != (
        owner,
        plan.iteration,
        plan.world,
        plan.save_id,
    ):
        raise CorruptCheckpointError(f"it is rank {manifest.rank}'s iteration {manifest.iteration} (save {save_id})")
    if manifest.algorithm is None or len(pieces) != 2 + len(manifest.components):
        raise CorruptCheckpointError("it lacks checksums or a component's metadata")
    out = {}
    for component, raw in zip(manifest.components, pieces[1:-1], strict=True):
        entry = manifest.files.get(f"{component}/{METADATA_FILE}")
        hasher = new_hasher(manifest.algorithm)
        if entry is None or hasher is None or entry.size != len(raw):
            raise CorruptCheckpointError(f"{component}/{METADATA_FILE} is not the one its manifest lists")
        hasher.update(raw)
        if hasher.hexdigest() != entry.checksum:
            raise CorruptCheckpointError(f"{component}/{METADATA_FILE} does not match its manifest's checksum")
        os.makedirs(os.path.join(where, component), exist_ok=True)
        with open(os.path.join(where, component, METADATA_FILE), "wb") as f:
            f.write(raw)
        out[component] = read_metadata(os.path.join(where, component))
    return _Part(manifest, out, _digests(pieces[-1], manifest.components))


def _digests(raw: bytes, components: tuple[str, ...]) -> dict[str, list[list[Any]]]:
    """The items' digests a server sent, checked to be ``{component: [[fqn, offsets, digest]]}``."""
    try:
        doc = bounded_json.loads(raw, max_depth=5, max_int_digits=24, constants=False)
    except bounded_json.JSONRefused as err:
        raise CorruptCheckpointError(f"its items' digests are refused: {err}") from None
    ok = isinstance(doc, dict) and set(doc) == set(components)
    for items in doc.values() if ok else ():
        ok = ok and isinstance(items, list) and all(_digest_ok(i) for i in items)
    if not ok:
        raise CorruptCheckpointError("its items' digests are malformed")
    return doc  # type: ignore[no-any-return]


def _digest_ok(item: Any) -> bool:
    if not isinstance(item, list) or len(item) != 3 or not isinstance(item[0], str) or not isinstance(item[2], str):
        return False
    return item[1] is None or (isinstance(item[1], list) and all(type(o) is int for o in item[1]))


def _build(
    folder: str,
    plan: _Plan,
    parts: dict[int, _Part],
    mine: dict[tuple[int, int], Held],
    servers: dict[int, int],
    sync: bool,
) -> Exchange:
    """This rank's resharded folder (see the module, step 4) and the exchange that fills it."""
    first = parts[0].manifest
    if any(
        p.manifest.components != first.components or p.manifest.algorithm != first.algorithm for p in parts.values()
    ):
        raise CorruptCheckpointError(f"the old ranks' parts of iteration {plan.iteration} hold different components")
    assert first.algorithm is not None
    ckpt = os.path.join(folder, iter_dirname(plan.iteration))
    entries: dict[str, FileEntry] = {}
    files: dict[str, PartFile] = {}
    for component in first.components:
        merged, names = merge_metadata(
            {o: p.metadata[component] for o, p in parts.items()}, {o: p.digests[component] for o, p in parts.items()}
        )
        validate_metadata(merged, os.path.join(ckpt, component))
        os.makedirs(os.path.join(ckpt, component))
        raw = pickle_metadata(merged)
        with open(os.path.join(ckpt, component, METADATA_FILE), "wb") as f:
            f.write(raw)
        hasher = new_hasher(first.algorithm)
        assert hasher is not None
        hasher.update(raw)
        entries[f"{component}/{METADATA_FILE}"] = FileEntry(len(raw), hasher.hexdigest())
        for new, (owner, name) in names.items():
            rel = f"{component}/{name}"
            entry = parts[owner].manifest.files.get(rel)
            if entry is None or entry.checksum is None:
                raise CorruptCheckpointError(f"rank {owner}'s manifest of iteration {plan.iteration} lacks {rel}")
            held = mine.get((owner, plan.iteration))
            at = None if held is None else os.path.join(held.path, component, name)
            files[f"{component}/{new}"] = _place(os.path.join(ckpt, component, new), at, owner, rel, entry)
            entries[f"{component}/{new}"] = FileEntry(entry.size, entry.checksum, blocks=entry.blocks)
    lineage = first.lineage
    write_manifest(
        ckpt,
        new_manifest(
            plan.iteration,
            _dist.world_size(),
            first.components,
            first.algorithm,
            entries,
            rank=_dist.rank(),
            lineage=lineage,
        ),
    )
    return Exchange(files, servers, ckpt, first.algorithm, sync)


def _place(dest: str, held_at: str | None, owner: int, rel: str, entry: FileEntry) -> PartFile:
    """The resharded folder's stand-in for a part's data file: a hard link to this node's copy,
    else a sparse file of its size that the exchange fills."""
    if held_at is not None:
        try:
            os.link(held_at, dest)
        except OSError:
            held_at = None
    if held_at is None:
        with open(dest, "wb") as f:
            f.truncate(entry.size)
    if entry.blocks:
        starts = [0]
        for n, _ in entry.blocks:
            starts.append(starts[-1] + n)
        digests = tuple(d for _, d in entry.blocks)
    else:
        starts, digests = [0, entry.size], (entry.checksum or "",)
    return PartFile(owner, rel, entry.size, tuple(starts), digests, held_at)
