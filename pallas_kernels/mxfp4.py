"""The MXFP4 codec (OCP Microscaling v1.0, element type E2M1) and the grouped
weight container the kernels accept.

An MXFP4 tensor of logical shape ``[..., n]`` (n a multiple of 32) is stored as

* ``packed`` uint8 ``[..., n/2]``: two 4-bit E2M1 codes per byte, the LOW
  nibble is element ``2j`` and the HIGH nibble element ``2j+1``;
* ``scales`` uint8 ``[..., n/32]``: one UE8M0 scale per 32 consecutive
  elements, ``scale = 2 ** (byte - 127)``.

``dequant`` / ``dequant_numpy`` take the codes along any one axis (``axis``;
the grouped weights ``Mxfp4Weights`` hold codes [G, N, K/2], packed along K,
the last axis).

An E2M1 code: bit 3 is the sign, bits 0-2 index the magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6 (``E2M1_VALUES``).

Decisions, shared by every dequant (jnp here, numpy here, the Mosaic and
Triton kernels' in-register ones), so that all give bit-identical results:

* Scale byte 255 (SCALE_NAN) is NaN in OCP MX; it dequantizes to NaN.
  ``validate_scales`` is the host-side check that rejects it (loaders call it).
* Dequantization happens in float32. Results beyond the float32 range (only
  with scale bytes 253-254 and large codes) become +-inf. Results below the
  smallest float32 normal, MIN_NORMAL_F32 = 2**-126 (only with scale bytes
  0-1), are flushed to a signed zero (XLA backends flush subnormals anyway).
* Every other result is exact in float32 and in bfloat16 (an E2M1 value has
  one mantissa bit), so ``dtype=jnp.bfloat16`` loses nothing.

``encode`` follows the OCP rule: shared exponent ``floor(log2(amax)) - 2``
per block (2 = the largest E2M1 exponent), each element rounded to the
nearest E2M1 value, ties to the even code, saturating at +-6. Values that are
exactly representable round-trip unchanged.

``Mxfp4Weights`` is a pytree (``jax.tree_util.register_dataclass``), so it
passes through jit and shard_map like the arrays it holds; its ``dequant``
(``Mxfp4Dequant``: FAST or EXACT) is static aux data, decided on the host
from the stored scale bytes (``Mxfp4Dequant.of_scales``) once, when the
weights are made or loaded: no compiled program reduces over the scales.
Its ``k_order_axis`` (static too) may name one logical axis along which the
weight is the stored one in ``k_order``, the Mosaic kernels' K order.
"""

from __future__ import annotations

import dataclasses
import enum

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.mxfp4_fast import FAST_SCALES
from pallas_kernels.mxfp4_words import deinterleave_words, interleave_words

BLOCK_SIZE = 32
"""Elements that share one UE8M0 scale."""

SCALE_NAN = 255
"""The UE8M0 byte that OCP MX reserves for NaN."""

E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
     -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
"""The 16 E2M1 values, indexed by 4-bit code (float32, [16])."""
E2M1_VALUES.flags.writeable = False

MIN_NORMAL_F32 = float(2.0 ** -126)
"""Results below it (in magnitude) flush to a signed zero."""

K_ORDER_CHUNK = 128
"""Elements ``k_order`` permutes among (the Mosaic MXFP4 kernels' K step)."""


def k_order(x, axis: int = -1, *, inverse: bool = False):
    """The Mosaic MXFP4 kernels' K order along ``axis`` (numpy or jax; its
    size a multiple of K_ORDER_CHUNK): in each 128-element chunk, position
    32b + 8j + 2l + L takes element 32l + 8b + 2j + L (l, b, j < 4, L < 2;
    grouped_matmul/mxfp4_dequant.py says why). ``inverse`` undoes it."""
    axis = axis % x.ndim
    size = x.shape[axis]
    if size % K_ORDER_CHUNK:
        raise ValueError(f"k_order takes an axis of a multiple of {K_ORDER_CHUNK} elements, "
                         f"got {size} (shape {tuple(x.shape)})")
    lead, trail = x.shape[:axis], x.shape[axis + 1:]
    a = len(lead) + 1                                    # the first of the chunk's 4 axes
    # stored (l, b, j, L) -> (b, j, l, L); inverse: (b, j, l, L) -> (l, b, j, L)
    order = (a + 2, a, a + 1, a + 3) if inverse else (a + 1, a + 2, a, a + 3)
    perm = (*range(a), *order, *range(a + 4, a + 4 + len(trail)))
    return x.reshape(*lead, size // K_ORDER_CHUNK, 4, 4, 4, 2, *trail).transpose(perm) \
        .reshape(x.shape)


def k_order_index(size: int) -> np.ndarray:
    """int32 [size]: the element ``k_order`` puts at each position
    (k_order(x)[..., c] = x[..., k_order_index(size)[c]])."""
    return np.asarray(k_order(np.arange(size, dtype=np.int32)))


# -- shape / dtype checks ----------------------------------------------------

def check_shapes(packed_shape, packed_dtype, scales_shape, scales_dtype) -> int:
    """Validate an MXFP4 (packed, scales) pair; return the logical width n."""
    if np.dtype(packed_dtype) != np.uint8:
        raise ValueError(f"MXFP4 packed codes must be uint8, got {np.dtype(packed_dtype)}")
    if np.dtype(scales_dtype) != np.uint8:
        raise ValueError(f"MXFP4 scales must be uint8 (UE8M0), got {np.dtype(scales_dtype)}")
    if len(packed_shape) == 0 or len(scales_shape) == 0:
        raise ValueError("MXFP4 packed codes and scales must have at least one dimension, "
                         f"got shapes {tuple(packed_shape)} and {tuple(scales_shape)}")
    if tuple(packed_shape[:-1]) != tuple(scales_shape[:-1]):
        raise ValueError("MXFP4 packed codes and scales must share their leading dims: "
                         f"packed {tuple(packed_shape)} vs scales {tuple(scales_shape)}")
    half = packed_shape[-1]
    if half == 0 or half % (BLOCK_SIZE // 2):
        raise ValueError(f"MXFP4 packed last dim must be n/2 with n a positive multiple of "
                         f"{BLOCK_SIZE}, got {half} (shape {tuple(packed_shape)})")
    n = 2 * half
    if scales_shape[-1] != n // BLOCK_SIZE:
        raise ValueError(f"MXFP4 scales last dim must be n/{BLOCK_SIZE} = {n // BLOCK_SIZE} "
                         f"for packed last dim n/2 = {half}, got {scales_shape[-1]} "
                         f"(packed {tuple(packed_shape)}, scales {tuple(scales_shape)})")
    return n


def validate_scales(scales) -> None:
    """Host-side check: raise ValueError if any UE8M0 byte is 255 (NaN in OCP MX).

    scales: uint8 [..., n/32] (numpy or a concrete jax array)."""
    s = np.asarray(scales)
    if s.dtype != np.uint8:
        raise ValueError(f"MXFP4 scales must be uint8 (UE8M0), got {s.dtype}")
    bad = np.argwhere(s == SCALE_NAN)
    if bad.size:
        raise ValueError(f"MXFP4 scales hold {len(bad)} NaN byte(s) (255), first at index "
                         f"{tuple(int(i) for i in bad[0])}")


# -- dequant -----------------------------------------------------------------

def _codes_shape(packed, scales, axis: int) -> tuple[int, int, tuple, tuple]:
    """(axis >= 0, n, leading dims, trailing dims) of codes along ``axis``;
    ValueError (check_shapes) for a malformed pair."""
    if packed.ndim == 0 or packed.ndim != scales.ndim:
        check_shapes(packed.shape, packed.dtype, scales.shape, scales.dtype)  # raises
    axis = axis % packed.ndim
    move = lambda shape: (*shape[:axis], *shape[axis + 1:], shape[axis])  # noqa: E731
    n = check_shapes(move(packed.shape), packed.dtype, move(scales.shape), scales.dtype)
    return axis, n, tuple(packed.shape[:axis]), tuple(packed.shape[axis + 1:])


def dequant(packed, scales, dtype=jnp.float32, *, axis: int = -1) -> jax.Array:
    """Dequantize MXFP4 with jax.numpy (host arrays and inside jit).

    packed: uint8 [..., n/2, ...]; scales: uint8 [..., n/32, ...], the codes
    along ``axis`` -> dtype [..., n, ...]. Computed in float32, then cast to
    ``dtype`` (exact for bfloat16)."""
    packed = packed if isinstance(packed, jax.Array) else jnp.asarray(packed)
    scales = scales if isinstance(scales, jax.Array) else jnp.asarray(scales)
    axis, n, lead, trail = _codes_shape(packed, scales, axis)
    codes = jnp.stack([packed & 0x0F, packed >> 4], axis=axis + 1).reshape(*lead, n, *trail)
    # A writeable copy of the table: with the read-only E2M1_VALUES itself, XLA
    # compiles the blocked MXFP4 path with more temporaries.
    vals = jnp.take(jnp.asarray(np.array(E2M1_VALUES)), codes.astype(jnp.int32), axis=0)
    vals = vals.reshape(*lead, n // BLOCK_SIZE, BLOCK_SIZE, *trail)
    b = scales.astype(jnp.uint32)
    # 2**(b-127) as float32 bits, kept normal: byte 0 uses 2**-126 times a 0.5 fixup.
    scale = jax.lax.bitcast_convert_type(jnp.maximum(b, 1) << 23, jnp.float32)
    scale = jnp.where(b == SCALE_NAN, jnp.float32(jnp.nan), scale)
    fix = jnp.where(b == 0, jnp.float32(0.5), jnp.float32(1.0))
    out = vals * jnp.expand_dims(scale, axis + 1) * jnp.expand_dims(fix, axis + 1)
    out = jnp.where(jnp.abs(out) < jnp.float32(MIN_NORMAL_F32), vals * jnp.float32(0.0), out)
    return out.reshape(*lead, n, *trail).astype(dtype)


def dequant_numpy(packed, scales, *, axis: int = -1) -> np.ndarray:
    """Host-side dequant, the same float32 math as ``dequant``.

    packed: uint8 [..., n/2, ...]; scales: uint8 [..., n/32, ...] -> float32."""
    packed = np.asarray(packed)
    scales = np.asarray(scales)
    axis, n, lead, trail = _codes_shape(packed, scales, axis)
    codes = np.stack([packed & 0x0F, packed >> 4], axis=axis + 1).reshape(*lead, n, *trail)
    vals = E2M1_VALUES[codes].reshape(*lead, n // BLOCK_SIZE, BLOCK_SIZE, *trail)
    b = scales.astype(np.uint32)
    scale = (np.maximum(b, 1) << 23).astype(np.uint32).view(np.float32)
    scale = np.where(b == SCALE_NAN, np.float32(np.nan), scale).astype(np.float32)
    fix = np.where(b == 0, np.float32(0.5), np.float32(1.0)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        out = vals * np.expand_dims(scale, axis + 1) * np.expand_dims(fix, axis + 1)
        out = np.where(np.abs(out) < np.float32(MIN_NORMAL_F32), vals * np.float32(0.0), out)
    return out.reshape(*lead, n, *trail).astype(np.float32, copy=False)


# -- encode ------------------------------------------------------------------

# Midpoints between consecutive E2M1 magnitudes; at a tie the even code wins,
# so a midpoint after an even code is crossed with '>', after an odd one '>='.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def encode(x) -> tuple[np.ndarray, np.ndarray]:
    """Quantize to MXFP4 on the host (for writing synthetic checkpoints).

    x: float [..., n], n a multiple of 32 -> (packed uint8 [..., n/2],
    scales uint8 [..., n/32]). Per 32-block shared exponent
    ``clip(floor(log2(amax)) - 2, -127, 127)`` (byte 127 for an all-zero block),
    round to nearest E2M1 with ties to the even code, saturate at +-6."""
    x = np.asarray(x)
    if x.dtype.kind in "biucOSU":          # floats (incl. ml_dtypes bfloat16) only
        raise ValueError(f"encode expects a floating array, got {x.dtype}")
    x = x.astype(np.float64)
    if x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % BLOCK_SIZE:
        raise ValueError(f"encode: last dim must be a positive multiple of {BLOCK_SIZE}, "
                         f"got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("encode: input holds NaN or inf")
    lead, n = x.shape[:-1], x.shape[-1]
    blocks = x.reshape(*lead, n // BLOCK_SIZE, BLOCK_SIZE)
    amax = np.max(np.abs(blocks), axis=-1)
    _, e2 = np.frexp(amax)                      # amax = m * 2**e2, m in [0.5, 1)
    shared = np.where(amax > 0, e2.astype(np.int64) - 1 - 2, 0)
    shared = np.clip(shared, -127, 127)
    y = np.abs(blocks) * np.ldexp(1.0, -shared)[..., None]   # exact power-of-2 scaling
    mag = np.zeros(y.shape, np.uint8)
    for i, mid in enumerate(_MIDPOINTS):
        mag += (y > mid) if i % 2 == 0 else (y >= mid)
    code = mag | np.where((blocks < 0) & (mag != 0), np.uint8(8), np.uint8(0))
    code = code.astype(np.uint8).reshape(*lead, n)
    packed = (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8)
    scales = (shared + 127).astype(np.uint8)
    return packed, scales


# -- grouped weights -----------------------------------------------------------

class Mxfp4Dequant(enum.Enum):
    """Which in-kernel dequantization a packed weight's scale bytes allow,
    a static property of the stored bytes (``of_scales``).

    FAST   every UE8M0 byte is in mxfp4_fast.FAST_SCALES (2..128): the fast
           in-register sequence is exact for it (pallas_kernels.mxfp4_fast).
    EXACT  any byte: the exact dequantization (the codec's decisions for
           bytes 0, 1, 129..254 and 255), about 6x the fast one's
           instructions. Correct for every weight, FAST ones included.

    Only the Mosaic kernels tell them apart; the blocked XLA path and the
    Triton kernels dequantize every byte exactly either way.
    """

    FAST = "fast"
    EXACT = "exact"

    @classmethod
    def of_scales(cls, scales) -> Mxfp4Dequant:
        """FAST when every byte of ``scales`` (uint8, host numpy or a
        concrete jax array, any shape) is in FAST_SCALES, else EXACT.
        ValueError for another dtype; an empty array is FAST."""
        s = np.asarray(scales)
        if s.dtype != np.uint8:
            raise ValueError(f"MXFP4 scales must be uint8 (UE8M0), got {s.dtype}")
        if s.size == 0:
            return cls.FAST
        fast = FAST_SCALES.start <= int(s.min()) and int(s.max()) < FAST_SCALES.stop
        return cls.FAST if fast else cls.EXACT

    @classmethod
    def combine(cls, parts) -> Mxfp4Dequant:
        """The dequant of a weight made of ``parts`` (an iterable of
        Mxfp4Dequant: its slices, or each process's share): EXACT when
        any part is, else FAST (also for no parts)."""
        parts = list(parts)
        bad = [p for p in parts if not isinstance(p, cls)]
        if bad:
            raise ValueError(f"Mxfp4Dequant.combine takes Mxfp4Dequant values, got {bad[0]!r}")
        return cls.EXACT if cls.EXACT in parts else cls.FAST


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Weights:
    """One MXFP4 weight of logical shape [G, K, N] (x_MK @ w[g] contracts K).

    * packed_GNK uint8 [G, N, K/2]: the checkpoint's [out, in] orientation,
      each output row's K/2 bytes contiguous, in the word layout
      (pallas_kernels.mxfp4_words): the checkpoint's bytes with the bits of
      every 4 permuted for the kernels' fast dequantization. The loader
      interleaves the stored bytes (``from_checkpoint``); ``dequantize`` and
      ``expert`` undo it inside their XLA fusion.
    * scale_GKN uint8 [G, K/32, N]: the UE8M0 scales, K-block major (one row
      of N bytes per 32 K elements). The loader transposes them from the
      stored [N, K/32]: a kernel's K step needs 4 scale bytes per output row,
      fewer than the 16 contiguous bytes a TMA box takes, but block_n of them
      per K-block row.
    * dequant (static, pytree aux data): Mxfp4Dequant.FAST only when every
      scale byte is in FAST_SCALES, which the maker asserts (the loader and
      ``from_checkpoint`` read it off the bytes; nothing checks it on the
      device: a FAST weight with another byte gives inexact results there);
      EXACT is right for any bytes. The Mosaic kernels pick their
      dequantization from it at trace time.
    * k_order_axis (static): None, or the logical axis (1: K, 2: N, of a
      multiple of K_ORDER_CHUNK elements) along which this weight is the
      stored one in ``k_order``: w[g] = k_order(stored[g], axis - 1). With
      1, x @ w[g] = x' @ stored[g] for x = k_order(x') (the Mosaic kernels
      take x as it comes); with 2, x @ w[g] = k_order(x @ stored[g]) (the
      row-major Mosaic kernel dequantizes the stored rows in that order).
      Chained, the MoE's gate/up (2) makes h in the order its down
      projection (1) takes: no transposed copy of h. ``expert`` and
      ``dequantize`` apply it; no program permutes the codes.

    Every kernel reads the word layout in place: no program holds a
    reordered copy of the codes (``checkpoint_codes`` is one, for tests and
    the host).
    """

    packed_GNK: jax.Array
    scale_GKN: jax.Array
    dequant: Mxfp4Dequant = dataclasses.field(metadata=dict(static=True))
    k_order_axis: int | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self) -> None:
        if not isinstance(self.dequant, Mxfp4Dequant):
            raise ValueError(f"Mxfp4Weights: dequant must be an Mxfp4Dequant, got {self.dequant!r}")
        if self.k_order_axis not in (None, 1, 2):
            raise ValueError(f"Mxfp4Weights: k_order_axis must be None, 1 (K) or 2 (N), got "
                             f"{self.k_order_axis!r}")

    @classmethod
    def from_checkpoint(cls, packed_GNK, scale_GKN) -> Mxfp4Weights:
        """The weight of checkpoint codes uint8 [G, N, K/2] (two E2M1 codes a
        byte along K, low nibble first) and scales uint8 [G, K/32, N] (host
        or concrete arrays): the codes interleaved into the word layout
        (numpy stays numpy), the dequant read off the scale bytes
        (``Mxfp4Dequant.of_scales``)."""
        return cls(interleave_words(packed_GNK), scale_GKN, Mxfp4Dequant.of_scales(scale_GKN))

    def checkpoint_codes(self) -> jax.Array:
        """The codes in the checkpoint's byte layout, uint8 [G, N, K/2]: a
        full copy of the codes (tests and host-side use; the kernels read
        ``packed_GNK`` in place)."""
        return deinterleave_words(self.packed_GNK)

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical shape (G, K, N)."""
        g, n, half_k = self.packed_GNK.shape
        return g, 2 * half_k, n

    @property
    def ndim(self) -> int:
        return 3

    def validate(self, name: str) -> None:
        """ValueError naming ``name`` unless the pair is a well-formed MXFP4 weight."""
        packed, scale = self.packed_GNK, self.scale_GKN
        if packed.ndim != 3 or scale.ndim != 3:
            raise ValueError(f"{name}: MXFP4 packed_GNK and scale_GKN must be 3-D, got "
                             f"{packed.shape} and {scale.shape}")
        if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
            raise ValueError(f"{name}: MXFP4 packed_GNK and scale_GKN must be uint8, got "
                             f"{packed.dtype} and {scale.dtype}")
        g, n, half_k = packed.shape
        if half_k % (BLOCK_SIZE // 2) or scale.shape != (g, 2 * half_k // BLOCK_SIZE, n):
            raise ValueError(f"{name}: MXFP4 packed_GNK {packed.shape} needs K/2 a multiple of "
                             f"{BLOCK_SIZE // 2} and scale_GKN [G, K/{BLOCK_SIZE}, N] = "
                             f"{[g, 2 * half_k // BLOCK_SIZE, n]}, got {list(scale.shape)}")
        if self.k_order_axis is not None and self.shape[self.k_order_axis] % K_ORDER_CHUNK:
            raise ValueError(f"{name}: k_order_axis {self.k_order_axis} needs that axis a "
                             f"multiple of {K_ORDER_CHUNK}, got shape {self.shape}")

    def expert(self, g: jax.Array | int, dtype) -> jax.Array:
        """Group ``g``'s weight [K, N] in ``dtype`` (g may be traced)."""
        packed_NK = deinterleave_words(
            jax.lax.dynamic_index_in_dim(self.packed_GNK, g, 0, keepdims=False))
        scale_KN = jax.lax.dynamic_index_in_dim(self.scale_GKN, g, 0, keepdims=False)
        # The uint8 codes are turned, not the dequantized [N, K] (4x the bytes):
        # XLA reads them transposed inside the dequant's fusion.
        w_KN = dequant(packed_NK.T, scale_KN, dtype, axis=0)
        return w_KN if self.k_order_axis is None else k_order(w_KN, self.k_order_axis - 1)

    def dequantize(self, dtype) -> jax.Array:
        """Every group [G, K, N] in ``dtype`` (for tests and small shapes only)."""
        w = jax.vmap(lambda p, s: dequant(p.T, s, dtype, axis=0))(self.checkpoint_codes(),
                                                                  self.scale_GKN)
        return w if self.k_order_axis is None else k_order(w, self.k_order_axis)


__all__ = ["BLOCK_SIZE", "E2M1_VALUES", "K_ORDER_CHUNK", "MIN_NORMAL_F32", "SCALE_NAN",
           "Mxfp4Dequant", "Mxfp4Weights", "check_shapes", "dequant", "dequant_numpy", "encode",
           "k_order", "k_order_index", "validate_scales"]
