"""The ``rng`` component (``EngineConfig.rng: true``): every rank's random state, so that a
resumed run draws the same random numbers as an uninterrupted one.

Each rank saves its Python (``random``), NumPy (global ``np.random``), torch CPU and, where CUDA
is present, every CUDA device's generator state under its own keys (``rank0.python.state``,
``rank1.torch_cpu``, ...), as accelerate's ``save_state`` does: DCP keeps one copy of a value
that several ranks save under one key. On load each rank reads its own keys back. Rank ``r``'s
state only means something to rank ``r`` of a job of the same size, so a load into another
world size is refused with :class:`RngWorldSizeError` (leave ``rng`` out with
``keys_not_to_resume: [rng]`` to resume with fresh random state instead).
"""

from __future__ import annotations

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
    "check_saved_world_size",
    "other_rank_prefixes",
    "with_rng",
]

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
    """A ``Stateful`` over this rank's generators; ``rank``/``world_size`` default to the process group's."""

    def __init__(self, rank: int | None = None, world_size: int | None = None) -> None:
        self.rank = _dist.rank() if rank is None else rank
        self.world_size = _dist.world_size() if world_size is None else world_size

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
        return {f"rank{self.rank}": state}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = state_dict[f"rank{self.rank}"]
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
    ranks = {int(m.group(1)) for key in metadata.state_dict_metadata if (m := _RANK_KEY.match(key))}
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


def other_rank_prefixes(rank: int, world_size: int) -> tuple[str, ...]:
    """Storage key prefixes of the other ranks' states: not unexpected, just not this rank's."""
    return tuple(f"rank{r}." for r in range(world_size) if r != rank)
