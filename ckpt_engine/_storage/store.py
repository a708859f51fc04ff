"""Where checkpoints live: local folders, or any filesystem fsspec knows (``s3://``, ``gs://``,
``memory://``, ...).

Every piece of the engine that touches the save directory (the layout, the manifest, retention,
the readers and the CLI) does so through a :class:`Store`. A plain path (or a ``file://`` URL)
gets :class:`LocalStore`, which is the engine's original code: ``os`` calls, fsync, rename.
Any other URL gets :class:`FsspecStore`, which

* retries transient errors (connection refused or reset, timeouts, throttling) with exponential
  backoff and jitter, ``retries`` attempts in all, and raises :class:`~ckpt_engine.errors.StorageError`
  naming the object when they are spent;
* maps "not found" and "access denied" to ``FileNotFoundError`` / ``PermissionError`` as a local
  folder would, so that the callers' typed errors are the same on every store;
* never puts a credential into an error message or a log line (:meth:`FsspecStore.scrub`).

Object stores have no atomic folder rename; how the engine commits there is in docs/storage.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import posixpath
import random
import re
import shutil
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ..errors import ConfigError, StorageError
from .fscheck import read_regular
from .urls import is_url, local_path

__all__ = [
    "VERSION_PATTERN",
    "FsspecStore",
    "LocalStore",
    "Store",
    "is_url",
    "local_file_version",
    "local_path",
    "open_store",
    "store_for",
]

logger = logging.getLogger("ckpt_engine")

_T = TypeVar("_T")
_F = TypeVar("_F", bound="ReadableFile")

#: What a file version (:meth:`Store.versions`) looks like: short, and plain characters only.
VERSION_PATTERN = re.compile(r"[A-Za-z0-9:._+=/\-]{1,160}")
#: Object metadata that changes whenever an object's bytes are replaced, most specific first:
#: a version id (S3 with versioning), a generation (GCS), an ETag (S3, Azure, most others).
_OBJECT_VERSION_KEYS = ("VersionId", "generation", "ETag", "etag")


def local_file_version(st: os.stat_result) -> str:
    """The version of a local file (:meth:`Store.versions`) from its ``lstat``: a write changes
    its mtime and ctime, a replacement its inode, ``utime`` its ctime; only a hard link to it or
    the removal of one also changes the ctime."""
    return f"i{st.st_ino}:s{st.st_size}:m{st.st_mtime_ns}:c{st.st_ctime_ns}"


def object_version(info: Mapping[str, Any]) -> str | None:
    """The version of an object (:meth:`Store.versions`) from the metadata a listing gives, or
    ``None`` where the store gives nothing that changes when the object is replaced."""
    size = info.get("size")
    for key in _OBJECT_VERSION_KEYS:
        value = info.get(key)
        if value is not None and str(value) not in ("", "null"):
            text = f"{key}:{str(value).strip(chr(34))}:s{size}"
            if VERSION_PATTERN.fullmatch(text):
                return text
            return f"{key}:h{hashlib.sha256(str(value).encode()).hexdigest()[:40]}:s{size}"
    created = info.get("created")  # fsspec's memory:// (every write creates the object anew)
    if isinstance(created, (int, float)) and not isinstance(created, bool):
        return f"created:{created!r}:s{size}"
    return None


#: Exception class names (anywhere in the MRO) that mean "try again": the network, not the request.
_TRANSIENT_NAMES = frozenset(
    {
        "ConnectionError",  # builtins and botocore.exceptions
        "TimeoutError",
        "EndpointConnectionError",
        "ConnectTimeoutError",
        "ReadTimeoutError",
        "ConnectionClosedError",
        "HTTPClientError",
        "IncompleteRead",
        "ResponseStreamingError",
        "ClientConnectorError",
        "ClientOSError",
        "ClientPayloadError",
        "ServerDisconnectedError",
        "FSTimeoutError",
    }
)
_TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.EAGAIN, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET})
_PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, FileExistsError)


def is_transient(err: BaseException) -> bool:
    """Whether ``err`` is worth retrying: a network error or a server-side hiccup, not a refusal."""
    if isinstance(err, _PERMANENT):
        return False
    if any(cls.__name__ in _TRANSIENT_NAMES for cls in type(err).__mro__):
        return True
    return isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS


class ReadableFile(Protocol):
    """What :meth:`Store.open_read` returns: a binary file read with ``readinto``."""

    def readinto(self, buffer: Any, /) -> int | None: ...

    def __enter__(self: _F) -> _F: ...

    def __exit__(self, *exc: Any) -> Any: ...


@dataclass(frozen=True)
class Capabilities:
    """What a store can do, which the engine asks instead of what kind of store it is."""

    #: Paths are files of this machine's filesystem: ``os`` calls, file types (a FIFO would block
    #: a reader), symlinks, ``flock`` read locks and readers of local paths apply.
    local_files: bool
    #: A folder renames into place atomically, so a commit is a rename; otherwise it is a
    #: completion marker (the manifest) written last, and removed first (docs/storage.md).
    commit_by_rename: bool
    #: One listing is cheaper than a request per file (sizes and existence come from it).
    listing_first: bool
    #: A file can be copied within the store without its bytes passing through this process.
    server_side_copy: bool
    #: A file can be hard-linked into another checkpoint (an incremental save's carry-over).
    hard_links: bool


class Store:
    """The operations the engine needs from a place that holds checkpoints.

    Paths are full paths or URLs (``/data/run/iter_000000005``, ``s3://bucket/run/iter_000000005``),
    joined with :meth:`join`. Missing paths raise ``FileNotFoundError``, refused access
    ``PermissionError`` (both as for a local folder).
    """

    #: What this store can do (:class:`Capabilities`).
    capabilities = Capabilities(
        local_files=True, commit_by_rename=True, listing_first=False, server_side_copy=False, hard_links=True
    )

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The content of a file (at most ``limit`` + 1 bytes, so that a caller can tell "too big")."""
        raise NotImplementedError

    def read_range(self, path: str, start: int, end: int) -> bytes:
        raise NotImplementedError

    def write_bytes(self, path: str, data: bytes) -> None:
        """Create or replace the file ``path`` atomically: a reader sees the old or the new content."""
        raise NotImplementedError

    def open_read(self, path: str) -> ReadableFile:
        raise NotImplementedError

    def size(self, path: str) -> int:
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def isdir(self, path: str) -> bool:
        raise NotImplementedError

    def list_dir(self, path: str) -> list[tuple[str, bool]]:
        """``(name, is_folder)`` of every entry directly in ``path``, sorted by name."""
        raise NotImplementedError

    def list_files(self, path: str) -> dict[str, int]:
        """Every file below ``path``: ``/``-separated relative path -> size."""
        raise NotImplementedError

    def versions(self, path: str) -> dict[str, str]:
        """Every file below ``path`` (relative paths, as :meth:`list_files`) -> its *version*: a
        short string (:data:`VERSION_PATTERN`) that changes whenever the file's bytes may have.
        Recorded in the manifest at commit, it lets an incremental save trust a file it did not
        read (``docs/reliability.md``). A file the store gives no version for is left out."""
        raise NotImplementedError

    def remove_file(self, path: str) -> None:
        raise NotImplementedError

    def remove_tree(self, path: str) -> None:
        raise NotImplementedError


class LocalStore(Store):
    """A local (or network-mounted) folder: plain ``os`` calls."""

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        return read_regular(path, limit)  # a FIFO or device is refused, never waited on

    def read_range(self, path: str, start: int, end: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def write_bytes(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp.{os.getpid()}.{threading.get_ident()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(path) or ".")

    def open_read(self, path: str) -> ReadableFile:
        return open(path, "rb", buffering=0)

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def list_dir(self, path: str) -> list[tuple[str, bool]]:
        return sorted((e.name, e.is_dir()) for e in os.scandir(path))

    def list_files(self, path: str) -> dict[str, int]:
        return {rel: st.st_size for rel, st in _regular_files(path, follow_symlinks=True)}

    def versions(self, path: str) -> dict[str, str]:
        # lstat: a symlink has no version, so it is never trusted unread
        return {rel: local_file_version(st) for rel, st in _regular_files(path, follow_symlinks=False)}

    def remove_file(self, path: str) -> None:
        os.remove(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path)


def _regular_files(path: str, *, follow_symlinks: bool) -> list[tuple[str, os.stat_result]]:
    """Every regular file below ``path``, sorted: ``/``-separated relative path and its stat."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        rel_dir = os.path.relpath(dirpath, path)
        for name in sorted(filenames):
            try:
                st = os.stat(os.path.join(dirpath, name), follow_symlinks=follow_symlinks)
            except FileNotFoundError:
                continue  # removed since the folder was read: not there any more
            if stat.S_ISREG(st.st_mode):
                out.append((name if rel_dir == "." else f"{rel_dir.replace(os.sep, '/')}/{name}", st))
    return out


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or file creation inside ``path`` durable (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # e.g. some network filesystems refuse fsync on a directory
    finally:
        os.close(fd)


def _secret_values(kwargs: Mapping[str, Any]) -> list[str]:
    out = []
    for key, value in kwargs.items():
        if isinstance(value, Mapping):
            out += _secret_values(value)
        elif isinstance(value, str) and len(value) >= 4 and any(w in key.lower() for w in ("secret", "token", "key")):
            out.append(value)
    return out


class FsspecStore(Store):
    """A filesystem fsspec knows, addressed by URLs of one protocol (``s3://bucket/...``).

    ``options`` go to the fsspec filesystem's constructor (for S3, :func:`s3_options` builds them
    from the engine's ``storage`` config). ``retries`` attempts in all for a transient error,
    sleeping ``backoff_s`` x 2^n (x 0.5-1.5 jitter, at most 20 s) in between.
    """

    capabilities = Capabilities(
        local_files=False, commit_by_rename=False, listing_first=True, server_side_copy=True, hard_links=False
    )

    def __init__(
        self,
        protocol: str,
        options: Mapping[str, Any] | None = None,
        *,
        retries: int = 5,
        backoff_s: float = 0.5,
        max_concurrency: int = 8,
        part_size: int = 64 << 20,
    ) -> None:
        try:
            import fsspec
        except ImportError as err:  # pragma: no cover - fsspec is a dependency
            raise ConfigError("object storage needs fsspec: pip install fsspec") from err
        self.protocol = protocol
        self.retries = max(1, retries)
        self.backoff_s = backoff_s
        self.max_concurrency = max(1, max_concurrency)
        self.part_size = part_size
        opts = dict(options or {})
        self._secrets = _secret_values(opts)
        try:
            self.fs: Any = fsspec.filesystem(protocol, **opts)
        except ImportError as err:
            extra = " (pip install 'ckpt-engine[s3]')" if protocol in ("s3", "s3a") else ""
            raise ConfigError(f"the {protocol}:// filesystem is not installed{extra}: {err}") from None
        except ValueError as err:
            raise ConfigError(f"no fsspec filesystem for {protocol}:// URLs: {self.scrub(str(err))}") from None
        except TypeError as err:
            raise ConfigError(
                f"invalid storage options for {protocol}:// ({self.scrub(str(err))}); check the storage.options "
                "of the engine config"
            ) from None
        if protocol in ("s3", "s3a") and hasattr(self.fs, "retries"):
            self.fs.retries = 1  # one retry loop, ours: s3fs would otherwise retry 5x inside each attempt

    # -- errors ----------------------------------------------------------------------------------

    def scrub(self, text: str) -> str:
        """``text`` with every configured credential replaced by ``***``."""
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def call(self, what: str, path: str, fn: Callable[[], _T]) -> _T:
        """``fn()``, retried on transient errors; a spent retry budget raises :class:`StorageError`
        naming ``what`` and ``path``. Permanent errors (not found, access denied) pass through,
        with their message scrubbed of credentials."""
        delay = self.backoff_s
        for attempt in range(1, self.retries + 1):
            try:
                return fn()
            except _PERMANENT as err:
                if isinstance(err, PermissionError):
                    raise PermissionError(
                        errno.EACCES,
                        f"access denied ({self.scrub(str(err)) or 'no reason given'}); check the credentials "
                        "(storage.access_key_id / secret_access_key, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY) "
                        "and the bucket policy",
                        path,
                    ) from None
                raise
            except Exception as err:
                if not is_transient(err):
                    raise StorageError(
                        f"{what} {path} failed: {type(err).__name__}: {self.scrub(str(err))[:500]}"
                    ) from None
                if attempt == self.retries:
                    raise StorageError(
                        f"{what} {path} failed after {self.retries} attempt(s): {type(err).__name__}: "
                        f"{self.scrub(str(err))[:500]}. Is the endpoint reachable? (storage.retries and "
                        "storage.retry_backoff_s set how long transient errors are retried)"
                    ) from None
                logger.debug("%s %s: %s; retrying in %.2fs", what, path, type(err).__name__, delay)
                time.sleep(min(20.0, delay * random.uniform(0.5, 1.5)))
                delay *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    # -- operations ------------------------------------------------------------------------------

    def join(self, base: str, *parts: str) -> str:
        return posixpath.join(base, *parts)

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        if limit is None:
            data: bytes = self.call("reading", path, lambda: self.fs.cat_file(path))
            return data
        data = self.call("reading", path, lambda: self.fs.cat_file(path, start=0, end=limit + 1))
        return data

    def read_range(self, path: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        data: bytes = self.call("reading", path, lambda: self.fs.cat_file(path, start=start, end=end))
        return data

    def read_ranges(self, requests: Sequence[tuple[str, int, int]]) -> list[bytes]:
        """Several ``(path, start, end)`` ranges, up to ``max_concurrency`` at a time."""
        if len(requests) <= 1 or self.max_concurrency == 1:
            return [self.read_range(*r) for r in requests]
        with ThreadPoolExecutor(min(self.max_concurrency, len(requests)), thread_name_prefix="ckpt-get") as pool:
            return list(pool.map(lambda r: self.read_range(*r), requests))

    def write_bytes(self, path: str, data: bytes) -> None:
        # One PUT: an object store replaces an object atomically.
        self.call("writing", path, lambda: self.fs.pipe_file(path, data))

    def open_read(self, path: str) -> ReadableFile:
        def open_fresh() -> ReadableFile:
            # A listing's cached entry may describe an object another process has since replaced
            # (a re-save with allow_overwrite): s3fs would read with its old ETag and fail.
            with contextlib.suppress(AttributeError):
                self.fs.invalidate_cache(path)
            f: ReadableFile = self.fs.open(path, "rb", block_size=self.part_size)
            return f

        return self.call("opening", path, open_fresh)

    def _info(self, path: str) -> dict[str, Any]:
        def info() -> dict[str, Any]:
            with contextlib.suppress(AttributeError):
                self.fs.invalidate_cache(path)
            result: dict[str, Any] = self.fs.info(path)
            return result

        return self.call("looking up", path, info)

    def size(self, path: str) -> int:
        info = self._info(path)
        if info.get("type") == "directory":
            raise IsADirectoryError(errno.EISDIR, "is a folder", path)
        return int(info.get("size") or 0)

    def exists(self, path: str) -> bool:
        try:
            self._info(path)
        except FileNotFoundError:
            return False
        return True

    def isdir(self, path: str) -> bool:
        try:
            return self._info(path).get("type") == "directory"
        except FileNotFoundError:
            return False

    def _strip(self, path: str) -> str:
        from fsspec.core import strip_protocol

        stripped: str = strip_protocol(path)
        return stripped.rstrip("/")

    def list_dir(self, path: str) -> list[tuple[str, bool]]:
        def ls() -> list[dict[str, Any]]:
            with contextlib.suppress(AttributeError):
                self.fs.invalidate_cache(path)
            entries: list[dict[str, Any]] = self.fs.ls(path, detail=True)
            return entries

        root = self._strip(path)
        out = []
        for entry in self.call("listing", path, ls):
            name = str(entry["name"]).rstrip("/")
            if name == root:
                continue
            out.append((posixpath.basename(name), entry.get("type") == "directory"))
        return sorted(set(out))

    def _file_infos(self, path: str) -> dict[str, dict[str, Any]]:
        """One listing of every object below ``path``: relative path -> its metadata."""

        def find() -> dict[str, dict[str, Any]]:
            with contextlib.suppress(AttributeError):
                self.fs.invalidate_cache(path)
            found: dict[str, dict[str, Any]] = self.fs.find(path, detail=True)
            return found

        root = self._strip(path) + "/"
        return {
            name[len(root) :]: info
            for name, info in self.call("listing", path, find).items()
            if info.get("type") != "directory" and name.startswith(root)
        }

    def list_files(self, path: str) -> dict[str, int]:
        return dict(sorted((rel, int(info.get("size") or 0)) for rel, info in self._file_infos(path).items()))

    def versions(self, path: str) -> dict[str, str]:
        out = {rel: object_version(info) for rel, info in self._file_infos(path).items()}
        return {rel: version for rel, version in out.items() if version is not None}

    def remove_file(self, path: str) -> None:
        self.call("deleting", path, lambda: self.fs.rm_file(path))

    def remove_tree(self, path: str) -> None:
        files = sorted(self.list_files(path))
        self.remove_files([self.join(path, rel) for rel in files])
        with contextlib.suppress(FileNotFoundError, OSError, StorageError):
            if self.isdir(path):  # pseudo-folders of filesystems that keep them (memory://)
                self.fs.rm(path, recursive=True)

    def copy_files(self, pairs: Sequence[tuple[str, str]]) -> None:
        """Server-side copies ``(source, destination)`` within the store (no bytes pass through
        this process on S3), in one batched request set."""
        if not pairs:
            return

        def cp() -> None:
            self.fs.copy([s for s, _ in pairs], [d for _, d in pairs])

        self.call("copying", f"{len(pairs)} object(s) to {posixpath.commonpath([d for _, d in pairs])}", cp)

    def remove_files(self, paths: Sequence[str]) -> None:
        if not paths:
            return

        def rm() -> None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(list(paths))

        self.call("deleting", f"{len(paths)} object(s) under {posixpath.commonpath(paths)}", rm)

    def upload(self, local: str, remote: str, part_concurrency: int = 1) -> int:
        """Upload one local file; returns its size. On S3 a file above ``part_size`` goes up as a
        multipart upload, ``part_concurrency`` parts at a time; a failed attempt is retried whole
        (the local file is the replayable source)."""
        size = os.path.getsize(local)

        def put() -> None:
            if self.protocol in ("s3", "s3a"):
                self.fs.put_file(local, remote, chunksize=self.part_size, max_concurrency=part_concurrency)
            else:
                self.fs.put_file(local, remote)

        self.call("uploading", remote, put)
        return size

    def upload_many(self, pairs: Iterable[tuple[str, str]]) -> int:
        """:meth:`upload` ``(local, remote)`` pairs; returns the bytes uploaded. At most
        ``max_concurrency`` requests run at once: files in parallel, and the parts of a large file
        share what the files leave. The first failure is raised once the uploads in flight are done."""
        todo = sorted(pairs, key=lambda p: -os.path.getsize(p[0]))  # largest first: shortest tail
        if not todo:
            return 0
        workers = min(self.max_concurrency, len(todo))
        parts = max(1, self.max_concurrency // workers)
        if workers == 1:
            return sum(self.upload(lo, re, parts) for lo, re in todo)
        with ThreadPoolExecutor(workers, thread_name_prefix="ckpt-put") as pool:
            futures = [pool.submit(self.upload, lo, re, parts) for lo, re in todo]
            return sum(f.result() for f in futures)


_STORES: dict[tuple[Any, ...], Store] = {}
_STORES_LOCK = threading.Lock()
_LOCAL = LocalStore()


def open_store(path: str, settings: Any = None) -> Store:
    """The store for ``path``: :class:`LocalStore` for a local path or ``file://`` URL, else an
    :class:`FsspecStore` configured from ``settings`` (an :class:`~ckpt_engine.config.StorageOptions`,
    or None for the defaults and the standard environment variables). Stores are cached."""
    if not is_url(path):
        return _LOCAL
    protocol = path.split("://", 1)[0].lower()
    if settings is None:
        from ..config import StorageOptions  # here: local paths (every CLI listing) never import pydantic

        settings = StorageOptions()
    options = settings.fsspec_options(protocol)
    # The key holds the secrets themselves (SecretStr dumps as '****'): other credentials, other store.
    key = (protocol, json.dumps(options, sort_keys=True, default=repr), settings.model_dump_json())
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = FsspecStore(
                protocol,
                options,
                retries=settings.retries,
                backoff_s=settings.retry_backoff_s,
                max_concurrency=settings.max_concurrency,
                part_size=settings.part_size_mb << 20,
            )
        return store


def store_for(path: str | os.PathLike[str], store: Store | None = None) -> Store:
    """``store`` if given, else the default store for ``path`` (see :func:`open_store`)."""
    return store if store is not None else open_store(os.fspath(path))
