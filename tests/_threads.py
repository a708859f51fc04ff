"""Run functions as the ranks of a job, one thread each (for tests of store-based barriers)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_threads(*fns: Callable[[], Any]) -> list[Any]:
    """Each of ``fns`` on a thread of its own, all started before any is joined; what each
    returned or raised, in order. No time limit: the barriers the functions run bound themselves."""
    out: list[Any] = [None] * len(fns)

    def call(i: int) -> None:
        try:
            out[i] = fns[i]()
        except Exception as err:
            out[i] = err

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out
