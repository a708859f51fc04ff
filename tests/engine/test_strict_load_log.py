"""A failed strict load is reported once: by the engine's error, with no ERROR line from DCP's own
logger repeating it with a traceback.

``dcp.load`` is wrapped by torch's ``_dcp_method_logger(log_exceptions=True)``, which logs the
wrapped error (for a ``CheckpointException``, every rank's traceback) at ERROR on the logger
``c10d-NullHandler-dcp_logger``. In the torch this project pins, that logger has only a
``NullHandler`` and does not propagate, so nothing reaches the terminal, in one process or under
torchrun. These tests pin that, with the root logger configured as the command line and the
demo configure it (``logging.basicConfig``), and fail if a torch upgrade starts printing it.
"""

from __future__ import annotations

import logging
import os
import textwrap
from pathlib import Path

import pytest
from torch import nn

from ckpt_engine import CheckpointEngine, LoadStrictnessError

#: The name torch gives DCP's logger (``c10d_logger._get_or_create_logger("dcp_logger")``).
DCP_LOGGER = "c10d-NullHandler-dcp_logger"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_a_strict_mismatch_in_one_process_prints_nothing_but_the_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """Also with a handler on DCP's logger itself (as a torch build or a job's logging setup may
    give it): ``load()`` reads through the engine's own loader, so DCP's ``dcp.load`` wrapper,
    and with it the ERROR record, never runs."""
    import torch.distributed.checkpoint  # noqa: F401  (creates DCP's logger)

    root, dcp_logger = logging.getLogger(), logging.getLogger(DCP_LOGGER)
    handler, dcp_records, stream = _Records(), _Records(), logging.StreamHandler()  # stream: fd 2, captured
    old_level = root.level
    root.addHandler(handler)
    root.addHandler(stream)
    dcp_logger.addHandler(dcp_records)
    root.setLevel(logging.DEBUG)
    try:
        with CheckpointEngine({"save_dir": str(tmp_path)}) as engine:
            engine.save(1, model=nn.Linear(4, 4))
        capfd.readouterr()
        with CheckpointEngine({"save_dir": str(tmp_path)}) as engine, pytest.raises(LoadStrictnessError):
            engine.load(model=nn.Linear(4, 8))
    finally:
        root.removeHandler(handler)
        root.removeHandler(stream)
        dcp_logger.removeHandler(dcp_records)
        root.setLevel(old_level)
    out, err = capfd.readouterr()
    assert "Traceback" not in out + err and "'event': 'exception'" not in out + err, err
    for records in (handler.records, dcp_records.records):
        assert not [r for r in records if r.levelno >= logging.ERROR], [r.getMessage()[:300] for r in records]


SCRIPT = textwrap.dedent(
    """
    import logging
    import sys

    import torch.distributed as dist
    from torch import nn

    from ckpt_engine import CheckpointEngine, LoadStrictnessError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    dist.init_process_group("gloo")
    with CheckpointEngine({"save_dir": sys.argv[1]}) as engine:
        engine.save(1, model=nn.Linear(4, 4))
    with CheckpointEngine({"save_dir": sys.argv[1]}) as engine:
        try:
            engine.load(model=nn.Linear(4, 8))
        except LoadStrictnessError:
            print(f"rank {dist.get_rank()}: LoadStrictnessError", flush=True)
    dist.destroy_process_group()
    """
)


@pytest.mark.dist
@pytest.mark.skipif(not os.environ.get("CKPT_ENGINE_SLOW_TESTS"), reason="a torchrun run: set CKPT_ENGINE_SLOW_TESTS=1")
def test_a_strict_mismatch_under_torchrun_prints_nothing_but_the_error(tmp_path: Path) -> None:
    from _torchrun import run_torchrun

    script = tmp_path / "strict_load.py"
    script.write_text(SCRIPT)
    result = run_torchrun(str(script), str(tmp_path / "run"), nproc=2, timeout=300)
    assert result.returncode == 0, result.describe()
    assert "rank 0: LoadStrictnessError" in result.stdout and "rank 1: LoadStrictnessError" in result.stdout
    assert "Traceback" not in result.stderr and "ERROR" not in result.stderr, result.stderr
