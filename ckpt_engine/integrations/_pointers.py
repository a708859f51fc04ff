"""Lightning pointer files: read bounded and checked, written atomically, and the record of the
folders that hold them, so a checkpoint is deleted only when no pointer of its engine names it.

A pointer is the small JSON file at the path Lightning chose (``epoch=1-step=8.ckpt``) naming the
engine checkpoint ``<save_dir>/iter_N``. Nothing here imports Lightning.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import threading
from dataclasses import dataclass
from typing import Any

import fsspec

from .._format import bounded_json
from .._storage.paths import same_folder
from .._storage.store import store_for
from .._storage.urls import is_url
from ..checkpoints import iteration_of
from ..errors import CheckpointLoadError, CkptEngineError, CorruptCheckpointError

__all__ = [
    "ITER_NAME",
    "LAST_ALIAS",
    "POINTER_FOLDERS_FILE",
    "POINTER_FORMAT",
    "NotALightningCheckpointError",
    "Pointer",
    "PointerFolders",
    "PointerMismatchError",
    "pointer_body",
    "read_pointer",
    "url_to_fs",
    "write_file",
]

logger = logging.getLogger("ckpt_engine")

#: ``format`` of a pointer file (and of the structure JSON and the folder record).
POINTER_FORMAT = "ckpt-engine/lightning"
#: The pointer refreshed after every commit in each folder Lightning saves into: it always means
#: "the engine's latest", and its name makes ``ckpt_path="last"`` find it whatever the
#: ``ModelCheckpoint`` settings (Lightning looks for ``last*.ckpt`` there).
LAST_ALIAS = "last-engine.ckpt"
#: In the engine's save_dir: every folder the integration wrote pointers into.
POINTER_FOLDERS_FILE = "lightning_pointer_folders.json"
#: The name of an engine checkpoint folder a pointer may name.
ITER_NAME = re.compile(r"^iter_\d{9}$")
_MAX_POINTER_BYTES = 64 * 1024
_MAX_RECORD_BYTES = 1 << 20
_MAX_DEPTH = 8
_MAX_INT_DIGITS = 30


class NotALightningCheckpointError(CkptEngineError, ValueError):
    """The path Lightning asked to load is neither a pointer file of this integration, nor an
    engine checkpoint with a ``lightning`` component, nor a save folder with one as its latest."""


class PointerMismatchError(CheckpointLoadError):
    """A pointer file names a checkpoint other than the one it claims: another run's ``save_dir``
    (without ``allow_foreign_pointers``), or an iteration the checkpoint does not hold."""


@dataclass(frozen=True)
class Pointer:
    """What a pointer file says: the engine checkpoint ``<save_dir>/<checkpoint>``."""

    save_dir: str
    checkpoint: str
    iteration: int
    #: The save the pointer was written for (the checkpoint's structure JSON holds it too): a
    #: checkpoint replaced by another save of its step (``allow_overwrite``) no longer matches.
    save_id: str | None = None
    #: Where ``save_dir`` is relative to the pointer's folder, when that is elsewhere (the run
    #: folder was copied or moved): trusted once the checkpoint there holds ``save_id``.
    moved_dir: str | None = None

    @property
    def folder(self) -> str:
        return f"{self.save_dir.rstrip('/')}/{self.checkpoint}"


def url_to_fs(path: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``path`` and the path inside it."""
    fs, inner = fsspec.core.url_to_fs(path)
    return fs, inner


def _small_json(raw: bytes, limit: int) -> Any:
    """``raw`` as JSON, or ``None`` when it is over ``limit`` bytes or no (bounded) JSON."""
    if len(raw) > limit:
        return None
    try:
        return bounded_json.loads(raw, max_depth=_MAX_DEPTH, max_int_digits=_MAX_INT_DIGITS)
    except bounded_json.JSONRefused:
        return None


def read_pointer(path: str | os.PathLike[str]) -> Pointer | None:
    """The pointer file at ``path``, or ``None`` if there is no file there. Raises
    :class:`NotALightningCheckpointError` for a file that is not a pointer (a ``torch.save``
    Lightning checkpoint, say), :class:`~ckpt_engine.CorruptCheckpointError` for a pointer whose
    fields are missing, mistyped or disagree (``iteration`` against the ``iter_*`` name), or that
    is no regular file (a FIFO)."""
    path = os.fspath(path)
    try:
        raw = store_for(path).read_bytes(path, _MAX_POINTER_BYTES)  # a FIFO is refused, not waited on
    except (FileNotFoundError, IsADirectoryError):
        return None
    data = _small_json(raw, _MAX_POINTER_BYTES)
    if not isinstance(data, dict) or data.get("format") != POINTER_FORMAT:
        raise NotALightningCheckpointError(
            f"{path} is not a ckpt-engine pointer file (is it a checkpoint Lightning wrote with torch.save, without "
            "EngineCheckpointIO?); load it with a Trainer that has no EngineCheckpointIO, or pass an engine "
            "checkpoint folder (iter_*) or save folder"
        )
    for field, kind in (("save_dir", str), ("checkpoint", str), ("iteration", int)):
        value = data.get(field)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise CorruptCheckpointError(
                f"{path}: the pointer's {field!r} is missing or not a {kind.__name__}; rewrite the pointer, or load "
                "the checkpoint folder (iter_*) itself"
            )
    relative, save_id = data.get("save_dir_relative"), data.get("save_id")
    for field, value in (("save_dir_relative", relative), ("save_id", save_id)):
        if value is not None and not isinstance(value, str):
            raise CorruptCheckpointError(
                f"{path}: the pointer's {field!r} is not a str; rewrite the pointer, or load the checkpoint folder "
                "(iter_*) itself"
            )
    moved: str | None = None
    if relative is not None and not is_url(path):  # a moved or copied run: its pointers move with it
        moved = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(path)), relative))
        moved = None if same_folder(moved, data["save_dir"]) else moved
    pointer = Pointer(data["save_dir"], data["checkpoint"], data["iteration"], save_id, moved)
    if not ITER_NAME.match(pointer.checkpoint):
        raise CorruptCheckpointError(f"{path}: names {pointer.checkpoint[:80]!r}, which is no checkpoint folder name")
    if iteration_of(pointer.checkpoint) != pointer.iteration:
        raise CorruptCheckpointError(
            f"{path}: the pointer names {pointer.checkpoint} but claims iteration {pointer.iteration}; rewrite the "
            "pointer, or load the checkpoint folder itself"
        )
    return pointer


def pointer_body(path: str, save_dir: str, iteration: int, **more: Any) -> bytes:
    """The pointer file at ``path`` naming ``<save_dir>/iter_{iteration:09}``. Between local
    folders it also names ``save_dir`` relative to the pointer's folder, which :func:`read_pointer`
    prefers, so that a run folder copied or moved whole still resumes (``save_dir`` stays for
    the pointers of a pointer folder moved alone, and for older readers)."""
    body: dict[str, Any] = {
        "format": POINTER_FORMAT,
        "save_dir": save_dir,
        "checkpoint": f"iter_{iteration:09}",
        "iteration": iteration,
    }
    if not is_url(path) and not is_url(save_dir):
        folder = os.path.dirname(os.path.abspath(path))
        with contextlib.suppress(ValueError):  # another drive (Windows): absolute only
            body["save_dir_relative"] = os.path.relpath(save_dir, folder)
    return (json.dumps({**body, **more}, indent=1) + "\n").encode()


def write_file(path: str, data: bytes) -> None:
    """Replace the file at ``path`` at once (a local rename; one PUT on an object store)."""
    if is_url(path):
        fs, inner = url_to_fs(path)
        fs.pipe_file(inner, data)
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".pointer-", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


class PointerFolders:
    """The folders that hold pointers of the engine checkpoints in ``save_dir``: those this
    process wrote into or removed from, and those :data:`POINTER_FOLDERS_FILE` records for the
    runs before it. :meth:`named` answers which checkpoints some pointer still names."""

    def __init__(self, save_dir: str) -> None:
        self.save_dir = save_dir
        self._lock = threading.Lock()
        self._known: set[str] = set()

    @property
    def record(self) -> str:
        """Where the folders are recorded: :data:`POINTER_FOLDERS_FILE` in ``save_dir``."""
        return f"{self.save_dir.rstrip('/')}/{POINTER_FOLDERS_FILE}"

    def recorded(self) -> set[str]:
        """The folders the record lists (none if there is no record yet)."""
        try:
            raw = store_for(self.record).read_bytes(self.record, _MAX_RECORD_BYTES)
        except FileNotFoundError:
            return set()
        data = _small_json(raw, _MAX_RECORD_BYTES)
        folders = data.get("folders") if isinstance(data, dict) else None
        if not isinstance(folders, list) or not all(isinstance(f, str) for f in folders):
            raise CorruptCheckpointError(
                f"{self.record} is not the record of pointer folders EngineCheckpointIO writes; delete it (the next "
                "save rewrites it; until then only the pointers in this run's folders protect their checkpoints)"
            )
        return set(folders)

    def add(self, folders: set[str], *, record: bool = True) -> None:
        """Know ``folders``; with ``record``, also in the record (rewritten only when it lacks one)."""
        with self._lock:
            new = folders - self._known
            self._known |= folders
        if not new or not record:
            return
        recorded = self.recorded()
        if new <= recorded:
            return
        body = (json.dumps({"format": POINTER_FORMAT, "folders": sorted(recorded | new)}, indent=1) + "\n").encode()
        if len(body) > _MAX_RECORD_BYTES:
            raise CorruptCheckpointError(
                f"{self.record} would exceed {_MAX_RECORD_BYTES >> 10} KiB ({len(recorded | new)} folders); remove "
                "the folders of finished runs from it"
            )
        write_file(self.record, body)

    def named(self) -> set[str]:
        """The checkpoint names some pointer of this engine names, in any known folder
        (:data:`LAST_ALIAS` aside: it names the latest, which is never removed). A file that is no
        readable pointer (a FIFO, a ``torch.save`` checkpoint) names nothing."""
        try:
            recorded = self.recorded()
        except CkptEngineError as err:
            logger.warning("%s", err)
            recorded = set()
        with self._lock:
            folders = sorted(self._known | recorded)
        named: set[str] = set()
        for folder in folders:
            fs, inner = url_to_fs(folder)
            try:
                entries = [str(n) for n in fs.ls(inner, detail=False)]
            except (FileNotFoundError, NotADirectoryError):
                continue
            for entry in entries:
                base = os.path.basename(entry.rstrip("/"))
                if not base.endswith(".ckpt") or base == LAST_ALIAS:
                    continue
                try:
                    other = read_pointer(os.path.join(folder, base))
                except CkptEngineError:
                    continue
                if other is not None and any(
                    d is not None and same_folder(d, self.save_dir) for d in (other.save_dir, other.moved_dir)
                ):
                    named.add(other.checkpoint)  # a copied run's pointer may name it too: kept
        return named
