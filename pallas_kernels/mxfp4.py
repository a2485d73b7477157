"""MXFP4 grouped weights: the typed container the grouped kernels accept.

``Mxfp4Weights(packed_GKN, scale_GKN)`` is one weight [G, K, N] stored packed
along K (k3jax's stored layout, SPEC section 3 with the input axis second):

* ``packed_GKN`` uint8 [G, K/2, N]: byte j of column n holds elements 2j (LOW
  nibble) and 2j+1 (HIGH nibble) of that column;
* ``scale_GKN`` uint8 [G, K/32, N]: UE8M0, ``2 ** (byte - 127)`` for the 32
  consecutive K elements of its block.

E2M1 code: bit 3 sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6.

``dequantize_expert`` decodes one group's [K, N] in float32 and casts, with
the same decisions as ``k3jax.ops.mxfp4.decode_mxfp4`` (byte 255 -> NaN,
float32 overflow -> inf, results below 2**-126 flushed to a signed zero), so
both give bit-identical weights (tests/test_mxfp4_grouped.py checks it).
It is a pytree (``jax.tree_util.register_dataclass``), so it passes through
jit and shard_map like the arrays it holds.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_SIZE = 32
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_MIN_NORMAL_F32 = float(2.0 ** -126)
_SCALE_NAN = 255


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Mxfp4Weights:
    """One MXFP4 weight [G, K, N]: packed_GKN uint8 [G, K/2, N] (two E2M1 codes
    per byte along K, low nibble first), scale_GKN uint8 [G, K/32, N] (UE8M0)."""

    packed_GKN: jax.Array
    scale_GKN: jax.Array

    @property
    def shape(self) -> tuple[int, int, int]:
        """The logical shape (G, K, N)."""
        g, half_k, n = self.packed_GKN.shape
        return g, 2 * half_k, n

    @property
    def ndim(self) -> int:
        return 3

    def validate(self, name: str) -> None:
        """ValueError naming ``name`` unless the pair is a well-formed MXFP4 weight."""
        packed, scale = self.packed_GKN, self.scale_GKN
        if packed.ndim != 3 or scale.ndim != 3:
            raise ValueError(f"{name}: MXFP4 packed_GKN and scale_GKN must be 3-D, got "
                             f"{packed.shape} and {scale.shape}")
        if packed.dtype != jnp.uint8 or scale.dtype != jnp.uint8:
            raise ValueError(f"{name}: MXFP4 packed_GKN and scale_GKN must be uint8, got "
                             f"{packed.dtype} and {scale.dtype}")
        g, half_k, n = packed.shape
        if half_k % (BLOCK_SIZE // 2) or scale.shape != (g, 2 * half_k // BLOCK_SIZE, n):
            raise ValueError(f"{name}: MXFP4 packed_GKN {packed.shape} needs K/2 a multiple of "
                             f"{BLOCK_SIZE // 2} and scale_GKN [G, K/{BLOCK_SIZE}, N] = "
                             f"{[g, 2 * half_k // BLOCK_SIZE, n]}, got {list(scale.shape)}")

    def expert(self, g: jax.Array | int, dtype) -> jax.Array:
        """Group ``g``'s weight [K, N] in ``dtype`` (g may be traced)."""
        packed_KN = jax.lax.dynamic_index_in_dim(self.packed_GKN, g, 0, keepdims=False)
        scale_KN = jax.lax.dynamic_index_in_dim(self.scale_GKN, g, 0, keepdims=False)
        return dequantize_expert(packed_KN, scale_KN, dtype)

    def dequantize(self, dtype) -> jax.Array:
        """Every group [G, K, N] in ``dtype`` (for tests and small shapes only)."""
        return jax.vmap(lambda p, s: dequantize_expert(p, s, dtype))(self.packed_GKN,
                                                                     self.scale_GKN)


def dequantize_expert(packed_KN: jax.Array, scale_KN: jax.Array, dtype) -> jax.Array:
    """uint8 packed_KN [K/2, N], scale_KN [K/32, N] -> dtype [K, N] (float32 math)."""
    half_k, n = packed_KN.shape
    k = 2 * half_k
    codes = jnp.stack([packed_KN & 0x0F, packed_KN >> 4], axis=1).reshape(k, n)
    vals = jnp.take(jnp.asarray(np.array(_E2M1_VALUES, np.float32)), codes.astype(jnp.int32),
                    axis=0).reshape(k // BLOCK_SIZE, BLOCK_SIZE, n)
    b = scale_KN.astype(jnp.uint32)
    scale = jax.lax.bitcast_convert_type(jnp.maximum(b, 1) << 23, jnp.float32)
    scale = jnp.where(b == _SCALE_NAN, jnp.float32(jnp.nan), scale)
    fix = jnp.where(b == 0, jnp.float32(0.5), jnp.float32(1.0))
    out = vals * scale[:, None, :] * fix[:, None, :]
    out = jnp.where(jnp.abs(out) < _MIN_NORMAL_F32, vals * jnp.float32(0.0), out)
    return out.reshape(k, n).astype(dtype)


__all__ = ["BLOCK_SIZE", "Mxfp4Weights", "dequantize_expert"]
