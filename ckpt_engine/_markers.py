"""The pluggy project name and markers. ``hookimpl`` is public; ``hookspec`` is for :mod:`.hookspecs`."""

from __future__ import annotations

import pluggy

PROJECT_NAME = "ckpt_engine"

hookimpl = pluggy.HookimplMarker(PROJECT_NAME)
hookspec = pluggy.HookspecMarker(PROJECT_NAME)
