"""Skeletons for ``pinned_staging``: state dicts pickled with each tensor replaced by a staging slot (private).

:func:`collect` pickles every component once. Each distinct tensor (by object: aliases share a
slot) gets a slot; a DTensor contributes its local shard, and its mesh, placements, global
shape and stride travel in the skeleton. What ``stage`` produced for each component is kept as
a :class:`Staged` record until ``write`` sends it to the writer.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckpt_engine import CkptEngineError

from .copies import Snapshot
from .ipc import MeshSpec, SkeletonUnpickler
from .pool import BufferSet, Signature
from .windows import WindowPump

__all__ = ["Collector", "SkeletonPickler", "Staged", "collect", "staged_components"]


@dataclass(frozen=True, eq=False)
class Staged:
    """One component as ``stage`` left it: its buffers, skeleton and the tree handed to ``write``."""

    buffers: BufferSet
    skeleton: bytes
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


def collect(
    state: Mapping[str, dict[str, Any]], *, share_across_components: bool
) -> tuple[Collector, dict[str, bytes]]:
    """Each component's skeleton, and the collector that assigned the slots."""
    collector = Collector(share_across_components=share_across_components)
    skeletons: dict[str, bytes] = {}
    for name, sd in state.items():
        collector.next_component()
        buf = io.BytesIO()
        try:
            SkeletonPickler(buf, collector).dump(sd)
        except CkptEngineError:
            raise
        except Exception as err:
            raise CkptEngineError(
                f"pinned_staging cannot copy the non-tensor values of component {name!r}: "
                f"{type(err).__name__}: {err}; values must be picklable"
            ) from err
        skeletons[name] = buf.getvalue()
    return collector, skeletons


def staged_components(
    skeletons: Mapping[str, bytes],
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
        tree = SkeletonUnpickler(skeleton, lambda pid: views[pid[1]]).load()
        epoch = buffers.epoch if pump is not None else None
        staged[name] = Staged(buffers, skeleton, meshes, tree, snapshot, pump, epoch, order)
    return staged
