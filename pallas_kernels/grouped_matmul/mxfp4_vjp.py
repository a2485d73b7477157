"""The MXFP4 kernel's custom VJP: frozen weights, a gradient for x only.

mosaic_sm90_mxfp4's kernel has no autodiff rule. Its forward is wrapped in a
jax.custom_vjp whose backward is jax's VJP, with respect to x, of the same
product on the blocked XLA path (blocked.py: each active expert dequantized
inside a scan), recomputed in the backward: dx = dy @ W[g]^T for
grouped_matmul, and the SiTU-GLU derivative through both products for
grouped_situ_glu. The packed weights and group_sizes get no cotangent (None):
MXFP4 experts are frozen (inference checkpoints), as on every backend.
"""

from __future__ import annotations

import functools

import jax

from pallas_kernels.grouped_matmul import blocked, mosaic_sm90_mxfp4
from pallas_kernels.mxfp4 import Mxfp4Weights
from pallas_kernels.vma import like_primal, varying_like_inputs


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x_MK: jax.Array, w_GKN: Mxfp4Weights, group_sizes_G: jax.Array,
                   interpret: bool) -> jax.Array:
    """mosaic_sm90_mxfp4.grouped_matmul_mxfp4, differentiable in x_MK."""
    y_MN = mosaic_sm90_mxfp4.grouped_matmul_mxfp4(x_MK, w_GKN, group_sizes_G,
                                                  interpret=interpret)
    return varying_like_inputs(y_MN, x_MK, *jax.tree.leaves(w_GKN), group_sizes_G)


def _plain_fwd(x_MK, w_GKN, group_sizes_G, interpret):
    return grouped_matmul(x_MK, w_GKN, group_sizes_G, interpret), (x_MK, w_GKN, group_sizes_G)


def _plain_bwd(interpret, residuals, dy_MN):
    del interpret
    x_MK, w_GKN, group_sizes_G = residuals
    _, pullback = jax.vjp(lambda x: blocked.grouped_matmul(x, w_GKN, group_sizes_G), x_MK)
    (dx_MK,) = pullback(dy_MN.astype(x_MK.dtype))
    return like_primal(dx_MK.astype(x_MK.dtype), x_MK), None, None


grouped_matmul.defvjp(_plain_fwd, _plain_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def grouped_situ_glu(x_MK: jax.Array, w_gate_GKN: Mxfp4Weights, w_up_GKN: Mxfp4Weights,
                     group_sizes_G: jax.Array, beta: float, linear_beta: float | None,
                     interpret: bool) -> jax.Array:
    """mosaic_sm90_mxfp4.grouped_situ_glu_mxfp4, differentiable in x_MK."""
    h_MN = mosaic_sm90_mxfp4.grouped_situ_glu_mxfp4(
        x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta=beta, linear_beta=linear_beta,
        interpret=interpret)
    return varying_like_inputs(h_MN, x_MK, *jax.tree.leaves((w_gate_GKN, w_up_GKN)),
                               group_sizes_G)


def _fused_fwd(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta, interpret):
    h_MN = grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta,
                            interpret)
    return h_MN, (x_MK, w_gate_GKN, w_up_GKN, group_sizes_G)


def _fused_bwd(beta, linear_beta, interpret, residuals, dh_MN):
    del interpret
    x_MK, w_gate_GKN, w_up_GKN, group_sizes_G = residuals
    _, pullback = jax.vjp(
        lambda x: blocked.grouped_situ_glu(x, w_gate_GKN, w_up_GKN, group_sizes_G, beta=beta,
                                           linear_beta=linear_beta), x_MK)
    (dx_MK,) = pullback(dh_MN.astype(x_MK.dtype))
    return like_primal(dx_MK.astype(x_MK.dtype), x_MK), None, None, None


grouped_situ_glu.defvjp(_fused_fwd, _fused_bwd)
