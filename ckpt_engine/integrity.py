"""Checking a checkpoint against its manifest, as a library call.

>>> from ckpt_engine.integrity import verify_checkpoint
>>> report = verify_checkpoint("runs/exp1/checkpoints/iter_000000020")  # doctest: +SKIP
>>> report.verified, report.problems                                    # doctest: +SKIP
(True, [])

The manifest format and the rest of the machinery live in the engine's internal format package.
"""

from ._format.names import MANIFEST_FILE
from ._format.verify import VerifyLevel, VerifyReport, verify_checkpoint

__all__ = ["MANIFEST_FILE", "VerifyLevel", "VerifyReport", "verify_checkpoint"]
