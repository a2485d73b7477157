"""RMSNorm over the last axis, computed in float32."""

import jax
import jax.numpy as jnp


def rms_norm(x_TL: jax.Array, weight_L: jax.Array, eps: float, out_dtype=None) -> jax.Array:
    """x_TL: [T, L] (any float dtype), weight_L: [L] -> [T, L] in ``out_dtype``
    (default x's)."""
    if weight_L.shape != x_TL.shape[-1:]:
        raise ValueError(f"rms_norm: weight_L must have shape {list(x_TL.shape[-1:])} (the last "
                         f"axis of x_TL {list(x_TL.shape)}), got {list(weight_L.shape)}")
    out_dtype = out_dtype or x_TL.dtype
    x = x_TL.astype(jnp.float32)
    var = jnp.mean(x * x, axis=-1, keepdims=True)
    y = x * jax.lax.rsqrt(var + eps) * weight_L.astype(jnp.float32)
    return y.astype(out_dtype)
