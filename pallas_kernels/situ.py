"""SiTU-GLU: the single definition of the activation math (SPEC section 2).

Every k3jax module and every kernel epilogue uses :func:`situ_glu_f32`
(float32 in, float32 out) or :func:`situ_glu` (casts back to the input dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def situ_glu_f32(gate_f32: jax.Array, up_f32: jax.Array, *, beta: float,
                 linear_beta: float | None) -> jax.Array:
    """float32 SiTU-GLU on same-shape float32 arrays; returns float32.

    gate' = beta * tanh(gate / beta) * sigmoid(gate)
    up'   = linear_beta * tanh(up / linear_beta)   (up' = up if linear_beta is None)
    Uses only tanh / exp / mul / add / div so it lowers inside Mosaic GPU kernels.
    """
    sigmoid = 1.0 / (1.0 + jnp.exp(-gate_f32))
    gate_act = beta * jnp.tanh(gate_f32 * (1.0 / beta)) * sigmoid
    if linear_beta is None:
        up_act = up_f32
    else:
        up_act = linear_beta * jnp.tanh(up_f32 * (1.0 / linear_beta))
    return gate_act * up_act


def situ_glu(gate, up, *, beta: float, linear_beta: float | None):
    """SiTU-GLU of gate [..., n] and up [..., n]; math in float32, result in gate.dtype."""
    if gate.shape != up.shape:
        raise ValueError(f"situ_glu: gate shape {gate.shape} != up shape {up.shape}")
    check_betas(beta, linear_beta)
    out_f32 = situ_glu_f32(jnp.asarray(gate, jnp.float32), jnp.asarray(up, jnp.float32),
                           beta=beta, linear_beta=linear_beta)
    return out_f32.astype(jnp.asarray(gate).dtype)


def check_betas(beta: float, linear_beta: float | None) -> None:
    """Reject non-positive betas (tanh(x / beta) is meaningless for beta <= 0)."""
    if not beta > 0:
        raise ValueError(f"situ_glu: beta must be > 0, got {beta!r}")
    if linear_beta is not None and not linear_beta > 0:
        raise ValueError(f"situ_glu: linear_beta must be > 0 or None, got {linear_beta!r}")
