"""The custom VJP of MXFP4 grouped matmuls: frozen weights, a gradient for x only.

The forward is the backend's own, given by the caller (dispatch.py: on
Mosaic an in-kernel dequant kernel, which has no autodiff rule; on XLA
blocked.py's scan, one active expert dequantized at a time). The backward
is explicit and the same on every backend, on blocked.py's scan, so it
never holds a dequantized copy of all local experts (and never autodiffs a
scan, which crashed XLA:CPU under an 8-device shard_map, and whose
residuals would stack one dequantized [K, N] weight per item):

  grouped_matmul, y = x @ W[g]:
    dx_MK = blocked.grouped_matmul_nt(dy_MN, (W,))      dy @ W[g]^T, W[g]
            dequantized inside the scan when the item's group changes
  grouped_situ_glu, h = situ_glu(x @ W_gate[g], x @ W_up[g]):
    one scan recomputes gate and up per block in float32 and applies the
    SiTU-GLU derivative there (blocked.grouped_situ_glu_dgate_up; rows >=
    sum(group_sizes) never selected, so NaN there never reaches dx), then
    dx_MK = blocked.grouped_matmul_nt([d_gate | d_up],
    (W_gate, W_up)) (one f32 accumulation, one rounding to x's dtype).

The packed weights and group_sizes get no cotangent (None): MXFP4 experts are
frozen (inference checkpoints), as on every backend.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax

from pallas_kernels.grouped_matmul import blocked
from pallas_kernels.mxfp4 import Mxfp4Weights
from pallas_kernels.vma import like_primal, varying_like_inputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def grouped_matmul(forward: Callable[..., jax.Array], x_MK: jax.Array, w_GKN: Mxfp4Weights,
                   group_sizes_G: jax.Array) -> jax.Array:
    """y_MN = forward(x_MK, w_GKN, group_sizes_G) ([M, N] in x's dtype),
    differentiable in x_MK."""
    y_MN = forward(x_MK, w_GKN, group_sizes_G)
    return varying_like_inputs(y_MN, x_MK, *jax.tree.leaves(w_GKN), group_sizes_G)


def _plain_fwd(forward, x_MK, w_GKN, group_sizes_G):
    return grouped_matmul(forward, x_MK, w_GKN, group_sizes_G), (x_MK, w_GKN, group_sizes_G)


def _plain_bwd(forward, residuals, dy_MN):
    del forward
    x_MK, w_GKN, group_sizes_G = residuals
    dx_MK = blocked.grouped_matmul_nt(dy_MN.astype(x_MK.dtype), (w_GKN,), group_sizes_G)
    return like_primal(dx_MK.astype(x_MK.dtype), x_MK), None, None


grouped_matmul.defvjp(_plain_fwd, _plain_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6))
def grouped_situ_glu(forward: Callable[..., jax.Array], x_MK: jax.Array,
                     w_gate_GKN: Mxfp4Weights, w_up_GKN: Mxfp4Weights, group_sizes_G: jax.Array,
                     beta: float, linear_beta: float | None) -> jax.Array:
    """h_MN = forward(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta)
    (situ_glu(x @ W_gate[g], x @ W_up[g]), [M, N] in x's dtype), differentiable in x_MK."""
    h_MN = forward(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta)
    return varying_like_inputs(h_MN, x_MK, *jax.tree.leaves((w_gate_GKN, w_up_GKN)),
                               group_sizes_G)


def _fused_fwd(forward, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta):
    h_MN = grouped_situ_glu(forward, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                            linear_beta)
    return h_MN, (x_MK, w_gate_GKN, w_up_GKN, group_sizes_G)


def _fused_bwd(forward, beta, linear_beta, residuals, dh_MN):
    del forward
    x_MK, w_gate_GKN, w_up_GKN, group_sizes_G = residuals
    d_gateup_M2N = blocked.grouped_situ_glu_dgate_up(
        x_MK, w_gate_GKN, w_up_GKN, dh_MN, group_sizes_G, beta=beta, linear_beta=linear_beta)
    dx_MK = blocked.grouped_matmul_nt(d_gateup_M2N, (w_gate_GKN, w_up_GKN), group_sizes_G)
    return like_primal(dx_MK.astype(x_MK.dtype), x_MK), None, None, None


grouped_situ_glu.defvjp(_fused_fwd, _fused_bwd)
