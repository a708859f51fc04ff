"""``pinned_staging``'s copies into host buffers (private): in ``stage``, or in the background.

:func:`copy_now` is the synchronous copy every save makes (everything, or with ``overlap`` what
can change outside the optimizer). :class:`Snapshot` is the ``overlap`` copy of parameters and
optimizer state that continues after ``save()`` returned:

* **CPU**: a worker thread copies tensor by tensor and checks each source's version counter
  right after its copy (an in-place edit that completed before the copy ended is caught).
* **Edits the counter cannot see.** ``param.data.add_()``, a write through a numpy view or
  through ``untyped_storage()`` change the bytes without moving the version counter. So
  ``save()`` also takes a *sample* of each tensor it defers: one element in every
  :data:`SAMPLE_SPAN` bytes, at least :data:`SAMPLES` a tensor (the whole tensor when it is that
  small), and the last, on the current stream for CUDA tensors. Each copy is compared with its
  sample, bit for bit, once it is complete: an edit made before the copy that changes a sampled
  element fails the save. So every edit that changes a contiguous run of at least
  ``SAMPLE_SPAN`` bytes is caught, wherever it starts: an embedding row of 1,024 fp32, rows added
  with ``index_add_`` into ``.data``, an ``exp_avg`` row, and every whole-tensor edit (``mul_``,
  ``add_``, ``copy_``, ``clamp_`` of every element, ``zero_``). Single scattered elements are
  caught only where sampled (docs/reliability.md's table says which edits are caught how).
* **CUDA**: the copies are queued on a side stream that first waits for the current stream,
  an event is recorded after them, and a thread waits for that event (never the training thread).
* **The guard**: every optimizer passed to ``save()`` gets a step pre-hook. On CPU it waits for
  the copy; on CUDA it makes the current stream wait on the copy's event (no host sync). Either
  way it then *confirms* the snapshot on the thread that steps the optimizer, where every edit
  that thread made since ``save()`` has finished: if any source's version counter moved since
  ``save()``, the save fails with :class:`SnapshotChangedError`. ``wait()``
  (``SaveHandle.wait_staged()``), ``SaveHandle.result()``, the next ``save()`` and ``close()``
  confirm too. Only a snapshot that is copied *and* confirmed is handed to the writer: an edit
  still running while the copy read the tensor cannot slip through between the two checks.
* The hooks are removed once the snapshot is settled, on the training thread only (a hook
  cannot remove itself while the optimizer iterates its hooks: it leaves that to a one-shot
  step post-hook).
"""

from __future__ import annotations

import contextlib
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch
from torch.distributed.tensor import DTensor
from torch.utils.hooks import RemovableHandle

from ckpt_engine import CkptEngineError, SnapshotChangedError

# The one private torch behaviour this module relies on, behind the engine's public helper
# (tests/dcpio/test_torch_private.py pins it).
from ckpt_engine.staging import TensorKey, local_tensor, memory_key, tensor_version

__all__ = [
    "Snapshot",
    "SnapshotChangedError",
    "StreamPool",
    "copy_now",
    "deferrable",
    "optimizer_owned",
    "stage_copy",
    "tensor_names",
]

#: The fewest elements sampled from each tensor an ``overlap`` save copies in the background.
SAMPLES = 64
#: At most this many bytes lie between two sampled elements (one page): any edit of a contiguous
#: run this long changes a sampled element. About 1/1,000 of an fp32 tensor's elements.
SAMPLE_SPAN = 4096
#: Above this many bytes a CPU tensor is sampled with torch (whose strided copy runs on the
#: intra-op threads) rather than with numpy's ``take`` (fewer microseconds a call below it).
_TORCH_SAMPLE_BYTES = 64 << 20


def _sample_step(numel: int, element_size: int) -> int:
    """The stride, in elements, of the sample of a tensor of ``numel`` elements."""
    return max(1, min((numel - 1) // (SAMPLES - 1), SAMPLE_SPAN // element_size))


#: Integer dtypes of each element size: a CPU tensor of a dtype numpy lacks (bfloat16, the
#: float8s) is sampled through a same-size integer view of its bytes.
_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flat_numpy(tensor: torch.Tensor) -> np.ndarray[Any, Any] | None:
    """A flat numpy view of a contiguous CPU tensor's elements (no copy), or ``None``."""
    try:
        plain = tensor.detach() if tensor.requires_grad else tensor
        try:
            array = plain.numpy()
        except TypeError:  # a dtype numpy has not
            as_int = _SAME_SIZE_INT.get(plain.element_size())
            if as_int is None:
                return None
            array = plain.view(as_int).numpy()
        return array.reshape(-1)
    except (RuntimeError, TypeError, ValueError):  # a conjugate or negative view, a sparse tensor
        return None


Sample = torch.Tensor | np.ndarray[Any, Any]


@functools.lru_cache(maxsize=4096)
def _sample_index(numel: int, element_size: int) -> np.ndarray[Any, Any]:
    """The flat indices :func:`_sample` takes from a tensor of ``numel`` elements (``numel > 0``):
    every ``_sample_step``-th one and the last. One array per size, shared by every tensor of it."""
    index = np.append(np.arange(0, numel, _sample_step(numel, element_size)), numel - 1)
    index.flags.writeable = False
    return index


def _sample(tensor: torch.Tensor) -> Sample:
    """A copy of every ``_sample_step``-th element of a contiguous ``tensor`` and of its last one:
    for a CPU tensor one ``take`` through a numpy view with the indices of its size (about two
    microseconds a tensor, where four torch ops cost about fifteen), for a CUDA tensor a kernel
    on the current stream (no host sync). With the first and the last element sampled, an edit
    of the whole tensor that overtakes the copy is caught too: the copy then reads edited bytes
    up to the end."""
    if tensor.is_cpu and tensor.numel() * tensor.element_size() <= _TORCH_SAMPLE_BYTES:
        array = _flat_numpy(tensor)
        if array is not None:
            return array.take(_sample_index(array.size, array.itemsize)) if array.size else array.copy()
    flat = tensor.reshape(-1)
    return torch.cat((flat[:: _sample_step(flat.numel(), flat.element_size())], flat[-1:]))


def _bits(sample: Sample) -> bytes:
    if isinstance(sample, torch.Tensor):
        return bytes(sample.detach().cpu().contiguous().view(torch.uint8).numpy())
    return sample.tobytes()


def _same_bits(a: Sample, b: Sample) -> bool:
    """Bitwise equality of two samples of one dtype (NaNs included), numpy or torch alike."""
    return _bits(a) == _bits(b)


def optimizer_owned(optimizers: Sequence[torch.optim.Optimizer]) -> dict[TensorKey, list[torch.Tensor]]:
    """The memory that only ``optimizer.step()`` changes (parameters and optimizer state), each
    with the tensors whose version counters an in-place change of it bumps.

    A state dict may alias that memory through a tensor with a version counter of its own (FSDP2's
    state dicts do), so the owners' counters are watched as well as the state dict's.
    """
    owned: dict[TensorKey, list[torch.Tensor]] = {}

    def add(tensor: torch.Tensor) -> None:
        if isinstance(tensor, DTensor):
            owned.setdefault(memory_key(tensor), []).extend((tensor, local_tensor(tensor)))
        else:
            owned.setdefault(memory_key(tensor), []).append(tensor)

    for optimizer in optimizers:
        state = optimizer.state
        for group in optimizer.param_groups:
            for param in group["params"]:
                add(param)
                for value in state.get(param, {}).values():
                    if isinstance(value, torch.Tensor):
                        add(value)
    return owned


def deferrable(
    sources: Sequence[torch.Tensor], owned: Mapping[TensorKey, list[torch.Tensor]]
) -> tuple[list[int], list[list[torch.Tensor]]]:
    """The sources an ``overlap`` copy may leave to the background, and the tensors watched for
    each (:func:`optimizer_owned`): the contiguous views of memory only the optimizer changes. A
    non-contiguous source is copied in ``save()``: its sample would cost a copy of its own."""
    later: list[int] = []
    watched: list[list[torch.Tensor]] = []
    if not owned:
        return later, watched
    for i, source in enumerate(sources):
        owners = owned.get(memory_key(source))
        if owners is not None and source.is_contiguous():
            later.append(i)
            watched.append(owners)
    return later, watched


def tensor_names(state: Mapping[str, Any]) -> dict[int, str]:
    """``id(tensor) -> "component: key.path"`` for error messages (first name wins for aliases)."""
    names: dict[int, str] = {}

    def walk(value: Any, path: str) -> None:
        if isinstance(value, torch.Tensor):
            names.setdefault(id(value), path)
        elif isinstance(value, Mapping):
            for k, v in value.items():
                walk(v, f"{path}.{k}" if not path.endswith(": ") else f"{path}{k}")
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(v, f"{path}.{i}" if not path.endswith(": ") else f"{path}{i}")

    for component, sd in state.items():
        walk(sd, f"{component}: ")
    return names


class StreamPool:
    """One side CUDA stream per device, created on first use and reused by every save."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, Any] = {}

    def get(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        return stream


def _by_device(
    views: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]
) -> dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]]:
    by_device: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]] = {}
    for v, s in zip(views, sources, strict=True):
        if s.is_cuda:
            by_device.setdefault(s.device, []).append((v, s))
    return by_device


def _queue_cuda(streams: StreamPool, pairs: dict[torch.device, list[tuple[torch.Tensor, torch.Tensor]]]) -> list[Any]:
    """Queue the copies on side streams that first wait for the current streams (values as of now)."""
    used = []
    for device, device_pairs in pairs.items():
        stream = streams.get(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for v, s in device_pairs:
                v.copy_(s, non_blocking=True)
        used.append(stream)
    return used


def copy_now(views: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], streams: StreamPool) -> None:
    """Copy ``sources`` into ``views``; returns when every copy is complete."""
    with torch.no_grad():
        used = _queue_cuda(streams, _by_device(views, sources))
        for v, s in zip(views, sources, strict=True):
            if not s.is_cuda:
                v.copy_(s)
        for stream in used:
            stream.synchronize()


def stage_copy(
    views: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    objects: Sequence[torch.Tensor],
    state: Mapping[str, Any],
    optimizers: Sequence[torch.optim.Optimizer],
    streams: StreamPool,
    *,
    overlap: bool,
) -> Snapshot | None:
    """Copy ``sources`` into ``views``: everything now, or (``overlap``) now only what can change
    outside the optimizer and the rest in a background :class:`Snapshot`, which is returned.

    ``objects`` are the tensors met for each source (a DTensor, where ``sources`` holds its
    shard) and name the snapshot's tensors by their keys in ``state``."""
    later, watched = deferrable(sources, optimizer_owned(optimizers) if overlap else {})
    deferred = set(later)
    now = [i for i in range(len(sources)) if i not in deferred]
    copy_now([views[i] for i in now], [sources[i] for i in now], streams)
    if not later:
        return None

    def names() -> list[str]:  # for error messages only: worked out when one is raised
        by_id = tensor_names(state)
        return [by_id.get(id(objects[i]), f"tensor {i}") for i in later]

    return Snapshot([views[i] for i in later], [sources[i] for i in later], names, watched, optimizers, streams)


class _CopyWorker:
    """The one thread per process that runs the overlap copies, one snapshot after another.

    Starting a thread per save made ``save()`` wait until the new thread was scheduled (about
    0.1 ms on a quiet machine, milliseconds on a busy one). Snapshots settle themselves and catch
    every error of their copy, so the loop never ends; after a fork the child starts its own."""

    _lock = threading.Lock()
    _queue: queue.SimpleQueue[Callable[[], object]] | None = None
    _pid = -1

    @classmethod
    def run(cls, job: Callable[[], object]) -> None:
        with cls._lock:
            if cls._queue is None or cls._pid != os.getpid():
                cls._queue, cls._pid = queue.SimpleQueue(), os.getpid()
                worker = threading.Thread(
                    target=cls._loop, args=(cls._queue,), name="pinned-staging-overlap-copy", daemon=True
                )
                worker.start()
            cls._queue.put(job)

    @staticmethod
    def _loop(jobs: queue.SimpleQueue[Callable[[], object]]) -> None:
        while True:
            job = jobs.get()
            # Snapshot._run turns every error into its save's failure; nothing reaches here, and
            # if it did, the copies queued behind it must still run.
            with contextlib.suppress(BaseException):
                job()


class Snapshot:
    """The background copy of one ``overlap`` save (see the module docstring).

    ``names`` gives the keys of ``sources`` for error messages (called only for one).
    ``settled`` completes (``None``, or the error) once the copy is complete and confirmed, or
    failed and no copy still writes into the buffers; only then may a writer read them.
    """

    def __init__(
        self,
        views: Sequence[torch.Tensor],
        sources: Sequence[torch.Tensor],
        names: Callable[[], Sequence[str]],
        watched: Sequence[Sequence[torch.Tensor]],
        optimizers: Sequence[torch.optim.Optimizer],
        streams: StreamPool,
    ) -> None:
        self._views, self._sources, self._names_of = list(views), list(sources), names
        self._names: Sequence[str] | None = None
        #: Per source: it and the tensors whose in-place changes change it (their counters).
        self._watched = [[s, *w] for s, w in zip(self._sources, watched, strict=True)]
        self._versions = [self._version(i) for i in range(len(self._sources))]
        with torch.no_grad():  # before the copies are queued: CUDA samples are taken on the current stream
            self._samples = [_sample(src) if src.numel() else src for src in self._sources]
        self._lock = threading.Lock()
        self._cpu_copied = threading.Event()
        self._copied = threading.Event()
        self._confirmed = False
        self._error: BaseException | None = None
        self._step_wait = 0.0
        self._copy_seconds = 0.0
        self.settled: Future[None] = Future()
        self._t0 = time.perf_counter()
        cuda_pairs = _by_device(self._views, self._sources)
        self._events: dict[torch.device, Any] = {}
        if cuda_pairs:
            with torch.no_grad():
                for device, stream in zip(cuda_pairs, _queue_cuda(streams, cuda_pairs), strict=True):
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(stream)
                    self._events[device] = event
        self._handles: dict[int, RemovableHandle] = {
            id(opt): opt.register_step_pre_hook(self._on_step) for opt in dict.fromkeys(optimizers)
        }
        _CopyWorker.run(self._run)

    # -- PendingSnapshot ----------------------------------------------------------------------

    @property
    def step_wait_seconds(self) -> float:
        return self._step_wait

    @property
    def copy_seconds(self) -> float:
        return self._copy_seconds

    def wait(self, timeout: float | None = None) -> None:
        """Block until the copy is complete, confirm it on this thread, raise if it failed."""
        t = time.perf_counter()
        if not self._copied.wait(timeout):
            raise TimeoutError(f"the overlap snapshot copy did not complete within {timeout}s")
        self._step_wait += time.perf_counter() - t
        self._confirm()
        self.remove_hooks()
        error = self.settled.exception()
        if error is not None:
            raise error

    def after_copy(self, job: Callable[[], object]) -> None:
        """Run ``job`` on the copy thread once this snapshot's copy is done (its errors are
        ignored there: whoever needs its result must be able to do it again)."""
        _CopyWorker.run(job)

    # -- the copy thread -----------------------------------------------------------------------

    def _run(self) -> None:
        error: BaseException | None = None
        try:
            with torch.no_grad():
                for i, (v, s) in enumerate(zip(self._views, self._sources, strict=True)):
                    if not s.is_cuda:
                        v.copy_(s)
                        self._check(i)
                        self._check_sample(i)
                self._cpu_copied.set()
                for event in self._events.values():
                    event.synchronize()
                with self._lock:
                    if not self._confirmed:  # once confirmed, the step that follows changes them
                        for i, s in enumerate(self._sources):
                            if s.is_cuda:
                                self._check(i)
                for i, s in enumerate(self._sources):  # the copies against save()'s samples, whenever
                    if s.is_cuda:
                        self._check_sample(i)
        except BaseException as err:  # every failure fails this save, never the training loop
            error = (
                err
                if isinstance(err, CkptEngineError)
                else CkptEngineError(f"pinned_staging: the overlap snapshot copy failed: {type(err).__name__}: {err}")
            )
        with self._lock:
            self._copy_seconds = time.perf_counter() - self._t0
            if error is not None and self._error is None:
                self._error = error
        self._cpu_copied.set()
        self._copied.set()
        self._maybe_settle()

    def _version(self, i: int) -> tuple[int, ...]:
        return tuple(tensor_version(t) for t in self._watched[i])

    def _check(self, i: int) -> None:
        if self._version(i) != self._versions[i]:
            raise self._changed(i)

    def _check_sample(self, i: int) -> None:
        """The copy of source ``i`` holds the bits its sample took in ``save()``."""
        view, sample = self._views[i], self._samples[i]
        if view.numel() and not _same_bits(_sample(view), sample):
            raise SnapshotChangedError(
                f"pinned_staging (overlap): {self._name(i)} was changed after save() and before its "
                "snapshot copy, through an alias whose edits its version counter does not count (param.data, "
                "a numpy view, untyped_storage()), so this checkpoint would not hold the state at save(); "
                "the save failed. Call handle.wait_staged() before editing weights or optimizer state "
                "outside optimizer.step(), or move the edit before save()"
            )

    def _name(self, i: int) -> str:
        if self._names is None:
            self._names = self._names_of()
        return self._names[i]

    def _changed(self, i: int) -> SnapshotChangedError:
        return SnapshotChangedError(
            f"pinned_staging (overlap): {self._name(i)} was changed in place after save() and before its "
            "snapshot copy was complete, so this checkpoint would not hold the state at save(); the save "
            "failed. Call handle.wait_staged() before editing weights or optimizer state outside "
            "optimizer.step(), or move the edit before save()"
        )

    # -- confirmation and hand-over ------------------------------------------------------------

    def _confirm(self) -> None:
        """On the thread that steps the optimizer: no source moved since ``save()``."""
        with self._lock:
            if self._confirmed:
                return
            self._confirmed = True
            if self._error is None:
                for i in range(len(self._sources)):
                    if self._version(i) != self._versions[i]:
                        self._error = self._changed(i)
                        break
        self._maybe_settle()

    def confirm_at_exit(self) -> None:
        """The interpreter is exiting (the main thread has ended): confirm a copied snapshot."""
        if self._copied.is_set():
            self._confirm()

    def _maybe_settle(self) -> None:
        with self._lock:
            if self.settled.done() or not self._copied.is_set():
                return  # a failed snapshot still settles only once no copy writes its buffers
            if self._error is None and not self._confirmed:
                return
            error = self._error
        if error is None:
            self.settled.set_result(None)
        else:
            self.settled.set_exception(error)

    def when_settled(self, callback: Callable[[BaseException | None], None]) -> None:
        """Call ``callback(error or None)`` once settled (in the thread that settles it)."""
        self.settled.add_done_callback(lambda f: callback(f.exception()))

    # -- the step pre-hook ---------------------------------------------------------------------

    def _on_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self.settled.done():
            t = time.perf_counter()
            if self._events:
                self._cpu_copied.wait()
                self._step_wait += time.perf_counter() - t
                self._confirm()
                for device, event in self._events.items():  # the step runs after the copy, no host sync
                    torch.cuda.current_stream(device).wait_event(event)
            else:
                self._copied.wait()
                self._step_wait += time.perf_counter() - t
                self._confirm()
        if self._confirmed or self.settled.done():
            self._remove_from_hook(optimizer)

    def _remove_from_hook(self, optimizer: torch.optim.Optimizer) -> None:
        with self._lock:
            own = self._handles.pop(id(optimizer), None)
            others, self._handles = list(self._handles.values()), {}
        for handle in others:
            handle.remove()
        if own is None:
            return
        # The optimizer is iterating its pre-hooks: remove this one after the step. The post-hook
        # is the last one registered, so removing itself cannot disturb the iteration either.
        post: list[RemovableHandle] = []

        def after_step(opt: torch.optim.Optimizer, a: Any, k: Any) -> None:
            own.remove()
            post[0].remove()

        post.append(optimizer.register_step_post_hook(after_step))

    def remove_hooks(self) -> None:
        """Remove the step pre-hooks (outside a step, on the training thread)."""
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle.remove()
