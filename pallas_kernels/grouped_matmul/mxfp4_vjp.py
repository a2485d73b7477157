"""The custom VJP of MXFP4 grouped matmuls: frozen weights, a gradient for x only.

The forward on "pallas" / "interpret" is a Mosaic kernel (no autodiff rule):
mosaic_sm90_mxfp4_swap_ab's, unless mosaic_sm90_mxfp4's row-major tiles read
each group's weights fewer times (mosaic_sm90_mxfp4_swap_ab.block_t_for);
on "xla" blocked.py's scan (one active expert dequantized at a time). The
backward is explicit on every backend, on blocked.py's scan, so it never
holds a dequantized copy of all local experts (and never autodiffs a scan,
which crashed XLA:CPU under an 8-device shard_map, and whose residuals would
stack one dequantized [K, N] weight per item):

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

import jax

from pallas_kernels.grouped_matmul import blocked, mosaic_sm90_mxfp4, mosaic_sm90_mxfp4_swap_ab
from pallas_kernels.mxfp4 import Mxfp4Weights
from pallas_kernels.vma import like_primal, varying_like_inputs

IMPLS = ("pallas", "interpret", "xla")


def _check_impl(impl: str) -> None:
    if impl not in IMPLS:
        raise ValueError(f"mxfp4_vjp: impl must be one of {IMPLS}, got {impl!r}")


def kernel_module(x_MK: jax.Array, w_GKN: Mxfp4Weights, num_weights: int):
    """The Mosaic kernel module a launch runs: mosaic_sm90_mxfp4_swap_ab, or
    mosaic_sm90_mxfp4 where block_t_for says its tiles read the weights fewer times."""
    block_t = mosaic_sm90_mxfp4_swap_ab.block_t_for(x_MK.shape[0], w_GKN.shape[0], num_weights)
    return mosaic_sm90_mxfp4 if block_t is None else mosaic_sm90_mxfp4_swap_ab


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def grouped_matmul(x_MK: jax.Array, w_GKN: Mxfp4Weights, group_sizes_G: jax.Array,
                   impl: str) -> jax.Array:
    """y_MN = x_MK @ W[g] on ``impl`` (IMPLS), differentiable in x_MK."""
    _check_impl(impl)
    if impl == "xla":
        y_MN = blocked.grouped_matmul(x_MK, w_GKN, group_sizes_G)
    else:
        y_MN = kernel_module(x_MK, w_GKN, 1).grouped_matmul_mxfp4(
            x_MK, w_GKN, group_sizes_G, interpret=impl == "interpret")
    return varying_like_inputs(y_MN, x_MK, *jax.tree.leaves(w_GKN), group_sizes_G)


def _plain_fwd(x_MK, w_GKN, group_sizes_G, impl):
    return grouped_matmul(x_MK, w_GKN, group_sizes_G, impl), (x_MK, w_GKN, group_sizes_G)


def _plain_bwd(impl, residuals, dy_MN):
    del impl
    x_MK, w_GKN, group_sizes_G = residuals
    dx_MK = blocked.grouped_matmul_nt(dy_MN.astype(x_MK.dtype), (w_GKN,), group_sizes_G)
    return like_primal(dx_MK.astype(x_MK.dtype), x_MK), None, None


grouped_matmul.defvjp(_plain_fwd, _plain_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def grouped_situ_glu(x_MK: jax.Array, w_gate_GKN: Mxfp4Weights, w_up_GKN: Mxfp4Weights,
                     group_sizes_G: jax.Array, beta: float, linear_beta: float | None,
                     impl: str) -> jax.Array:
    """h_MN = situ_glu(x @ W_gate[g], x @ W_up[g]) on ``impl``, differentiable in x_MK."""
    _check_impl(impl)
    if impl == "xla":
        h_MN = blocked.grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta=beta,
                                        linear_beta=linear_beta)
    else:
        h_MN = kernel_module(x_MK, w_gate_GKN, 2).grouped_situ_glu_mxfp4(
            x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta=beta, linear_beta=linear_beta,
            interpret=impl == "interpret")
    return varying_like_inputs(h_MN, x_MK, *jax.tree.leaves((w_gate_GKN, w_up_GKN)),
                               group_sizes_G)


def _fused_fwd(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta, impl):
    h_MN = grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta, impl)
    return h_MN, (x_MK, w_gate_GKN, w_up_GKN, group_sizes_G)


def _fused_bwd(beta, linear_beta, impl, residuals, dh_MN):
    del impl
    x_MK, w_gate_GKN, w_up_GKN, group_sizes_G = residuals
    d_gateup_M2N = blocked.grouped_situ_glu_dgate_up(
        x_MK, w_gate_GKN, w_up_GKN, dh_MN, group_sizes_G, beta=beta, linear_beta=linear_beta)
    dx_MK = blocked.grouped_matmul_nt(d_gateup_M2N, (w_gate_GKN, w_up_GKN), group_sizes_G)
    return like_primal(dx_MK.astype(x_MK.dtype), x_MK), None, None, None


grouped_situ_glu.defvjp(_fused_fwd, _fused_bwd)
