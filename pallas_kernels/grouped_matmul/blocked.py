"""Sorted, blocked grouped matmul in plain XLA: the XLA family's forward.

``jax.lax.ragged_dot`` is what reference.py uses, but XLA (jax 0.11.2, GPU
and CPU) lowers it densely: the LHS is broadcast to [G, M, K], masked and
multiplied as one [M, G*K] GEMM (101 GiB of temporaries for K3 at 8192 tokens
and EP 8). This formulation costs O(block) memory on top of its output:

* rows (sorted by group) are cut into *items*, the non-empty intersections of
  one group's rows with one ``block_m``-row block; there are at most
  W = cdiv(M, block_m) + G of them (a static count), in row order;
* a ``lax.scan`` over the W items multiplies the item's row block
  x[s:s+block_m] (s clamped so the block stays inside [0, M)) by its group's
  weight, indexed dynamically (no [W, K, N] gather), and writes back only the
  item's rows with a select; empty items skip the matmul (``lax.cond``);
* MXFP4 weights (``Mxfp4Weights``) are dequantized one group at a time inside
  the loop, only for groups that own rows: the scan carries the current
  group's dequantized [K, N] and decodes anew when the item's group changes
  (items are in group order, so each active group is decoded once).

The same scan runs the backward's transposed products (``grouped_matmul_nt``:
dx = dy @ w[g]^T, contracting w's N in the dot, so no [G, N, K] copy of the
weights) and the fused pair's backward rows (``grouped_situ_glu_dgate_up``:
gate/up recomputed per block in float32 and turned into [d_gate | d_up] in the
epilogue, so no [M, 2N] float32 pre-activations are ever held);
blocked_tgmm.py holds the weight gradient.

Numerics are reference.py's: bf16/f32 products accumulated in f32
(``preferred_element_type``), SiTU in f32, one cast to x's dtype; rows at
index >= sum(group_sizes) are exact zeros (never written). Rows of other
groups inside a block are computed and discarded by a select, so NaN in rows
past sum(group_sizes) never leaks.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.mxfp4 import Mxfp4Weights
from pallas_kernels.situ import situ_glu, situ_glu_vjp_f32

Weight = jax.Array | Mxfp4Weights
MAX_BLOCK_M = 256
MIN_BLOCK_M = 16


def block_rows(num_rows: int, num_groups: int) -> int:
    """Static row block: the power of two >= the average rows per group, in
    [MIN_BLOCK_M, MAX_BLOCK_M], and at most num_rows (decode: small blocks, so
    a group of 2 rows does not multiply 256; prefill: 256-row GEMMs)."""
    average = -(-num_rows // max(num_groups, 1))
    block = 1 << max(average - 1, 0).bit_length()
    return max(1, min(num_rows, MAX_BLOCK_M, max(MIN_BLOCK_M, block)))


def num_items(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound W on (group, row block) intersections."""
    return -(-num_rows // block_m) + num_groups


def items_3W(group_sizes_G: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """int32 [3, W]: (group, first row, end row) of each item in row order;
    unused trailing items are empty (end == first). Group ends are clamped to
    num_rows; rows past sum(group_sizes) belong to no item."""
    num_groups = group_sizes_G.shape[0]
    end_G = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), num_rows)
    start_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), end_G[:-1]])
    first_block_G = start_G // block_m
    count_G = jnp.where(end_G > start_G, (end_G - 1) // block_m - first_block_G + 1, 0)
    item_end_G = jnp.cumsum(count_G)
    w_W = jnp.arange(num_items(num_rows, num_groups, block_m), dtype=jnp.int32)
    # compare_all: one [W, G] comparison, no while loop
    group_W = jnp.searchsorted(item_end_G, w_W, side="right", method="compare_all")
    used_W = group_W < num_groups
    group_W = jnp.minimum(group_W, num_groups - 1).astype(jnp.int32)
    block_W = first_block_G[group_W] + w_W - (item_end_G - count_G)[group_W]
    first_W = jnp.maximum(start_G[group_W], block_W * block_m)
    end_W = jnp.where(used_W, jnp.minimum(end_G[group_W], (block_W + 1) * block_m), first_W)
    return jnp.stack([group_W, first_W, end_W]).astype(jnp.int32)


def filled(operands: tuple, shape, value, dtype) -> jax.Array:
    """``value`` in ``shape``, varying over every manual axis any of
    ``operands`` varies over (inside shard_map, a loop carry and both branches
    of a cond must agree on them)."""
    out = lax.full_like(operands[0], value, dtype, shape)
    for a in operands[1:]:     # + 0 only to take on a's varying axes
        out = out + lax.full_like(a, 0, dtype, shape)
    return out


def item_block(item, num_rows: int, block_m: int):
    """(start, keep_B1) of one item: the block's first row (clamped so the
    block stays inside [0, num_rows)) and the [block_m, 1] mask of its rows."""
    first, end = item[1], item[2]
    start = jnp.clip((first // block_m) * block_m, 0, num_rows - block_m)
    rows_B = start + jnp.arange(block_m, dtype=jnp.int32)
    return start, ((rows_B >= first) & (rows_B < end))[:, None]


def _blocked(x_MP: jax.Array, weights: tuple[Weight, ...], group_sizes_G: jax.Array,
             epilogue: Callable[..., jax.Array], n: int, *, transposed: bool = False,
             side_MS: jax.Array | None = None) -> jax.Array:
    """[M, n] in x's dtype: epilogue(*products) per row's group (f32
    products), rows >= sum(group_sizes) exactly 0. The products are
    x_rows @ w[g] for each weight [G, K, N] (P = K), or with ``transposed``
    x_rows[:, i*N:(i+1)*N] @ w_i[g]^T for each weight (P = len(weights) * N,
    products [rows, K]). With ``side_MS`` [M, S], the epilogue also gets the
    block's rows of it as its last argument."""
    m, _ = x_MP.shape
    num_groups = group_sizes_G.shape[0]
    out_dtype = x_MP.dtype
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    block_m = block_rows(m, num_groups)
    items = items_3W(group_sizes_G, m, block_m).T
    packed = tuple(w for w in weights if isinstance(w, Mxfp4Weights))
    operands = (x_MP, *jax.tree.leaves(weights), group_sizes_G,
                *(() if side_MS is None else (side_MS,)))
    dequant_dtype = x_MP.dtype

    def fill(shape, value=0, dtype=out_dtype):
        return filled(operands, shape, value, dtype)

    def dense_weights(g, cached):
        it = iter(cached)
        return [next(it) if isinstance(w, Mxfp4Weights)
                else lax.dynamic_index_in_dim(w, g, 0, keepdims=False) for w in weights]

    def products(x_BP, w_KNs):
        if not transposed:
            return [jnp.dot(x_BP, w, preferred_element_type=jnp.float32) for w in w_KNs]
        width = w_KNs[0].shape[1]
        return [lax.dot_general(x_BP[:, i * width:(i + 1) * width], w, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32)
                for i, w in enumerate(w_KNs)]

    def step(carry, item):
        y_MN, cached_group, cached = carry
        group, first, end = item[0], item[1], item[2]
        active = end > first
        if packed:   # dequantize this group's MXFP4 weights when the group changes
            cached = lax.cond(active & (group != cached_group),
                              lambda: tuple(w.expert(group, dequant_dtype) for w in packed),
                              lambda: cached)
            cached_group = jnp.where(active, group, cached_group)
        start, keep_B1 = item_block(item, m, block_m)
        # Rows of other items (possibly NaN past sum(group_sizes)) are zeroed, so
        # they reach neither this item's output nor, under autodiff, its weight's
        # gradient (x^T @ dy would give NaN * 0 = NaN).
        x_BP = jnp.where(keep_B1, lax.dynamic_slice_in_dim(x_MP, start, block_m), 0)

        def compute():
            prods = products(x_BP, dense_weights(group, cached))
            if side_MS is not None:
                prods.append(lax.dynamic_slice_in_dim(side_MS, start, block_m))
            return epilogue(*prods).astype(out_dtype)

        new_BN = lax.cond(active, compute, lambda: fill((block_m, n)))
        old_BN = lax.dynamic_slice_in_dim(y_MN, start, block_m)
        y_MN = lax.dynamic_update_slice_in_dim(y_MN, jnp.where(keep_B1, new_BN, old_BN), start, 0)
        return (y_MN, cached_group, cached), None

    init_cached = tuple(fill(w.shape[1:], dtype=dequant_dtype) for w in packed)
    # The [M, N] zero init is built from a scalar that leaves an optimization
    # barrier with x: XLA cannot materialize it before x exists (it hoisted it
    # otherwise, so two grouped matmuls in a row kept three [M, .] buffers live).
    zero, _ = lax.optimization_barrier((fill(()), x_MP))
    init = (jnp.broadcast_to(zero, (m, n)), fill((), -1, jnp.int32), init_cached)
    (y_MN, _, _), _ = lax.scan(step, init, items)
    return y_MN


def grouped_matmul(x_MK: jax.Array, w_GKN: Weight, group_sizes_G: jax.Array) -> jax.Array:
    """y_MN = x_MK @ w_GKN[group(row)]; dtype of x; rows >= sum(group_sizes) are 0.
    w_GKN: [G, K, N] floating, or Mxfp4Weights (dequantized to x's dtype)."""
    return _blocked(x_MK, (w_GKN,), group_sizes_G, lambda acc: acc, w_GKN.shape[2])


def grouped_situ_glu(x_MK: jax.Array, w_gate_GKN: Weight, w_up_GKN: Weight,
                     group_sizes_G: jax.Array, *, beta: float,
                     linear_beta: float | None) -> jax.Array:
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) per row's group; tail rows 0."""
    def epilogue(gate, up):
        return situ_glu(gate, up, beta=beta, linear_beta=linear_beta)
    return _blocked(x_MK, (w_gate_GKN, w_up_GKN), group_sizes_G, epilogue, w_gate_GKN.shape[2])


def grouped_matmul_nt(dy_MP: jax.Array, weights: tuple[Weight, ...],
                      group_sizes_G: jax.Array) -> jax.Array:
    """dx_MK = sum_i dy_MP[:, i*N:(i+1)*N] @ w_i[g]^T per row's group, one f32
    accumulation and one cast to dy's dtype; tail rows 0. weights: [G, K, N]
    each (float or Mxfp4Weights, dequantized to dy's dtype), P = len * N. The
    x-gradient of grouped_matmul (one weight) and of the fused pair (two)."""
    num_groups, k, n = weights[0].shape
    if dy_MP.shape[1] != len(weights) * n:
        raise ValueError(f"dy_MP width {dy_MP.shape[1]} != {len(weights)} x N={n}")
    return _blocked(dy_MP, weights, group_sizes_G, lambda *prods: sum(prods[1:], prods[0]), k,
                    transposed=True)


def grouped_situ_glu_dgate_up(x_MK: jax.Array, w_gate_GKN: Weight, w_up_GKN: Weight,
                              dh_MN: jax.Array, group_sizes_G: jax.Array, *, beta: float,
                              linear_beta: float | None) -> jax.Array:
    """[M, 2N] in x's dtype: [d_gate | d_up], the cotangents of the fused
    pair's pre-activations for dh_MN [M, N], per block: gate and up
    recomputed in float32 (x @ w[g], f32 accumulation), the SiTU-GLU
    derivative applied in float32 (situ_glu_vjp_f32) on dh in float32, one
    cast. Rows >= sum(group_sizes) are 0 (their dh, possibly NaN, is never
    selected)."""
    def epilogue(gate, up, dh_BN):
        d_gate, d_up = situ_glu_vjp_f32(gate, up, dh_BN.astype(jnp.float32), beta=beta,
                                        linear_beta=linear_beta)
        return jnp.concatenate([d_gate, d_up], axis=1)
    return _blocked(x_MK, (w_gate_GKN, w_up_GKN), group_sizes_G, epilogue,
                    2 * w_gate_GKN.shape[2], side_MS=dh_MN)
