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
METHODS = ("raw_write", "ours_sync", "ours_no_value_cache", "safetensors")
_OURS = ("ours_sync", "ours_no_value_cache")


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

    def run(self, method: str) -> float:
        from ckpt_engine._dcpio import planner

        value_archive = planner.value_archive
        path = os.path.join(self.root, method)
        os.makedirs(path, exist_ok=True)
        t0 = time.perf_counter()
        try:
            if method == "raw_write":
                _raw(os.path.join(path, "raw.bin"), self.tensors)
            elif method in _OURS:
                if method == "ours_no_value_cache":
                    planner.value_archive = lambda obj: None  # every value torch.save'd, as DCP does
                self.step += 1
                self.engine.save(self.step, model=self.w.model, optimizer=self.w.optim)  # durable on return
            else:
                from safetensors.torch import save_file

                save_file(self.tensors, os.path.join(path, "state.safetensors"))
                fsync_all([os.path.join(path, "state.safetensors")])  # the file, then its folder
            return time.perf_counter() - t0
        finally:
            planner.value_archive = value_archive
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
    try:
        for m in methods:  # untimed: first save (planning), files created once
            bench.run(m)
        for r in range(rounds):
            order = methods if r % 2 == 0 else methods[::-1]
            for m in order:
                samples[m].append(bench.run(m))
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
        "ratios": {
            "ours_sync / ours_no_value_cache": ratio("ours_sync", "ours_no_value_cache"),
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
            cells.append(
                f"{statistics.median(s) * 1e3:.0f} ms ({min(s) * 1e3:.0f}-{max(s) * 1e3:.0f})" if s else "not run"
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
    try:
        for size in sizes:
            shutil.rmtree(args.workdir, ignore_errors=True)
            results.append(_measure(size, rounds, args.workdir, methods))
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
    }
    print(_table(results))
    for m, why in skipped.items():
        print(f"{m}: not run: {why}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
