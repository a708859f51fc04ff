"""Helpers for ``stage`` providers that copy a snapshot in the background.

A provider that lets training run while it copies must notice an in-place edit of a tensor it has
not copied yet. torch counts in-place edits per tensor (the version counter autograd uses), but
exposes the count only as a private attribute; :func:`tensor_version` reads it through the
engine's one seam to private torch behaviour, which the engine's tests pin.
"""

from ._dcpio.torch_private import tensor_version

__all__ = ["tensor_version"]
