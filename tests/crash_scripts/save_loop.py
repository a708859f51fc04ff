"""SIGKILL a process at random moments while it saves checkpoints in a loop; check every restore.

Run by ``tests/reliability/test_crash.py`` (and by hand: ``python tests/crash_scripts/save_loop.py --help``).
This process imports torch once, then per trial forks a child (no import cost) that:

1. constructs an engine on ``--dir`` (which removes what the previous kill left behind),
2. resumes with ``load()`` and checks the restored state is exactly the state of that iteration,
3. saves iterations k+1, k+2, ... forever, each with a state that is a pure function of the
   iteration (model, AdamW, StepLR, GradScaler, iteration, and a 4 MB ``extra`` tensor).

The child reports ``START i`` before each save and ``COMMITTED i`` once a save is committed,
through a pipe. This process waits until the child has resumed, sleeps a random time, kills the
child's whole process group with SIGKILL, notes which temporary folders the kill left, then
loads the checkpoint with ``verify="checksums"`` in a fresh engine and checks:

* the loaded iteration k is at least the last committed one (a committed save survives) and at
  most the last started one;
* every component equals, bit for bit, the state of iteration k (never a partial checkpoint);
* ``verify_checkpoint`` of the loaded checkpoint finds no problem.

With ``--local-dir``, every save is committed to that node-local tier and only every
``--persist-every``-th also to ``--dir``: the resume takes the newest complete step of either.

With ``--incremental``, the engine saves incrementally and the model gains a frozen part that
never changes (a 4 MB weight with ``requires_grad`` off), so that every save carries files over
by hard link; then every kept checkpoint, not only the loaded one, must pass
``verify_checkpoint``.

One JSON line per trial on stdout (``TRIAL {...}``), then ``SUMMARY {...}``. Exit status 0 when
every trial passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import select
import signal
import sys
import time
import traceback
from typing import Any

import torch

from ckpt_engine import CheckpointEngine
from ckpt_engine._format.verify import verify_checkpoint
from ckpt_engine.testing import TinyTrainingState, assert_state_dicts_equal

BLOB = 1 << 20  # float32 elements: 4 MB per save, so that a save spans many instructions


class Blob:
    """An ``extra=`` component: a large tensor and a counter derived from the iteration."""

    def __init__(self, iteration: int) -> None:
        gen = torch.Generator().manual_seed(10_000 + iteration)
        self.data = torch.randn(BLOB, generator=gen)
        self.counter = iteration * 7

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data, "counter": self.counter}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.data.copy_(sd["data"])
        self.counter = sd["counter"]


#: Set by ``--incremental``: the model gets a frozen part (inherited by the forked children).
INCREMENTAL = False


def make_state(iteration: int) -> tuple[TinyTrainingState, Blob]:
    state = TinyTrainingState.create(seed=iteration, hidden=64, steps=2)
    if INCREMENTAL:  # the same frozen weights at every iteration, as in fine-tuning
        base = torch.nn.Linear(1024, 1024, bias=False)
        with torch.no_grad():
            base.weight.copy_(torch.randn(1024, 1024, generator=torch.Generator().manual_seed(7)))
        base.weight.requires_grad_(False)
        state.model.add_module("frozen_base", base)
    return state, Blob(iteration)


def snapshot(state: TinyTrainingState, blob: Blob) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in state.model.state_dict().items()},
        "optim": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "scaler": state.grad_scaler.state_dict(),
        "blob": {"data": blob.data.clone(), "counter": blob.counter},
    }


def restore(config: dict[str, Any]) -> tuple[int, dict[str, Any] | None, Any]:
    """Load into a fresh state; returns (iteration, snapshot or None when from scratch, result)."""
    state, blob = make_state(999_999)
    blob.counter = -1
    with CheckpointEngine(config) as engine:
        result = engine.load(**state.objects(), extra={"blob": blob})
    if result.checkpoint_path is None:
        return 0, None, result
    return result.iteration, snapshot(state, blob), result


def expected(iteration: int) -> dict[str, Any]:
    return snapshot(*make_state(iteration))


def child(config: dict[str, Any], out: int) -> None:
    os.setpgid(0, 0)  # the parent kills the whole group: any writer process dies with us

    def say(line: str) -> None:
        os.write(out, f"{line}\n".encode())

    try:
        k, got, _ = restore(config)
        if got is not None:
            assert_state_dicts_equal(got, expected(k))
        say(f"RESUMED {k}")
        with CheckpointEngine(config) as engine:
            pending = None
            i = k
            while True:
                i += 1
                state, blob = make_state(i)
                say(f"START {i}")
                handle = engine.save(i, **state.objects(), extra={"blob": blob})
                if pending is not None:
                    pending[1].result()
                    say(f"COMMITTED {pending[0]}")
                pending = (i, handle)
                if handle.done():
                    handle.result()
                    say(f"COMMITTED {i}")
                    pending = None
    except BaseException:
        say("ERROR " + traceback.format_exc().replace("\n", " | "))
        os._exit(3)


def read_lines(fd: int, until: str | None, timeout: float) -> list[str]:
    """Read the child's lines; stop after a line starting with ``until`` or at EOF/timeout."""
    buf = b""
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        buf += chunk
        *done, buf_rest = buf.split(b"\n")
        buf = buf_rest
        lines += [d.decode() for d in done]
        if until is not None and any(line.startswith(until) or line.startswith("ERROR") for line in lines):
            break
    return lines


def leftovers(save_dir: str) -> list[str]:
    try:
        return sorted(n for n in os.listdir(save_dir) if n.startswith("."))
    except FileNotFoundError:
        return []


def trial(n: int, config: dict[str, Any], rng: random.Random, max_delay: float, arm_after: str) -> dict[str, Any]:
    save_dir = config["save_dir"]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        child(config, w)
        os._exit(4)  # unreachable: child() loops until killed
    os.close(w)
    record: dict[str, Any] = {"trial": n}
    t0 = time.monotonic()
    # Arm the kill once the child is saving: after it resumed (sync saves), or after its first
    # commit (async saves, whose first save waits for the writer process to start).
    lines = read_lines(r, arm_after, timeout=120.0)
    armed = time.monotonic()
    delay = rng.uniform(0.0, max_delay)
    time.sleep(delay)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    lines += read_lines(r, None, timeout=10.0)
    os.close(r)
    record["armed_after_s"] = round(armed - t0, 2)
    record["left_behind"] = leftovers(save_dir)
    if config.get("local_dir"):  # the local tier's uncommitted folders are this rank's
        record["left_behind"] += leftovers(os.path.join(config["local_dir"], "rank_00000"))
    record["total_s"] = round(time.monotonic() - t0, 2)
    record["delay"] = round(delay, 3)
    errors = [line for line in lines if line.startswith("ERROR")]
    resumed = [int(line.split()[1]) for line in lines if line.startswith("RESUMED")]
    started = [int(line.split()[1]) for line in lines if line.startswith("START")]
    committed = [int(line.split()[1]) for line in lines if line.startswith("COMMITTED")]
    record.update(
        resumed=resumed[0] if resumed else None,
        last_started=max(started, default=None),
        last_committed=max(committed, default=None),
    )
    problems = [f"child: {e}" for e in errors]
    if not resumed:
        problems.append("the child never resumed")
    try:
        k, got, result = restore({**config, "verify": "checksums"})
        record["loaded"] = k
        record["verified"] = bool(result.verified)
        record["from"] = sorted(result.bytes_by_source)
        floor = max(committed, default=resumed[0] if resumed else 0)
        ceiling = max(started, default=floor)
        if not floor <= k <= ceiling:
            problems.append(f"loaded iteration {k}, expected between {floor} (committed) and {ceiling} (started)")
        if got is not None:
            try:
                assert_state_dicts_equal(got, expected(k))
            except AssertionError as err:
                problems.append(f"iteration {k} restored with different contents: {err}")
            report = verify_checkpoint(result.checkpoint_path, "checksums")
            if not report.verified:
                problems.append(f"verify_checkpoint: {report.unverified_reason}: {report.problems}")
        kept = sorted(e for e in os.listdir(save_dir) if e.startswith("iter_"))
        record["checkpoints"] = len(kept)
        if config.get("incremental"):  # files are shared: every kept checkpoint must still be whole
            for name in kept:
                path = os.path.join(save_dir, name)
                if not os.path.exists(os.path.join(path, "ckpt_engine_manifest.json")):
                    continue  # a committed folder latest never named is not a checkpoint yet
                kept_report = verify_checkpoint(path, "checksums")
                if not kept_report.verified:
                    problems.append(f"{name}: {kept_report.unverified_reason}: {kept_report.problems}")
            record["linked"] = sum(
                os.stat(os.path.join(root, f)).st_nlink > 1
                for root, _, files in os.walk(save_dir)
                for f in files
                if f.endswith(".distcp")
            )
    except Exception as err:  # a refused load is a failed trial, with the reason
        problems.append(f"load failed: {type(err).__name__}: {err}")
    record["problems"] = problems
    return record


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", required=True, help="save_dir (created)")
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-delay", type=float, default=0.5, help="kill up to this many seconds after resume")
    parser.add_argument(
        "--min-mid-save",
        type=int,
        default=0,
        help="run more trials (up to 3x --trials) until this many kills landed mid-save: a kill's timing is "
        "random, and a fast save can dodge a few",
    )
    parser.add_argument("--keep-last", type=int, default=3, help="retention during the run (0: off)")
    parser.add_argument("--incremental", action="store_true", help="incremental saves, with a frozen component")
    parser.add_argument("--plugin", action="append", default=[], help="plugins to enable (e.g. an async writer)")
    parser.add_argument("--local-dir", help="a node-local tier (local_dir): every save is committed there")
    parser.add_argument("--persist-every", type=int, default=3, help="with --local-dir: durable every N saves")
    parser.add_argument(
        "--arm-after",
        choices=["RESUMED", "COMMITTED"],
        default="RESUMED",
        help="start the kill timer when the child reports this (COMMITTED: after its first commit)",
    )
    args = parser.parse_args()
    global INCREMENTAL
    INCREMENTAL = args.incremental
    torch.set_num_threads(1)
    config: dict[str, Any] = {"save_dir": args.dir, "plugins": args.plugin, "incremental": args.incremental}
    if args.keep_last:
        config["keep_last"] = args.keep_last
    if args.local_dir:
        config.update(local_dir=args.local_dir, persist_every=args.persist_every)
    rng = random.Random(args.seed)
    failed = 0
    mid_save = 0
    t0 = time.perf_counter()
    n = 0
    while n < args.trials or (mid_save < args.min_mid_save and n < 3 * args.trials):
        record = trial(n, config, rng, args.max_delay, args.arm_after)
        failed += bool(record["problems"])
        mid_save += any(name.endswith(".partial") for name in record["left_behind"])
        print("TRIAL " + json.dumps(record), flush=True)
        n += 1
    summary = {
        "trials": n,
        "failed": failed,
        "killed_mid_save": mid_save,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print("SUMMARY " + json.dumps(summary), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
