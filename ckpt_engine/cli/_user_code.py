"""How the command line imports the user's code (``--model`` factories, ``module:attr`` plugins
of a ``--config``): the current folder is importable, as with ``python -m``, for every command."""

from __future__ import annotations

import os
import sys


def make_cwd_importable() -> None:
    """Put the current folder first on ``sys.path`` (once), as ``python -m`` does."""
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
