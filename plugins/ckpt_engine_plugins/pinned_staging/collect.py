"""Skeletons for ``pinned_staging``: state dicts with each tensor replaced by a staging slot (private).

:func:`collect` records every component's :class:`Skeleton`. Each distinct tensor (by object:
aliases share a slot) gets a slot; a DTensor contributes its local shard, and its mesh,
placements, global shape and stride travel in the skeleton. A state dict that holds anything
but tensors and immutable values is pickled at once (which deep-copies its values); a flat one
of tensors and immutable values (every model and flattened optimizer state dict) is pickled
only when the writer needs it, off ``save()``'s path where the save overlaps. What ``stage``
produced for each component is kept as a :class:`Staged` record until ``write`` sends it.
"""

from __future__ import annotations

import io
import pickle
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckpt_engine import CkptEngineError

from .copies import Snapshot
from .ipc import MeshSpec, SkeletonUnpickler
from .pool import BufferSet, Signature
from .windows import WindowPump

__all__ = ["Collector", "Skeleton", "SkeletonPickler", "Staged", "collect", "staged_components"]


@dataclass(frozen=True, eq=False)
class Staged:
    """One component as ``stage`` left it: its buffers, skeleton and the tree handed to ``write``."""

    buffers: BufferSet
    skeleton: Skeleton
    meshes: tuple[MeshSpec, ...]
    tree: dict[str, Any]
    snapshot: Snapshot | None = None
    #: ``max_host_bytes``: the window hand-over, its epoch and the components in write order.
    pump: WindowPump | None = None
    epoch: int | None = None
    order: tuple[str, ...] = ()


class Collector:
    """Assigns staging slots to the tensors met while pickling a skeleton."""

    def __init__(self, *, share_across_components: bool = True) -> None:
        self.share_across_components = share_across_components
        self.sources: list[torch.Tensor] = []
        self.meshes: list[MeshSpec] = []
        self._slots: dict[int, int] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids unique while the skeletons are pickled
        self._mesh_index: dict[MeshSpec, int] = {}
        #: id(DeviceMesh) -> (the mesh, its index in ``meshes``), see :meth:`_mesh_of`.
        self._mesh_by_id: dict[int, tuple[Any, int]] = {}

    def _slot(self, obj: torch.Tensor, local: torch.Tensor) -> int:
        slot = self._slots.get(id(obj))
        if slot is None:
            if local.layout != torch.strided or local.device.type == "meta":
                raise CkptEngineError(
                    f"pinned_staging cannot stage a {local.layout} tensor on {local.device} "
                    f"(shape {list(local.shape)}); only dense tensors with data can be saved asynchronously"
                )
            slot = len(self.sources)
            self._slots[id(obj)] = slot
            self.sources.append(local)
            self._keep.append(obj)
        return slot

    def next_component(self) -> None:
        """A windowed save writes components one after another: a tensor two components share
        gets a slot in each, so neither reads a window the other's writes have moved past."""
        if not self.share_across_components:
            self._slots = {}

    @property
    def objects(self) -> list[torch.Tensor]:
        """The tensor met for each slot (a DTensor itself, where ``sources`` holds its shard)."""
        return self._keep

    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, torch.Tensor):
            return None
        if isinstance(obj, DTensor):
            index = self._mesh_of(obj.device_mesh)
            slot = self._slot(obj, obj.to_local())
            return ("dt", slot, index, tuple(obj.placements), tuple(obj.shape), tuple(obj.stride()))
        if type(obj) not in (torch.Tensor, torch.nn.Parameter):
            raise CkptEngineError(
                f"pinned_staging cannot stage a tensor of type {type(obj).__qualname__}; plain tensors, "
                "parameters and DTensors are supported"
            )
        return ("t", self._slot(obj, obj))

    def _mesh_of(self, mesh: Any) -> int:
        """The index of ``mesh``'s :class:`MeshSpec`, worked out once per mesh object: the
        ``DeviceMesh.mesh`` tensor is rebuilt from its layout on every access (about 0.1 ms in
        torch 2.13), and every DTensor of a model shares one or a few meshes."""
        known = self._mesh_by_id.get(id(mesh))
        if known is not None and known[0] is mesh:
            return known[1]
        ranks = mesh.mesh
        spec = MeshSpec(
            shape=tuple(ranks.shape),
            ranks=tuple(int(r) for r in ranks.flatten().tolist()),
            dim_names=tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
        )
        index = self._mesh_index.setdefault(spec, len(self.meshes))
        if index == len(self.meshes):
            self.meshes.append(spec)
        self._mesh_by_id[id(mesh)] = (mesh, index)  # the mesh is kept: its id stays its own
        return index

    def signature(self) -> Signature:
        return tuple((tuple(t.shape), t.dtype) for t in self.sources)


class SkeletonPickler(pickle.Pickler):
    """Pickles a skeleton: the collector's ``persistent_id`` replaces each tensor by its slot.

    The pickler calls ``persistent_id`` once per object of the state (a flattened AdamW state
    dict has about ten values per parameter): the collector's bound method is set on the
    instance, so each call is one Python frame, not two."""

    def __init__(self, file: io.BytesIO, collector: Collector) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.persistent_id = collector.persistent_id  # type: ignore[method-assign]


class _Slot:
    """A tensor's place in a flat skeleton: pickled as its persistent id."""

    __slots__ = ("pid",)

    def __init__(self, pid: tuple[Any, ...]) -> None:
        self.pid = pid


class _FlatPickler(pickle.Pickler):
    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)

    def persistent_id(self, obj: Any) -> Any:
        return obj.pid if type(obj) is _Slot else None


#: The types whose values cannot change after ``save()``: a flat skeleton holds them by reference.
_IMMUTABLE: frozenset[type] = frozenset({bool, int, float, complex, str, bytes, type(None)})


def _flat_tensors(sd: dict[str, Any]) -> list[tuple[str, torch.Tensor]] | None:
    """The tensors of ``sd`` by key, if every key is a string and every other value immutable (a
    number, a string, ``None`` or a tuple of those); else ``None``."""
    tensors: list[tuple[str, torch.Tensor]] = []
    immutable = _IMMUTABLE
    for k, v in sd.items():
        t = type(v)
        if type(k) is not str:
            return None
        if isinstance(v, torch.Tensor):
            tensors.append((k, v))
        elif t not in immutable and not (t is tuple and all(type(x) in immutable for x in v)):
            return None
    return tensors


class Skeleton:
    """One component's skeleton: its state dict with each tensor replaced by a persistent id.

    ``pickled()`` is what the writer unpickles (:class:`SkeletonUnpickler`); :meth:`tree` the
    same state dict over the buffer set's views, handed to ``write``. A flat skeleton keeps a
    shallow copy of the state dict (its values are immutable) and pickles it on the first call
    to ``pickled()``, from whichever thread makes it."""

    def __init__(self, pickled: bytes | None = None, flat: dict[str, Any] | None = None) -> None:
        if (pickled is None) == (flat is None):
            raise ValueError("a skeleton is either pickled or flat")
        self._pickled, self._flat = pickled, flat
        self._lock = threading.Lock()

    @classmethod
    def of(cls, sd: dict[str, Any], collector: Collector) -> Skeleton:
        tensors = _flat_tensors(sd)
        if tensors is None:
            buf = io.BytesIO()
            SkeletonPickler(buf, collector).dump(sd)
            return cls(pickled=buf.getvalue())
        flat = dict(sd)  # a later change to the state dict itself does not reach this save
        for k, v in tensors:
            flat[k] = _Slot(collector.persistent_id(v))
        return cls(flat=flat)

    def pickled(self) -> bytes:
        with self._lock:
            if self._pickled is None:
                buf = io.BytesIO()
                _FlatPickler(buf).dump(self._flat)
                self._pickled = buf.getvalue()
            return self._pickled

    def tree(self, views: Sequence[torch.Tensor]) -> dict[str, Any]:
        """The state dict with each tensor replaced by the view of its slot."""
        flat = self._flat
        if flat is None:
            assert self._pickled is not None
            tree: dict[str, Any] = SkeletonUnpickler(self._pickled, lambda pid: views[pid[1]]).load()
            return tree
        return {k: views[v.pid[1]] if type(v) is _Slot else v for k, v in flat.items()}


def collect(
    state: Mapping[str, dict[str, Any]], *, share_across_components: bool
) -> tuple[Collector, dict[str, Skeleton]]:
    """Each component's skeleton, and the collector that assigned the slots."""
    collector = Collector(share_across_components=share_across_components)
    skeletons: dict[str, Skeleton] = {}
    for name, sd in state.items():
        collector.next_component()
        try:
            skeletons[name] = Skeleton.of(sd, collector)
        except CkptEngineError:
            raise
        except Exception as err:
            raise CkptEngineError(
                f"pinned_staging cannot copy the non-tensor values of component {name!r}: "
                f"{type(err).__name__}: {err}; values must be picklable"
            ) from err
    return collector, skeletons


def staged_components(
    skeletons: Mapping[str, Skeleton],
    buffers: BufferSet,
    meshes: tuple[MeshSpec, ...],
    snapshot: Snapshot | None,
    pump: WindowPump | None,
) -> dict[str, Staged]:
    """Each component's tree over the buffer set's views, with what ``write`` needs to send it."""
    views = buffers.slab.views
    order = tuple(skeletons)
    staged: dict[str, Staged] = {}
    for name, skeleton in skeletons.items():
        # With windows, the views show whichever window the set holds now: only the writer reads them.
        epoch = buffers.epoch if pump is not None else None
        staged[name] = Staged(buffers, skeleton, meshes, skeleton.tree(views), snapshot, pump, epoch, order)
    return staged
