"""Plain matmuls at the precision k3jax promises: float32 operands use full
float32 precision (no TF32 on GPUs); bf16 operands accumulate in float32."""

import jax
import jax.numpy as jnp


def precision_for(dtype) -> jax.lax.Precision:
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def matmul(x_MK: jax.Array, w_KN: jax.Array, out_dtype=None) -> jax.Array:
    """[M, K] @ [K, N] -> [M, N] in ``out_dtype`` (default x's dtype), f32 accumulation."""
    y = jnp.dot(x_MK, w_KN, precision=precision_for(x_MK.dtype),
                preferred_element_type=jnp.float32)
    return y.astype(out_dtype or x_MK.dtype)
