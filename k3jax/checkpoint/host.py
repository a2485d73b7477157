"""Host-side helpers of the loader: a worker pool that stops at the first
error, 64-byte aligned buffers (which the CPU client can take without a
copy) and a pool that reuses them, and finite checks on the bits of a float
array."""

from __future__ import annotations

import functools
import math
import os
import queue
import threading
from typing import Callable, Iterable, Sequence

import numpy as np

ALIGN_BYTES = 64
"""Alignment of host blocks: XLA's CPU client aliases buffers aligned to it."""

CHUNK_BYTES = 8 << 20
"""Work unit when one large read or check is split over the workers."""


def default_workers() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:   # not Linux
        return max(1, os.cpu_count() or 1)


class _Batch:
    """The jobs of one ``Workers.run``: ``wait()`` returns once every one has
    ended and re-raises the first exception one raised (in time); after a
    failure the jobs not yet started are skipped."""

    def __init__(self, count: int):
        self._left = count
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._failed = threading.Event()
        self._first: list[BaseException] = []
        if not count:
            self._done.set()

    def run(self, job: Callable[[], None], closing: threading.Event | None = None) -> None:
        try:
            if closing is not None and closing.is_set():
                raise RuntimeError("the workers were closed before this job ran")
            if not self._failed.is_set():
                job()
        except BaseException as e:
            with self._lock:
                if not self._first:
                    self._first.append(e)
            self._failed.set()
        finally:
            with self._lock:
                self._left -= 1
                if not self._left:
                    self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self._first:
            raise self._first[0]


class Workers:
    """A pool of ``count`` threads over independent jobs. ``run(jobs)`` runs
    them all and returns when every one is done; when one raises, jobs not
    yet started are skipped, the running ones finish, and the first
    exception raised (in time) is re-raised. With one worker, or a single
    job, the jobs run in the caller. Jobs must not call ``run`` themselves.
    The threads take jobs from one queue and the last job of a ``run``
    wakes the caller: no future or condition a job (the loader runs
    hundreds a layer, and each notify takes the GIL from the threads
    reading). ``close()`` skips the jobs still queued and stops the threads."""

    def __init__(self, count: int | None = None):
        self.count = default_workers() if count is None else count
        if self.count < 1:
            raise ValueError(f"workers must be >= 1, got {self.count}")
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()
        if self.count > 1:
            self._start()

    def _start(self) -> None:
        """Start the threads (once, not inside a job)."""
        if not self._threads:
            self._closing.clear()
            self._threads = [threading.Thread(target=self._serve, name=f"k3jax-load_{i}",
                                              daemon=True) for i in range(self.count)]
            for t in self._threads:
                t.start()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            job()

    def run(self, jobs: Iterable[Callable[[], None]]) -> None:
        jobs = list(jobs)
        batch = _Batch(len(jobs))
        if self.count == 1 or len(jobs) <= 1:
            for job in jobs:
                batch.run(job)
        else:
            self._start()
            for job in jobs:
                self._queue.put(functools.partial(batch.run, job, self._closing))
        batch.wait()

    def close(self) -> None:
        """Skip the jobs still queued, then stop the threads."""
        self._closing.set()
        for _ in self._threads:
            self._queue.put(None)
        for t in self._threads:
            t.join()
        self._threads = []


def aligned_empty(shape: Sequence[int], dtype, *, zero: bool = False) -> np.ndarray:
    """An uninitialised (or zeroed) C-contiguous array starting on an
    ALIGN_BYTES boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = (np.zeros if zero else np.empty)(nbytes + ALIGN_BYTES, np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start:start + nbytes].view(dtype).reshape(tuple(shape))


class BufferPool:
    """Reused 64-byte aligned uint8 host buffers, shared by threads:
    ``take(nbytes)`` hands out a free one at least ``nbytes`` long (the
    smallest that fits), else drops the free ones (all shorter) and makes
    one of ``nbytes``; ``give`` returns it. So it holds no more buffers than
    were ever out at once (the loader's slabs: one per worker thread).
    ``clear()`` frees the free ones."""

    def __init__(self):
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.nbytes >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].nbytes))
            self._free.clear()
        return aligned_empty((nbytes,), np.uint8)

    def give(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._free.append(buffer)

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


# float dtype -> (unsigned view, mask of the bits without the sign, the bits of +inf)
_FLOAT_BITS = {np.dtype(np.float32): (np.uint32, 0x7FFFFFFF, 0x7F800000),
               np.dtype(np.float16): (np.uint16, 0x7FFF, 0x7C00),
               np.dtype("bfloat16"): (np.uint16, 0x7FFF, 0x7F80)}


def first_nonfinite(a: np.ndarray, workers: Workers | None = None) -> tuple[int, ...] | None:
    """The index of the first NaN or inf of float array ``a`` (float32,
    float16, bfloat16), or None. Works on the bits (exponent all ones), in
    chunks split over ``workers`` for a large contiguous array."""
    if a.dtype not in _FLOAT_BITS:
        raise TypeError(f"first_nonfinite: unsupported dtype {a.dtype}")
    uint, magnitude, inf = _FLOAT_BITS[a.dtype]
    if a.size == 0:
        return None
    bits = a.view(uint)
    if not a.flags.c_contiguous or workers is None or a.nbytes <= CHUNK_BYTES:
        if not np.max(bits & uint(magnitude)) >= inf:
            return None
    else:
        flat = bits.reshape(-1)
        step = CHUNK_BYTES // a.itemsize
        bad = []

        def chunk(lo):
            if np.max(flat[lo:lo + step] & uint(magnitude)) >= inf:
                bad.append(lo)
        workers.run([lambda lo=lo: chunk(lo) for lo in range(0, flat.size, step)])
        if not bad:
            return None
    where = np.argwhere((bits & uint(magnitude)) >= inf)
    return tuple(int(i) for i in where[0])
