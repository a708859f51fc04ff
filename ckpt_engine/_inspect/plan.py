"""``ckpt-engine plan``: a dry run of a load, with the engine's real planner and plugins.

The load goes through ``dcp.load`` exactly as :meth:`CheckpointEngine.load` does (same planner,
same plugins, same strictness), with a storage reader whose ``read_data`` reads nothing. So the
report is the one a real load would produce, no tensor data is read, the model is untouched and
nothing is written.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from .._dcpio.dist import quiet_dcp
from .._dcpio.planner import EngineLoadPlanner
from .._engine.loader import Loader, is_warm_start
from .._engine.resume import components_by_rule
from .._engine.state import TrainingObjects, load_template
from .._format.layout import check_component_files
from .._format.metadata import SafeFileSystemReader, read_metadata
from .._format.names import METADATA_FILE
from .._storage.fscheck import require_regular_file
from .._storage.store import is_url, open_store
from ..config import EngineConfig
from ..errors import CheckpointLoadError, CkptEngineError, LoadStrictnessError, UsageError, first_failure
from ..pipeline import Pipeline
from ..plugin_manager import build_plugin_manager
from ..report import ComponentReport, LoadReport
from .files import shown
from .target import resolve


class NoReadReader(SafeFileSystemReader):
    """A reader that plans like the real one and reads nothing."""

    planned_items = 0

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self.planned_items = len(plan.items)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def dry_run_component(
    engine: Loader,
    objs: TrainingObjects,
    name: str,
    component_dir: str,
    *,
    strict: bool,
    strict_unexpected: bool,
    warm_start: bool = False,
) -> tuple[ComponentReport, int]:
    """Plan the load of one component (``warm_start``: by the ``load_path`` rule); returns its
    report and the number of read items planned."""
    require_regular_file(os.path.join(component_dir, METADATA_FILE), "DCP metadata")
    metadata = read_metadata(component_dir)
    sd, unread = load_template(objs, name, metadata.state_dict_metadata)
    cfg = engine.config
    planner = EngineLoadPlanner(
        component=name,
        checkpoint_dir=component_dir,
        pipeline=engine.pipeline,
        strict=strict,
        strict_unexpected=strict_unexpected,
        trust_checkpoint=cfg.trust_checkpoint,
        ignore_unexpected_prefixes=("grad_scaler.",) if name == "trainer" and objs.grad_scaler is None else (),
        unread=unread,
        warm_start=warm_start,
    )
    check_component_files(component_dir, metadata, open_store(component_dir))  # the plan is what a load does
    reader = NoReadReader(component_dir, metadata)
    try:
        with quiet_dcp():
            dcp.load(sd, storage_reader=reader, planner=planner, no_dist=True)
    except (Exception, CheckpointException) as exc:
        err = first_failure(exc)[0]
        if isinstance(err, CkptEngineError):
            raise err from None
        raise CheckpointLoadError(
            f"planning the load of component {name!r} from {component_dir} failed: {type(err).__name__}: {err}"
        ) from err
    assert planner.report is not None
    return planner.report, reader.planned_items


def _report_doc(run: _DryRun) -> dict[str, Any]:
    """The JSON report: as the text shows it, unresolved mismatches under ``mismatched`` (the
    text's ``MISMATCH`` lines), never as keys a lenient re-plan skipped."""
    doc: dict[str, Any] = {}
    for name, rep in run.reports.items():
        kept, unresolved = _split_unresolved(rep)
        doc[name] = {**LoadReport({name: kept}).to_dict()[name], "mismatched": dict(sorted(unresolved.items()))}
    return doc


def _split_unresolved(rep: ComponentReport) -> tuple[ComponentReport, dict[str, str]]:
    """Separate what a lenient re-plan skipped only because strict was off (the unresolved
    mismatches a strict load fails on) from what plugins decided to skip."""
    unresolved = {
        k: r.reason.removeprefix("mismatch: ").removesuffix(" (strict=False)")
        for k, r in rep.skipped.items()
        if r.plugin is None and r.reason.startswith("mismatch: ")
    }
    if not unresolved:
        return rep, {}
    kept = {k: r for k, r in rep.skipped.items() if k not in unresolved}
    return dataclasses.replace(rep, skipped=kept), unresolved


def load_rule(config: EngineConfig, checkpoint: str) -> str:
    """``load_path`` when ``checkpoint`` is the one the config's ``load_path`` names (a checkpoint
    folder, or a save folder's latest): load() reads it by that rule; else ``latest``."""
    if not config.load_path or config.load_path.endswith(".pth"):
        return "latest"
    try:
        named = resolve(config.load_path, files=False).checkpoint
    except CkptEngineError:
        return "latest"
    same = named == checkpoint if is_url(named) else os.path.abspath(named) == os.path.abspath(checkpoint)
    return "load_path" if same else "latest"


@dataclasses.dataclass
class _DryRun:
    """What a dry-run load of one checkpoint found, component by component."""

    lines: list[str]
    reports: dict[str, ComponentReport] = dataclasses.field(default_factory=dict)
    failures: list[str] = dataclasses.field(default_factory=list)
    absent: list[str] = dataclasses.field(default_factory=list)
    items: int = 0


def plan_load(args: argparse.Namespace, objs: TrainingObjects) -> int:
    """``ckpt-engine plan``: what ``load()`` of ``args.checkpoint`` into ``objs`` would do;
    prints it (text or ``--json``) and returns the exit code (1: the load would fail)."""
    target = resolve(args.checkpoint, files=False)
    if args.config:
        config = EngineConfig.from_file(args.config)
    else:
        config = EngineConfig(save_dir=os.path.dirname(target.checkpoint) or ".")
    rule = load_rule(config, target.checkpoint)
    by_rule = components_by_rule(config, objs.extra, rule)
    wanted = _wanted(args, objs, [n for n in objs.available() if n in by_rule and n not in config.keys_not_to_resume])
    run = _DryRun([f"plan: load {target.describe()}", f"into: {args.model}"])
    if rule == "load_path":
        run.lines.append(f"rule: load_path, {', '.join(by_rule)} only (load_training_state loads every component)")
    _dry_run(config, target, objs, wanted, run, is_warm_start(config, target.checkpoint, rule))
    ok = not run.failures
    if args.json:
        import json

        doc = {
            "checkpoint": target.checkpoint,
            "ok": ok,
            "report": _report_doc(run),
            "absent": run.absent,
            "errors": run.failures,
        }
        print(json.dumps(doc, indent=2))
    else:
        # Keys are stored names: what a terminal would act on (ESC, BEL, CR) is printed escaped.
        print(shown("\n".join(run.lines + _text(run, show_all=args.all)), lines=True))
    return 0 if ok else 1


def _wanted(args: argparse.Namespace, objs: TrainingObjects, wanted: list[str]) -> list[str]:
    """``wanted`` narrowed to ``--component``, each of which the factory must provide."""
    if not args.component:
        return wanted
    unknown = [c for c in args.component if c not in objs.available()]
    if unknown:
        raise UsageError(
            f"--component {', '.join(unknown)}: the factory gives nothing to load it into "
            f"(it gives: {', '.join(objs.available())})"
        )
    return [n for n in wanted if n in args.component]


def _dry_run(
    config: EngineConfig, target: Any, objs: TrainingObjects, wanted: list[str], run: _DryRun, warm: bool
) -> None:
    """The engine's own checks and per-component plans (``warm``: a warm start's), with a reader
    that reads nothing."""
    loaded = build_plugin_manager(config)
    pipeline = Pipeline(loaded)
    engine = Loader(config, pipeline)  # the engine's own resume logic
    try:
        plugins = ", ".join(loaded.order) or "(none)"
        run.lines.append(f"plugins (fold order): {plugins}; strict={config.strict}")
        try:  # the checks load() runs before it reads anything
            engine.validate(target.checkpoint, open_store(target.checkpoint, config.storage))
        except CkptEngineError as err:
            run.failures.append(str(err))
            wanted = []
        for name in wanted:
            cdir = target.components.get(name)
            if cdir is None:
                if name == "trainer" and objs.grad_scaler is None:
                    continue
                run.absent.append(name)
                if config.strict:
                    run.failures.append(
                        f"the checkpoint has no component {name!r} (it has: {', '.join(target.components)})"
                    )
                continue
            try:
                report, n = dry_run_component(
                    engine,
                    objs,
                    name,
                    cdir,
                    strict=config.strict,
                    strict_unexpected=config.strict_unexpected,
                    warm_start=warm,
                )
            except LoadStrictnessError as err:
                run.failures.append(str(err))  # plan again, leniently, for the full report
                report, n = dry_run_component(
                    engine, objs, name, cdir, strict=False, strict_unexpected=False, warm_start=warm
                )
            except CheckpointLoadError as err:  # refused before any plan (PerRankStateError): no report
                run.failures.append(f"{name}: {err}")
                continue
            run.reports[name] = report
            run.items += n
    finally:
        pipeline.close()


def _text(run: _DryRun, *, show_all: bool) -> list[str]:
    """The plain-text report after the header lines."""
    lines = [""]
    threshold = 10**9 if show_all else 8
    for rep in run.reports.values():
        rep, unresolved = _split_unresolved(rep)
        head, *rest = rep.summary_lines(threshold)
        lines.append(head + (f", {len(unresolved)} MISMATCHED" if unresolved else ""))
        lines += rest
        lines += [f"  MISMATCH: {k}: {why}" for k, why in sorted(unresolved.items())]
        if show_all:
            lines += [f"  loaded: {k}" + (f" <- {rep.renamed[k]}" if k in rep.renamed else "") for k in rep.loaded]
    lines += [f"{name}: not in the checkpoint" for name in run.absent]
    lines.append("")
    if not run.failures:
        lines.append(f"ok: the load would succeed ({run.items} reads planned; nothing was read or written)")
        return lines
    lines.append("FAILED: the load would fail:")
    for failure in run.failures:
        # The keys are listed above; keep the error's headline and its fix.
        err_lines = failure.splitlines()
        lines.append(f"  {err_lines[0]}")
        lines += [f"  {line}" for line in err_lines[1:] if line.startswith("fix:")]
    return lines
