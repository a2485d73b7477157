"""The loader's ops on the host, for CPU devices, one slab at a time.

A parameter whose op changes its stored bytes (a weight stored [out, in] and
held [in, out]: TRANSPOSE; packed MXFP4 codes held in the word layout:
INTERLEAVE) is, on an accelerator, read as stored into a staging buffer,
copied to the device and changed there (pipeline.place_blocks, the device
op). On a CPU device the device is the host, and that route writes every
byte twice (the read into the staging buffer, the op's result into the
parameter) through staging buffers of two whole blocks. Here instead the
block that becomes the parameter is made in the parameter's orientation, in
fresh 64-byte aligned memory that the device aliases (``jax.device_put``
copies nothing), one slab at a time: a slab of the block is read as stored
into a reused buffer and checked there (as every read is), the op runs on it
while it is in the core's cache, and its result is written once, into its
place in the block. Slabs are independent: the loader's worker threads run
them side by side.

The ops are the device ops, run by XLA on the CPU device that will hold the
parameter, one call per slab: the transpose on an unsigned view of the same
width (bit for bit, whatever the float dtype), the interleave on the codes'
bytes viewed as uint32 words (pallas_kernels.mxfp4_words.interleave_word_bits;
on a little-endian host those are ``words_of`` the bytes, and the result's
bytes are ``interleave_words`` of them). A slab's result is the device op's
on the same rows: the transpose maps rows of the stored slab to columns of
the parameter, the interleave works within each 4 bytes of a row.

``slabs(shape, itemsize, row_axis, slab_bytes)`` splits a block [E, a, b]
into whole experts when one fits in ``slab_bytes``, else each expert (and a
2-D block) along its stored rows (``row_axis``, in the parameter's axes: the
last for a transposed weight, the second last for codes), into equal parts
where a divisor of the length allows it, so that a parameter's slabs share
one shape (one XLA compile).
"""
from __future__ import annotations

import dataclasses
import math
import sys
from typing import Callable, Sequence

import jax
import numpy as np

from k3jax.checkpoint.pipeline import swap_last_axes
from pallas_kernels.mxfp4_words import WORD_BYTES, interleave_word_bits, interleave_words

_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}
_compiled: set[tuple] = set()   # (apply, shape, dtype, device) that HostOp.compile ran
_interleave_word_bits = jax.jit(interleave_word_bits)
_interleave_bytes = jax.jit(interleave_words)


def _run(fn, x: np.ndarray, device: jax.Device) -> np.ndarray:
    """``fn(x)`` computed on ``device`` (jit's own transfer of a host array,
    without jax.device_put's Python path); the result as read-only numpy (no
    copy), so computed: ``x`` may be reused once this returns."""
    with jax.default_device(device):
        return np.asarray(fn(x))


def transpose_into(stored: np.ndarray, dest: np.ndarray, device: jax.Device) -> None:
    """[..., a, b] as stored -> ``dest`` [..., b, a] (pipeline.swap_last_axes on the bits)."""
    unsigned = _UNSIGNED.get(stored.dtype.itemsize)
    if unsigned is None:
        raise ValueError(f"transpose_into: no unsigned view of {stored.dtype} "
                         f"({stored.dtype.itemsize} bytes) for a CPU device")
    np.copyto(dest.view(unsigned), _run(swap_last_axes, stored.view(unsigned), device))


def interleave_into(stored: np.ndarray, dest: np.ndarray, device: jax.Device) -> None:
    """Packed MXFP4 codes uint8 [..., n] as stored -> ``dest`` [..., n] in the
    word layout (pipeline.interleave_codes' bytes)."""
    if stored.dtype != np.uint8 or stored.shape[-1] % WORD_BYTES:
        raise ValueError(f"interleave_into takes uint8 codes [..., n] with n a multiple of "
                         f"{WORD_BYTES}, got {stored.dtype} {list(stored.shape)}")
    if sys.byteorder != "little":   # a uint32 view is not words_of the bytes there
        np.copyto(dest, _run(_interleave_bytes, stored, device))
        return
    np.copyto(dest.view(np.uint32), _run(_interleave_word_bits, stored.view(np.uint32), device))


@dataclasses.dataclass(frozen=True)
class HostOp:
    """A device op as the host runs it: ``apply(stored, dest, device)``
    writes the op's result for the slab ``stored`` (as read, C-contiguous,
    64-byte aligned) into ``dest`` (its place in the parameter's block),
    computed by XLA on ``device`` (a CPU device); a slab's stored bytes take
    at most about ``slab_bytes`` (its read, the op's input and its result
    stay in a core's cache)."""

    apply: Callable[[np.ndarray, np.ndarray, jax.Device], None]
    slab_bytes: int
    swaps_last_axes: bool

    def compile(self, shape: Sequence[int], dtype, device: jax.Device) -> None:
        """Compile the op for result slabs of ``shape`` and ``dtype`` on
        ``device`` (by running it once, on zeros), once in the process."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        key = (self.apply, shape, dtype, device)
        if key in _compiled:
            return
        stored = shape[:-2] + shape[:-3:-1] if self.swaps_last_axes else shape
        self.apply(np.zeros(stored, dtype), np.empty(shape, dtype), device)
        _compiled.add(key)


TRANSPOSE = HostOp(transpose_into, 4 << 20, swaps_last_axes=True)
"""Slabs of 4 MiB: XLA:CPU's transpose of a larger one runs slower (the
source's rows and the result's fall out of cache)."""
INTERLEAVE = HostOp(interleave_into, 8 << 20, swaps_last_axes=False)
"""Slabs of 8 MiB: an elementwise pass, so larger slabs only save calls."""


def _parts(n: int, count: int) -> list[tuple[int, int]]:
    """``range(n)`` in at least ``count`` parts (at most n), none longer than
    n / count: equal ones when a divisor of n lies in [count, 2 count], else
    n // count long and a shorter last one."""
    count = max(1, min(count, n))
    size = next((n // c for c in range(count, min(2 * count, n) + 1) if n % c == 0),
                n // count)
    return [(lo, min(lo + size, n)) for lo in range(0, n, size)]


def slabs(shape: Sequence[int], itemsize: int, row_axis: int,
          slab_bytes: int) -> list[tuple[slice, ...]]:
    """The slabs of a block of ``shape`` (the parameter's axes, 2-D or 3-D
    with experts first) as slices of it, in order, covering it exactly once:
    whole experts (an equal number in each slab) when one expert's bytes fit
    in ``slab_bytes``, else one expert (or the 2-D block) at a time split
    along ``row_axis`` (-1 or -2: the axis of the stored rows); no slab holds
    more than ``slab_bytes`` unless one stored row alone is larger."""
    shape = tuple(shape)
    if len(shape) not in (2, 3):
        raise ValueError(f"slabs: a block is 2-D or 3-D (experts first), got shape {list(shape)}")
    if row_axis not in (-1, -2):
        raise ValueError(f"slabs: row_axis is -1 or -2, got {row_axis}")
    whole = (slice(None),) * len(shape)
    nbytes = math.prod(shape) * itemsize
    if nbytes == 0:
        return []
    if len(shape) == 3 and nbytes // shape[0] <= slab_bytes:
        return [(slice(lo, hi),) + whole[1:]
                for lo, hi in _parts(shape[0], math.ceil(nbytes / slab_bytes))]
    experts = [()] if len(shape) == 2 else [(slice(e, e + 1),) for e in range(shape[0])]
    axis = len(shape) + row_axis
    per_expert = nbytes // (1 if len(shape) == 2 else shape[0])
    out = []
    for lead in experts:
        for lo, hi in _parts(shape[axis], math.ceil(per_expert / slab_bytes)):
            index = list(lead + whole[len(lead):])
            index[axis] = slice(lo, hi)
            out.append(tuple(index))
    return out


__all__ = ["INTERLEAVE", "TRANSPOSE", "HostOp", "interleave_into", "slabs", "transpose_into"]
