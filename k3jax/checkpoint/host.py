"""Host-side helpers of the loader: a worker pool that stops at the first
error, 64-byte aligned buffers (which the CPU client can take without a
copy), and finite checks on the bits of a float array."""

from __future__ import annotations

import concurrent.futures
import math
import os
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


class Workers:
    """A thread pool over independent jobs. ``run(jobs)`` runs them all and
    returns when every one is done; when one raises, jobs not yet started
    are skipped, the running ones finish, and the first exception raised
    (in time) is re-raised. Jobs must not call ``run`` themselves."""

    def __init__(self, count: int | None = None):
        self.count = default_workers() if count is None else count
        if self.count < 1:
            raise ValueError(f"workers must be >= 1, got {self.count}")
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        if self.count > 1:
            self._start()

    def _start(self) -> concurrent.futures.ThreadPoolExecutor:
        """The pool, with all its threads running (started once, not inside a job)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.count,
                                                               thread_name_prefix="k3jax-load")
            barrier = threading.Barrier(self.count)
            concurrent.futures.wait([self._pool.submit(barrier.wait) for _ in range(self.count)])
        return self._pool

    def run(self, jobs: Iterable[Callable[[], None]]) -> None:
        jobs = list(jobs)
        if self.count == 1 or len(jobs) <= 1:
            for job in jobs:
                job()
            return
        pool = self._start()
        stop = threading.Event()
        first: list[BaseException] = []
        lock = threading.Lock()

        def guarded(job):
            if stop.is_set():
                return
            try:
                job()
            except BaseException as e:
                with lock:
                    if not first:
                        first.append(e)
                stop.set()
        futures = [pool.submit(guarded, job) for job in jobs]
        concurrent.futures.wait(futures)
        if first:
            raise first[0]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


def aligned_empty(shape: Sequence[int], dtype, *, zero: bool = False) -> np.ndarray:
    """An uninitialised (or zeroed) C-contiguous array starting on an
    ALIGN_BYTES boundary."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    raw = (np.zeros if zero else np.empty)(nbytes + ALIGN_BYTES, np.uint8)
    start = -raw.ctypes.data % ALIGN_BYTES
    return raw[start:start + nbytes].view(dtype).reshape(tuple(shape))


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
