"""2 ranks: a strict load into a model whose shapes and keys differ must fail on every rank.

A scenario of ``core.py`` (argument: save_dir). Saves an FSDP2 model (``LINEAR_SIZES``), then
loads it (strict, the default) into an FSDP2 model whose ``2.*``/``3.weight`` shapes differ and
that has an extra layer ``4``. Each rank catches the error and returns its type, fields, message
and how long it took, plus whether the target parameters were left untouched; then both ranks load
the checkpoint into a correct model (the process group is still in step after the failure).
"""

from __future__ import annotations

import time
from typing import Any

from _common import cpu_mesh, make_model, params_full, shard_fsdp2

from ckpt_engine import CheckpointEngine, CkptEngineError, LoadStrictnessError

MISMATCHED_SIZES = ((8, 16), (16, 6), (6, 1), (1, 2))


def scenario(save_dir: str) -> list[Any]:
    mesh = cpu_mesh()
    src = shard_fsdp2(make_model(seed=0), mesh)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        engine.save(1, model=src)
    saved = params_full(src)

    dst = shard_fsdp2(make_model(seed=3, sizes=MISMATCHED_SIZES), mesh)
    before = params_full(dst)
    outcome: dict[str, object] = {"raised": None}
    t0 = time.monotonic()
    try:
        with CheckpointEngine({"save_dir": save_dir}) as engine:
            engine.load(model=dst)
    except CkptEngineError as err:
        outcome = {
            "raised": type(err).__name__,
            "is_strictness": isinstance(err, LoadStrictnessError),
            "component": getattr(err, "component", None),
            "missing": list(getattr(err, "missing", ())),
            "mismatched": list(getattr(err, "mismatched", ())),
            "message": str(err),
        }
    outcome["seconds"] = time.monotonic() - t0
    outcome["untouched"] = params_full(dst) == before

    # The ranks are still in step: a good load right after the failed one works.
    good = shard_fsdp2(make_model(seed=4), mesh)
    with CheckpointEngine({"save_dir": save_dir}) as engine:
        result = engine.load(model=good)
    outcome["recovered_iteration"] = result.iteration
    outcome["recovered_equal"] = params_full(good) == saved
    return [outcome]
