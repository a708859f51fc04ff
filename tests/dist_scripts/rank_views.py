"""Ranks that resolve different checkpoints (tests/engine/test_rank_agreement.py).

argv: one JSON object ``{"cases": [{"name": ..., "config": {engine config}}, ...]}``, where every
``{rank}`` in a config's strings becomes this rank's number: each rank gets a folder of its own,
standing for what one host sees. For each case, every rank loads a model (``dedup_reads`` as the
config says) and reports, rank-ordered, what ``load()`` raised (type and message) or the
iteration and the loaded weights' SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

from _common import ckpt_test_exit, init, make_model, report_ordered

from ckpt_engine import CheckpointEngine, CkptEngineError


def _fill(value: Any, rank: int) -> Any:
    if isinstance(value, str):
        return value.replace("{rank}", str(rank))
    if isinstance(value, dict):
        return {k: _fill(v, rank) for k, v in value.items()}
    return value


def weights_digest(model: Any) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    rank, _ = init()
    spec = json.loads(sys.argv[1])
    for case in spec["cases"]:
        model = make_model(seed=99)
        try:
            with CheckpointEngine(_fill(case["config"], rank)) as engine:
                result = engine.load(model=model)
            out: dict[str, Any] = {"iteration": result.iteration, "weights": weights_digest(model)}
        except CkptEngineError as err:
            out = {"type": type(err).__name__, "message": str(err)}
        report_ordered({"case": case["name"], **out})
    ckpt_test_exit()


if __name__ == "__main__":
    main()
