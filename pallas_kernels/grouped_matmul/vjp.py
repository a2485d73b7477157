"""Custom VJPs of grouped_matmul and grouped_situ_glu, for every backend.

api.py validates, resolves the backend and calls these with the backend's
entry of dispatch.py's table (``GroupedKernels``), so every backend the
table holds (and any added later) is differentiable. The backward passes are
built from the backend's own forward kernel and a transposed grouped matmul
(the entry's tgmm):

grouped_matmul, y = x @ w[g] (rows of group g; rows >= sum(sizes) are 0):
  dx_MK  = grouped_matmul(dy_MN, w_GKN^T)   the backend's forward kernel on a
           [G, N, K] copy of the weights transposed in XLA (one extra read and
           write of w per backward: the forward kernels stream N-major
           weights only)
  dw_GKN = tgmm(x_MK, dy_MN)                per group x_g^T @ dy_g
  On XLA (an entry with ``backward_scan``) both in one blocked scan
  contracting w's N in its dot (no copy), blocked_tgmm.grouped_matmul_vjp:
  x and dy die together at its end.
  group_sizes gets no cotangent (None).

grouped_situ_glu, h = situ_glu(x @ w_gate[g], x @ w_up[g]) (fused forward):
  RECOMPUTE, not store. The fused forward keeps the 2N-wide gate/up
  pre-activations in registers and never writes them; storing them as f32
  residuals would cost 8 * M * N bytes per layer (0.8 GB at M = 32768 pairs,
  N = 3072) held from the forward to the backward, where recomputing costs two
  grouped matmuls (the forward's own FLOPs) in the backward. So the backward
  re-runs the two products with the backend's plain grouped kernel (result in
  x's dtype: in bf16 the derivative sees bf16-rounded pre-activations; on
  XLA the whole backward is one blocked scan, blocked_tgmm.grouped_situ_glu_vjp:
  gate/up recomputed per item in float32, the derivative, dx and both weight
  gradients there, no [M, 2N] buffer),
  applies the SiTU-GLU derivative in float32 (situ.situ_glu_vjp_f32), then
  dx_MK  = [d_gate | d_up] @ [w_gate | w_up]^T  one grouped matmul with a
           2N-wide contraction (one f32 accumulation, one rounding; on XLA
           blocked.grouped_matmul_nt on both weights, uncopied)
  dw_gate = tgmm(x, d_gate), dw_up = tgmm(x, d_up).
  The cotangent of rows >= sum(sizes) (constant zero outputs) is dropped by a
  select, so NaN there never reaches a gradient.

Inside shard_map each output is typed varying like its inputs and each
cotangent gets its primal's varying axes
(pallas_kernels.vma.like_primal).

tgmm: mosaic_sm90_tgmm.tgmm on Mosaic (compiled or interpreted);
blocked_tgmm.tgmm (a scan over (group, row block) items, O(block) memory
besides its output) on XLA, Triton and any family without a tgmm kernel
(dispatch.py). Every backward is
explicit (no autodiff of a forward scan: that crashed XLA:CPU under an
8-device shard_map), and nothing in it is of size [M, G, ...].
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import blocked_tgmm, reference
from pallas_kernels.grouped_matmul.dispatch import GroupedKernels
from pallas_kernels.situ import situ_glu_vjp_f32
from pallas_kernels.vma import like_primal, varying_like_inputs


def _transposed_GNK(w_GKN: jax.Array) -> jax.Array:
    """[G, K, N] -> [G, N, K] (an XLA transpose copy; see the module docstring)."""
    return jnp.swapaxes(w_GKN, 1, 2)


# ---------------------------------------------------------------- grouped_matmul

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def grouped_matmul(kernels: GroupedKernels, x_MK, w_GKN, group_sizes_G):
    """kernels.matmul(x_MK, w_GKN, group_sizes_G) with the VJP above (dense w_GKN)."""
    y_MN = kernels.matmul(x_MK, w_GKN, group_sizes_G)
    return varying_like_inputs(y_MN, x_MK, w_GKN, group_sizes_G)


def _grouped_matmul_fwd(kernels, x_MK, w_GKN, group_sizes_G):
    y_MN = grouped_matmul(kernels, x_MK, w_GKN, group_sizes_G)
    return y_MN, (x_MK, w_GKN, group_sizes_G)


def _grouped_matmul_bwd(kernels, residuals, dy_MN):
    x_MK, w_GKN, group_sizes_G = residuals
    dy_MN = dy_MN.astype(x_MK.dtype)
    if kernels.backward_scan:   # one scan: dx and dw per item
        dx_MK, dw_GKN = blocked_tgmm.grouped_matmul_vjp(x_MK, w_GKN, dy_MN, group_sizes_G)
        return like_primal(dx_MK, x_MK), like_primal(dw_GKN, w_GKN), None
    dx_MK = kernels.matmul(dy_MN, _transposed_GNK(w_GKN), group_sizes_G)
    dw_GKN = kernels.tgmm(x_MK, dy_MN, group_sizes_G, w_GKN.dtype)
    return like_primal(dx_MK.astype(x_MK.dtype), x_MK), like_primal(dw_GKN, w_GKN), None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


# -------------------------------------------------------------- grouped_situ_glu

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 5, 6))
def grouped_situ_glu(kernels: GroupedKernels, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G,
                     beta: float, linear_beta: float | None):
    """kernels.situ_glu(...) with the recompute VJP above (dense weights)."""
    h_MN = kernels.situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta)
    return varying_like_inputs(h_MN, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G)


def _grouped_situ_glu_fwd(kernels, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                          linear_beta):
    h_MN = grouped_situ_glu(kernels, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                            linear_beta)
    return h_MN, (x_MK, w_gate_GKN, w_up_GKN, group_sizes_G)


def _grouped_situ_glu_bwd(kernels, beta, linear_beta, residuals, dh_MN):
    x_MK, w_gate_GKN, w_up_GKN, group_sizes_G = residuals
    if kernels.backward_scan:   # one scan: recompute, derivative, dx and dw per item
        dx_MK, dw_gate_GKN, dw_up_GKN = blocked_tgmm.grouped_situ_glu_vjp(
            x_MK, w_gate_GKN, w_up_GKN, dh_MN, group_sizes_G, beta=beta, linear_beta=linear_beta)
        return (like_primal(dx_MK, x_MK), like_primal(dw_gate_GKN, w_gate_GKN),
                like_primal(dw_up_GKN, w_up_GKN), None)
    # Recompute the pre-activations with the backend's plain grouped kernel.
    gate_MN = kernels.matmul(x_MK, w_gate_GKN, group_sizes_G).astype(jnp.float32)
    up_MN = kernels.matmul(x_MK, w_up_GKN, group_sizes_G).astype(jnp.float32)
    valid_M1 = reference.valid_rows_mask_M1(x_MK.shape[0], group_sizes_G)
    dh_MN = jnp.where(valid_M1, dh_MN.astype(jnp.float32), 0.0)
    d_gate_MN, d_up_MN = situ_glu_vjp_f32(gate_MN, up_MN, dh_MN, beta=beta,
                                          linear_beta=linear_beta)
    d_gate_MN, d_up_MN = d_gate_MN.astype(x_MK.dtype), d_up_MN.astype(x_MK.dtype)
    d_gateup_M2N = jnp.concatenate([d_gate_MN, d_up_MN], axis=1)
    w_G2NK = jnp.concatenate([_transposed_GNK(w_gate_GKN), _transposed_GNK(w_up_GKN)], axis=1)
    dx_MK = kernels.matmul(d_gateup_M2N, w_G2NK, group_sizes_G)
    dw_gate_GKN = kernels.tgmm(x_MK, d_gate_MN, group_sizes_G, w_gate_GKN.dtype)
    dw_up_GKN = kernels.tgmm(x_MK, d_up_MN, group_sizes_G, w_up_GKN.dtype)
    return (like_primal(dx_MK.astype(x_MK.dtype), x_MK), like_primal(dw_gate_GKN, w_gate_GKN),
            like_primal(dw_up_GKN, w_up_GKN), None)


grouped_situ_glu.defvjp(_grouped_situ_glu_fwd, _grouped_situ_glu_bwd)
