"""Plain-XLA grouped matmul (the reference every kernel is tested against).

jax.lax.ragged_dot: exact, but XLA (jax 0.11.2) expands it densely ([M, G*K]
on GPU and CPU), so the "xla" backend runs blocked.py instead.

Rows of x_MK are sorted by group: rows [off_g, off_g + group_sizes_G[g]) use
w_GKN[g]. Rows at index >= sum(group_sizes_G) come out as exact zeros.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.situ import situ_glu


def valid_rows_mask_M1(num_rows: int, group_sizes_G: jax.Array) -> jax.Array:
    """[M, 1] bool: True for rows below sum(group_sizes_G)."""
    total = jnp.sum(group_sizes_G.astype(jnp.int32))
    return (jnp.arange(num_rows, dtype=jnp.int32) < total)[:, None]


def _ragged_f32(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """[M, N] float32 ragged product (accumulated in f32), no tail masking."""
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G.astype(jnp.int32),
                              preferred_element_type=jnp.float32)


def grouped_matmul(x_MK, w_GKN, group_sizes_G):
    """y_MN = x_MK @ w_GKN[group(row)]; dtype of x; rows >= sum(group_sizes) are 0."""
    y_MN = _ragged_f32(x_MK, w_GKN, group_sizes_G)
    y_MN = jnp.where(valid_rows_mask_M1(x_MK.shape[0], group_sizes_G), y_MN, 0.0)
    return y_MN.astype(x_MK.dtype)


def grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, *, beta: float,
                     linear_beta: float | None):
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) per row's group; tail rows 0."""
    gate_MN = _ragged_f32(x_MK, w_gate_GKN, group_sizes_G)
    up_MN = _ragged_f32(x_MK, w_up_GKN, group_sizes_G)
    h_MN = situ_glu(gate_MN, up_MN, beta=beta, linear_beta=linear_beta)
    h_MN = jnp.where(valid_rows_mask_M1(x_MK.shape[0], group_sizes_G), h_MN, 0.0)
    return h_MN.astype(x_MK.dtype)


def tgmm(x_MK, dy_MN, group_sizes_G, *, out_dtype=None):
    """dw_GKN[g] = x_MK[rows of g]^T @ dy_MN[rows of g] (f32 accumulate), the
    weight gradient of grouped_matmul; [G, K, N] in out_dtype (default x's).

    Rows >= sum(group_sizes) are zeroed first (a select: NaN there never
    reaches a group); empty groups give zeros.
    """
    valid_M1 = valid_rows_mask_M1(x_MK.shape[0], group_sizes_G)
    x_MK = jnp.where(valid_M1, x_MK, jnp.zeros((), x_MK.dtype))
    dy_MN = jnp.where(valid_M1, dy_MN, jnp.zeros((), dy_MN.dtype))
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())),
        lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
    dw_GKN = jax.lax.ragged_dot_general(x_MK, dy_MN, group_sizes_G.astype(jnp.int32), dims,
                                        preferred_element_type=jnp.float32)
    return dw_GKN.astype(out_dtype or x_MK.dtype)
