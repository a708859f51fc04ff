"""Reading DCP ``.metadata`` without running code from the checkpoint, and handing it to DCP.

DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``: a crafted file
runs arbitrary code. The engine parses it with its own interpreter (:mod:`.metadata_parser`),
validates the result (:mod:`.metadata_read`, which imports no DCP and whose names this module
re-exports) and hands it to DCP through :class:`SafeFileSystemReader`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import re
import struct
import zipfile
from collections.abc import Iterator
from typing import Any

from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from ..errors import (
    CheckpointLoadError,
    CheckpointPermissionError,
    CkptEngineError,
    CorruptCheckpointError,
    UnsafeCheckpointError,
    denied,
)
from .metadata_read import MAX_METADATA_BYTES as MAX_METADATA_BYTES
from .metadata_read import read_metadata as read_metadata
from .metadata_read import recall_metadata as recall_metadata
from .metadata_read import remember_metadata as remember_metadata
from .metadata_read import validate_metadata as validate_metadata

__all__ = [
    "MAX_METADATA_BYTES",
    "SafeFileSystemReader",
    "read_metadata",
    "recall_metadata",
    "remember_metadata",
    "validate_metadata",
]


class SafeFileSystemReader(FileSystemReader):
    """A ``FileSystemReader`` that returns metadata read by :func:`read_metadata`."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata | None = None) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = self._metadata if self._metadata is not None else read_metadata(self.path)
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id  # as the stock reader does
        return md

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, one data file at a time, so that a failure names the file it came from."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            with self.naming_errors(rel, items):
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @contextlib.contextmanager
    def naming_errors(self, rel: str, items: list[ReadItem]) -> Iterator[None]:
        """Raise a failure to read ``items`` of data file ``rel`` as a typed error naming the
        file (an engine error as it is; one that is no read error, such as a planner's bug, too)."""
        try:
            yield
        except CkptEngineError:
            raise
        except Exception as err:
            mapped = _read_error(os.path.join(os.fspath(self.path), rel), items, err)
            if mapped is err:
                raise
            raise mapped from err


#: Where decoding a stored item runs: an error raised there is damage to what it decodes.
_DECODERS = (
    "torch/serialization.py",
    "/zipfile.py",
    "/pickle.py",
    "torch/_weights_only_unpickler.py",
    "torch/_utils.py",  # rebuilding a tensor: ``set_()`` of a storage of the wrong size
    "ckpt_engine/_dcpio/torch_save_archive.py",
)
#: What damaged bytes make a decoder raise besides its own errors (an index or a size out of
#: range, a value of the wrong type where a storage or a shape was expected).
_DECODE_ERRORS = (
    RuntimeError,
    ValueError,
    TypeError,
    IndexError,
    KeyError,
    AttributeError,
    OverflowError,
    struct.error,
)


def _raised_by_deserialisation(err: BaseException) -> bool:
    """Whether ``err`` came out of ``torch.load`` / zip parsing (and not, say, the load planner)."""
    tb = err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if name.endswith(_DECODERS):
            return True
        tb = tb.tb_next
    return False


def _read_error(path: str, items: list[ReadItem], err: Exception) -> Exception:
    """A typed error naming ``path`` for a failure reading it; ``err`` itself if it is no read error."""
    keys = sorted({i.storage_index.fqn for i in items})
    what = f"{keys[0]!r}" + (f" and {len(keys) - 1} more key(s)" if len(keys) > 1 else "")
    # torch's weights-only errors bury the reason under a paragraph of advice
    inner = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", str(err))
    first_line = inner.group(1) if inner else next((ln.strip() for ln in str(err).splitlines() if ln.strip()), "")
    detail = f"{type(err).__name__}: {first_line[:300]}"
    if isinstance(err, PermissionError):
        return CheckpointPermissionError(f"cannot read {path}: {denied(err, 'make it readable')}")
    if isinstance(err, pickle.UnpicklingError) and "Unsupported global" in str(err):
        found = re.search(r"GLOBAL (\S+)", str(err))
        return UnsafeCheckpointError(
            f"{path}: the data of {what} references {found.group(1) if found else 'a global'}, which "
            "weights_only=True refuses to construct; the file may have been tampered with"
        )
    if isinstance(err, OSError):
        return CheckpointLoadError(f"cannot read {path} (reading {what}): {detail}")
    if isinstance(err, (pickle.UnpicklingError, EOFError, zipfile.BadZipFile)) or (
        isinstance(err, _DECODE_ERRORS) and _raised_by_deserialisation(err)
    ):
        return CorruptCheckpointError(
            f"{path} is corrupt: reading {what} failed with {detail}. Check the checkpoint with "
            "verify='checksums' (or the CLI's verify command) to find every damaged file"
        )
    return err
