"""Reading DCP ``.metadata`` without running code from the checkpoint.

DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``: a crafted file
runs arbitrary code. The engine reads it with a restricted unpickler that constructs only the
classes DCP writes, and hands the result to DCP through :class:`SafeFileSystemReader`.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .errors import CorruptCheckpointError, IncompleteCheckpointError, UnsafeCheckpointError

METADATA_FILE = ".metadata"

_DCP_MD = "torch.distributed.checkpoint.metadata"
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (_DCP_MD, "Metadata"),
        (_DCP_MD, "TensorStorageMetadata"),
        (_DCP_MD, "BytesStorageMetadata"),
        (_DCP_MD, "ChunkStorageMetadata"),
        (_DCP_MD, "TensorProperties"),
        (_DCP_MD, "MetadataIndex"),
        (_DCP_MD, "StorageMeta"),
        (_DCP_MD, "_MEM_FORMAT_ENCODING"),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("builtins", "set"),
        ("builtins", "frozenset"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "_local.PosixPath"),
        ("pathlib", "_local.WindowsPath"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
    }
    | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), (torch.dtype, torch.layout))}
)


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"forbidden global {module}.{name}")
        return super().find_class(module, name)


def read_metadata(component_dir: str | os.PathLike[str]) -> Metadata:
    """Read ``component_dir/.metadata`` safely; typed errors name the file."""
    path = os.path.join(os.fspath(component_dir), METADATA_FILE)
    try:
        with open(path, "rb") as f:
            md = _RestrictedUnpickler(f).load()
    except FileNotFoundError as err:
        raise IncompleteCheckpointError(
            f"{path} does not exist: the component was never committed (an interrupted save?)"
        ) from err
    except PermissionError as err:
        raise CorruptCheckpointError(f"{path}: permission denied; make it readable") from err
    except pickle.UnpicklingError as err:
        if "forbidden global" in str(err):
            raise UnsafeCheckpointError(
                f"{path} references {str(err).removeprefix('forbidden global ')}, which DCP metadata never "
                "contains; refusing to unpickle it (the file may have been tampered with)"
            ) from err
        raise CorruptCheckpointError(f"{path} is not a valid DCP metadata file: {err}") from err
    except (EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError) as err:
        raise CorruptCheckpointError(f"{path} is truncated or corrupt: {type(err).__name__}: {err}") from err
    if not isinstance(md, Metadata):
        raise CorruptCheckpointError(f"{path} holds a {type(md).__name__}, not DCP Metadata")
    return md


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
