"""Where the suite's shared folders are, for the test modules of every part folder."""

from __future__ import annotations

from pathlib import Path

#: ``tests/``: the helper modules (``_cli``, ``_s3``, ``_torchrun``) and the scripts tests launch.
TESTS = Path(__file__).resolve().parent
#: The repository: ``benchmarks/``, ``docs/``, ``examples/``, ``scripts/``.
ROOT = TESTS.parent
#: Scripts a crash test forks and kills.
CRASH_SCRIPTS = TESTS / "crash_scripts"
#: The rank programs torchrun tests launch (``_common`` holds what they share).
DIST_SCRIPTS = TESTS / "dist_scripts"
#: The Lightning fits the integration tests run.
LIGHTNING_SCRIPTS = TESTS / "lightning_scripts"
#: The Hugging Face Trainer runs the ``transformers`` integration tests start, stop and kill.
HF_SCRIPTS = TESTS / "hf_scripts"
