"""The loader's pipeline from host blocks to device arrays.

A parameter is placed one device block at a time (``place_blocks``): the
block is read on the host in the checkpoint's stored orientation, put on the
devices that hold it, and changed there by the parameter's device op: a
weight stored ``[out, in]`` is transposed (``swap_last_axes``), packed MXFP4
codes are interleaved into the word layout ``Mxfp4Weights`` holds
(``interleave_codes``). ``Prefetcher`` reads the blocks of a whole layer
on one thread, in the order they will be placed, so reading overlaps the
transfer and transposes of the blocks before; ``InFlight`` holds the last
placed block until its device work is done, and then releases its share of
the read-ahead budget: the host blocks read and not yet released, with the
staging buffers below, never hold more than two of the plan's largest blocks.

On an accelerator a block that a device op changes is only a staging copy:
the parameter is the op's result. Such blocks are read into ``Staging``
buffers that are reused from block to block (and layer to layer), so only
the parameters themselves are written into fresh memory. An accelerator
copies every block to its own memory, so there all blocks are staging
copies (``devices_copy_blocks``). On CPU devices the ops run on the host
instead, as each block is read (k3jax.checkpoint.slabs: slab by slab, in
reused ``Staging.slabs`` buffers), and every block is read into fresh
64-byte aligned memory that becomes the parameter: the device aliases it
(``jax.device_put`` copies nothing). Fresh memory costs a page fault per
page on its first touch (the kernel zeroes it), CPU time taken from the
reads and ops on a CPU device.
"""

from __future__ import annotations

import functools
import gc
import math
import queue
import threading
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from k3jax.checkpoint.host import BufferPool, aligned_empty
from pallas_kernels.mxfp4_words import interleave_words

BlockKey = tuple
"""(parameter name, the block's index as (start, stop, step) per axis)."""


def local_blocks(shape: Sequence[int], sharding: NamedSharding
                 ) -> list[tuple[tuple[slice, ...], list[jax.Device]]]:
    """The distinct blocks of ``shape`` that this process's devices hold under
    ``sharding``: (index, the devices holding it)."""
    shape = tuple(shape)
    groups: dict[tuple, tuple[tuple[slice, ...], list[jax.Device]]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        groups.setdefault(block_key(index, shape), (index, []))[1].append(device)
    return list(groups.values())


def block_nbytes(index, shape, dtype) -> int:
    """Bytes of the block ``index`` (slices) of a ``shape`` array of ``dtype``."""
    return (math.prod(len(range(*s.indices(n))) for s, n in zip(index, shape))
            * np.dtype(dtype).itemsize)


def devices_copy_blocks(mesh) -> bool:
    """Whether ``jax.device_put`` copies a host block to ``mesh``'s devices
    (accelerators), so the block is only a staging copy even when it is not
    transposed; a CPU device aliases a 64-byte aligned block instead
    (checked: the device buffer's address is the block's)."""
    return any(d.platform != "cpu" for d in mesh.devices.flat)


def block_key(index, shape) -> tuple:
    """A hashable form of a block's index (slices) within ``shape``."""
    return tuple(s.indices(n) for s, n in zip(index, shape))


@functools.partial(jax.jit, inline=True)
def swap_last_axes(x):
    """[..., a, b] -> [..., b, a] where ``x`` lies (the loader's on-device transpose)."""
    return jnp.swapaxes(x, -1, -2)


@functools.partial(jax.jit, inline=True)
def interleave_codes(x):
    """MXFP4 codes uint8 [..., K/2] as stored -> the word layout, where ``x`` lies
    (pallas_kernels.mxfp4_words.interleave_words: one fused elementwise pass)."""
    return interleave_words(x)


DeviceOp = Callable[[jax.Array], jax.Array]
"""What the devices do to a placed block: swap_last_axes or interleave_codes."""


class Staging:
    """The reused host buffers of a load. ``free``: 64-byte aligned buffers
    kept for blocks that are copied to the devices and then dropped (uint8,
    each ``nbytes`` long), which a Prefetcher takes and returns and counts
    against its budget. ``slabs``: the buffers the host ops read slabs into
    on CPU devices (k3jax.checkpoint.slabs; one per worker thread, outside the
    budget). One Staging may serve the prefetchers of several layers in
    turn. ``clear()`` frees them all."""

    def __init__(self):
        self.free: list[np.ndarray] = []
        self.slabs = BufferPool()

    @property
    def nbytes(self) -> int:
        """Bytes of the free block buffers (the slab buffers not counted)."""
        return sum(b.nbytes for b in self.free)

    def clear(self) -> None:
        self.free.clear()
        self.slabs.clear()


class InFlight:
    """The last placed host block, the device arrays made from it (``arrays``,
    awaited before the block is dropped) and the staging arrays on the
    devices that alias it (``inputs``, deleted when it is dropped).
    ``on_drop(block)``, when set, is called with each dropped block."""

    def __init__(self):
        self.block: np.ndarray | None = None
        self.arrays: list[jax.Array] = []
        self.inputs: list[jax.Array] = []
        self.on_drop: Callable[[np.ndarray], None] | None = None

    def replace(self, block: np.ndarray | None, arrays: list[jax.Array],
                inputs: list[jax.Array] = ()) -> None:
        """Wait for the held block's device work, drop it, hold the new one."""
        if self.arrays:
            jax.block_until_ready(self.arrays)   # copied (or transposed) before it is dropped
        for a in self.inputs:
            a.delete()
        dropped = self.block
        self.block, self.arrays, self.inputs = block, arrays, list(inputs)
        gc.collect(0)   # jax drops its reference to a copied host block in a gc hook (jax#14882)
        if dropped is not None and self.on_drop is not None:
            self.on_drop(dropped)

    def drop_if_done(self) -> None:
        """Drop the held block now if its device work has finished (a CPU
        device runs the transfer and the transposes in the dispatching
        thread), so that its read-ahead slot is free while the next block
        is placed."""
        if self.block is not None and all(a.is_ready() for a in self.arrays):
            self.replace(None, [])


class Prefetcher:
    """Reads the blocks of a plan, ``[(key, nbytes, staged, read arguments)]``
    in the order they will be placed, on one thread ahead of the caller:
    ``read_block(*arguments, into)`` with ``into`` a staging buffer of at
    least ``nbytes`` for a ``staged`` block (one that is copied to the
    devices and dropped), None for a block that becomes a parameter itself.

    The host memory it holds, the blocks read and not yet released plus
    every staging buffer (taken or free), stays within ``budget`` bytes
    (default: twice the plan's largest block): before a block is read, free
    buffers that cannot serve it are freed as needed, and the thread waits
    for releases while that is not enough. ``take(key)`` returns the next
    block (re-raising the thread's error); ``release(block)`` gives its
    bytes back (a staged block's buffer goes back to ``staging``)."""

    def __init__(self, read_block: Callable[..., np.ndarray], plan: list, staging: Staging,
                 budget: int | None = None):
        largest = max((n for _, n, _, _ in plan), default=0)
        self.budget = 2 * largest if budget is None else budget
        if largest > self.budget:
            raise ValueError(f"read-ahead budget {self.budget} B is smaller than a block "
                             f"({largest} B)")
        self._staging = staging
        self._available = self.budget - staging.nbytes
        self._held: dict[int, tuple[int, np.ndarray | None]] = {}   # id(block) -> bytes, buffer
        self._changed = threading.Condition()
        self._queue: queue.Queue = queue.Queue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(read_block, plan), daemon=True,
                                        name="k3jax-prefetch")
        self._thread.start()

    def _reserve(self, nbytes: int, staged: bool) -> np.ndarray | None:
        """Under the lock: the staging buffer for the block (None for an
        unstaged block) once the budget allows it; None with the stop flag
        set when stopped."""
        free = self._staging.free
        while not self._stop.is_set():
            if staged:
                fits = [i for i, b in enumerate(free) if b.nbytes >= nbytes]
                if fits:
                    return free.pop(min(fits, key=lambda i: free[i].nbytes))
            # free buffers that cannot serve this block go first, the largest first
            while free and self._available < nbytes:
                self._available += free.pop(max(range(len(free)),
                                                key=lambda i: free[i].nbytes)).nbytes
            if self._available >= nbytes:
                self._available -= nbytes
                return aligned_empty((nbytes,), np.uint8) if staged else None
            self._changed.wait(timeout=0.1)
        return None

    def _run(self, read_block, plan) -> None:
        for key, nbytes, staged, args in plan:
            with self._changed:
                into = self._reserve(nbytes, staged)
                if self._stop.is_set():
                    return
            try:
                block = read_block(*args, into)
                with self._changed:
                    self._held[id(block)] = (nbytes, into)
                self._queue.put((key, block))
            except BaseException as e:   # handed to the caller, which raises it
                self._queue.put((key, e))
                return

    def take(self, key: BlockKey) -> np.ndarray:
        got, value = self._queue.get()
        if isinstance(value, BaseException):
            raise value
        if got != key:
            raise RuntimeError(f"checkpoint loader: block {got} was read ahead of {key}")
        return value

    def release(self, block: np.ndarray) -> None:
        with self._changed:
            nbytes, buffer = self._held.pop(id(block))
            if buffer is None:
                self._available += nbytes
            else:
                self._staging.free.append(buffer)
            self._changed.notify()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def place_blocks(shape: Sequence[int], sharding: NamedSharding, read,
                 device_op: DeviceOp | None = None,
                 in_flight: InFlight | None = None) -> jax.Array:
    """``jax.make_array_from_callback(shape, sharding, read)``, one block at a
    time; ``read(index)`` gives the block as stored, ``device_op`` (if any)
    makes the parameter's block of it on the device (the transpose read
    gives the block with its last two axes swapped).

    Each distinct block among this process's devices is read once and put on
    the devices that hold it. Its device work is awaited and the host block
    dropped before the next block is read when that work is already done
    (CPU devices), else after the next block is placed, so host memory beyond
    the device buffers peaks near two blocks. ``in_flight`` carries that
    last block across parameters (the caller calls ``in_flight.replace(None,
    [])`` at the end); without it, the last block is awaited here.
    (make_array_from_callback keeps every local block of the parameter on the
    host until all are read, and reads a block once per device when it is
    replicated over a mesh axis.)"""
    shape = tuple(shape)
    own = in_flight is None
    in_flight = InFlight() if own else in_flight
    arrays = []
    for index, devices in local_blocks(shape, sharding):
        in_flight.drop_if_done()
        block = read(index)
        placed = [jax.device_put(block, d) for d in devices]   # the CPU may alias the block
        if device_op is not None:
            staged, placed = placed, [device_op(a) for a in placed]
            in_flight.replace(block, placed, inputs=staged)
            del staged
        else:
            in_flight.replace(block, placed)
        arrays += placed
        del block, placed
    if own:
        in_flight.replace(None, [])
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)
