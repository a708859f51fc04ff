"""What every command shares: exit codes, printing text and JSON, a progress bar, size arguments."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import IO, Any

EXIT_OK, EXIT_PROBLEM, EXIT_ERROR, EXIT_INTERRUPTED = 0, 1, 2, 130
#: ``verify``: nothing is damaged, but some checkpoint's content holds no checksums to check it against.
EXIT_UNVERIFIED = 3
JSON_HELP = "print JSON instead of text (for scripts)"
TRUST_HELP = (
    "read values that weights_only refuses with weights_only=False: this runs any code the "
    "checkpoint holds; only for checkpoints you trust"
)


class Progress:
    """A one-line progress bar on stderr, shown only when stderr is a terminal."""

    def __init__(self, label: str, total: int, stream: IO[str] | None = None, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = isatty(self.stream) if enabled is None else enabled
        from .._inspect.files import shown

        # A label may hold a stored name (a component folder's): escaped as print_lines escapes it.
        self.label, self.total, self.done = shown(label), max(total, 0), 0
        self._last = 0.0

    def advance(self, n: int) -> None:
        self.update(self.done + n)

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        now = time.monotonic()
        if self.enabled and (now - self._last > 0.1 or self.done >= self.total):
            from .._inspect.files import human_bytes

            self._last = now
            frac = min(self.done / self.total, 1.0) if self.total else 1.0
            bar = "#" * int(frac * 30)
            self.stream.write(
                f"\r{self.label} [{bar:<30}] {frac:4.0%} {human_bytes(self.done)}/{human_bytes(self.total)}"
            )
            self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\r\033[K")
            self.stream.flush()


def isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


def print_lines(*lines: str) -> None:
    """Print ``lines``; a character a terminal would act on (ESC, BEL, CR: from a stored name that
    reached a line unescaped) is printed escaped, as ``repr`` writes it."""
    from .._inspect.files import shown

    for line in lines:
        print(shown(line, lines=True))


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def print_json(obj: Any) -> None:
    print(json.dumps(obj, indent=2, default=str))


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    mult = units.get(t[-1:], 1)
    try:
        value = int(float(t[:-1] if t[-1:] in units else t) * mult)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 64M)") from err
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return value
