"""Reading DCP ``.metadata`` without running code from the checkpoint.

DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load`` on ``.metadata``: a crafted file
runs arbitrary code. The engine reads it with a restricted unpickler that constructs only the
classes DCP writes, and hands the result to DCP through :class:`SafeFileSystemReader`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
import zipfile
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from .errors import (
    CheckpointLoadError,
    CheckpointPermissionError,
    CkptEngineError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsafeCheckpointError,
    denied,
)
from .store import Store, store_for

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


def read_metadata(component_dir: str | os.PathLike[str], store: Store | None = None) -> Metadata:
    """Read ``component_dir/.metadata`` safely (from any :class:`~ckpt_engine.store.Store`);
    typed errors name the file."""
    component_dir = os.fspath(component_dir)
    store = store_for(component_dir, store)
    path = store.join(component_dir, METADATA_FILE)
    try:
        if store.is_object_store:
            md = _RestrictedUnpickler(io.BytesIO(store.read_bytes(path))).load()
        else:
            with open(path, "rb") as f:
                md = _RestrictedUnpickler(f).load()
    except FileNotFoundError as err:
        raise IncompleteCheckpointError(
            f"{path} does not exist: the component was never committed (an interrupted save?)"
        ) from err
    except PermissionError as err:
        raise CheckpointPermissionError(f"cannot read {path}: {denied(err, 'make it readable')}") from err
    except IsADirectoryError as err:
        raise CorruptCheckpointError(f"{path} is a folder, not a DCP metadata file") from err
    except OSError as err:
        raise CheckpointLoadError(f"cannot read {path}: {err.strerror or err}") from err
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

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's read, one data file at a time, so that a failure names the file it came from."""
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(item)
        for rel, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except CkptEngineError:
                raise
            except Exception as err:
                mapped = _read_error(os.path.join(os.fspath(self.path), rel), items, err)
                if mapped is err:
                    raise
                raise mapped from err
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut


def _raised_by_deserialisation(err: BaseException) -> bool:
    """Whether ``err`` came out of ``torch.load`` / zip parsing (and not, say, the load planner)."""
    tb = err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename.replace(os.sep, "/")
        if name.endswith(("torch/serialization.py", "/zipfile.py", "/pickle.py", "torch/_weights_only_unpickler.py")):
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
        isinstance(err, (RuntimeError, ValueError)) and _raised_by_deserialisation(err)
    ):
        return CorruptCheckpointError(
            f"{path} is corrupt: reading {what} failed with {detail}. Check the checkpoint with "
            "verify='checksums' (or the CLI's verify command) to find every damaged file"
        )
    return err
