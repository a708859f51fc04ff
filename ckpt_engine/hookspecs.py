"""Hook specifications of the ``ckpt_engine`` pluggy project.

Three kinds of hook, fold, provider and observer: :data:`HOOK_KINDS` says which each hook is
and what each kind means (``docs/hooks.md`` explains them with examples).

Hooks are called with keyword arguments only; an implementation may accept any subset of the
parameters. Return values are checked by the engine (:mod:`ckpt_engine.pipeline`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Literal

from ._markers import hookspec

if TYPE_CHECKING:
    from .types import (
        LoadContext,
        PlanEntry,
        RemapContext,
        SaveContext,
        SaveResult,
        StagedState,
        WriteContext,
        WriteResult,
    )


#: The kind of every hook (``docs/hooks.md``): the one place the pipeline, the CLI's plugin
#: descriptions, the docs generator and the docs test read it from.
#:
#: - ``fold``: plugins run one at a time in config order, each fed the previous one's output;
#: - ``provider``: one implementation runs, the single enabled plugin that provides it, else the
#:   engine's default;
#: - ``observer``: every implementation runs; return values are ignored.
HOOK_KINDS: dict[str, Literal["fold", "provider", "observer"]] = {
    "remap_keys": "fold",
    "pre_load_plan": "fold",
    "stage": "provider",
    "write": "provider",
    "on_save_done": "observer",
}


class CkptSpecs:
    """The five hooks of ckpt-engine."""

    @hookspec
    def remap_keys(self, ctx: RemapContext, key_map: Mapping[str, str]) -> Mapping[str, str] | None:
        """Edit the key map of one component: destination key -> storage key.

        Kind: fold. Plugins run in config order, each receiving the map the previous one
        returned (the first receives the identity map over the component's flattened keys).

        :param ctx: component, direction (``"save"`` or ``"load"``), the checkpoint's keys on
            load, rank and world size. Do not mutate.
        :param key_map: read-only; keys are the live state dict's flattened keys.
        :returns: a new mapping with exactly the same keys, or ``None`` for "no change".
            On load, several destinations may read one storage key (it is read once and copied
            to each). On save, two destinations mapping to one storage key is an error.

        Ranks: every rank, for every component, on save and on load. Must be deterministic:
        the same inputs give the same map on every rank.

        Errors: an exception, or a return value that breaks the contract, fails the save or
        load. On load it is raised inside DCP's planning step, so it reaches every rank as the
        same :class:`~ckpt_engine.errors.CheckpointLoadError`; on save the ranks agree on it
        before any data is written.

        .. versionadded:: 0.1
        """

    @hookspec
    def pre_load_plan(self, ctx: LoadContext, entries: tuple[PlanEntry, ...]) -> Sequence[PlanEntry] | None:
        """Decide, per destination key, what the load will read.

        Kind: fold. Plugins run in config order, after storage metadata is read and keys are
        remapped, before DCP read items exist.

        :param ctx: component, checkpoint path, strictness, rank, world size, storage keys.
        :param entries: one :class:`~ckpt_engine.types.PlanEntry` per destination key, with
            its storage key, target and stored shape/dtype, and the current decision (``load``,
            ``missing`` or ``mismatch`` initially). Entries are frozen: return changed copies
            made with ``entry.skip(reason)``, ``entry.overlap()`` or ``entry.load()``.
        :returns: the entries, in the same order, identity fields unchanged; or ``None`` for
            "no change". Storage keys no entry refers to are reported as unexpected.

        After the fold the engine applies strictness: in strict mode every entry still
        ``missing`` or ``mismatch`` is collected into one
        :class:`~ckpt_engine.errors.LoadStrictnessError`; otherwise each is skipped and
        reported.

        Ranks: every rank, per component, inside DCP's local planning step. Must be
        deterministic across ranks.

        Errors: raised inside DCP's planning step; every rank raises the same error.

        .. versionadded:: 0.1
        """

    @hookspec
    def stage(self, ctx: SaveContext, state: Mapping[str, dict[str, Any]]) -> StagedState:
        """Produce the state to write: a point-in-time host copy, or the live state.

        Kind: provider. One implementation runs: the single enabled plugin providing it, else
        the engine's default, which returns the live state (``is_copy=False``); the engine then
        finishes the write before ``save()`` returns.

        :param ctx: iteration, checkpoint path, components, rank, world size.
        :param state: component name -> state dict (nested, as ``get_model_state_dict`` and
            friends return it). Do not mutate.
        :returns: a :class:`~ckpt_engine.types.StagedState`. When ``is_copy`` is true it must
            not alias the live tensors: the caller may mutate them once ``save()`` returns.
            A ``completion`` future, if given, is awaited before ``save()`` returns.

        Ranks: every rank, once per save.

        Errors: the save fails before anything is written; ``on_save_done`` reports it and
        ``save()`` raises :class:`~ckpt_engine.errors.CheckpointSaveError`.

        .. versionadded:: 0.1
        """
        raise NotImplementedError

    @hookspec
    def write(self, ctx: WriteContext, state_dict: dict[str, Any]) -> WriteResult | Future[WriteResult]:
        """Persist one component's staged state dict into ``ctx.path`` as a DCP checkpoint.

        Kind: provider. One implementation runs: the single enabled plugin providing it, else
        the engine's default (DCP ``FileSystemWriter`` in the calling process).

        :param ctx: component, iteration, target folder (always local: for an object-store
            ``save_dir`` the engine uploads it at commit), rank, world size, and the save
            planner to pass to DCP (it applies ``remap_keys`` and replica de-duplication).
        :param state_dict: the component's staged state dict. When ``ctx.staged_copy`` is true
            the provider may keep using it after returning; otherwise it must finish first.
        :returns: a :class:`~ckpt_engine.types.WriteResult`, or a ``Future`` of one for a
            background write. The engine commits the checkpoint (rename, then
            ``latest_checkpoint.txt``) only after every component's write has succeeded.

        Ranks: every rank, for every component, in component order; a DCP save is collective,
        so every rank must call it.

        Errors: the save fails; the uncommitted folder is removed and ``latest`` is unchanged.

        .. versionadded:: 0.1
        """
        raise NotImplementedError

    @hookspec
    def on_save_done(self, result: SaveResult) -> None:
        """Observe the outcome of one save.

        Kind: observer. Every implementation runs; return values are ignored.

        :param result: iteration, path, succeeded, error, bytes, seconds blocked, staging
            seconds, write seconds, total seconds.

        Ranks: every rank, once per save, after the checkpoint is committed or has failed, in
        the training process (for background saves: from the engine's commit thread).

        Errors: logged and re-raised to the caller of ``save()``/``wait()``: an observer that
        raises is a bug worth seeing. The checkpoint itself is already committed.

        .. versionadded:: 0.1
        """
