"""RMSNorm over the last axis, computed in float32."""

import jax
import jax.numpy as jnp


def rms_norm(x_TL: jax.Array, weight_L: jax.Array, eps: float, out_dtype=None) -> jax.Array:
    """x_TL: [T, L] (any float dtype) -> [T, L] in ``out_dtype`` (default x's)."""
    out_dtype = out_dtype or x_TL.dtype
    x = x_TL.astype(jnp.float32)
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(var + eps) * weight_L.astype(jnp.float32)
    return y.astype(out_dtype)
