"""Files and small messages between two ranks over a gloo process group: raw bytes, checksummed on
arrival, never unpickled.

A transfer is a stream: the files one rank sends another, in an order both know in advance (the
receiver has their sizes and checksums from the manifest it was sent first), concatenated and cut
into chunks of :data:`CHUNK_BYTES`. Both sides step through the same chunks in lockstep, each step
an ``isend`` and an ``irecv`` of at most one chunk, so two ranks can send to each other at once
(a ring of replicas), memory stays at two chunks per transfer, and no step waits longer than the
group's timeout. The receiver hashes every byte as it writes it and compares each file with its
checksum; a file that does not match (a replica damaged on the sender's disk, a sender that
could not read its file and sent zeros to keep the lockstep) is reported, never committed.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._format.hashing import Hasher, new_hasher

__all__ = [
    "CHUNK_BYTES",
    "Incoming",
    "Outgoing",
    "Throttle",
    "TransferOutcome",
    "exchange_bytes",
    "exchange_files",
]

#: The largest piece of a stream one ``isend`` carries (and what each side buffers).
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class Outgoing:
    """Files this rank sends to rank ``peer``: ``(rel, size)`` under ``root``, in stream order."""

    peer: int
    root: str
    files: Sequence[tuple[str, int]]


@dataclass(frozen=True)
class Incoming:
    """Files this rank receives from rank ``peer`` into ``root``: ``(rel, size, checksum)`` in
    stream order, checked with ``algorithm``; ``sync``: fsync each file once it is complete."""

    peer: int
    root: str
    files: Sequence[tuple[str, int, str]]
    algorithm: str
    sync: bool = True


@dataclass
class TransferOutcome:
    """What a transfer did on this rank."""

    bytes_sent: int = 0
    bytes_received: int = 0
    #: Files this rank could not send (read errors: zeros went in their place), with the reason.
    unsent: dict[str, str] = field(default_factory=dict)
    #: Files received that failed their checks (checksum, write error), with the reason.
    bad: dict[str, str] = field(default_factory=dict)


class Throttle:
    """Keeps a stream under ``mb_per_s`` (``None``: no limit) by sleeping between chunks."""

    def __init__(self, mb_per_s: float | None) -> None:
        self._rate = None if mb_per_s is None else mb_per_s * 1e6
        self._start = time.monotonic()
        self._bytes = 0

    def account(self, nbytes: int) -> None:
        if self._rate is None:
            return
        self._bytes += nbytes
        ahead = self._bytes / self._rate - (time.monotonic() - self._start)
        if ahead > 0:
            time.sleep(ahead)


def _wait(works: Sequence[Any]) -> None:
    for work in works:
        work.wait()


def _isend(tensor: torch.Tensor, dst: int, group: Any) -> Any:
    return dist.isend(tensor, dst=dist.get_global_rank(group, dst) if group is not None else dst, group=group)


def _irecv(tensor: torch.Tensor, src: int, group: Any) -> Any:
    return dist.irecv(tensor, src=dist.get_global_rank(group, src) if group is not None else src, group=group)


def exchange_bytes(group: Any, send_to: int | None, data: bytes, recv_from: int | None, limit: int) -> bytes | None:
    """Send ``data`` to rank ``send_to`` while receiving a message from ``recv_from`` (either may
    be ``None``); returns what was received. A message longer than ``limit`` bytes is refused
    (:class:`ValueError`) before its payload is received, which leaves the pair out of step: the
    caller treats the group as broken."""
    out_len = torch.tensor([len(data)], dtype=torch.int64)
    in_len = torch.zeros(1, dtype=torch.int64)
    works = []
    if send_to is not None:
        works.append(_isend(out_len, send_to, group))
    if recv_from is not None:
        works.append(_irecv(in_len, recv_from, group))
    _wait(works)
    size = int(in_len.item())
    if recv_from is not None and not 0 <= size <= limit:
        raise ValueError(f"rank {recv_from} announced a message of {size} bytes; at most {limit} are allowed")
    works = []
    if send_to is not None and data:
        works.append(_isend(torch.frombuffer(bytearray(data), dtype=torch.uint8), send_to, group))
    payload = torch.empty(size if recv_from is not None else 0, dtype=torch.uint8)
    if recv_from is not None and size:
        works.append(_irecv(payload, recv_from, group))
    _wait(works)
    return payload.numpy().tobytes() if recv_from is not None else None


class _Reader:
    """The sender's side: files read one after another into chunks."""

    def __init__(self, out: Outgoing, result: TransferOutcome) -> None:
        self._files = iter(out.files)
        self._root = out.root
        self._result = result
        self._current: tuple[str, io.BufferedIOBase | None, int] | None = None

    def _next_file(self) -> tuple[str, io.BufferedIOBase | None, int]:
        rel, size = next(self._files)
        try:
            handle: io.BufferedIOBase | None = open(os.path.join(self._root, *rel.split("/")), "rb")  # noqa: SIM115
        except OSError as err:
            self._result.unsent[rel] = f"{type(err).__name__}: {err.strerror or err}"
            handle = None
        return rel, handle, size

    def fill(self, view: memoryview) -> None:
        """Fill ``view`` with the next bytes of the stream (zeros for what cannot be read)."""
        done = 0
        while done < len(view):
            if self._current is None or self._current[2] == 0:
                self._close()
                self._current = self._next_file()
                continue
            rel, handle, left = self._current
            n = min(left, len(view) - done)
            got = 0
            if handle is not None:
                try:
                    got = handle.readinto(view[done : done + n]) or 0
                except OSError as err:
                    self._result.unsent.setdefault(rel, f"{type(err).__name__}: {err.strerror or err}")
                    handle.close()
                    handle = None
            if got < n:
                self._result.unsent.setdefault(rel, "the file is shorter than its manifest says")
                view[done + got : done + n] = bytes(n - got)
            done += n
            self._current = (rel, handle, left - n)

    def _close(self) -> None:
        if self._current is not None and self._current[1] is not None:
            self._current[1].close()
        self._current = None

    def close(self) -> None:
        self._close()


class _Writer:
    """The receiver's side: chunks split into files, each hashed as written and checked at its end."""

    def __init__(self, inc: Incoming, result: TransferOutcome) -> None:
        self._inc = inc
        self._files = iter(inc.files)
        self._result = result
        self._current: tuple[str, io.BufferedIOBase | None, int, str, Hasher | None] | None = None
        for rel, size, checksum in inc.files:
            if size == 0:  # no bytes in the stream: written here, checked like any other
                self._finish((rel, self._open(rel), 0, checksum, new_hasher(inc.algorithm)))

    def _open(self, rel: str) -> io.BufferedIOBase | None:
        path = os.path.join(self._inc.root, *rel.split("/"))
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return open(path, "wb")
        except OSError as err:
            self._result.bad[rel] = f"cannot write it: {err.strerror or err}"
            return None

    def _next_file(self) -> tuple[str, io.BufferedIOBase | None, int, str, Hasher | None]:
        while True:
            rel, size, checksum = next(self._files)
            if size:
                return rel, self._open(rel), size, checksum, new_hasher(self._inc.algorithm)

    def take(self, view: memoryview) -> None:
        done = 0
        while done < len(view):
            if self._current is None:
                self._current = self._next_file()
            rel, handle, left, checksum, hasher = self._current
            n = min(left, len(view) - done)
            piece = view[done : done + n]
            if hasher is not None:
                hasher.update(piece)
            if handle is not None:
                try:
                    handle.write(piece)
                except OSError as err:
                    self._result.bad.setdefault(rel, f"cannot write it: {err.strerror or err}")
                    handle.close()
                    handle = None
            done += n
            self._current = (rel, handle, left - n, checksum, hasher)
            if left - n == 0:
                self._finish(self._current)
                self._current = None

    def _finish(self, current: tuple[str, io.BufferedIOBase | None, int, str, Hasher | None]) -> None:
        rel, handle, _, checksum, hasher = current
        if handle is not None:
            try:
                handle.flush()
                if self._inc.sync:
                    os.fsync(handle.fileno())
            except OSError as err:
                self._result.bad.setdefault(rel, f"cannot write it: {err.strerror or err}")
            finally:
                handle.close()
        if hasher is None:
            self._result.bad.setdefault(rel, f"cannot check it: checksum algorithm {self._inc.algorithm!r} is unknown")
        elif hasher.hexdigest() != checksum:
            self._result.bad.setdefault(rel, "its checksum does not match the manifest's")

    def close(self) -> None:
        if self._current is not None and self._current[1] is not None:
            self._current[1].close()
        self._current = None


def _chunks(total: int) -> Iterator[int]:
    for start in range(0, total, CHUNK_BYTES):
        yield min(CHUNK_BYTES, total - start)


def exchange_files(
    group: Any, out: Outgoing | None, inc: Incoming | None, throttle: Throttle | None = None
) -> TransferOutcome:
    """Send ``out``'s files and receive ``inc``'s at the same time (see the module docstring).

    Both ranks of each pair must call this with matching lists (the sender's ``out`` is the
    receiver's ``inc`` without checksums). Returns what was sent and received, and which files
    failed; a failure of the process group itself (a peer died, a timeout) raises."""
    result = TransferOutcome()
    send_sizes = list(_chunks(sum(size for _, size in out.files))) if out is not None else []
    recv_sizes = list(_chunks(sum(size for _, size, _ in inc.files))) if inc is not None else []
    send_buf = torch.empty(min(CHUNK_BYTES, max(send_sizes, default=0)), dtype=torch.uint8)
    recv_buf = torch.empty(min(CHUNK_BYTES, max(recv_sizes, default=0)), dtype=torch.uint8)
    reader = _Reader(out, result) if out is not None else None
    writer = _Writer(inc, result) if inc is not None else None
    try:
        for step in range(max(len(send_sizes), len(recv_sizes))):
            works = []
            if reader is not None and step < len(send_sizes):
                n = send_sizes[step]
                reader.fill(send_buf.numpy().data[:n])
                assert out is not None
                works.append(_isend(send_buf[:n], out.peer, group))
                result.bytes_sent += n
            if writer is not None and step < len(recv_sizes):
                assert inc is not None
                works.append(_irecv(recv_buf[: recv_sizes[step]], inc.peer, group))
            _wait(works)
            if writer is not None and step < len(recv_sizes):
                n = recv_sizes[step]
                writer.take(recv_buf.numpy().data[:n])
                result.bytes_received += n
            if throttle is not None:
                throttle.account(max(send_sizes[step] if step < len(send_sizes) else 0, 0))
    finally:
        if reader is not None:
            reader.close()
        if writer is not None:
            writer.close()
    return result
