"""The nested optimizer state dict that ``optimizer.load_state_dict`` takes, rebuilt from the flat
``state.<fqn>.<name>`` / ``param_groups.<fqn>.<option>`` keys the engine stores for ``optim``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class NotOptimizerStateError(ValueError):
    """The keys are not the flat keys of an optimizer state dict."""


def nest_optimizer_state(flat: Mapping[str, Any]) -> dict[str, Any]:
    """``{"state": {fqn: {name: value}}, "param_groups": [{..., "params": [fqn, ...]}]}``.

    Parameters are named by their FQN, in stored order, as ``torch.distributed.checkpoint``'s own
    ``dcp_to_torch_save`` keeps them; ``optimizer.load_state_dict`` maps them to the optimizer's
    parameters by position. Consecutive parameters with the same options form one group (two
    adjacent groups with identical options cannot be told apart in the flat form, and merge).
    """
    state: dict[str, dict[str, Any]] = {}
    options: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        kind, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        if kind not in ("state", "param_groups") or not fqn or not name:
            raise NotOptimizerStateError(f"{key!r} is not a state.<param>.<name> or param_groups.<param>.<option> key")
        (state if kind == "state" else options).setdefault(fqn, {})[name] = value
    groups: list[dict[str, Any]] = []
    for fqn, opts in options.items():
        if groups and _same(groups[-1], opts):
            groups[-1]["params"].append(fqn)
        else:
            groups.append({**opts, "params": [fqn]})
    return {"state": state, "param_groups": groups}


def _same(group: dict[str, Any], opts: dict[str, Any]) -> bool:
    theirs = {k: v for k, v in group.items() if k != "params"}
    if theirs.keys() != opts.keys():
        return False
    try:
        return all(bool(theirs[k] == opts[k]) for k in opts)
    except Exception:  # values without a plain truth value (tensors): not the same group
        return False
