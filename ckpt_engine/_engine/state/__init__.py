"""Component state dicts, built as the original checkpointer built them (docs/design.md, section 2).

* ``model``: ``get_model_state_dict`` over one module or a list of modules, keys merged.
* ``optim``: ``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)`` per
  (module, optimizer) pair, keys merged.
* ``scheduler``: ``scheduler.state_dict()``.
* ``trainer``: ``{"grad_scaler": scaler.state_dict(), "iteration": iteration}``.
* extras: ``obj.state_dict()`` of each ``Stateful``.

Tensor subclasses in them are made plain for a save by :func:`plain_tensors` (see its section).
The optimizers' part is :mod:`.optim`'s.
"""

from __future__ import annotations

import operator
import weakref
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor

from ..._dcpio.torch_private import dcp_state_dict_is_own, loads_by_copy
from ...errors import ArgumentTypeError, ConfigError, InvalidArgumentError, UnsupportedTensorError
from ...types import STANDARD_COMPONENTS
from .optim import load_templates, optimizer_state_dict, set_optimizer_state, unread_keys


def _as_list(obj: Any) -> list[Any]:
    if obj is None:
        return []
    if isinstance(obj, (list, tuple)):
        return list(obj)
    return [obj]


@dataclass
class TrainingObjects:
    """What the caller passed to ``save()`` or ``load()``, normalised and validated."""

    modules: list[nn.Module] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)
    scheduler: Any = None
    grad_scaler: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_args(
        cls,
        model: nn.Module | Sequence[nn.Module] | None,
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None,
        scheduler: Any,
        grad_scaler: Any,
        extra: Mapping[str, Any] | None,
    ) -> TrainingObjects:
        modules = _as_list(model)
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise ArgumentTypeError(f"model[{i}] is a {type(m).__name__}, not a torch.nn.Module")
        optimizers = _as_list(optimizer)
        for i, o in enumerate(optimizers):
            if not isinstance(o, torch.optim.Optimizer):
                raise ArgumentTypeError(f"optimizer[{i}] is a {type(o).__name__}, not a torch.optim.Optimizer")
        if optimizers and len(optimizers) != len(modules):
            raise InvalidArgumentError(
                f"{len(optimizers)} optimizer(s) for {len(modules)} module(s): optimizers are paired with "
                "modules; pass one optimizer per module, in the same order"
            )
        for i, (m, o) in enumerate(zip(modules, optimizers, strict=False)):
            _check_optimizer_params(i, m, o)
        for name, obj in (("scheduler", scheduler), ("grad_scaler", grad_scaler)):
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ArgumentTypeError(f"{name} ({type(obj).__name__}) has no state_dict()/load_state_dict()")
        extras = dict(extra or {})
        for name, obj in extras.items():
            if name in STANDARD_COMPONENTS:
                raise ConfigError(
                    f"extra component {name!r} clashes with a standard component "
                    f"({', '.join(STANDARD_COMPONENTS)}); choose another name"
                )
            if not name or not (name[0].isalpha() or name[0] == "_") or not all(c.isalnum() or c in "_-" for c in name):
                raise ConfigError(
                    f"extra component name {name!r} must be a plain folder name ([A-Za-z_][A-Za-z0-9_-]*)"
                )
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ArgumentTypeError(
                    f"extra component {name!r} ({type(obj).__name__}) is not Stateful: it needs "
                    "state_dict() and load_state_dict()"
                )
        return cls(modules, optimizers, scheduler, grad_scaler, extras)

    def available(self) -> list[str]:
        """Components these objects can fill, in load order (``trainer`` always: the iteration)."""
        names = []
        if self.modules:
            names.append("model")
        if self.optimizers:
            names.append("optim")
        if self.scheduler is not None:
            names.append("scheduler")
        names.append("trainer")
        return names + list(self.extra)


def _check_optimizer_params(i: int, module: nn.Module, optim: torch.optim.Optimizer) -> None:
    """Every parameter the optimizer updates must be one of its module's parameters (the very
    tensor objects); otherwise DCP's state dict code fails with a bare ``KeyError``."""
    own = {id(p) for p in module.parameters()}
    foreign = sum(1 for g in optim.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        total = sum(len(g["params"]) for g in optim.param_groups)
        raise InvalidArgumentError(
            f"optimizer[{i}] updates {foreign} of its {total} parameter(s) that are not parameters of model[{i}] "
            f"({type(module).__name__}): it was built for other tensors. If the model is sharded (fully_shard, "
            "DTensor), build the optimizer after sharding, from model.parameters(); otherwise pass the optimizer "
            "built from this model (or pair them in the same order)"
        )


def _merge(dicts: Iterable[dict[str, Any]], what: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for i, d in enumerate(dicts):
        for k, v in d.items():
            if k in merged:
                raise ConfigError(
                    f"{what} of module {i} has key {k!r}, which an earlier module also has; merged keys must "
                    "be unique: wrap the modules in one nn.ModuleDict so their keys get distinct prefixes"
                )
            merged[k] = v
    return merged


def model_state_dict(modules: Sequence[nn.Module]) -> dict[str, Any]:
    return _merge((_model_state_dict(m) for m in modules), "model state dict")


#: Modules whose own ``state_dict()`` was shown to be what ``get_model_state_dict`` returns,
#: each with the signature of the state it was shown on (see :func:`_model_state_dict`).
_PLAIN: weakref.WeakKeyDictionary[nn.Module, tuple[Any, ...]] = weakref.WeakKeyDictionary()
#: Modules whose ``state_dict()`` was not what DCP returns (a wrapper, DTensors): they keep
#: DCP's function, without the extra ``state_dict()`` a comparison would cost on every save.
_DCP_ONLY: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _signature(sd: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """Keys, value types and tensor memory of a module's ``state_dict()``; ``None`` when a value
    is a tensor subclass (a DTensor: DCP's handling of it is not a plain ``state_dict()``)."""
    out: list[Any] = []
    for k, v in sd.items():
        if isinstance(v, torch.Tensor):
            if type(v) is not torch.Tensor or v.is_meta:
                return None
            out.append((k, v.data_ptr(), v.dtype, v.shape))
        else:
            out.append((k, type(v)))
    return tuple(out)


def _same_state(ours: Mapping[str, Any], dcp: Mapping[str, Any]) -> bool:
    """Same keys in the same order, the same tensor memory and layout, the same value types."""
    if list(ours) != list(dcp):
        return False
    for k, a in ours.items():
        b = dcp[k]
        if type(a) is not type(b):
            return False
        if isinstance(a, torch.Tensor) and (
            a.data_ptr() != b.data_ptr() or a.dtype != b.dtype or a.shape != b.shape or a.stride() != b.stride()
        ):
            return False
    return True


def _model_state_dict(module: nn.Module) -> dict[str, Any]:
    """``get_model_state_dict(module)``, by the module's own ``state_dict()`` once shown equal.

    For a module without wrappers (DDP, ``torch.compile``, activation checkpointing, FSDP) or
    DTensors, DCP's function returns the module's ``state_dict()`` after a walk over every
    parameter's fully qualified names that costs about 2.5 microseconds a tensor on each save and
    load, and tens of microseconds a tensor on its first call. Where the module tree shows none of
    what that walk looks for (:func:`~ckpt_engine._dcpio.torch_private.dcp_state_dict_is_own`),
    the module's own result is taken at once; otherwise the first call compares the two results.
    Either way, while the module's keys, value types and tensor memory stay as they were then,
    the walk is skipped. Any change (a wrapper renames keys,
    ``fully_shard`` swaps in DTensors, a parameter is replaced) asks DCP again; a module whose
    ``state_dict()`` differs from DCP's result keeps DCP's function from then on.
    """
    dcp_sd: dict[str, Any]
    if module in _DCP_ONLY:
        dcp_sd = get_model_state_dict(module)
        return dcp_sd
    sd: dict[str, Any] = module.state_dict()
    signature = _signature(sd)
    if signature is not None and _PLAIN.get(module) == signature:
        return sd
    if signature is not None and dcp_state_dict_is_own(module, sd):  # no wrapper: DCP's walk is moot
        _PLAIN[module] = signature
        return sd
    dcp_sd = get_model_state_dict(module)
    if signature is not None and _same_state(sd, dcp_sd):
        _PLAIN[module] = signature
    else:
        _PLAIN.pop(module, None)
        _DCP_ONLY.add(module)
    return dcp_sd


def _set_model_state_dict(module: nn.Module, sd: dict[str, Any], *, in_place: bool = False) -> None:
    """``set_model_state_dict(module, sd, strict=False)``; for a module :func:`_model_state_dict`
    just showed plain (its load template was built by it), DCP's function renames no key and
    calls the module's own ``load_state_dict``, so that is called directly.

    ``in_place``: every value of ``sd`` is still the tensor of the load template, which the load
    filled in place. For a plain module that ``load_state_dict`` would only copy each tensor onto
    itself (about 4 microseconds a tensor: 0.2 s for 50,000), unless some part of it loads
    differently (:func:`~ckpt_engine._dcpio.torch_private.loads_by_copy`); those copies are
    skipped, and their one effect, a new version of each tensor for autograd, is kept."""
    if module not in _PLAIN:
        set_model_state_dict(module, sd, options=StateDictOptions(strict=False))
    elif in_place and loads_by_copy(module):
        torch.autograd.graph.increment_version(list(sd.values()))
    else:
        module.load_state_dict(sd, strict=False)


def optim_state_dict(
    modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], *, for_load: bool = False
) -> dict[str, Any]:
    """The optimizers' flattened state dict: what a save writes, or (``for_load``) the template a
    load fills, which holds the state an optimizer that took no step yet gets at its first."""
    pairs = zip(modules, optimizers, strict=True)
    return _merge((optimizer_state_dict(m, o, for_load) for m, o in pairs), "optimizer state dict")


def trainer_state_dict(grad_scaler: Any, iteration: int) -> dict[str, Any]:
    sd: dict[str, Any] = {"iteration": iteration}
    if grad_scaler is not None:
        sd["grad_scaler"] = grad_scaler.state_dict()
    return sd


def component_state_dict(
    objs: TrainingObjects, component: str, iteration: int = 0, *, for_load: bool = False
) -> dict[str, Any]:
    """The state dict of one component: the save content, or (``for_load``) the load template."""
    if component == "model":
        return model_state_dict(objs.modules)
    if component == "optim":
        return optim_state_dict(objs.modules, objs.optimizers, for_load=for_load)
    if component == "scheduler":
        sd: dict[str, Any] = objs.scheduler.state_dict()
        return sd
    if component == "trainer":
        return trainer_state_dict(objs.grad_scaler, iteration)
    extra_sd: dict[str, Any] = objs.extra[component].state_dict()
    return extra_sd


def load_template(
    objs: TrainingObjects, component: str, stored: Collection[str] | None = None
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The state dict a load of ``component`` fills, and the keys of its saved form left unread: of
    ``optim``, each group's hyper-parameters under every parameter but the group's first. A save
    writes them under every parameter (``param_groups.<fqn>.<option>``: DCP's flattened form, as
    plain ``dcp.load`` expects), but ``set_optimizer_state_dict`` takes a group's values from its
    first parameter and never reads the others' (2,200 of the 3,025 items of a 201-parameter
    language model with AdamW). Kept where torch reads them: a tied parameter's (they tell torch
    which of its names was saved), and all of an optimizer named otherwise (by a wrapper).
    ``stored``: the checkpoint's keys of ``component``; of an optimizer saved before its first
    step (none of its ``state.`` keys), the template holds the groups only (:func:`.optim.load_templates`)."""
    if component != "optim":
        return component_state_dict(objs, component, 0, for_load=True), ()
    sd = _merge(load_templates(objs.modules, objs.optimizers, stored), "optimizer state dict")
    unread = tuple(k for m, o in zip(objs.modules, objs.optimizers, strict=True) for k in unread_keys(m, o, sd))
    skip = set(unread)
    return {k: v for k, v in sd.items() if k not in skip}, unread


def repartitions_state(objs: TrainingObjects, component: str) -> bool:
    """Whether ``component`` is an extra whose class declares ``repartitions_state = True``: its
    ``load_state_dict`` re-partitions the state one rank saved, so state it saved per rank (it
    differed across ranks) loads into a job of another size (each rank gets the copy of saving
    rank ``rank % saved ranks``) instead of being refused."""
    obj = objs.extra.get(component)
    return obj is not None and getattr(type(obj), "repartitions_state", False) is True


def apply_component(
    objs: TrainingObjects,
    component: str,
    sd: dict[str, Any],
    untouched: set[Any],
    template: tuple[Any, ...] | None = None,
) -> None:
    """Hand a loaded state dict back to its objects.

    DCP filled tensors in place and replaced other values in ``sd``; ``untouched`` holds the
    top-level keys whose value was skipped or missing. Non-tensor values in ``untouched`` are
    left out, so a module's own ``_extra_state`` stays as it was when the plugin skipped it.
    ``template``: the values ``sd`` held before the load (``model``), to tell a load that filled
    every tensor in place (see :func:`_set_model_state_dict`).
    """
    if component == "model":
        keep = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor) or k not in untouched}
        in_place = (
            template is not None
            and len(sd) == len(template)
            and all(map(operator.is_, sd.values(), template))
            and all(type(v) is torch.Tensor for v in template)  # so ``keep`` is all of ``sd``
        )
        for module in objs.modules:
            _set_model_state_dict(module, keep, in_place=in_place)
    elif component == "optim":
        for module, optim in zip(objs.modules, objs.optimizers, strict=True):
            set_optimizer_state(module, optim, sd)
    elif component == "scheduler":
        objs.scheduler.load_state_dict(_int_keys_back(sd))
    elif component == "trainer":
        if objs.grad_scaler is not None and "grad_scaler" in sd and "grad_scaler" not in untouched:
            objs.grad_scaler.load_state_dict(sd["grad_scaler"])
    else:
        objs.extra[component].load_state_dict(_int_keys_back(sd))


def _int_text(key: str) -> bool:
    """Whether ``key`` is ``str(n)`` of an int ``n`` (``"-3"``, not ``"007"``)."""
    digits = key[1:] if key.startswith("-") else key
    return digits.isascii() and digits.isdigit() and str(int(key)) == key


def _int_keys_back(value: Any) -> Any:
    """``value`` with each loaded ``"3"`` key of a nested dict put back under the int key ``3`` the
    template holds. DCP's flattening names a nested item by its path with every key made a
    string, and its load sets the loaded value under that string beside the template's int key,
    which kept its template value (a scheduler's milestones, an extra's per-class counts): the
    object got both, and read the stale one. Dicts changed in place; returns ``value``."""
    if isinstance(value, dict):
        for key in [k for k in value if type(k) is str and _int_text(k) and int(k) in value]:
            value[int(key)] = value.pop(key)
        for item in value.values():
            _int_keys_back(item)
    elif isinstance(value, list):
        for item in value:
            _int_keys_back(item)
    return value


# -- tensor subclasses in a state dict: a wrapper of one tensor saved as that tensor, any other refused --
#
# Training code holds tensor subclasses in its state: torchao's float8 training wraps each weight in
# a subclass that casts on the fly (``WeightWithDynamicFloat8CastTensor``, also as the local tensor
# of an FSDP2 ``DTensor``); QLoRA keeps a frozen base as ``NF4Tensor``, quantized data and scalers
# in one object. DCP writes such a tensor by pickling it, which the engine's readers (which check
# every stored size, and never unpickle) cannot read back, and an asynchronous copy of it may
# stage garbage. So the rule is made once, here, before a state dict reaches a plugin:
#
# * a *wrapper* (a subclass whose ``__tensor_flatten__`` names exactly one inner tensor of its own
#   shape, dtype and strides) is saved as that inner tensor: the same bytes, so a load copies them
#   back bit for bit (DCP copies into the wrapper, which forwards the copy to its inner tensor);
# * any other subclass with ``__tensor_flatten__`` is refused at save with
#   :class:`~ckpt_engine.errors.UnsupportedTensorError` naming the component and key, before
#   anything is written: never a silent cast, never NaN;
# * plain tensors, parameters, ``DTensor`` (whose local tensor follows the same rule) and
#   subclasses without ``__tensor_flatten__`` (which have storage of their own) pass as they are.

_PLAIN_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter, DTensor)


def plain_tensors(component: str, sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` with every wrapper subclass replaced by the tensor it wraps (a new dict only where
    one was found); raises for subclasses that are not one tensor."""
    out: dict[str, Any] | None = None
    for key, value in sd.items():
        new = _plain(component, key, value)
        if new is not value:
            if out is None:
                out = dict(sd)
            out[key] = new
    return sd if out is None else out


def _plain(component: str, key: str, value: Any) -> Any:
    kind = type(value)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return value
    if isinstance(value, DTensor):
        local = value.to_local()
        inner = _plain(component, key, local)
        if inner is local:
            return value
        return DTensor.from_local(
            inner, value.device_mesh, value.placements, run_check=False, shape=value.shape, stride=value.stride()
        )
    if isinstance(value, torch.Tensor):
        return _unwrap(component, key, value) if hasattr(kind, "__tensor_flatten__") else value
    if isinstance(value, Mapping):
        return plain_tensors(component, {str(k): v for k, v in value.items()}) if _has_subclass(value) else value
    if isinstance(value, (list, tuple)) and any(
        isinstance(v, torch.Tensor) and type(v) not in _PLAIN_TENSOR_TYPES for v in value
    ):
        return type(value)(_plain(component, f"{key}[{i}]", v) for i, v in enumerate(value))
    return value


def _has_subclass(value: Mapping[Any, Any]) -> bool:
    for v in value.values():
        if isinstance(v, torch.Tensor) and type(v) not in _PLAIN_TENSOR_TYPES:
            return True
        if isinstance(v, (Mapping, list, tuple)):
            return True  # look inside (rare: nested state such as a scheduler's)
    return False


def _unwrap(component: str, key: str, value: torch.Tensor) -> torch.Tensor:
    attrs, _ctx = value.__tensor_flatten__()  # type: ignore[attr-defined]
    inner = [getattr(value, a) for a in attrs]
    if (
        len(inner) == 1
        and isinstance(inner[0], torch.Tensor)
        and inner[0].shape == value.shape
        and inner[0].dtype == value.dtype
        and inner[0].stride() == value.stride()
    ):
        plain: torch.Tensor = _plain(component, key, inner[0]).detach()
        return plain
    parts = ", ".join(
        f"{a} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}" if isinstance(t, torch.Tensor) else a
        for a, t in zip(attrs, inner, strict=True)
    )
    raise UnsupportedTensorError(
        f"{component}: {key!r} is a {type(value).__qualname__} ({tuple(value.shape)} "
        f"{str(value.dtype).removeprefix('torch.')}, made of {parts}): the engine saves plain tensors, DTensors and "
        "subclasses that wrap one tensor of their own shape and dtype (torchao's float8 training weights), so "
        "this one cannot be saved exactly. Pass the modules without it (model=[...] takes a list: the trainable "
        "modules of a frozen quantized base, which is rebuilt from its pretrained weights at load), or hold it as a "
        "plain tensor while saving"
    )
