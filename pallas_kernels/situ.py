"""SiTU-GLU: the single definition of the activation math (docs/spec.md §2).

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


def situ_glu_vjp_f32(gate_f32: jax.Array, up_f32: jax.Array, dout_f32: jax.Array, *,
                     beta: float, linear_beta: float | None) -> tuple[jax.Array, jax.Array]:
    """(d_gate, d_up) float32: the cotangents of situ_glu_f32's two inputs for
    the output cotangent dout_f32 (all three the same shape).

    With s = sigmoid(gate), t = tanh(gate / beta):
      gate' = beta * t * s,  d gate'/d gate = (1 - t^2) * s + beta * t * s * (1 - s)
      up'   = lb * tanh(up / lb),  d up'/d up = 1 - tanh(up / lb)^2   (up' = up: 1)
      d_gate = dout * up' * d gate'/d gate,  d_up = dout * gate' * d up'/d up
    """
    sigmoid = 1.0 / (1.0 + jnp.exp(-gate_f32))
    tanh_gate = jnp.tanh(gate_f32 * (1.0 / beta))
    gate_act = beta * tanh_gate * sigmoid
    dgate_act = (1.0 - tanh_gate * tanh_gate) * sigmoid + gate_act * (1.0 - sigmoid)
    if linear_beta is None:
        up_act, dup_act = up_f32, jnp.ones_like(up_f32)
    else:
        tanh_up = jnp.tanh(up_f32 * (1.0 / linear_beta))
        up_act, dup_act = linear_beta * tanh_up, 1.0 - tanh_up * tanh_up
    return dout_f32 * up_act * dgate_act, dout_f32 * gate_act * dup_act
