"""Files and messages between 2 gloo ranks (``ckpt_engine._tier.transfer``), both directions at once.

Run by ``tiers.py pair BASE`` (:func:`exchanges`), last in that launch: its last step leaves the
pair out of step. ``base``: a folder of the test's. Small chunks (1,000 bytes) so that files span
several chunks and chunks span several files. Each rank reports (``"scenario": "transfer"``) what
it received and what its outcome said:

1. messages both ways, one of them empty;
2. files both ways: several chunks, a file of 0 bytes, files smaller than a chunk;
3. a file changed on the sender after its checksum was announced: refused on arrival;
4. a file the sender cannot read: zeros keep the lockstep, the sender says so, the receiver refuses it;
5. a message longer than the receiver allows: refused before its payload is received.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch.distributed as dist
from _common import report

from ckpt_engine._format.hashing import DEFAULT_ALGORITHM, new_hasher
from ckpt_engine._tier import transfer
from ckpt_engine._tier.transfer import Incoming, Outgoing, exchange_bytes, exchange_files


def digest(path: str) -> str:
    hasher = new_hasher(DEFAULT_ALGORITHM)
    assert hasher is not None
    with open(path, "rb") as f:
        hasher.update(f.read())
    return hasher.hexdigest()


def write(folder: str, files: dict[str, int], seed: int) -> list[tuple[str, int, str]]:
    out = []
    for rel, size in files.items():
        path = os.path.join(folder, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        data = (hashlib.sha256(f"{seed}{rel}".encode()).digest() * (size // 32 + 1))[:size]
        with open(path, "wb") as f:
            f.write(data)
        out.append((rel, size, digest(path)))
    return out


def swap(rank: int, files: list[tuple[str, int, str]], group: object) -> list[tuple[str, int, str]]:
    """Each rank's file list (with checksums) to the other, as a manifest would carry it."""
    got = exchange_bytes(group, 1 - rank, json.dumps(files).encode(), 1 - rank, 1 << 20) or b"[]"
    return [tuple(f) for f in json.loads(got)]  # type: ignore[misc]


def exchanges(base: str, rank: int) -> None:
    group = dist.new_group(backend="gloo")
    transfer.CHUNK_BYTES = 1000
    mine, theirs = os.path.join(base, f"from{rank}"), os.path.join(base, f"into{rank}")
    out: dict[str, object] = {"scenario": "transfer"}

    text = b"hello from rank 0" if rank == 0 else b""
    out["message"] = (exchange_bytes(group, 1 - rank, text, 1 - rank, 100) or b"").decode()

    sizes = {"model/a.distcp": 2500, "model/empty": 0, "optim/b.distcp": 10} if rank == 0 else {"c.distcp": 3000}
    offered = write(mine, sizes, seed=rank)
    wanted = swap(rank, offered, group)
    outcome = exchange_files(
        group,
        Outgoing(1 - rank, mine, [(rel, size) for rel, size, _ in offered]),
        Incoming(1 - rank, theirs, wanted, DEFAULT_ALGORITHM),
    )
    same = all(digest(os.path.join(theirs, rel)) == checksum for rel, _, checksum in wanted)
    out["files"] = {"bad": outcome.bad, "same": same, "received": outcome.bytes_received, "sent": outcome.bytes_sent}

    offered = write(mine, {"late.distcp": 1500}, seed=10 + rank)
    wanted = swap(rank, offered, group)
    if rank == 0:  # changed after its checksum went out
        with open(os.path.join(mine, "late.distcp"), "r+b") as f:
            f.seek(700)
            f.write(b"X")
    outcome = exchange_files(
        group,
        Outgoing(1 - rank, mine, [(rel, size) for rel, size, _ in offered]),
        Incoming(1 - rank, theirs, wanted, DEFAULT_ALGORITHM),
    )
    out["changed"] = {"bad": outcome.bad}

    gone = [("gone.distcp", 1200)]
    outcome = exchange_files(
        group,
        Outgoing(1, mine, gone) if rank == 0 else None,
        Incoming(0, theirs, [("gone.distcp", 1200, "0" * 16)], DEFAULT_ALGORITHM) if rank == 1 else None,
    )
    out["unreadable"] = {"unsent": outcome.unsent, "bad": outcome.bad}

    report(out)  # before the last step: it leaves the pair out of step, and rank 1 then exits
    try:
        if rank == 0:
            exchange_bytes(group, 1, b"x" * 500, None, 0)
        else:
            exchange_bytes(group, None, b"", 0, 10)
        report({"scenario": "transfer", "limit": None})
    except ValueError as err:
        report({"scenario": "transfer", "limit": str(err)})
    except RuntimeError:  # rank 0: its payload's receiver left, as it should
        report({"scenario": "transfer", "limit": "sender cut off"})
