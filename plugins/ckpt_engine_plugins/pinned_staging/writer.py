"""The ``pinned_staging`` writer process (private).

Started by the plugin as ``python -m ckpt_engine_plugins.pinned_staging.writer FD_IN FD_OUT``: a
fresh interpreter that never imports the training script (no ``__main__`` guard needed) and
receives no file descriptors but its two pipe ends. It maps the buffer sets the training
process announces, and for every ``Save`` request runs ``dcp.save`` of one component from
those buffers with a ``FileSystemWriter`` and the planner it was sent, then reports the result.

With several ranks, the writers form one gloo process group of their own. They meet through
the job's existing rendezvous store (torchrun's ``MASTER_ADDR``/``MASTER_PORT``) under a key
prefix unique to the engine instance and writer generation: no port is picked or bound here.
Before every DCP save the writers agree, in one ``all_gather_object``, that every rank can
write (buffers mapped, values importable) and which DeviceMeshes the component's DTensors use;
a rank that cannot write fails the save on every rank instead of leaving the others waiting.

The process exits when the training process closes the pipe (it died: nothing would commit
what this process writes), ignores SIGINT (a Ctrl-C in the terminal must not kill an accepted
save; the training process decides), and uses one intra-op thread.
"""

from __future__ import annotations

import gc
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any

from .ipc import (
    Alloc,
    Beat,
    Done,
    Drained,
    Free,
    Init,
    Mapped,
    MeshSpec,
    PipeClosed,
    Ready,
    Save,
    Shutdown,
    SkeletonUnpickler,
    StartFailed,
    Window,
    encode,
    read_message,
    write_frame,
)

#: Exit codes that the training process reports.
EXIT_PARENT_GONE = 5
EXIT_START_FAILED = 3
EXIT_PROTOCOL = 2


def _describe(exc: BaseException) -> str:
    """One line for an error, unwrapping DCP's ``CheckpointException`` (a ``BaseException``)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        ranks = sorted(failures)
        first = failures[ranks[0]]
        inner = first[0] if isinstance(first, tuple) else first
        if isinstance(inner, BaseException):
            return f"{type(inner).__name__}: {inner} (DCP failed on writer rank(s) {ranks})"
    return f"{type(exc).__name__}: {exc}"


class _Writer:
    def __init__(self, init: Init) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        # Import now what the first save would import (DCP, the engine's planner classes), so
        # the first checkpoint is not slower than the others.
        import torch.distributed.checkpoint

        import ckpt_engine  # noqa: F401

        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        warnings.filterwarnings("ignore", message="Detected an existing checkpoint in")
        self.rank, self.world = init.rank, init.world_size
        self.write_timeout = timedelta(seconds=init.write_timeout_s)
        self.slabs: dict[int, Any] = {}
        self.slab_errors: dict[int, str] = {}
        self.meshes: dict[MeshSpec, Any] = {}
        #: Windowed sets (``max_host_bytes``): each slot's window, and how far the current epoch was read.
        self.windows: dict[int, tuple[int, ...]] = {}
        self.cursors: dict[int, Any] = {}
        self.board: Any = None
        self.send: Any = None
        #: Bounds the writer group's collectives (``collective_timeout_s``); see :meth:`_watch_for`.
        self.watch: Any = None
        if self.world > 1:
            if init.store_host is None or init.store_port is None:
                raise RuntimeError("no rendezvous store address for a multi-rank writer group")
            store = dist.TCPStore(
                init.store_host, init.store_port, is_master=False, timeout=timedelta(seconds=init.start_timeout_s)
            )
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(init.store_prefix, store),
                rank=self.rank,
                world_size=self.world,
                timeout=self.write_timeout,
            )

    # -- requests ---------------------------------------------------------------------------

    def alloc(self, msg: Alloc) -> Mapped:
        from .shm import WriterSlab

        try:
            self.slabs[msg.set_id] = WriterSlab(msg.path, msg.nbytes, msg.slots)
            if msg.windows and max(msg.windows) > 0:
                self.windows[msg.set_id] = msg.windows
        except Exception as err:
            self.slab_errors[msg.set_id] = f"cannot map buffer set {msg.set_id} ({msg.path}): {_describe(err)}"
            return Mapped(msg.set_id, self.slab_errors[msg.set_id])
        return Mapped(msg.set_id, None)

    def free(self, msg: Free) -> None:
        slab = self.slabs.pop(msg.set_id, None)
        self.slab_errors.pop(msg.set_id, None)
        self.windows.pop(msg.set_id, None)
        self.cursors.pop(msg.set_id, None)
        if self.board is not None:
            self.board.forget(msg.set_id)
        if slab is not None:
            slab.release()
            gc.collect()

    def _slab(self, set_id: int) -> Any:
        slab = self.slabs.get(set_id)
        if slab is None:
            raise RuntimeError(self.slab_errors.get(set_id, f"unknown buffer set {set_id}"))
        return slab

    def _mesh(self, spec: MeshSpec) -> Any:
        mesh = self.meshes.get(spec)
        if mesh is None:
            import torch
            import torch.distributed as dist
            from torch.distributed.device_mesh import DeviceMesh

            if not dist.is_initialized():  # one rank with DTensors: a local group of one
                dist.init_process_group(
                    "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=self.write_timeout
                )
            ranks = torch.tensor(spec.ranks, dtype=torch.int).view(spec.shape)
            mesh = DeviceMesh("cpu", ranks, mesh_dim_names=spec.dim_names)
            self.meshes[spec] = mesh
        return mesh

    def save(self, msg: Save) -> Done:
        """One component's save; with several writer ranks, every collective of it is bounded
        by the engine's ``collective_timeout_s`` and each writer publishes its phase."""
        from ckpt_engine.storage import activate_watch

        watch = self._watch_for(msg)
        with activate_watch(watch):
            return self._save(msg, watch)

    def _watch_for(self, msg: Save) -> Any:
        """The writers' :class:`~ckpt_engine.storage.CollectiveWatch` for ``msg``'s timeout,
        created at the first save that has one (every writer rank gets the same saves in the
        same order, so they create it together), and again after a timeout closed it."""
        if self.world == 1 or msg.collective_timeout_s is None:
            return None
        from ckpt_engine.storage import CollectiveWatch

        watch = self.watch
        if watch is None or watch.group is None or watch.timeout_s != msg.collective_timeout_s:
            if watch is not None:
                watch.close()
            watch = self.watch = CollectiveWatch.create(msg.collective_timeout_s, who="writer rank", monitored=True)
        return watch

    def _save(self, msg: Save, watch: Any) -> Done:
        t0 = time.perf_counter()
        local_error: str | None = None
        slab: Any = None
        try:
            if msg.abort is not None:
                raise RuntimeError(msg.abort)
            slab = self._slab(msg.set_id)
            # Dry run: every class the values need must be importable here, before any rank
            # commits to the collective save.
            SkeletonUnpickler(msg.skeleton, lambda pid: None, forbid_main=True).load()
        except Exception as err:
            local_error = _describe(err)
        try:
            agreed = self._agree(msg, local_error, watch)
            if isinstance(agreed, tuple):
                error, intact = agreed
                return Done(msg.req_id, False, 0, time.perf_counter() - t0, error, intact)
            for spec in agreed:  # same meshes, same order, on every rank (group creation is collective)
                self._mesh(spec)
            out = self._write_state(msg, slab.tensors)
            return Done(
                msg.req_id,
                True,
                out.bytes_written,
                time.perf_counter() - t0,
                None,
                bytes_reused=out.bytes_reused,
                carried_by=out.carried_by,
            )
        except BaseException as err:  # DCP's CheckpointException is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            return Done(msg.req_id, False, 0, time.perf_counter() - t0, _describe(err))

    def _agree(self, msg: Save, local_error: str | None, watch: Any) -> list[MeshSpec] | tuple[str, bool]:
        """Every writer rank's readiness for this save, in one collective: the device meshes
        all of them need, or ``(error, intact)`` for the first rank that cannot save (``intact``:
        every failure was an abort, so the buffers were never touched)."""
        import torch.distributed as dist

        if self.world == 1:
            return (local_error, False) if local_error is not None else list(msg.meshes)
        gathered: list[Any] = [None] * self.world
        group = None
        if watch is not None:
            watch.phase("agree")
            watch.barrier("agree")
            group = watch.group
        dist.all_gather_object(gathered, (local_error, msg.meshes, msg.abort is not None), group=group)
        failed = [(r, e, aborted) for r, (e, _, aborted) in enumerate(gathered) if e is not None]
        if failed:
            r, e, _ = failed[0]
            where = "" if r == self.rank else f"writer rank {r}: "
            return where + e, all(aborted for _, _, aborted in failed)
        return sorted({m for _, specs, _ in gathered for m in specs}, key=_mesh_key)

    def _write_state(self, msg: Save, tensors: Any) -> Any:
        """Rebuild the state dict from its skeleton over the shared buffers and save it with the
        engine's DCP save; returns its ``WriteResult`` (bytes written, and carried over)."""
        import torch
        from torch.distributed.tensor import DTensor

        from ckpt_engine.storage import RANK_LOCAL, write_component

        window_of: dict[int, int] = {}
        slot_windows = self.windows.get(msg.set_id) if msg.epoch is not None else None

        def resolve(pid: Any) -> Any:
            obj = _resolve(pid)
            if slot_windows is not None:
                window_of[id(obj)] = slot_windows[pid[1]]
            return obj

        def _resolve(pid: Any) -> Any:
            if pid[0] == "t":
                return tensors[pid[1]]
            _, slot, mesh_index, placements, shape, stride = pid
            return DTensor.from_local(
                tensors[slot],
                self.meshes[msg.meshes[mesh_index]],
                placements,
                run_check=False,
                shape=torch.Size(shape),
                stride=stride,
            )

        state_dict = SkeletonUnpickler(msg.skeleton, resolve, forbid_main=True).load()
        windowed = self._windowed_writer(msg, window_of) if slot_windows is not None and msg.epoch is not None else None
        return write_component(
            state_dict,
            component=msg.component,
            path=msg.path,
            planner=msg.planner,
            thread_count=msg.thread_count,
            sync_files=msg.sync_files,
            carry_over=msg.carry_over,
            storage_writer=windowed,
            process_group=RANK_LOCAL if msg.rank_local else None,
        )

    def _windowed_writer(self, msg: Save, window_of: dict[int, int]) -> Any:
        """The storage writer of a save staged in windows (``windows``)."""
        from .windows import WindowCursor, WindowedStorageWriter

        assert msg.epoch is not None
        cursor = self.cursors.get(msg.set_id)
        if cursor is None or cursor.epoch != msg.epoch:
            set_id, epoch, send = msg.set_id, msg.epoch, self.send
            cursor = WindowCursor(
                set_id,
                epoch,
                self.board,
                lambda index: send(Drained(set_id, epoch, index)),
                self.write_timeout.total_seconds(),
            )
            self.cursors[msg.set_id] = cursor
        return WindowedStorageWriter(
            msg.path,
            window_of=window_of,
            cursor=cursor,
            sync_files=msg.sync_files,
            overwrite=True,
            carry_over=msg.carry_over,
        )

    def close(self) -> None:
        import torch.distributed as dist

        if self.watch is not None:
            self.watch.close()
            self.watch = None

        for slab in self.slabs.values():
            slab.release()
        self.slabs.clear()
        if dist.is_initialized():
            dist.destroy_process_group()


def _mesh_key(spec: MeshSpec) -> tuple[Any, ...]:
    return (spec.shape, spec.ranks, spec.dim_names or ())


def _pump(fd_in: int, inbox: queue.Queue[Any], board: Any) -> None:
    """Move requests from the pipe to the inbox (window announcements straight to the board: a
    save may be waiting for one); exit the process if the training process is gone."""
    while True:
        try:
            msg = read_message(fd_in)
        except (PipeClosed, OSError, pickle.UnpicklingError):
            os._exit(EXIT_PARENT_GONE)
        if isinstance(msg, Window):
            board.staged(msg.set_id, msg.epoch, msg.index, msg.error)
            continue
        inbox.put(msg)
        if isinstance(msg, Shutdown):
            return


def _beat(send: Any, interval: float) -> None:
    """Tell the training process this writer runs (a stopped or frozen one falls silent)."""
    while True:
        time.sleep(interval)
        try:
            send(Beat(_bytes_written()))
        except OSError:
            return  # the training process is gone; the main loop exits


def _bytes_written() -> int:
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f.read(4096).splitlines():
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return -1


def main(argv: list[str]) -> None:
    fd_in, fd_out = int(argv[1]), int(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out_lock = threading.Lock()

    def send(message: object) -> None:
        frame = encode(message)
        with out_lock:
            write_frame(fd_out, frame)

    t0 = time.perf_counter()
    try:
        init = read_message(fd_in)
    except (PipeClosed, OSError):
        os._exit(EXIT_PARENT_GONE)
    if not isinstance(init, Init):
        os._exit(EXIT_PROTOCOL)
    from .windows import WindowBoard

    inbox: queue.Queue[Any] = queue.Queue()
    board = WindowBoard()
    threading.Thread(target=_pump, args=(fd_in, inbox, board), name="pinned-writer-pump", daemon=True).start()
    try:
        writer = _Writer(init)
    except BaseException as err:
        tb = "".join(traceback.format_exception_only(type(err), err)).strip()
        try:
            send(StartFailed(f"{tb} (rank {init.rank} of {init.world_size})"))
        finally:
            os._exit(EXIT_START_FAILED)
    writer.board, writer.send = board, send
    try:
        send(Ready(os.getpid(), time.perf_counter() - t0))
        threading.Thread(target=_beat, args=(send, init.heartbeat_s), name="pinned-writer-beat", daemon=True).start()
        while True:
            msg = inbox.get()
            if isinstance(msg, Shutdown):
                break
            if isinstance(msg, Alloc):
                send(writer.alloc(msg))
            elif isinstance(msg, Free):
                writer.free(msg)
            elif isinstance(msg, Save):
                send(writer.save(msg))
            else:
                os._exit(EXIT_PROTOCOL)
    except OSError:  # the pipe back is gone: so is the training process
        os._exit(EXIT_PARENT_GONE)
    writer.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv)
