"""Custom VJPs of grouped_matmul and grouped_situ_glu, for every backend.

api.py validates, resolves the backend and calls these with its own forward
dispatch (``GroupedForwards``), so every backend it knows (and any added
later) is differentiable. The backward passes are built from the backend's
own forward kernel and a transposed grouped matmul (tgmm):

grouped_matmul, y = x @ w[g] (rows of group g; rows >= sum(sizes) are 0):
  dx_MK  = grouped_matmul(dy_MN, w_GKN^T)   the backend's forward kernel on a
           [G, N, K] copy of the weights transposed in XLA (one extra read and
           write of w per backward: the forward kernels stream N-major
           weights only)
  dw_GKN = tgmm(x_MK, dy_MN)                per group x_g^T @ dy_g
  On "xla" both in one blocked scan contracting w's N in its dot (no copy),
  blocked_tgmm.grouped_matmul_vjp: x and dy die together at its end.
  group_sizes gets no cotangent (None).

grouped_situ_glu, h = situ_glu(x @ w_gate[g], x @ w_up[g]) (fused forward):
  RECOMPUTE, not store. The fused forward keeps the 2N-wide gate/up
  pre-activations in registers and never writes them; storing them as f32
  residuals would cost 8 * M * N bytes per layer (0.8 GB at M = 32768 pairs,
  N = 3072) held from the forward to the backward, where recomputing costs two
  grouped matmuls (the forward's own FLOPs) in the backward. So the backward
  re-runs the two products with the backend's plain grouped kernel (result in
  x's dtype: in bf16 the derivative sees bf16-rounded pre-activations; on
  "xla" the whole backward is one blocked scan, blocked_tgmm.grouped_situ_glu_vjp:
  gate/up recomputed per item in float32, the derivative, dx and both weight
  gradients there, no [M, 2N] buffer),
  applies the SiTU-GLU derivative in float32 (situ.situ_glu_vjp_f32), then
  dx_MK  = [d_gate | d_up] @ [w_gate | w_up]^T  one grouped matmul with a
           2N-wide contraction (one f32 accumulation, one rounding; on "xla"
           blocked.grouped_matmul_nt on both weights, uncopied)
  dw_gate = tgmm(x, d_gate), dw_up = tgmm(x, d_up).
  The cotangent of rows >= sum(sizes) (constant zero outputs) is dropped by a
  select, so NaN there never reaches a gradient.

Inside shard_map each output is typed varying like its inputs and each
cotangent gets its primal's varying axes
(pallas_kernels.vma.like_primal).

tgmm: mosaic_sm90_tgmm.tgmm on "pallas" / "interpret"; blocked_tgmm.tgmm
(a scan over (group, row block) items, O(block) memory besides its output) on
"xla", "triton" and any backend without a tgmm kernel. Every backward is
explicit (no autodiff of a forward scan: that crashed XLA:CPU under an
8-device shard_map), and nothing in it is of size [M, G, ...].
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import blocked_tgmm, mosaic_sm90_tgmm, reference
from pallas_kernels.situ import situ_glu_vjp_f32
from pallas_kernels.vma import like_primal, varying_like_inputs


@dataclasses.dataclass(frozen=True)
class GroupedForwards:
    """api.py's forward dispatch, on validated inputs and a resolved backend:
    plain(x_MK, w_GKN, group_sizes_G, impl) -> y_MN and
    fused(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta, impl) -> h_MN."""

    plain: Callable[..., jax.Array]
    fused: Callable[..., jax.Array]


def tgmm(x_MK: jax.Array, dy_MN: jax.Array, group_sizes_G: jax.Array, impl: str,
         out_dtype) -> jax.Array:
    """dw_GKN[g] = x_g^T @ dy_g on backend ``impl``; [G, K, N] in out_dtype."""
    if impl in ("pallas", "interpret"):
        return mosaic_sm90_tgmm.tgmm(x_MK, dy_MN, group_sizes_G, out_dtype=out_dtype,
                                     interpret=impl == "interpret")
    return blocked_tgmm.tgmm(x_MK, dy_MN, group_sizes_G, out_dtype=out_dtype)


def _transposed_GNK(w_GKN: jax.Array) -> jax.Array:
    """[G, K, N] -> [G, N, K] (an XLA transpose copy; see the module docstring)."""
    return jnp.swapaxes(w_GKN, 1, 2)


# ---------------------------------------------------------------- grouped_matmul

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def grouped_matmul(forwards: GroupedForwards, impl: str, x_MK, w_GKN, group_sizes_G):
    """forwards.plain(x_MK, w_GKN, group_sizes_G, impl) with the VJP above."""
    y_MN = forwards.plain(x_MK, w_GKN, group_sizes_G, impl)
    return varying_like_inputs(y_MN, x_MK, w_GKN, group_sizes_G)


def _grouped_matmul_fwd(forwards, impl, x_MK, w_GKN, group_sizes_G):
    y_MN = grouped_matmul(forwards, impl, x_MK, w_GKN, group_sizes_G)
    return y_MN, (x_MK, w_GKN, group_sizes_G)


def _grouped_matmul_bwd(forwards, impl, residuals, dy_MN):
    x_MK, w_GKN, group_sizes_G = residuals
    dy_MN = dy_MN.astype(x_MK.dtype)
    if impl == "xla":   # one scan: dx and dw per item
        dx_MK, dw_GKN = blocked_tgmm.grouped_matmul_vjp(x_MK, w_GKN, dy_MN, group_sizes_G)
        return like_primal(dx_MK, x_MK), like_primal(dw_GKN, w_GKN), None
    dx_MK = forwards.plain(dy_MN, _transposed_GNK(w_GKN), group_sizes_G, impl)
    dw_GKN = tgmm(x_MK, dy_MN, group_sizes_G, impl, w_GKN.dtype)
    return like_primal(dx_MK.astype(x_MK.dtype), x_MK), like_primal(dw_GKN, w_GKN), None


grouped_matmul.defvjp(_grouped_matmul_fwd, _grouped_matmul_bwd)


# -------------------------------------------------------------- grouped_situ_glu

@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 6, 7))
def grouped_situ_glu(forwards: GroupedForwards, impl: str, x_MK, w_gate_GKN, w_up_GKN,
                     group_sizes_G, beta: float, linear_beta: float | None):
    """forwards.fused(...) with the recompute VJP above."""
    h_MN = forwards.fused(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta, impl)
    return varying_like_inputs(h_MN, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G)


def _grouped_situ_glu_fwd(forwards, impl, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                          linear_beta):
    h_MN = grouped_situ_glu(forwards, impl, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                            linear_beta)
    return h_MN, (x_MK, w_gate_GKN, w_up_GKN, group_sizes_G)


def _grouped_situ_glu_bwd(forwards, impl, beta, linear_beta, residuals, dh_MN):
    x_MK, w_gate_GKN, w_up_GKN, group_sizes_G = residuals
    if impl == "xla":   # one scan: recompute, derivative, dx and dw per item
        dx_MK, dw_gate_GKN, dw_up_GKN = blocked_tgmm.grouped_situ_glu_vjp(
            x_MK, w_gate_GKN, w_up_GKN, dh_MN, group_sizes_G, beta=beta, linear_beta=linear_beta)
        return (like_primal(dx_MK, x_MK), like_primal(dw_gate_GKN, w_gate_GKN),
                like_primal(dw_up_GKN, w_up_GKN), None)
    # Recompute the pre-activations with the backend's plain grouped kernel.
    gate_MN = forwards.plain(x_MK, w_gate_GKN, group_sizes_G, impl).astype(jnp.float32)
    up_MN = forwards.plain(x_MK, w_up_GKN, group_sizes_G, impl).astype(jnp.float32)
    valid_M1 = reference.valid_rows_mask_M1(x_MK.shape[0], group_sizes_G)
    dh_MN = jnp.where(valid_M1, dh_MN.astype(jnp.float32), 0.0)
    d_gate_MN, d_up_MN = situ_glu_vjp_f32(gate_MN, up_MN, dh_MN, beta=beta,
                                          linear_beta=linear_beta)
    d_gate_MN, d_up_MN = d_gate_MN.astype(x_MK.dtype), d_up_MN.astype(x_MK.dtype)
    d_gateup_M2N = jnp.concatenate([d_gate_MN, d_up_MN], axis=1)
    w_G2NK = jnp.concatenate([_transposed_GNK(w_gate_GKN), _transposed_GNK(w_up_GKN)], axis=1)
    dx_MK = forwards.plain(d_gateup_M2N, w_G2NK, group_sizes_G, impl)
    dw_gate_GKN = tgmm(x_MK, d_gate_MN, group_sizes_G, impl, w_gate_GKN.dtype)
    dw_up_GKN = tgmm(x_MK, d_up_MN, group_sizes_G, impl, w_up_GKN.dtype)
    return (like_primal(dx_MK.astype(x_MK.dtype), x_MK), like_primal(dw_gate_GKN, w_gate_GKN),
            like_primal(dw_up_GKN, w_up_GKN), None)


grouped_situ_glu.defvjp(_grouped_situ_glu_fwd, _grouped_situ_glu_bwd)
