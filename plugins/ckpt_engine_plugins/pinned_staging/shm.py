"""File-backed shared host buffers for ``pinned_staging`` (private).

One *buffer set* holds every tensor of one save: a single file in ``/dev/shm`` (tmpfs), sized
with ``posix_fallocate`` (a full tmpfs is a clear ``ENOSPC`` error here, not a ``SIGBUS`` in the
middle of a copy), mapped ``MAP_SHARED | MAP_POPULATE`` by the training process and by the
writer process. The training process copies into views of its mapping; the writer builds one
tensor per slot with ``torch.frombuffer`` over its own mapping, so each tensor owns exactly its
bytes and DCP writes it without the defensive ``clone()`` it makes of views into larger
storages. Once the writer has mapped the file, the file is unlinked: the memory lives exactly
as long as the two mappings, and nothing is left in ``/dev/shm`` even if both processes are
killed. Files of dead processes left between creation and unlink are swept on start.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
from collections.abc import Sequence

import torch

from .ipc import SlotSpec

FILE_PREFIX = "ckpt_engine_pinned."
_ALIGN = 64
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def default_shm_dir() -> str:
    """``/dev/shm`` where it exists (Linux), else the temporary directory."""
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        return "/dev/shm"
    import tempfile

    return tempfile.gettempdir()


def plan_layout(signature: Sequence[tuple[tuple[int, ...], torch.dtype]]) -> tuple[tuple[SlotSpec, ...], int]:
    """Slots (64-byte aligned, in order) for ``(shape, dtype)`` pairs, and the total size."""
    slots: list[SlotSpec] = []
    offset = 0
    for shape, dtype in signature:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        slots.append(SlotSpec(offset=offset, shape=shape, dtype=dtype, nbytes=nbytes))
        offset += -(-nbytes // _ALIGN) * _ALIGN
    return tuple(slots), offset


def _map(fd: int, nbytes: int) -> mmap.mmap:
    return mmap.mmap(fd, nbytes, flags=_MAP_FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def _close_map(mm: mmap.mmap | None) -> None:
    if mm is None:
        return
    # A tensor view may still be alive somewhere (e.g. a staged state dict the caller kept):
    # then the mapping is released with the last view; the file is already unlinked.
    with contextlib.suppress(BufferError):
        mm.close()


def sweep_stale_files(directory: str) -> list[str]:
    """Remove buffer files of processes that no longer exist (killed before unlinking)."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    uid = os.getuid()
    for name in names:
        if not name.startswith(FILE_PREFIX):
            continue
        try:
            pid = int(name[len(FILE_PREFIX) :].split(".", 1)[0])
        except ValueError:
            continue
        path = os.path.join(directory, name)
        try:
            if os.stat(path).st_uid != uid:
                continue
            os.kill(pid, 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(path)
        except OSError:
            continue
    return removed


class HostSlab:
    """The training process's side of one buffer set."""

    def __init__(self, set_id: int, directory: str, slots: tuple[SlotSpec, ...], nbytes: int, pin: bool) -> None:
        self.set_id = set_id
        self.slots = slots
        self.nbytes = nbytes
        self.path: str | None = None
        self.pinned = False
        self._mm: mmap.mmap | None = None
        self._base: torch.Tensor | None = None
        self._linked = False
        self.views: list[torch.Tensor] = []
        if nbytes == 0:  # only empty tensors (or none): nothing to share
            self.views = [torch.empty(s.shape, dtype=s.dtype) for s in slots]
            return
        path = os.path.join(directory, f"{FILE_PREFIX}{os.getpid()}.{secrets.token_hex(4)}.{set_id}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.path, self._linked = path, True
        try:
            try:
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, nbytes)
                else:  # pragma: no cover - not Linux
                    os.ftruncate(fd, nbytes)
            except OSError as err:
                if err.errno in (errno.ENOSPC, errno.EFBIG):
                    free = _free_bytes(directory)
                    raise MemoryError(
                        f"pinned_staging: cannot reserve {nbytes / 2**20:.1f} MiB of staging buffers in {directory} "
                        f"({free / 2**20:.1f} MiB free); enlarge it (docker: --shm-size) or set the plugin's "
                        "shm_dir option to a larger tmpfs"
                    ) from err
                raise
            self._mm = _map(fd, nbytes)
        except BaseException:
            os.close(fd)
            self.release()
            raise
        os.close(fd)
        self._base = torch.frombuffer(self._mm, dtype=torch.uint8)
        for s in slots:
            if s.nbytes == 0:
                self.views.append(torch.empty(s.shape, dtype=s.dtype))
            else:
                flat = self._base[s.offset : s.offset + s.nbytes].view(s.dtype)
                self.views.append(flat.view(s.shape))
        if pin:
            self._pin()

    @property
    def data_ptr(self) -> int:
        return 0 if self._base is None else self._base.data_ptr()

    def _pin(self) -> None:
        """Page-lock the mapping for fast, asynchronous device-to-host copies (CUDA only)."""
        assert self._base is not None
        cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
        res = cudart.cudaHostRegister(self._base.data_ptr(), self.nbytes, 1)  # 1: cudaHostRegisterPortable
        code = int(getattr(res, "value", res))
        if code != 0:
            raise RuntimeError(f"pinned_staging: cudaHostRegister of {self.nbytes} bytes failed with cudaError {code}")
        self.pinned = True

    def unlink(self) -> None:
        """Remove the file (the mappings stay valid); idempotent."""
        if self._linked and self.path is not None:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def release(self) -> None:
        """Unpin, drop the views, unmap and unlink; idempotent."""
        if self.pinned and self._base is not None:
            self.pinned = False
            with contextlib.suppress(Exception):  # best effort at teardown; nothing to recover
                torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())  # type: ignore[no-untyped-call]
        self.views = []
        self._base = None
        mm, self._mm = self._mm, None
        _close_map(mm)
        self.unlink()


def _free_bytes(directory: str) -> int:
    try:
        st = os.statvfs(directory)
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


class WriterSlab:
    """The writer process's side of one buffer set: one tensor per slot, each owning its bytes."""

    def __init__(self, path: str, nbytes: int, slots: tuple[SlotSpec, ...]) -> None:
        self._mm: mmap.mmap | None = None
        self.tensors: list[torch.Tensor] = []
        if nbytes:
            fd = os.open(path, os.O_RDWR)
            try:
                self._mm = _map(fd, nbytes)
            finally:
                os.close(fd)
        for s in slots:
            if s.nbytes == 0:
                self.tensors.append(torch.empty(s.shape, dtype=s.dtype))
            else:
                numel = s.nbytes // s.dtype.itemsize
                t = torch.frombuffer(self._mm, dtype=s.dtype, count=numel, offset=s.offset)
                self.tensors.append(t.view(s.shape))

    def release(self) -> None:
        self.tensors = []
        mm, self._mm = self._mm, None
        _close_map(mm)
