"""Paired hot loads of one peers-bench state through two versions of the engine's direct reader.

A change to ``ckpt_engine/_dcpio/fast_read.py`` moves a load by a few percent, less than two
separate benchmark runs drift apart on a shared machine. Here both versions load the same
checkpoint in the same process, round by round in alternating order, each load a new
``CheckpointEngine`` as a resumed job has; the figure is the median of the per-round ratios
(``b / a``). The other ``.py`` file is any version of ``fast_read.py`` that imports what the
current package still has (``git show REV:ckpt_engine/_dcpio/fast_read.py > /tmp/a.py``); it runs
as the package's module, so everything else is the current engine.

    python benchmarks/reader_ab_bench.py --a /tmp/a.py --state lm256 --rounds 15
    python benchmarks/reader_ab_bench.py --a /tmp/a.py --state 1024 --rounds 11 --cold --workdir ./ab

``--b`` defaults to the current ``fast_read.py``. ``--cold`` drops the checkpoint's pages before
every load (and safetensors' file's). One intra-op thread, as ``peers_bench.py``'s child.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))


def _reader(path: str) -> Any:
    """``FastFileSystemReader`` from the source file ``path``, run as the package's module."""
    import ckpt_engine._dcpio.fast_read as current

    module = types.ModuleType(current.__name__)
    module.__package__ = current.__package__
    module.__file__ = path
    with open(path) as f:
        exec(compile(f.read(), path, "exec"), module.__dict__)  # the user's own file, as the module
    return module.FastFileSystemReader


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", required=True, help="a version of fast_read.py (the baseline)")
    parser.add_argument("--b", help="another version (default: the current one)")
    parser.add_argument("--state", default="lm256", help="a peers_bench.py state: N, lmN or embN (MiB), or small[N]")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--cold", action="store_true", help="drop the files' pages before every load")
    parser.add_argument("--workdir", default="/dev/shm/reader_ab", help="where the checkpoints go")
    parser.add_argument("--out", help="JSON results")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, HERE)
    import torch
    from _peers_measure import build, drop_page_cache, fsync_all, parse_state, trim
    from _peers_methods import Safetensors

    import ckpt_engine._dcpio.fast_read as current
    import ckpt_engine._engine.loader as loader
    from ckpt_engine import CheckpointEngine

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    kind, size = parse_state(args.state)
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    w, loss, label = build(kind, size, 2)
    w.root = args.workdir
    loss().backward()
    w.optim.step()
    folder = w.folder("engine")
    with CheckpointEngine({"save_dir": folder}) as engine:
        engine.save(1, model=w.model, optimizer=w.optim)
    peer = Safetensors()
    peer.setup(w)
    peer.save(1)
    paths = [folder, peer.paths(1)[0]]
    fsync_all(paths)
    readers = {"a": _reader(args.a), "b": _reader(args.b or str(current.__file__))}

    def engine_load(reader: Any) -> Callable[[], None]:
        def load() -> None:
            loader.FastFileSystemReader = reader
            with CheckpointEngine({"save_dir": folder}) as engine:
                engine.load(model=w.model, optimizer=w.optim)

        return load

    loads: dict[str, Callable[[], None]] = {name: engine_load(r) for name, r in readers.items()}
    loads["safetensors"] = lambda: peer.load(1)
    try:
        for load in loads.values():
            load()
        wall: dict[str, list[float]] = {name: [] for name in loads}
        names = list(loads)
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                if args.cold:
                    drop_page_cache(paths)
                trim()
                t0 = time.perf_counter()
                loads[name]()
                wall[name].append(time.perf_counter() - t0)
    finally:
        loader.FastFileSystemReader = current.FastFileSystemReader
        shutil.rmtree(args.workdir, ignore_errors=True)
    ratio = {
        f"{x}/{y}": statistics.median(p / q for p, q in zip(wall[x], wall[y], strict=True))
        for x, y in (("b", "a"), ("a", "safetensors"), ("b", "safetensors"))
    }
    out = {"state": label, "cold": args.cold, "rounds": args.rounds, "wall_s": wall, "ratios": ratio}
    medians = ", ".join(f"{k} {1000 * statistics.median(v):.1f} ms" for k, v in wall.items())
    print(f"{label}, {'cold' if args.cold else 'hot'}: {medians}")
    print(", ".join(f"{k} {v:.3f}x" for k, v in ratio.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
