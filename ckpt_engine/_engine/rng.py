"""The ``rng`` component (``EngineConfig.rng``, on by default): every rank's random state, so
that a resumed run draws the same random numbers as an uninterrupted one.

Each rank saves its Python (``random``), NumPy (global ``np.random``), torch CPU and, where CUDA
is present, every CUDA device's generator state under its own keys (``rank0.python.state``,
``rank1.torch_cpu``, ...), as accelerate's ``save_state`` does: DCP keeps one copy of a value
that several ranks save under one key. On load each rank reads its own keys back.

A resume into another world size (a resharding resume) is not refused: every rank the checkpoint
has state for takes it back, a new rank reads the lowest saved rank's state and reseeds all of
its generators from a digest of that state and its own rank (deterministic: the same checkpoint
and rank give the same draws), and one rank logs one warning that the run is no longer bit-exact.
A checkpoint saved without random state (``rng: false``, or before it was on by default) loads
with a warning and the generators as they are. An ``rng`` component that is not the engine's own
(the Hugging Face Trainer's) is still refused into another world size with
:class:`RngWorldSizeError`.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata

from .._dcpio import dist as _dist
from ..errors import CheckpointLoadError, ConfigError

__all__ = [
    "RNG_COMPONENT",
    "RngState",
    "RngWorldSizeError",
    "absent_rng_is_allowed",
    "check_saved_world_size",
    "ignored_rng_prefixes",
    "other_rank_prefixes",
    "prepare_rng_load",
    "with_rng",
]

logger = logging.getLogger("ckpt_engine")

#: The component folder (and ``extra=`` name) of the random state.
RNG_COMPONENT = "rng"

_RANK_KEY = re.compile(r"^rank(\d+)\.")


class RngWorldSizeError(CheckpointLoadError):
    """The checkpoint's random state was saved by a job with another number of ranks."""


def _numpy() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - numpy ships with torch's usual installs
        return None
    return numpy


class RngState:
    """A ``Stateful`` over this rank's generators; ``rank``/``world_size`` default to the process group's.

    Before a load, :func:`prepare_rng_load` says whose saved keys this rank reads (``source``:
    its own, or the lowest saved rank's on a rank the checkpoint has no state for, ``derive``)."""

    def __init__(self, rank: int | None = None, world_size: int | None = None) -> None:
        self.rank = _dist.rank() if rank is None else rank
        self.world_size = _dist.world_size() if world_size is None else world_size
        self.source = self.rank
        self.derive = False
        self.ignored: tuple[str, ...] | None = None

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = random.getstate()
        state: dict[str, Any] = {
            "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
            "torch_cpu": torch.get_rng_state(),
        }
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {
                "kind": str(kind),
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        if torch.cuda.is_available():
            state["cuda"] = {str(i): s for i, s in enumerate(torch.cuda.get_rng_state_all())}
        return {f"rank{self.source}": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = state_dict[f"rank{self.source}"]
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
        torch.set_rng_state(state["torch_cpu"])
        np = _numpy()
        if np is not None and "numpy" in state:
            n = state["numpy"]
            keys = n["keys"].numpy().astype("uint32")
            np.random.set_state((n["kind"], keys, int(n["pos"]), int(n["has_gauss"]), float(n["cached_gaussian"])))
        if "cuda" in state and torch.cuda.is_available():
            saved = [state["cuda"][str(i)] for i in range(len(state["cuda"]))]
            for i, s in enumerate(saved[: torch.cuda.device_count()]):
                torch.cuda.set_rng_state(s, i)
        if self.derive:
            reseed(derived_seed(state, self.rank))


def derived_seed(state: Mapping[str, Any], rank: int) -> int:
    """A 63-bit seed for ``rank`` from a saved rank's state: its Python and torch CPU generators' digest."""
    digest = hashlib.sha256(f"ckpt-engine rng rank {rank}".encode())
    digest.update(state["python"]["state"].numpy().tobytes())
    digest.update(state["torch_cpu"].numpy().tobytes())
    return int.from_bytes(digest.digest()[:8], "little") >> 1


def reseed(seed: int) -> None:
    """Seed every generator the component holds (Python, NumPy, torch CPU and every CUDA device)."""
    random.seed(seed)
    np = _numpy()
    if np is not None:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def with_rng(extra: Mapping[str, Any] | None, enabled: bool) -> Mapping[str, Any] | None:
    """``extra`` plus the ``rng`` component when ``EngineConfig.rng`` is on."""
    if not enabled:
        return extra
    if extra and RNG_COMPONENT in extra:
        raise ConfigError(
            f"extra component {RNG_COMPONENT!r} clashes with the random state that rng: true saves; rename "
            "your component, or set rng: false"
        )
    return {**(extra or {}), RNG_COMPONENT: RngState()}


def saved_world_size(metadata: Metadata) -> int:
    ranks = saved_ranks(metadata)
    return max(ranks) + 1 if ranks else 0


def check_saved_world_size(metadata: Metadata, path: str, world_size: int) -> None:
    """Refuse random state saved by a job of another size (before anything is read)."""
    saved = saved_world_size(metadata)
    if saved != world_size:
        raise RngWorldSizeError(
            f"{path} holds the random state of {saved} rank(s), but this job has {world_size}: rank r's "
            "generators only reproduce rank r's draws in a job of the same size. Resume with the same number "
            "of ranks, or add 'rng' to keys_not_to_resume to start with fresh random state"
        )


def saved_ranks(metadata: Metadata) -> set[int]:
    return {int(m.group(1)) for key in metadata.state_dict_metadata if (m := _RANK_KEY.match(key))}


def prepare_rng_load(obj: Any, metadata: Metadata, path: str, world_size: int) -> None:
    """Before the ``rng`` component is read: which saved rank's keys this rank's :class:`RngState`
    reads. Each rank decides alone from the component's metadata (the node-local tier's holds
    only that rank's keys): its own keys where saved, else the lowest saved rank's, reseeded.
    Exactly one rank warns of a resume into another world size: the lowest rank without saved
    state, or rank 0 when the checkpoint has state for ranks this job lacks. Any other ``rng``
    object (not the engine's own) is refused into another world size, as before."""
    if not isinstance(obj, RngState):
        check_saved_world_size(metadata, path, world_size)
        return
    ranks = saved_ranks(metadata)
    if not ranks:  # stored under names a remap_keys plugin chose: its reverse mapping finds this rank's keys
        return
    missing = sorted(set(range(world_size)) - ranks)
    if obj.rank not in ranks:
        obj.source, obj.derive = min(ranks), True
    obj.ignored = tuple(f"rank{r}." for r in sorted(ranks) if r != obj.source)
    if (missing and obj.rank == missing[0]) or (obj.rank == 0 and max(ranks) >= world_size):
        if missing:
            fate = f"rank(s) {_ranges(missing)} are seeded from rank {min(ranks)}'s state and their own rank"
        else:
            fate = f"the state of rank(s) {_ranges([r for r in sorted(ranks) if r >= world_size])} is left unused"
        logger.warning(
            "%s holds the random state of rank(s) %s, but this job has %d rank(s): ranks with saved state take "
            "it back, %s. The resumed run is not bit-exact with an uninterrupted one (set rng: false to not save "
            "random state at all)",
            path,
            _ranges(sorted(ranks)),
            world_size,
            fate,
        )


def _ranges(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks[:8]) + (f", ... ({len(ranks)} in all)" if len(ranks) > 8 else "")


def ignored_rng_prefixes(obj: Any, rank: int, world_size: int) -> tuple[str, ...]:
    """Storage key prefixes of the saved ranks' states this rank does not read: not unexpected."""
    if isinstance(obj, RngState) and obj.ignored is not None:
        return obj.ignored
    return other_rank_prefixes(rank, world_size)


def absent_rng_is_allowed(obj: Any, path: str, rank: int) -> bool:
    """A checkpoint without the ``rng`` component the engine's ``rng: true`` adds (saved with
    ``rng: false``, or before it was on by default) loads with a warning; a caller's own ``rng``
    object follows the rules of any other absent component."""
    if not isinstance(obj, RngState):
        return False
    if rank == 0:
        logger.warning(
            "checkpoint %s holds no random state (saved with rng: false, or by an older version); the "
            "generators are left as they are, so the resumed run is not bit-exact with an uninterrupted one",
            path,
        )
    return True


def other_rank_prefixes(rank: int, world_size: int) -> tuple[str, ...]:
    """Storage key prefixes of the other ranks' states: not unexpected, just not this rank's."""
    return tuple(f"rank{r}." for r in range(world_size) if r != rank)
