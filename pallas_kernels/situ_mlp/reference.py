"""Plain-XLA fused MLP up-projection: h_TF = situ_glu(x @ gate, x @ up)."""

from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.situ import situ_glu


def situ_mlp_up(x_TD, gate_DF, up_DF, *, beta: float, linear_beta: float | None):
    """x_TD [T, D], gate_DF / up_DF [D, F] -> h_TF [T, F] in x's dtype (f32 accumulate)."""
    gate_TF = jnp.dot(x_TD, gate_DF, preferred_element_type=jnp.float32)
    up_TF = jnp.dot(x_TD, up_DF, preferred_element_type=jnp.float32)
    return situ_glu(gate_TF, up_TF, beta=beta, linear_beta=linear_beta).astype(x_TD.dtype)
