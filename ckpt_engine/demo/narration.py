"""What the demo user sees: each phase of the run narrated as it happens, then the comparison and the verdict."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from .._format.names import iter_dirname
from ..errors import CkptEngineError, UsageError
from .job import parameter_count
from .plot import plot_losses
from .settings import ASYNC_PLUGIN, Settings, check_settings, settings_from_args
from .supervisor import DemoFailure, RunLog, prepare_out, run_worker_process


def run_demo(args: argparse.Namespace) -> int:
    s = settings_from_args(args)
    problem = check_settings(s, args.ranks)
    if problem:
        raise UsageError(problem)
    from ..plugin_manager import installed_plugins

    has_async = ASYNC_PLUGIN in installed_plugins()
    save_dir = prepare_out(args.out)
    return Narrator(args, s, has_async, save_dir).run()


def run_demo_safely(args: argparse.Namespace) -> int:
    try:
        return run_demo(args)
    except DemoFailure as err:
        print(f"FAILED: {err}")
        return 1


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def save_line(ev: dict[str, Any], nbytes: int | None = None) -> str:
    """The line of one save event: committed (with its size, ``nbytes`` or what the save wrote, in
    the unit ``ckpt-engine ls`` uses, and its times) or failed."""
    from .._inspect.files import human_bytes

    if not ev["succeeded"]:
        return f"   step {ev['iteration']:>4}: save FAILED: {ev['error']}"
    size = human_bytes(ev["bytes"] if nbytes is None else nbytes)
    return f"   step {ev['iteration']:>4}: committed iter_{ev['iteration']:09}  {size}, " + describe_save_times(ev)


def checkpoint_bytes(save_dir: str, ev: dict[str, Any]) -> int:
    """The size ``ckpt-engine ls`` shows for the checkpoint a save event committed: its manifest's
    files, data and metadata of every rank; what rank 0 wrote when there is no manifest."""
    from .._format.manifest import lookup_manifest

    try:
        manifest = lookup_manifest(os.path.join(save_dir, iter_dirname(int(ev["iteration"])))).manifest
    except CkptEngineError:
        manifest = None
    return manifest.total_bytes if manifest is not None else int(ev["bytes"])


def save_times(ev: dict[str, Any]) -> tuple[float, float, float]:
    """(training blocked, committed, waited) of one save, in seconds, all from the start of the
    ``save()`` call: the same start for both figures, so a commit never reads as earlier than the
    return of the call that made it.

    ``call`` is ``save()`` timed around the call in the training loop; the engine's ``blocked``
    and ``total`` start later, once the save itself starts, after ``save()`` has waited for the
    previous save still in flight. That wait (``call - blocked``) is added to ``total``.
    """
    call = float(ev["call"])
    waited = max(0.0, call - float(ev.get("blocked", call)))
    return call, max(call, waited + float(ev["total"])), waited


def describe_save_times(ev: dict[str, Any]) -> str:
    """``save() blocked training 24 ms, committed 238 ms after the call began``, or, for a save
    that committed before ``save()`` returned (synchronous), ``... committed inside the call``."""
    call, committed, _ = save_times(ev)
    text = f"save() blocked training {_ms(call)}"
    if committed - call < 0.0005:
        return text + ", committed inside the call"
    return text + f", committed {_ms(committed)} after the call began"


class Narrator:
    """Runs the demo's phases (reference and kill, resume, compare) and prints each as it happens;
    it keeps what the printing needs between events (the reference losses)."""

    def __init__(self, args: argparse.Namespace, s: Settings, has_async: bool, save_dir: str) -> None:
        self.args = args
        self.s = s
        self.has_async = has_async
        self.async_saves = has_async and not args.sync
        self.out: str = args.out
        self.save_dir = save_dir
        self.reference: dict[int, float] = {}
        self.t_start = time.perf_counter()

    def run(self) -> int:
        self.header()
        train, killed_at = self.train()
        resume, resumed_from = self.resume()
        ok, prefix_ok, compared = self.compare(train, resume, resumed_from)
        self.saves(train, resume, killed_at, resumed_from)
        if not self.args.no_plot:
            plot = plot_losses(
                os.path.join(self.out, "demo.png"), self.s, self.reference, train, resume, killed_at, resumed_from
            )
            if plot:
                print(f"Plot: {plot}")
        print(f"Logs: {self.out}/worker-*.log    total time {time.perf_counter() - self.t_start:.1f}s")
        print("")
        return self.verdict(ok, prefix_ok, compared)

    def header(self) -> None:
        s, ranks = self.s, self.args.ranks
        print("ckpt-engine demo: train, SIGKILL in the middle of a save, resume, compare")
        print(
            f"  model: residual MLP, {s.layers} blocks of width {s.hidden} ({parameter_count(s):,} parameters), "
            "AdamW, cosine LR, grad scaler"
        )
        where = "1 process" if ranks == 1 else f"{ranks} gloo ranks under torchrun, FSDP2-sharded"
        print(f"  run: {s.steps} steps, batch {s.batch}, a checkpoint every {s.save_every} steps, {where}")
        print(f"  checkpoints: {self.save_dir}")
        if self.async_saves:
            print(f"  saves: async ({ASYNC_PLUGIN}: training continues while a background process writes)")
        elif self.has_async:
            print(f"  saves: synchronous (--sync; {ASYNC_PLUGIN} is installed but not used)")
        else:
            print(f"  saves: synchronous ({ASYNC_PLUGIN}, the async plugin, is not installed)")

    def _worker(self, role: str, on_event: Callable[[dict[str, Any]], None]) -> RunLog:
        return run_worker_process(
            role, self.s, self.out, self.save_dir, self.async_saves, self.args.ranks, self.args.timeout, on_event
        )

    # -- 1 and 2: the reference, then the checkpointed run killed mid-save --------------------------

    def train(self) -> tuple[RunLog, int]:
        s = self.s
        print("")
        print(f"1. Reference: {s.steps} steps without interruption (in the worker, before its checkpointed run)")
        train = self._worker("train", self.show)
        if len(train.reference) != s.steps:
            raise DemoFailure("the worker did not finish the reference run")
        if train.kill is None:
            raise DemoFailure("the training worker finished without reaching the kill point; lower --kill-at")
        killed_at = int(train.kill["iteration"])
        print(
            f"   worker killed: exit code {train.returncode} (SIGKILL), with every process under it"
            + (" (torchrun agent, ranks, writers)" if self.args.ranks > 1 else "")
        )
        print(
            "   (the worker paused itself with SIGSTOP once the save was writing, so the kill lands mid-save every run)"
        )
        print("")
        print("   on disk after the kill (`ckpt-engine ls`):")
        _show_ls(self.save_dir)
        return train, killed_at

    def show(self, ev: dict[str, Any]) -> None:
        """One worker event as the user sees it (most events print nothing)."""
        s, kind = self.s, ev["event"]
        if kind == "reference-step":
            self.reference[int(ev["step"])] = float(ev["loss"])
        elif kind == "reference-done":
            print(
                f"   loss {self.reference[1]:.6f} at step 1 -> {self.reference[s.steps]:.6f} at step {s.steps} "
                f"({ev['seconds']:.1f}s)"
            )
            print("")
            print(
                f"2. The same training with a checkpoint every {s.save_every} steps; SIGKILL during the save "
                f"of step {-(-s.kill_at // s.save_every) * s.save_every}"
            )
        elif kind == "loaded" and ev["source"] == "scratch":
            print(f"   no checkpoint yet: starting from scratch (plugins: {', '.join(ev['plugins'])})")
        elif kind == "writer-ready":
            print(
                f"   {ASYNC_PLUGIN}'s writer process started in {ev['seconds']:.1f}s (with the engine, before training)"
            )
        elif kind == "save-complete":
            self._show_save(ev)
        elif kind == "kill-missed":
            print(
                f"   step {ev['iteration']:>4}: (the save committed before the worker could pause; trying the next one)"
            )
        elif kind == "kill-point":
            print(
                f"   step {ev['iteration']:>4}: save of iter_{ev['iteration']:09} in progress "
                f"({ev['files']} data file(s) on disk) -> SIGKILL"
            )

    def _show_save(self, ev: dict[str, Any]) -> None:
        print(save_line(ev, checkpoint_bytes(self.save_dir, ev) if ev["succeeded"] else None))

    # -- 3: the resume -------------------------------------------------------------------------------

    def resume(self) -> tuple[RunLog, int]:
        print("")
        print("3. Resume in a fresh process from latest_checkpoint.txt")
        resume = self._worker("resume", self.show_resume)
        if resume.loaded is None:
            raise DemoFailure("the resumed worker reported no load")
        return resume, int(resume.loaded["iteration"])

    def show_resume(self, ev: dict[str, Any]) -> None:
        if ev["event"] == "loaded":
            print(
                f"   loaded {ev['path']} (iteration {ev['iteration']}, rule: {ev['source']}) in {_ms(ev['seconds'])}:"
            )
            for line in str(ev["summary"]).splitlines():
                print(f"     {line}")
        else:
            self.show(ev)

    # -- 4: the comparison, the saves, the verdict ---------------------------------------------------

    def compare(self, train: RunLog, resume: RunLog, resumed_from: int) -> tuple[bool, bool, int]:
        """Print the resumed losses next to the reference; returns (all equal, the checkpointed run
        matched the reference before the kill, steps compared)."""
        s, reference = self.s, self.reference
        print("")
        first = resumed_from + 1
        print(f"4. Resumed run vs uninterrupted run, steps {first}..{s.steps}")
        same = [step for step in range(first, s.steps + 1) if resume.losses.get(step) == reference[step]]
        prefix_ok = all(train.losses[k] == reference[k] for k in train.losses)
        rows = list(range(first, s.steps + 1))
        shown = rows if len(rows) <= 10 else [*rows[:4], -1, *rows[-4:]]
        print(f"   {'step':>6}  {'uninterrupted':>16}  {'resumed':>16}")
        for step in shown:
            if step == -1:
                print(f"   {'...':>6}")
                continue
            got = resume.losses.get(step)
            mark = "same" if got == reference[step] else "DIFFERENT"
            print(
                f"   {step:>6}  {reference[step]:>16.10f}  {(got if got is not None else float('nan')):>16.10f}  {mark}"
            )
        ok = len(same) == len(rows) and prefix_ok and len(resume.losses) == len(rows)
        return ok, prefix_ok, len(rows)

    def saves(self, train: RunLog, resume: RunLog, killed_at: int, resumed_from: int) -> None:
        committed = {**train.saves, **resume.saves}
        good = [ev for ev in committed.values() if ev.get("succeeded") and "call" in ev]
        print("")
        if good:
            times = [save_times(ev) for ev in good]
            calls = sorted(t[0] for t in times)
            totals = sorted(t[1] for t in times)
            median_call, median_total = calls[len(calls) // 2], totals[len(totals) // 2]
            from .._inspect.files import human_bytes

            size = human_bytes(sum(checkpoint_bytes(self.save_dir, ev) for ev in good) // len(good))
            print(
                f"Saves: {len(good)} committed, {size} each. "
                f"Median: save() blocked training {_ms(median_call)}, committed {_ms(median_total)} after the "
                "call began"
                + (
                    " (the rest ran in the background writer)."
                    if self.async_saves
                    else " (synchronous: all of it blocks)."
                )
            )
            if len(calls) > 2:
                print(f"   slowest save() call: {_ms(calls[-1])}; slowest commit: {_ms(totals[-1])}")
        print(
            f"The kill: SIGKILL during the save of iter_{killed_at:09}; it was never committed, "
            f"so the resume loaded iter_{resumed_from:09}."
        )

    def verdict(self, ok: bool, prefix_ok: bool, compared: int) -> int:
        if ok:
            print(f"OK: all {compared} steps after the resume are bit-identical to the uninterrupted run.")
            print(f"Next: ckpt-engine ls {self.save_dir}   |   ckpt-engine inspect {self.save_dir} --component model")
            return 0
        if not prefix_ok:
            print("FAILED: the checkpointed run diverged from the reference before the kill")
        print("FAILED: the resumed run does not match the uninterrupted run")
        return 1


def _show_ls(save_dir: str) -> None:
    """What ``ckpt-engine ls`` shows of the save folder, from the same library code."""
    from .._inspect.listing import list_save_dir, listing_table

    for line in listing_table(list_save_dir(save_dir)):
        print(f"     {line}")
