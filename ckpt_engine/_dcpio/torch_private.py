"""The one place where the engine relies on torch behaviour that is not public API.

``tests/dcpio/test_torch_private.py`` pins every item here, so a torch upgrade that changes one fails
loudly in CI instead of silently mis-loading checkpoints.

* ``DTensor.__create_chunk_list__``: the protocol method DCP itself calls to learn which global
  region a rank's shard covers (``torch/distributed/checkpoint/planner_helpers.py``). No public
  function returns a DTensor shard's global offsets.
* ``torch._utils._rebuild_tensor_v2``/``_v3``: the functions a ``torch.save`` archive names to
  rebuild a tensor (:func:`rebuild_tensor_functions`). The archive format itself is a file
  format, not an API: its reader is :mod:`.torch_save_archive`, its writer :mod:`.archive_write`.
* ``filesystem._StorageInfo``: DCP's per-item storage record (:func:`storage_info`, :func:`is_storage_info`),
  and the state its ``__getstate__`` pickles (:func:`pickle_metadata`).
* ``Tensor._version``: the in-place version counter autograd keeps per storage (shared by views
  and ``detach()``), bumped by every in-place op (also under ``no_grad``). ``pinned_staging``'s
  ``overlap`` mode reads it to prove a parameter was not changed before its background copy was
  taken (:func:`tensor_version`). No public API exposes it.
* ``nn.Module._load_state_dict_pre_hooks`` / ``_load_state_dict_post_hooks`` and the
  ``_load_from_state_dict`` override point: what ``load_state_dict`` runs besides copying each
  tensor into its parameter or buffer (:func:`loads_by_copy`). The hooks are registered through
  public methods, but only these attributes tell whether a module has any.
* What ``get_model_state_dict`` does beyond calling the module's ``state_dict()``
  (``torch/distributed/checkpoint/state_dict.py``): it renames keys only through DDP, FSDP and
  ``torch.compile`` wrappers, a module's ``_fqn_modifiers`` and the activation-checkpoint
  wrapper's ``_checkpoint_wrapped_module`` prefix, switches FSDP modules' state-dict type, calls
  the class's ``state_dict`` where it patched an instance's, and refuses an empty state dict or a
  key holding ``_flat_param`` (:func:`dcp_state_dict_is_own`). Where none of these apply, its
  result is the module's own ``state_dict()``, key for key and tensor for tensor.
* ``distributed_c10d._get_default_store()``: the key-value store the default process group was
  created with (torchrun's rendezvous store). The engine publishes each rank's checkpoint phase
  there and runs its bounded barriers on it (``_dcpio/watch.py``); no public function returns
  the store of an initialised process group.
"""

from __future__ import annotations

import copyreg
import functools
import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
from torch.distributed.tensor import DTensor


def local_chunks(tensor: torch.Tensor) -> list[ChunkStorageMetadata]:
    """The chunks of the global tensor that this rank holds, in global coordinates."""
    if isinstance(tensor, DTensor):
        if tensor.device_mesh.get_coordinate() is None:
            return []  # this rank is outside the tensor's mesh: it holds nothing
        chunks: list[ChunkStorageMetadata] = tensor.__create_chunk_list__()  # type: ignore[no-untyped-call]
        return chunks
    return [ChunkStorageMetadata(offsets=torch.Size([0] * tensor.dim()), sizes=tensor.size())]


def rebuild_tensor_functions() -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """``torch._utils._rebuild_tensor_v2`` and ``_v3``: the functions a ``torch.save`` archive's
    ``data.pkl`` names to rebuild a tensor (v3 for dtypes without a legacy storage class). The
    archive writer pickles references to them, as ``torch.save`` does."""
    return torch._utils._rebuild_tensor_v2, torch._utils._rebuild_tensor_v3


@functools.cache
def _storage_info_class() -> Any:
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return _StorageInfo


def storage_info(relative_path: str, offset: int, length: int, transform_descriptors: Any = None) -> Any:
    """DCP's per-item storage record (``filesystem._StorageInfo``), as its writer creates it
    (the class is looked up once: a coordinator rebuilds 200,000 of them at 1,024 ranks)."""
    return _storage_info_class()(relative_path, offset, length, transform_descriptors)


def pickle_metadata(metadata: Any) -> bytes:
    """``pickle.dumps(metadata, protocol=pickle.DEFAULT_PROTOCOL)``, byte for byte, faster.

    Every storage record pickles through ``_StorageInfo.__getstate__`` (its fields but those
    that are ``None``), a chain of Python calls per record: a third of the pickling time of a
    ``.metadata`` with 200,000 entries. A dispatch-table reducer gives pickle the same
    reduction (``copyreg.__newobj__``, the class, that state) in one call, with the state built
    directly for a record whose three fields are set and whose transforms are not."""
    cls = _storage_info_class()
    newobj = copyreg.__newobj__  # type: ignore[attr-defined]  # in copyreg, not in its stubs

    def reduce(info: Any) -> tuple[Any, ...]:
        fields = info.__dict__
        if len(fields) == 4 and fields.get("transform_descriptors", 0) is None:
            rel, offset, length = fields["relative_path"], fields["offset"], fields["length"]
            if rel is not None and offset is not None and length is not None:
                return newobj, (cls,), {"relative_path": rel, "offset": offset, "length": length}, None, None
        return newobj, (cls,), info.__getstate__(), None, None

    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.DEFAULT_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, cls: reduce}
    pickler.dump(metadata)
    return out.getvalue()


def is_storage_info(value: Any) -> bool:
    """Whether ``value`` is exactly DCP's per-item storage record (not a subclass or a stand-in)."""
    return type(value) is _storage_info_class()


def tensor_version(tensor: torch.Tensor) -> int:
    """The in-place version counter of ``tensor`` (shared with its views and ``detach()``)."""
    version: int = tensor._version
    return version


def default_store() -> Any:
    """The c10d ``Store`` of the default process group (which must be initialised)."""
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def loads_by_copy(module: nn.Module) -> bool:
    """Whether ``module.load_state_dict`` does nothing but copy each tensor into the parameter or
    buffer of its key: no class in the tree overrides how it loads (``load_state_dict``,
    ``_load_from_state_dict``, ``set_extra_state``), no module has load hooks, and torch does not
    swap tensors on load (``torch.__future__``)."""
    if torch.__future__.get_swap_module_params_on_conversion() or (
        type(module).load_state_dict is not nn.Module.load_state_dict
    ):
        return False
    return all(
        type(m)._load_from_state_dict is nn.Module._load_from_state_dict
        and type(m).set_extra_state is nn.Module.set_extra_state
        and not m._load_state_dict_pre_hooks
        and not m._load_state_dict_post_hooks
        for m in module.modules()
    )


#: The prefix DCP strips from keys (the activation-checkpoint wrapper's child), the hook name
#: through which a module renames its children's keys for DCP, and the key part DCP refuses.
_CHECKPOINT_CHILD = "_checkpoint_wrapped_module"
_FQN_MODIFIERS = "_fqn_modifiers"
_FLAT_PARAM = "_flat_param"


def dcp_state_dict_is_own(module: nn.Module, state_dict: dict[str, Any]) -> bool:
    """Whether ``get_model_state_dict(module)`` (default options) would return ``state_dict``,
    the module's own ``state_dict()``, as it is: every key its own FQN and nothing gathered,
    offloaded or refused. Decided from the module tree and the keys, without DCP's per-parameter
    walk (its ``_verify_options`` and ``_get_fqns``: tens of microseconds a parameter on the
    first call) and without importing ``torch._dynamo`` (no module can be compiled before it is
    imported). ``False`` means "ask DCP", not "different"."""
    import sys

    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.nn.parallel import DistributedDataParallel

    if not state_dict or "state_dict" in vars(module):  # empty: DCP refuses; patched by DCP
        return False
    dynamo = sys.modules.get("torch._dynamo")
    compiled: tuple[type, ...] = (dynamo.eval_frame.OptimizedModule,) if dynamo is not None else ()
    wrappers = (DistributedDataParallel, FullyShardedDataParallel, *compiled)
    for m in module.modules():
        if isinstance(m, wrappers) or _CHECKPOINT_CHILD in m._modules or hasattr(m, _FQN_MODIFIERS):
            return False
    return not any(_FLAT_PARAM in key for key in state_dict)
