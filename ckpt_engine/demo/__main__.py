"""``python -m ckpt_engine.demo``: the demo's worker and supervisor entry point."""

import sys

from .worker import worker_main

sys.exit(worker_main(sys.argv[1:]))
