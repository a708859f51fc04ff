"""Telling a hostile stored item from a damaged one.

Tensor items and non-tensor values are unpickled with ``torch.load(weights_only=True)``. When a
pickle names a global that loader refuses, the engine raises :class:`UnsafeCheckpointError`
naming the global, never :class:`CorruptCheckpointError`. torch's own message opens with advice
to re-run with ``weights_only=False``, which would run the pickle's code; that advice is never
repeated. torch 2.13 has two wordings:

* ``Trying to load unsupported GLOBAL posix.system whose module posix is blocked``: a module
  torch blocks outright (``os``, ``posix``, ``subprocess``, ...). No checkpoint needs it: the
  file was crafted, and the error says so (no hint to trust it).
* ``Unsupported global: GLOBAL fractions.Fraction was not an allowed global by default``: a
  class outside the allowlist, which a legacy checkpoint's non-tensor value may legitimately
  hold; for such values the error keeps the engine's ``trust_checkpoint`` hint.
"""

from __future__ import annotations

import re

from ..errors import CkptEngineError, CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["blocked_global", "refine_unsafe", "unsafe_value_error", "weights_only_reason"]

_BLOCKED = re.compile(r"unsupported GLOBAL\s+([^\s,;]+)\s+whose module\s+\S+\s+is blocked", re.IGNORECASE)
_GLOBAL = re.compile(r"(?:unsupported GLOBAL|Unsupported global: GLOBAL)\s+([^\s,;]+)", re.IGNORECASE)
#: Lines of torch's weights-only message that advise turning the protection off.
_ADVICE = re.compile(r"weights_only.{0,40}False|Weights only load failed|arbitrary code|trusted source", re.I)
#: The message :func:`ckpt_engine._format.metadata._read_error` gives a failed data read.
_READ_FAILED = re.compile(r"^(?P<file>.+?) is corrupt: reading (?P<what>.+?) failed with ", re.S)


def _chain(err: BaseException | None) -> list[BaseException]:
    seen: list[BaseException] = []
    while err is not None and err not in seen and len(seen) < 16:
        seen.append(err)
        err = err.__cause__ or err.__context__
    return seen


def blocked_global(err: BaseException | None, *, blocked_only: bool = False) -> str | None:
    """The global a weights-only unpickling refused (``posix.system``), found in ``err`` or
    the errors it was raised from; ``None`` if ``err`` is no such refusal. ``blocked_only``:
    only a global of a module torch blocks outright (never in a genuine checkpoint)."""
    for e in _chain(err):
        found = (_BLOCKED if blocked_only else _GLOBAL).search(str(e))
        if found:
            return found.group(1).rstrip(".")
    return None


def weights_only_reason(err: BaseException) -> str:
    """The reason in torch's weights-only error, without its advice to disable the protection."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    kept = [ln for ln in lines if not _ADVICE.search(ln) and not ln.startswith("Check the documentation")]
    return (kept[0] if kept else type(err).__name__)[:300]


def _message(where: str, name: str) -> str:
    return (
        f"{where} references the global {name}, which weights_only=True unpickling refuses to construct: "
        "the checkpoint was crafted or tampered with, not merely damaged. Nothing from it was loaded; "
        "do not load it with trust_checkpoint=True or weights_only=False"
    )


def unsafe_value_error(where: str, err: BaseException) -> UnsafeCheckpointError | None:
    """An :class:`UnsafeCheckpointError` for ``err`` raised unpickling the non-tensor value
    ``where`` describes: for a global of a blocked module, a crafted file; for a class outside
    the allowlist, a value that needs ``trust_checkpoint``. ``None`` if ``err`` names no global."""
    name = blocked_global(err, blocked_only=True)
    if name is not None:
        return UnsafeCheckpointError(_message(where, name))
    name = blocked_global(err)
    if name is None:
        return None
    return UnsafeCheckpointError(
        f"{where}: the stored value references the global {name}, which weights_only=True unpickling does not "
        "allow; it was not loaded. If you trust this checkpoint (it holds your own class), set "
        "trust_checkpoint=True"
    )


def refine_unsafe(err: CkptEngineError, where: str) -> CkptEngineError:
    """``err``, unless it reports a refused global as corruption: then the
    :class:`UnsafeCheckpointError` it should have been (``where`` names the component)."""
    if not isinstance(err, CorruptCheckpointError) or isinstance(err, UnsafeCheckpointError):
        return err
    name = blocked_global(err)
    if name is None:
        return err
    m = _READ_FAILED.match(str(err))
    what = f"{m.group('file')} (the data of {m.group('what')})" if m else where
    refined = UnsafeCheckpointError(_message(what, name))
    refined.__cause__ = None
    return refined
