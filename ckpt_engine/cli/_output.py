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


#: Set by ``--quiet``: no progress bar anywhere, even on a terminal.
QUIET = False


class Progress:
    """A one-line progress bar on stderr: bytes done of the total, with their rate, and the items
    (files, tensors, checkpoints) done. Shown only when stderr is a terminal and not ``--quiet``;
    drawn by ``tqdm`` where it is installed (imported here, when a bar is shown: never for a pipe,
    never at start-up), else by a line of its own."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: IO[str] | None = None,
        enabled: bool | None = None,
        *,
        items: int | None = None,
        noun: str = "file",
        interval: float = 0.1,
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = (not QUIET and isatty(self.stream)) if enabled is None else enabled
        from .._inspect.files import shown

        # A label may hold a stored name (a component folder's): escaped as print_lines escapes it.
        self.label, self.total, self.done = shown(label), max(total, 0), 0
        self.items, self.items_done, self.noun, self.interval = items, 0, noun, interval
        self._start = self._last = time.monotonic()
        self._last -= interval  # the first update draws
        self._tqdm: Any = _tqdm_bar(self) if self.enabled else None

    def advance(self, n: int) -> None:
        """``n`` more bytes, and one more item (a file, a tensor) done."""
        self.items_done += 1
        self.update(self.done + n)

    def update(self, done: int, total: int | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last < self.interval and self.done < self.total:
            return
        self._last = now
        if self._tqdm is not None:
            self._tqdm.total = self.total
            self._tqdm.set_postfix_str(self._items_text(), refresh=False)
            step = self.done - self._tqdm.n  # tqdm's rate: bytes over the time they took
            if step > 0:
                self._tqdm.update(step)
            else:
                self._tqdm.refresh()
            return
        self._draw(now)

    def _items_text(self) -> str:
        if self.items is None and not self.items_done:
            return ""
        of = f"/{self.items}" if self.items is not None else ""
        return f"{self.items_done}{of} {self.noun}s"

    def _draw(self, now: float) -> None:
        from .._inspect.files import human_bytes

        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        rate = self.done / max(now - self._start, 1e-6)
        items = self._items_text()
        self.stream.write(
            f"\r{self.label} [{'#' * int(frac * 30):<30}] {frac:4.0%} {human_bytes(self.done)}/"
            f"{human_bytes(self.total)} {human_bytes(int(rate))}/s" + (f", {items}" if items else "")
        )
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()  # leave=False: the line is cleared
            return
        self.stream.write("\r\033[K")
        self.stream.flush()


def _tqdm_bar(progress: Progress) -> Any:
    """A ``tqdm`` bar drawing ``progress`` (bytes, with tqdm's own rate), or None without tqdm."""
    try:
        from tqdm import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return None
    return tqdm(
        total=progress.total,
        desc=progress.label,
        file=progress.stream,
        unit="B",
        unit_scale=True,
        unit_divisor=1024,
        leave=False,
        mininterval=0,  # update() draws at most every ``interval`` already
        miniters=0,
        dynamic_ncols=True,
    )


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
