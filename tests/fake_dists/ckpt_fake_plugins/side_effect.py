"""Importing this module leaves a mark: proves a disabled plugin is never imported."""

import os

_marker = os.environ.get("CKPT_FAKE_SIDE_EFFECT_MARKER")
if _marker:
    with open(_marker, "w") as f:
        f.write("imported")
