"""A durable sync save, against a raw write and safetensors, with and without cached value archives.

DCP ``torch.save``s every non-tensor item of a state dict (463 per save of a 42-parameter AdamW
state: lr, betas, ... per parameter); the engine's save planner takes ``torch.save``'s archive of
an equal pickle from a cache instead (``ckpt_engine._dcpio.archive_write.value_archive``). This
benchmark times, in one process, paired rounds with the methods in alternating order, each until
the bytes are durable (fsynced, folders included):

* ``raw_write``: the state's tensor bytes written to one file in 1 MiB writes, then fsynced: what
  a plain write costs on this disk;
* ``ours_sync``: ``CheckpointEngine.save`` (every component, manifest, rename, pointer);
* ``ours_no_value_cache``: the same save with every plain value ``torch.save``'d, as DCP does;
* ``safetensors``: ``save_file`` of the same tensors, then the file and its folder fsynced.

The state is the peers benchmark's: an MLP of 1024-wide layers whose parameters and AdamW
moments make ``--sizes`` MiB. Ratios are medians of the per-round ratios.

Each sample is wall time; the JSON (and the table) also give the process's CPU time per save
(all threads, user and system), which other processes on the machine sway less: what the save
costs the CPUs, where the wall time also shows what a second CPU saved.

Usage::

    python benchmarks/write_path_bench.py [--sizes 256,1024] [--rounds 9] [--out results.json]
    python benchmarks/write_path_bench.py --smoke     # tiny, one round: keeps the script from rotting
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import torch  # noqa: E402
from _peers_measure import fsync_all  # noqa: E402

MIB = 1 << 20
METHODS = ("raw_write", "ours_sync", "ours_no_value_cache", "ours_no_early_writeback", "safetensors")
_OURS = ("ours_sync", "ours_no_value_cache", "ours_no_early_writeback")


def _tensors(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v for k, v in model.state_dict().items()}
    for n, state in enumerate(optim.state.values()):
        out.update({f"optim.{n}.{k}": v for k, v in state.items() if torch.is_tensor(v) and v.dim()})
    return out


def _raw(path: str, tensors: dict[str, torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors.values():
            view = memoryview(t.contiguous().view(-1).view(torch.uint8).numpy())
            for start in range(0, len(view), MIB):
                os.write(fd, view[start : start + MIB])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_all([os.path.dirname(path)])  # the folder, so the name is durable too


class _Bench:
    """One state, its methods, and the folder they write to (emptied after every save)."""

    def __init__(self, size: int, root: str) -> None:
        from _peers_measure import build

        from ckpt_engine import CheckpointEngine

        self.w, loss, self.label = build("big", size, 16)
        loss().backward()
        self.w.optim.step()  # AdamW's moments exist
        self.tensors = _tensors(self.w.model, self.w.optim)
        self.bytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.root = root
        self.engine = CheckpointEngine({"save_dir": os.path.join(root, "ours")})
        self.step = 0
        #: CPU seconds of the process (all threads) in the last ``run``: less swayed by other
        #: processes than wall time, and what a second CPU takes off the wall time.
        self.cpu_s = 0.0

    def run(self, method: str) -> float:
        from ckpt_engine._dcpio import planner
        from ckpt_engine._format import data_file

        value_archive = planner.value_archive
        path = os.path.join(self.root, method)
        os.makedirs(path, exist_ok=True)
        t0, cpu0 = time.perf_counter(), time.process_time()
        try:
            if method == "raw_write":
                _raw(os.path.join(path, "raw.bin"), self.tensors)
            elif method in _OURS:
                if method == "ours_no_value_cache":
                    planner.value_archive = lambda obj, settings=None: None  # every value torch.save'd, as DCP does
                data_file.WRITEBACK = method != "ours_no_early_writeback"
                self.step += 1
                self.engine.save(self.step, model=self.w.model, optimizer=self.w.optim)  # durable on return
            else:
                from safetensors.torch import save_file

                save_file(self.tensors, os.path.join(path, "state.safetensors"))
                fsync_all([os.path.join(path, "state.safetensors")])  # the file, then its folder
            took = time.perf_counter() - t0
            self.cpu_s = time.process_time() - cpu0  # every thread of the process, user + system
            return took
        finally:
            planner.value_archive = value_archive
            data_file.WRITEBACK = True
            if method not in _OURS:
                shutil.rmtree(path, ignore_errors=True)
            else:
                self._drop_old()

    def _drop_old(self) -> None:
        folder = os.path.join(self.root, "ours")
        for name in os.listdir(folder):
            if name.startswith("iter_") and name != f"iter_{self.step:09d}":
                shutil.rmtree(os.path.join(folder, name), ignore_errors=True)

    def close(self) -> None:
        self.engine.close()


class _Breakdown:
    """Where a sync save's time goes: exclusive wall time per part (a part's nested parts are
    subtracted from it), every ``os.fsync`` classed by what it makes durable. Installed by
    wrapping the engine's own functions for the breakdown run only (never in the timed rounds)."""

    #: (module, attribute path, part name): the functions whose time is a part.
    PARTS = (
        ("ckpt_engine._engine.saver", "Saver._prepare", "state dicts, remap, checks"),
        ("ckpt_engine._dcpio.fast_save", "_local_step", "plan (cached after the first save)"),
        ("ckpt_engine._dcpio.fast_write", "FastFileSystemWriter._write_file", "data files: write + checksum"),
        ("ckpt_engine._dcpio.fast_write", "FastFileSystemWriter._publish", ".metadata files"),
        ("ckpt_engine._engine.targets", "write_checked_manifest", "completeness check + manifest"),
        ("ckpt_engine._engine.targets", "commit_rename", "rename into place"),
        ("ckpt_engine._engine.targets", "advance_latest", "latest_checkpoint.txt"),
    )

    def __init__(self) -> None:
        self.parts: dict[str, float] = {}
        self.fsyncs: dict[str, list[float]] = {}
        self._stack: list[list[float]] = []
        self._undo: list[tuple[Any, str, Any]] = []

    def _timed(self, name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                took = time.perf_counter() - frame[0]
                self.parts[name] = self.parts.get(name, 0.0) + took - frame[1]
                if self._stack:
                    self._stack[-1][1] += took

        return wrapper

    def _fsync(self, real: Any) -> Any:
        def fsync(fd: int) -> None:
            try:
                path = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                path = "?"
            name = os.path.basename(path)
            kind = (
                "data file (.distcp)"
                if name.endswith(".distcp")
                else ".metadata"
                if name.startswith(".metadata")
                else "manifest"
                if "manifest" in name
                else "latest_checkpoint.txt"
                if name.startswith("latest_checkpoint")
                else "folder"
                if os.path.isdir(path)
                else f"other ({name})"
            )
            self._timed(f"fsync: {kind}", real)(fd)
            self.fsyncs.setdefault(kind, []).append(0.0)

        return fsync

    def __enter__(self) -> _Breakdown:
        import importlib

        for module, attr, name in self.PARTS:
            owner: Any = importlib.import_module(module)
            *path, last = attr.split(".")
            for p in path:
                owner = getattr(owner, p)
            fn = getattr(owner, last)
            self._undo.append((owner, last, fn))
            setattr(owner, last, self._timed(name, fn))
        self._undo.append((os, "fsync", os.fsync))
        os.fsync = self._fsync(os.fsync)  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, last, fn in reversed(self._undo):
            setattr(owner, last, fn)


def breakdown(size: int, saves: int, root: str) -> dict[str, Any]:
    """``saves`` sync saves after an untimed first one, timed per part (:class:`_Breakdown`)."""
    bench = _Bench(size, root)
    try:
        bench.run("ours_sync")  # plans, creates the files once
        total = 0.0
        with _Breakdown() as b:
            for _ in range(saves):
                total += bench.run("ours_sync")
    finally:
        bench.close()
    parts = {k: v / saves for k, v in sorted(b.parts.items(), key=lambda kv: -kv[1])}
    parts["other (hooks, agreement, bookkeeping)"] = total / saves - sum(parts.values())
    return {
        "size_mib": size,
        "saves": saves,
        "save_s": total / saves,
        "parts_s": parts,
        "fsyncs_per_save": {k: len(v) / saves for k, v in b.fsyncs.items()},
    }


def _breakdown_table(result: dict[str, Any]) -> str:
    lines = [f"| part ({result['size_mib']} MiB, {result['saves']} saves) | ms per save | share |", "|---|---|---|"]
    for name, sec in result["parts_s"].items():
        lines.append(f"| {name} | {sec * 1e3:.1f} | {sec / result['save_s'] * 100:.0f} % |")
    lines.append(f"| **save** | **{result['save_s'] * 1e3:.1f}** | |")
    fsyncs = ", ".join(f"{k}: {v:g}" for k, v in result["fsyncs_per_save"].items())
    return "\n".join(lines) + f"\n\nfsyncs per save: {fsyncs}"


def _available(methods: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    skipped: dict[str, str] = {}
    try:
        import safetensors  # noqa: F401
    except ImportError as err:
        skipped["safetensors"] = f"not installed: {err}"
    return [m for m in methods if m not in skipped], skipped


def _measure(size: int, rounds: int, root: str, methods: list[str]) -> dict[str, Any]:
    bench = _Bench(size, root)
    samples: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    try:
        for m in methods:  # untimed: first save (planning), files created once
            bench.run(m)
        for r in range(rounds):
            order = methods if r % 2 == 0 else methods[::-1]
            for m in order:
                samples[m].append(bench.run(m))
                cpu[m].append(bench.cpu_s)
    finally:
        bench.close()

    def ratio(a: str, b: str) -> float | None:
        if a not in samples or b not in samples:
            return None
        return statistics.median(x / y for x, y in zip(samples[a], samples[b], strict=True))

    return {
        "size_mib": size,
        "label": bench.label,
        "state_bytes": bench.bytes,
        "samples_s": samples,
        "median_s": {m: statistics.median(v) for m, v in samples.items()},
        "cpu_samples_s": cpu,
        "median_cpu_s": {m: statistics.median(v) for m, v in cpu.items()},
        "ratios": {
            "ours_sync / ours_no_value_cache": ratio("ours_sync", "ours_no_value_cache"),
            "ours_sync / ours_no_early_writeback": ratio("ours_sync", "ours_no_early_writeback"),
            "ours_sync / raw_write": ratio("ours_sync", "raw_write"),
            "ours_sync / safetensors": ratio("ours_sync", "safetensors"),
        },
    }


def _table(results: list[dict[str, Any]]) -> str:
    lines = ["| method | " + " | ".join(f"{r['size_mib']} MiB" for r in results) + " |"]
    lines.append("|---|" + "---|" * len(results))
    for m in METHODS:
        cells = []
        for r in results:
            s = r["samples_s"].get(m)
            c = r.get("median_cpu_s", {}).get(m)
            cells.append(
                f"{statistics.median(s) * 1e3:.0f} ms ({min(s) * 1e3:.0f}-{max(s) * 1e3:.0f}), CPU {c * 1e3:.0f} ms"
                if s
                else "not run"
            )
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    for key in results[0]["ratios"] if results else ():
        cells = [f"{r['ratios'][key]:.2f}x" if r["ratios"][key] is not None else "-" for r in results]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="256,1024", help="MiB of model + AdamW (comma separated)")
    p.add_argument("--rounds", type=int, default=9, help="paired rounds per size")
    p.add_argument("--workdir", default=os.path.join(HERE, ".work", "write_path"))
    p.add_argument("--out", default=None, help="JSON results")
    p.add_argument("--smoke", action="store_true", help="4 MiB, one round")
    p.add_argument("--breakdown", type=int, default=0, help="also time N more saves per part (fsyncs, files, manifest)")
    args = p.parse_args(argv)
    sizes = [4] if args.smoke else [int(s) for s in args.sizes.split(",")]
    rounds = 1 if args.smoke else args.rounds

    import torch.distributed as dist

    torch.set_num_threads(1)
    with socket.socket() as s:  # one rank of gloo, as a single-rank torchrun job has
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    methods, skipped = _available(METHODS)
    load_start, t0 = os.getloadavg(), time.perf_counter()
    results = []
    breakdowns = []
    try:
        for size in sizes:
            shutil.rmtree(args.workdir, ignore_errors=True)
            results.append(_measure(size, rounds, args.workdir, methods))
            if args.breakdown or args.smoke:
                shutil.rmtree(args.workdir, ignore_errors=True)
                breakdowns.append(breakdown(size, args.breakdown or 1, args.workdir))
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
        dist.destroy_process_group()
    out = {
        "command": " ".join([os.path.basename(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count()},
        "load_average_start": load_start,
        "load_average_end": os.getloadavg(),
        "wall_s": time.perf_counter() - t0,
        "skipped": skipped,
        "results": results,
        "breakdown": breakdowns,
    }
    print(_table(results))
    for b in breakdowns:
        print()
        print(_breakdown_table(b))
    for m, why in skipped.items():
        print(f"{m}: not run: {why}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
