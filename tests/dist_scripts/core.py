"""2 ranks: the core scenarios (``core_<name>.py``) one after another in one launch and process group.

argv: ``NAME=SAVE_DIR ...``, run in the order given: ``fsdp_save``, ``fsdp_load``, ``reshard``,
``strict``, ``rank_failure``. Each scenario is a module whose ``scenario(save_dir)`` returns its
payloads; every rank reports ``{"scenario": NAME, "payloads": [...]}`` (rank-ordered). A launch
costs more than most of these scenarios, so they share one; none of them leaves the process group
out of step (the failing ones check that the ranks still load together afterwards). Each scenario
starts from the seed a fresh process would have (``torch.manual_seed(0)``, as ``init()`` sets it).

A scenario that raises reports ``{"scenario": NAME, "error": <traceback>}`` from the rank it raised
on and ends the launch (exit 1; torchrun then stops the other rank): the tests of that scenario
and of the ones after it fail with the traceback, the earlier ones keep their results.
"""

from __future__ import annotations

import importlib
import sys
import traceback

import torch
from _common import ckpt_test_exit, init, report, report_ordered


def main() -> None:
    init()
    torch.set_num_threads(1)
    for arg in sys.argv[1:]:
        name, save_dir = arg.split("=", 1)
        torch.manual_seed(0)
        try:
            payloads = importlib.import_module(f"core_{name}").scenario(save_dir)
        except BaseException:
            report({"scenario": name, "error": traceback.format_exc()})
            ckpt_test_exit(1)
        report_ordered({"scenario": name, "payloads": payloads})
    ckpt_test_exit()


if __name__ == "__main__":
    main()
