"""Blocked transposed grouped matmul (tgmm) in plain XLA: the weight gradient
of grouped_matmul on the "xla" and "triton" backends.

    dw_GKN[g] = x_MK[rows of g]^T @ dy_MN[rows of g]

``reference.tgmm`` (``jax.lax.ragged_dot_general``) is exact but XLA expands it
densely ([M, G*K]). This costs O(block) memory on top of its [G, K, N] output:
the rows are cut into blocked.py's items (the non-empty intersections of one
group's rows with one ``block_m``-row block, in row order, so each group's
items are consecutive), and a ``lax.scan`` over them

* slices the item's row block of x and dy, zeroing the rows outside the item
  (both operands: rows of other groups, and rows past sum(group_sizes) that
  may hold NaN, contribute exact zeros and never NaN * 0);
* adds x_BK^T @ dy_BN (f32 products) to a float32 [K, N] accumulator that
  restarts at zero when the item's group changes;
* writes the accumulator, cast to out_dtype, into row g of the carried
  gradient (``dynamic_update_slice``): the last item of a group leaves that
  group's full sum there, rounded once.

Groups without rows stay exact zeros; empty items skip the product
(``lax.cond``). Nothing of size [M, G, ...] is allocated.

``grouped_matmul_vjp`` is grouped_matmul's whole backward on XLA (dx and dw)
in one such scan, and ``grouped_situ_glu_vjp`` the fused pair's whole backward on XLA in one
such scan (recompute, SiTU-GLU derivative, dx and both weight gradients per
item), so no [M, 2N] cotangent of the pre-activations is ever materialized.
``grouped_matmul_combine_vjp`` is combine.py's backward (a grouped matmul
whose rows are weighted and scatter-added into tokens): dx, dw and the
rows' weights' gradient in one scan that gathers the tokens' cotangent per
block, so no [M, N] cotangent of the rows is ever materialized.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.grouped_matmul.blocked import block_rows, filled, item_block, items_3W
from pallas_kernels.situ import situ_glu_vjp_f32


def tgmm(x_MK: jax.Array, dy_MP: jax.Array, group_sizes_G: jax.Array, *,
         out_dtype=None, columns: tuple[int, int] | None = None) -> jax.Array:
    """dw_GKN [G, K, N] in out_dtype (default x's): per group x_g^T @ dy_g,
    accumulated in f32; rows >= sum(group_sizes) ignored (NaN there never
    leaks); groups without rows are 0. dy is dy_MP[:, c0:c1] for
    ``columns`` (c0, c1) (read per block: no copy of the column range),
    else all of dy_MP (N = P)."""
    m, k = x_MK.shape
    if dy_MP.shape[0] != m:
        raise ValueError(f"dy_MN rows {dy_MP.shape[0]} != x_MK rows {m}")
    c0, c1 = columns if columns is not None else (0, dy_MP.shape[1])
    if not 0 <= c0 <= c1 <= dy_MP.shape[1]:
        raise ValueError(f"columns {columns} out of range for dy width {dy_MP.shape[1]}")
    n = c1 - c0
    dy_MN = dy_MP
    num_groups = group_sizes_G.shape[0]
    out_dtype = out_dtype or x_MK.dtype
    operands = (x_MK, dy_MN, group_sizes_G)
    if m == 0 or k == 0 or n == 0:
        return filled(operands, (num_groups, k, n), 0, out_dtype)
    block_m = block_rows(m, num_groups)
    items = items_3W(group_sizes_G.astype(jnp.int32), m, block_m).T

    def step(carry, item):
        dw_GKN, acc_KN, acc_group = carry
        group, active = item[0], item[2] > item[1]
        start, keep_B1 = item_block(item, m, block_m)

        def product():
            x_BK = jnp.where(keep_B1, lax.dynamic_slice_in_dim(x_MK, start, block_m), 0)
            dy_BN = lax.dynamic_slice(dy_MN, (start, c0), (block_m, n))
            dy_BN = jnp.where(keep_B1, dy_BN, 0)
            return lax.dot_general(x_BK, dy_BN, (((0,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)

        prod_KN = lax.cond(active, product, lambda: filled(operands, (k, n), 0, jnp.float32))
        acc_KN = jnp.where(group == acc_group, acc_KN, 0.0) + prod_KN
        # An empty trailing item (group clamped to G - 1, product 0) rewrites
        # group G - 1's sum, or zero when G - 1 has no rows: both exact.
        dw_GKN = lax.dynamic_update_slice_in_dim(dw_GKN, acc_KN.astype(out_dtype)[None], group, 0)
        return (dw_GKN, acc_KN, group + lax.full_like(acc_group, 0)), None

    init = (filled(operands, (num_groups, k, n), 0, out_dtype),
            filled(operands, (k, n), 0, jnp.float32), filled(operands, (), -1, jnp.int32))
    (dw_GKN, _, _), _ = lax.scan(step, init, items)
    return dw_GKN



def grouped_matmul_vjp(x_MK: jax.Array, w_GKN: jax.Array, dy_MN: jax.Array,
                       group_sizes_G: jax.Array):
    """(dx_MK, dw_GKN) of y = x @ w[g] for dy_MN [M, N], in one scan over the
    items: per item dx_B = dy_B @ w[g]^T (f32 accumulation, one cast to x's
    dtype) written into the item's rows, and x_B^T @ dy_B added to the group's
    f32 accumulator (as ``tgmm``; dw in w's dtype). One scan, so x and dy are
    both last read by it and die together (a separate tgmm may be scheduled
    after the next backward and hold them). Rows of other items and rows >=
    sum(group_sizes) are zeroed in x and dy first; dx there is exactly 0.
    Float weights only."""
    m, k = x_MK.shape
    num_groups, _, n = w_GKN.shape
    dtype, w_dtype = x_MK.dtype, w_GKN.dtype
    operands = (x_MK, w_GKN, dy_MN, group_sizes_G)
    if m == 0 or k == 0 or n == 0:
        return filled(operands, (m, k), 0, dtype), filled(operands, (num_groups, k, n), 0, w_dtype)
    block_m = block_rows(m, num_groups)
    items = items_3W(group_sizes_G.astype(jnp.int32), m, block_m).T
    nt = (((1,), (1,)), ((), ()))
    tn = (((0,), (0,)), ((), ()))

    def step(carry, item):
        dx_MK, dw_GKN, acc_KN, acc_group = carry
        group, active = item[0], item[2] > item[1]
        start, keep_B1 = item_block(item, m, block_m)

        def compute():
            x_BK = jnp.where(keep_B1, lax.dynamic_slice_in_dim(x_MK, start, block_m), 0)
            dy_BN = jnp.where(keep_B1, lax.dynamic_slice_in_dim(dy_MN, start, block_m), 0)
            dy_BN = dy_BN.astype(dtype)
            w_KN = lax.dynamic_index_in_dim(w_GKN, group, 0, keepdims=False)
            dx_BK = lax.dot_general(dy_BN, w_KN, nt, preferred_element_type=jnp.float32)
            return (dx_BK.astype(dtype),
                    lax.dot_general(x_BK, dy_BN, tn, preferred_element_type=jnp.float32))

        def skip():
            return (filled(operands, (block_m, k), 0, dtype),
                    filled(operands, (k, n), 0, jnp.float32))

        dx_BK, p_KN = lax.cond(active, compute, skip)
        old_BK = lax.dynamic_slice_in_dim(dx_MK, start, block_m)
        dx_MK = lax.dynamic_update_slice_in_dim(dx_MK, jnp.where(keep_B1, dx_BK, old_BK), start, 0)
        acc_KN = jnp.where(group == acc_group, acc_KN, 0.0) + p_KN
        dw_GKN = lax.dynamic_update_slice_in_dim(dw_GKN, acc_KN.astype(w_dtype)[None], group, 0)
        return (dx_MK, dw_GKN, acc_KN, group + lax.full_like(acc_group, 0)), None

    # dx's zero init leaves an optimization barrier with dy (see grouped_situ_glu_vjp)
    zero, _ = lax.optimization_barrier((filled(operands, (), 0, dtype), dy_MN))
    init = (jnp.broadcast_to(zero, (m, k)), filled(operands, (num_groups, k, n), 0, w_dtype),
            filled(operands, (k, n), 0, jnp.float32), filled(operands, (), -1, jnp.int32))
    (dx_MK, dw_GKN, _, _), _ = lax.scan(step, init, items)
    return dx_MK, dw_GKN


def grouped_situ_glu_vjp(x_MK: jax.Array, w_gate_GKN: jax.Array, w_up_GKN: jax.Array,
                         dh_MN: jax.Array, group_sizes_G: jax.Array, *, beta: float,
                         linear_beta: float | None):
    """(dx_MK, dw_gate_GKN, dw_up_GKN) of the fused pair for dh_MN [M, N], in
    one scan over the items, holding nothing of size [M, N] or more besides
    dx: per item, gate and up recomputed in float32 (x_B @ w[g]), the SiTU-GLU
    derivative in float32 (situ_glu_vjp_f32), d_gate / d_up rounded once to
    x's dtype, then dx_B = d_gate @ w_gate[g]^T + d_up @ w_up[g]^T (one f32
    sum, one cast) written into the item's rows, and x_B^T @ d_gate,
    x_B^T @ d_up added to the group's f32 accumulators (as ``tgmm``). Rows of
    other items and rows >= sum(group_sizes) are zeroed in x and dh first, so
    NaN there never leaks; dx there is exactly 0. Float weights only."""
    m, k = x_MK.shape
    num_groups, _, n = w_gate_GKN.shape
    dtype, w_dtype = x_MK.dtype, w_gate_GKN.dtype
    operands = (x_MK, w_gate_GKN, w_up_GKN, dh_MN, group_sizes_G)
    if m == 0 or k == 0 or n == 0:
        return (filled(operands, (m, k), 0, dtype), filled(operands, (num_groups, k, n), 0, w_dtype),
                filled(operands, (num_groups, k, n), 0, w_up_GKN.dtype))
    block_m = block_rows(m, num_groups)
    items = items_3W(group_sizes_G.astype(jnp.int32), m, block_m).T
    nt = (((1,), (1,)), ((), ()))
    tn = (((0,), (0,)), ((), ()))

    def step(carry, item):
        dx_MK, dwg_GKN, dwu_GKN, accg_KN, accu_KN, acc_group = carry
        group, active = item[0], item[2] > item[1]
        start, keep_B1 = item_block(item, m, block_m)

        def compute():
            x_BK = jnp.where(keep_B1, lax.dynamic_slice_in_dim(x_MK, start, block_m), 0)
            dh_BN = jnp.where(keep_B1, lax.dynamic_slice_in_dim(dh_MN, start, block_m), 0)
            wg_KN = lax.dynamic_index_in_dim(w_gate_GKN, group, 0, keepdims=False)
            wu_KN = lax.dynamic_index_in_dim(w_up_GKN, group, 0, keepdims=False)
            gate = jnp.dot(x_BK, wg_KN, preferred_element_type=jnp.float32)
            up = jnp.dot(x_BK, wu_KN, preferred_element_type=jnp.float32)
            d_gate, d_up = situ_glu_vjp_f32(gate, up, dh_BN.astype(jnp.float32), beta=beta,
                                            linear_beta=linear_beta)
            d_gate, d_up = d_gate.astype(dtype), d_up.astype(dtype)
            dx_BK = (lax.dot_general(d_gate, wg_KN, nt, preferred_element_type=jnp.float32)
                     + lax.dot_general(d_up, wu_KN, nt, preferred_element_type=jnp.float32))
            return (dx_BK.astype(dtype),
                    lax.dot_general(x_BK, d_gate, tn, preferred_element_type=jnp.float32),
                    lax.dot_general(x_BK, d_up, tn, preferred_element_type=jnp.float32))

        def skip():
            return (filled(operands, (block_m, k), 0, dtype),
                    filled(operands, (k, n), 0, jnp.float32),
                    filled(operands, (k, n), 0, jnp.float32))

        dx_BK, pg_KN, pu_KN = lax.cond(active, compute, skip)
        old_BK = lax.dynamic_slice_in_dim(dx_MK, start, block_m)
        dx_MK = lax.dynamic_update_slice_in_dim(dx_MK, jnp.where(keep_B1, dx_BK, old_BK), start, 0)
        same = group == acc_group
        accg_KN = jnp.where(same, accg_KN, 0.0) + pg_KN
        accu_KN = jnp.where(same, accu_KN, 0.0) + pu_KN
        dwg_GKN = lax.dynamic_update_slice_in_dim(dwg_GKN, accg_KN.astype(w_dtype)[None], group, 0)
        dwu_GKN = lax.dynamic_update_slice_in_dim(dwu_GKN, accu_KN.astype(w_up_GKN.dtype)[None],
                                                  group, 0)
        return (dx_MK, dwg_GKN, dwu_GKN, accg_KN, accu_KN,
                group + lax.full_like(acc_group, 0)), None

    # dx's zero init leaves an optimization barrier with dh (see blocked.py's
    # _blocked): dh is the last input to exist, x a residual live since the forward.
    zero, _ = lax.optimization_barrier((filled(operands, (), 0, dtype), dh_MN))
    init = (jnp.broadcast_to(zero, (m, k)),
            filled(operands, (num_groups, k, n), 0, w_dtype),
            filled(operands, (num_groups, k, n), 0, w_up_GKN.dtype),
            filled(operands, (k, n), 0, jnp.float32), filled(operands, (k, n), 0, jnp.float32),
            filled(operands, (), -1, jnp.int32))
    (dx_MK, dwg_GKN, dwu_GKN, _, _, _), _ = lax.scan(step, init, items)
    return dx_MK, dwg_GKN, dwu_GKN


def grouped_matmul_combine_vjp(x_MK: jax.Array, w_GKN: jax.Array, dr_TN: jax.Array,
                               token_M: jax.Array, weight_M: jax.Array,
                               group_sizes_G: jax.Array):
    """(dx_MK, dw_GKN, dweight_M) of r_TN = sum over rows m of weight_M[m] *
    float32(y_MN[m]) into row token_M[m], y_MN = x_MK @ w[g] (combine.py), for
    the float32 cotangent dr_TN [T, N], in one scan over the items. Per item,
    with dr_B = dr_TN[token_M[rows]] gathered for the block's rows only (no
    [M, N] cotangent of y is ever held):

        u_BK      = dr_B @ w[g]^T         (dr_B in x's dtype, f32 accumulation)
        dx_B      = weight_B * u_BK       (f32, one cast to x's dtype)
        dweight_B = sum_k x_BK * u_BK     (= <y_B, dr_B> without y: f32)
        dw[g]    += x_BK^T @ dy_BN,  dy_BN = weight_B * dr_B in x's dtype
                                          (f32 accumulator, as ``tgmm``)

    token_M int [M] in [0, T); weight_M floating [M] (dweight in its dtype).
    Rows of other items and rows >= sum(group_sizes) are zeroed in x, dr and
    weight first, so NaN there never leaks; dx and dweight there are exactly
    0 (such rows of y are constant zeros). Float weights only."""
    m, k = x_MK.shape
    num_groups, _, n = w_GKN.shape
    dtype, w_dtype, weight_dtype = x_MK.dtype, w_GKN.dtype, weight_M.dtype
    operands = (x_MK, w_GKN, dr_TN, token_M, weight_M, group_sizes_G)
    if m == 0 or k == 0 or n == 0:
        return (filled(operands, (m, k), 0, dtype), filled(operands, (num_groups, k, n), 0, w_dtype),
                filled(operands, (m,), 0, weight_dtype))
    block_m = block_rows(m, num_groups)
    items = items_3W(group_sizes_G.astype(jnp.int32), m, block_m).T
    nt = (((1,), (1,)), ((), ()))
    tn = (((0,), (0,)), ((), ()))

    def step(carry, item):
        dx_MK, dweight_M, dw_GKN, acc_KN, acc_group = carry
        group, active = item[0], item[2] > item[1]
        start, keep_B1 = item_block(item, m, block_m)

        def compute():
            x_BK = jnp.where(keep_B1, lax.dynamic_slice_in_dim(x_MK, start, block_m), 0)
            token_B = lax.dynamic_slice_in_dim(token_M, start, block_m)
            dr_BN = jnp.where(keep_B1, jnp.take(dr_TN, token_B, axis=0, mode="clip"), 0.0)
            dr_BN = dr_BN.astype(jnp.float32)
            weight_B1 = lax.dynamic_slice_in_dim(weight_M, start, block_m)[:, None]
            weight_B1 = jnp.where(keep_B1, weight_B1.astype(jnp.float32), 0.0)
            w_KN = lax.dynamic_index_in_dim(w_GKN, group, 0, keepdims=False)
            u_BK = lax.dot_general(dr_BN.astype(dtype), w_KN, nt,
                                   preferred_element_type=jnp.float32)
            dweight_B = jnp.sum(x_BK.astype(jnp.float32) * u_BK, axis=1)
            dy_BN = (weight_B1 * dr_BN).astype(dtype)
            return ((weight_B1 * u_BK).astype(dtype), dweight_B.astype(weight_dtype),
                    lax.dot_general(x_BK, dy_BN, tn, preferred_element_type=jnp.float32))

        def skip():
            return (filled(operands, (block_m, k), 0, dtype),
                    filled(operands, (block_m,), 0, weight_dtype),
                    filled(operands, (k, n), 0, jnp.float32))

        dx_BK, dweight_B, p_KN = lax.cond(active, compute, skip)
        old_BK = lax.dynamic_slice_in_dim(dx_MK, start, block_m)
        dx_MK = lax.dynamic_update_slice_in_dim(dx_MK, jnp.where(keep_B1, dx_BK, old_BK), start, 0)
        old_B = lax.dynamic_slice_in_dim(dweight_M, start, block_m)
        dweight_M = lax.dynamic_update_slice_in_dim(
            dweight_M, jnp.where(keep_B1[:, 0], dweight_B, old_B), start, 0)
        acc_KN = jnp.where(group == acc_group, acc_KN, 0.0) + p_KN
        dw_GKN = lax.dynamic_update_slice_in_dim(dw_GKN, acc_KN.astype(w_dtype)[None], group, 0)
        return (dx_MK, dweight_M, dw_GKN, acc_KN, group + lax.full_like(acc_group, 0)), None

    # dx's zero init leaves an optimization barrier with dr (see grouped_situ_glu_vjp)
    zero, _ = lax.optimization_barrier((filled(operands, (), 0, dtype), dr_TN))
    init = (jnp.broadcast_to(zero, (m, k)), filled(operands, (m,), 0, weight_dtype),
            filled(operands, (num_groups, k, n), 0, w_dtype),
            filled(operands, (k, n), 0, jnp.float32), filled(operands, (), -1, jnp.int32))
    (dx_MK, dweight_M, dw_GKN, _, _), _ = lax.scan(step, init, items)
    return dx_MK, dw_GKN, dweight_M


__all__ = ["grouped_matmul_combine_vjp", "grouped_matmul_vjp", "grouped_situ_glu_vjp", "tgmm"]
