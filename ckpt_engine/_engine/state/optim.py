"""The optimizers' part of the component state dicts: an optimizer's flattened state dict
(``get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)``, built from its own
``state_dict()`` once shown equal), the load template of one that took no step yet, and the
loaded state set back (:func:`set_optimizer_state`)."""

from __future__ import annotations

import contextlib
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.nn.parallel import DistributedDataParallel

__all__ = ["load_templates", "optimizer_state_dict", "set_optimizer_state", "unread_keys"]

_OPTIM_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

#: Optimizers shown to keep no state (plain SGD): DCP's state initialisation left them empty.
_STATELESS: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


#: Optimizers whose flattened state dict was shown to be built from their own ``state_dict()``
#: and their module's parameter names, each with the (module id, names) it was shown on.
_OWN_NAMES: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, tuple[str, ...]]] = weakref.WeakKeyDictionary()
#: Optimizers for which that was not so (a wrapper renames parameters): DCP's function from then on.
_OPTIM_DCP_ONLY: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer, for_load: bool) -> dict[str, Any]:
    """``get_optimizer_state_dict(module, optimizer, flatten_optimizer_state_dict=True)``, built
    from the optimizer's own ``state_dict()`` once shown equal.

    For an optimizer with state, DCP's function calls ``optimizer.state_dict()``, renames each
    parameter index to the parameter's fully qualified name and flattens the result; finding the
    names (its ``_verify_options``) walks every parameter and module and costs about 50
    microseconds a parameter on every save, inside ``save()``. Where DCP's names are the module's
    own ``named_parameters()`` names (no wrapper renames them: plain modules and ``fully_shard``),
    the first call shows the two results equal, key for key and value for value, and later calls
    build it directly while the module and its parameter names stay the same. A different
    module, renamed or new parameters, or a value DCP's flattening refuses ask DCP again; an
    optimizer whose result differed keeps DCP's function.

    An optimizer that took no step yet has no state: a save writes its groups only
    (:func:`_state_free_optimizer_state_dict`), a load template gets the state DCP initialises.
    """
    if not optimizer.state:
        if for_load:
            return _initialised_optimizer_state_dict(module, optimizer)
        return _state_free_optimizer_state_dict(module, optimizer)
    return _own_once_shown(module, optimizer, lambda: _dcp_optimizer_state_dict(module, optimizer))


def _own_once_shown(
    module: nn.Module, optimizer: torch.optim.Optimizer, dcp: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
    """The optimizer's flattened state dict built from its own ``state_dict()`` and its module's
    parameter names where that was shown equal to ``dcp()`` (DCP's result) for this module and
    these names; else ``dcp()``, compared once: equal, the next call builds its own; different,
    DCP's function from then on."""
    if optimizer in _OPTIM_DCP_ONLY:
        return dcp()
    names = _param_names(module, optimizer)
    ours = _flat_optimizer_state(optimizer, names) if names is not None else None
    if ours is not None and _OWN_NAMES.get(optimizer) == (id(module), names):
        return ours
    dcp_sd = dcp()
    if names is not None and ours is not None and _same_flat(ours, dcp_sd):
        _OWN_NAMES[optimizer] = (id(module), names)
    else:
        _OWN_NAMES.pop(optimizer, None)
        _OPTIM_DCP_ONLY.add(optimizer)
    return dcp_sd


def _dcp_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    sd: dict[str, Any] = get_optimizer_state_dict(module, optimizer, options=_OPTIM_OPTIONS)
    return sd


def _param_names(module: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[str, ...] | None:
    """The module's name of each parameter the optimizer updates, in the optimizer's order
    (the order of its ``state_dict()`` indices); ``None`` if one is not the module's."""
    by_id = {id(p): name for name, p in module.named_parameters()}
    names: list[str] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = by_id.get(id(p))
            if name is None:
                return None
            names.append(name)
    return tuple(names)


def _flat_optimizer_state(optimizer: torch.optim.Optimizer, names: tuple[str, ...]) -> dict[str, Any] | None:
    """DCP's flattened form of ``optimizer.state_dict()`` with each index named by ``names``
    (``state.<fqn>.<key>`` and ``param_groups.<fqn>.<key>``); ``None`` where the state dict is
    not the standard packed form or holds a value DCP's flattening refuses."""
    osd = optimizer.state_dict()
    flat: dict[str, Any] = {}
    try:
        for index, state in osd["state"].items():
            if type(index) is not int or index < 0 or not isinstance(state, dict):
                return None
            if not _flatten_into(flat, state, f"state.{names[index]}"):
                return None
        for group in osd["param_groups"]:
            group = dict(group)
            params = group.pop("params")
            for index in params:
                if type(index) is not int or index < 0:
                    return None
                name = names[index]
                for k, v in group.items():
                    flat[f"param_groups.{name}.{k}"] = v
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    return flat


def _flatten_into(flat: dict[str, Any], nested: dict[Any, Any], prefix: str) -> bool:
    for key, value in nested.items():
        full = prefix + "." + str(key)  # DCP names nested keys by str()
        if isinstance(value, dict):
            if not _flatten_into(flat, value, full):
                return False
        elif isinstance(value, (torch.Tensor, int, float)):
            flat[full] = value
        else:
            return False  # DCP raises NotImplementedError: let it, with its own message
    return True


def _same_flat(ours: Mapping[str, Any], dcp: Mapping[str, Any]) -> bool:
    """The same keys in the same order, the very same tensors, equal other values of one type."""
    if list(ours) != list(dcp):
        return False
    for k, a in ours.items():
        b = dcp[k]
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            if a is not b:
                return False
            continue
        try:
            if type(a) is not type(b) or not bool(a == b):
                return False
        except Exception:  # an __eq__ that raises or gives no truth value: not shown equal
            return False
    return True


def _initialised_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The load template of an optimizer without state yet: ``get_optimizer_state_dict``, whose
    state initialisation gives it the state its first step would (a load replaces it), except
    where that is known to create nothing.

    For an optimizer with no state and no gradients, DCP allocates a zero gradient for every
    parameter and runs ``optimizer.step()`` with ``lr=0`` to create the state (its
    ``_init_optim_state``). For a stateless optimizer (plain SGD) that creates nothing, yet costs
    about two copies of the parameters, bumps every parameter's version counter and runs the step
    hooks. The first call proves an optimizer stateless (its state is still empty afterwards);
    later calls skip the initialisation (:func:`_state_free_optimizer_state_dict`).
    """
    if optimizer not in _STATELESS:
        sd = _dcp_optimizer_state_dict(module, optimizer)
        if not optimizer.state:
            _STATELESS.add(optimizer)
        return sd
    return _state_free_optimizer_state_dict(module, optimizer)


def _state_free_optimizer_state_dict(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The flattened state dict of an optimizer without state (it took no step yet, or keeps
    none), as it is: its groups' hyper-parameters, and the optimizer left untouched.

    DCP's state initialisation (see :func:`_initialised_optimizer_state_dict`) runs a step: an
    optimizer saved before its first step came out of ``save()`` with that step's state (AdamW:
    ``step`` 1 and zero moments), so every later update's bias correction moved, and the
    checkpoint recorded a step never taken. DCP skips the initialisation where a parameter has
    a gradient: one small parameter gets a zero gradient for the duration. Where that result is
    the optimizer's own ``param_groups`` flattened under its module's parameter names (as for an
    optimizer with state, :func:`_optimizer_state_dict`), later calls build it directly, without
    DCP's walk over every parameter's names (the bulk of an ``overlap`` ``save()`` with plain SGD).
    """
    params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    if not params or any(p.grad is not None for p in params):
        return _dcp_optimizer_state_dict(module, optimizer)  # DCP initialises nothing here

    def dcp_without_initialising() -> dict[str, Any]:
        smallest = min(params, key=lambda p: p.numel())
        smallest.grad = torch.zeros_like(smallest)
        try:
            return _dcp_optimizer_state_dict(module, optimizer)
        finally:
            smallest.grad = None

    return _own_once_shown(module, optimizer, dcp_without_initialising)


def unread_keys(module: nn.Module, optimizer: torch.optim.Optimizer, sd: Mapping[str, Any]) -> list[str]:
    """:func:`~ckpt_engine._engine.state.load_template`'s unread keys of one module's optimizer
    (``sd``: the merged template)."""
    names, unread = _param_names(module, optimizer) or (), []
    held = Counter(id(p) for _, p in module.named_parameters(remove_duplicate=False))  # > 1: tied
    flat = [(i, p, g) for g in optimizer.param_groups for i, p in enumerate(g["params"])]
    for name, (i, param, group) in zip(names, flat, strict=False):
        keys = [f"param_groups.{name}.{k}" for k in group if k != "params"]
        if not all(k in sd for k in keys):
            return []  # not the module's own names: torch's decide, so every key is read
        if i and held[id(param)] == 1:
            unread += keys
    return unread


#: The prefix of the flattened optimizer state's per-parameter entries (``state.<fqn>.<name>``).
_OPTIM_STATE = "state."


def _set_groups_only(module: nn.Module, optimizer: torch.optim.Optimizer, sd: Mapping[str, Any]) -> None:
    """Load a state dict saved before the optimizer's first step (its groups, no state): the
    optimizer gets the saved hyper-parameters and no state, as the saved one had. DCP's function
    needs a state for every parameter, so it is given the state DCP initialises, then the state
    is dropped; an optimizer shown to keep none (plain SGD, :data:`_STATELESS`) takes ``sd`` as it
    is, as before."""
    if optimizer in _STATELESS:
        set_optimizer_state_dict(module, optimizer, optim_state_dict=dict(sd), options=_OPTIM_OPTIONS)
        return
    full = _dcp_optimizer_state_dict(module, optimizer)
    full.update(sd)
    set_optimizer_state_dict(module, optimizer, optim_state_dict=full, options=_OPTIM_OPTIONS)
    optimizer.state.clear()


@contextlib.contextmanager
def _empty_groups_aside(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """``optimizer`` without its parameter groups that hold no parameters while its state is set,
    then with them back in their places.

    The flattened optimizer state dict (``flatten_optimizer_state_dict=True``, the ``optim``
    format) keys a group's hyper-parameters by the group's first parameter, so a group without
    parameters has no keys, and ``set_optimizer_state_dict`` fails on it (an ``IndexError`` in
    torch's ``_unflatten_optim_state_dict``). Such groups are common (the Hugging Face Trainer's
    no-decay group when every bias and norm is frozen, as under LoRA); they hold no state, so
    nothing of them is lost.
    """
    aside = [(i, g) for i, g in enumerate(optimizer.param_groups) if not g["params"]]
    if not aside:
        yield
        return
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]
    try:
        yield
    finally:
        groups = optimizer.param_groups  # a new list once load_state_dict ran
        for index, group in aside:
            groups.insert(index, group)


#: Optimizers whose last load template holds no state: the checkpoint holds none of theirs (they
#: were saved before their first step; :func:`load_templates`).
_SAVED_WITHOUT_STATE: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


def load_templates(
    modules: Sequence[nn.Module], optimizers: Sequence[torch.optim.Optimizer], stored: Collection[str] | None
) -> list[dict[str, Any]]:
    """Each optimizer's load template. Where ``stored`` (the checkpoint's keys) holds none of an
    optimizer's state keys and no state key that no optimizer here names (a ``remap_keys`` plugin
    may read the state under other names: then the plan decides), it was saved before its first
    step: its template holds its groups only, and :func:`set_optimizer_state` leaves it without
    state. Each optimizer is judged alone (a GAN's discriminator may have stepped before its
    generator)."""
    parts = [optimizer_state_dict(m, o, True) for m, o in zip(modules, optimizers, strict=True)]
    named = {k for part in parts for k in part if k.startswith(_OPTIM_STATE)}
    saved = stored if stored is not None and all(k in named for k in stored if k.startswith(_OPTIM_STATE)) else None
    for i, (optimizer, part) in enumerate(zip(optimizers, parts, strict=True)):
        state = [k for k in part if k.startswith(_OPTIM_STATE)]
        if saved is not None and state and not any(k in saved for k in state):
            _SAVED_WITHOUT_STATE.add(optimizer)
            parts[i] = {k: v for k, v in part.items() if not k.startswith(_OPTIM_STATE)}
        else:
            _SAVED_WITHOUT_STATE.discard(optimizer)
            _UNSAVED_PARAMETERS.pop(optimizer, None)
            unsaved = _unsaved_parameters(modules[i], state, saved) if saved is not None else {}
            if unsaved:
                _UNSAVED_PARAMETERS[optimizer] = frozenset(unsaved)
                parts[i] = {k: v for k, v in part.items() if not any(k in keys for keys in unsaved.values())}
    return parts


#: Optimizers whose last load template left out the parameters the checkpoint holds no state of
#: (:func:`_unsaved_parameters`), by name: :func:`set_optimizer_state` leaves them without state.
_UNSAVED_PARAMETERS: weakref.WeakKeyDictionary[torch.optim.Optimizer, frozenset[str]] = weakref.WeakKeyDictionary()


def _unsaved_parameters(module: nn.Module, state: list[str], saved: Collection[str]) -> dict[str, set[str]]:
    """The parameters (by name, with their template's state keys) the checkpoint holds no state
    of at all, where others have some: a branch that had no gradient before the save, which the
    optimizer held no state for. Loaded from the template, each would get DCP's made-up first
    state (``step`` 1, zero moments) and train on from it; left out, it has none after the load,
    as at the save. Empty where a name is not the module's own (a wrapper renamed it)."""
    by_param: dict[str, set[str]] = {}
    for key in state:
        by_param.setdefault(key[len(_OPTIM_STATE) :].rpartition(".")[0], set()).add(key)
    unsaved = {name: keys for name, keys in by_param.items() if not any(k in saved for k in keys)}
    if not unsaved or len(unsaved) == len(by_param):
        return {}
    names = set(_parameters_by_name(module))
    return unsaved if all(name in names for name in unsaved) else {}


def _parameters_by_name(module: nn.Module) -> dict[str, nn.Parameter]:
    """The module's parameters by the names DCP's optimizer state uses: a ``DistributedDataParallel``
    wrapper's own ``module.`` prefix left out, as DCP leaves it out."""
    inner = module.module if isinstance(module, DistributedDataParallel) else module
    return dict(inner.named_parameters())


def _set_without_unsaved(
    module: nn.Module, optimizer: torch.optim.Optimizer, sd: Mapping[str, Any], unsaved: frozenset[str]
) -> None:
    """Load ``sd``, which holds no state of the ``unsaved`` parameters: DCP's function needs a
    state for every parameter, so it is given the state DCP initialised for those, which is then
    dropped (as :func:`_set_groups_only` does for all of them)."""
    full = _dcp_optimizer_state_dict(module, optimizer)
    full.update(sd)
    set_optimizer_state_dict(module, optimizer, optim_state_dict=full, options=_OPTIM_OPTIONS)
    params = _parameters_by_name(module)
    for name in unsaved:
        optimizer.state.pop(params[name], None)


def set_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, sd: Mapping[str, Any]) -> None:
    """Hand a loaded flattened state dict to ``optimizer`` (``sd`` may hold other modules' keys):
    ``set_optimizer_state_dict``, or, for one its template showed saved before its first step
    (:func:`load_templates`), its groups only and no state."""
    with _empty_groups_aside(optimizer):
        if optimizer in _SAVED_WITHOUT_STATE:
            _set_groups_only(module, optimizer, sd)
        elif (unsaved := _UNSAVED_PARAMETERS.get(optimizer)) is not None:
            _set_without_unsaved(module, optimizer, sd, unsaved)
        else:
            set_optimizer_state_dict(module, optimizer, optim_state_dict=dict(sd), options=_OPTIM_OPTIONS)
