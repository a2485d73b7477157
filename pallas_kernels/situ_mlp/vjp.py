"""Custom VJP of situ_mlp_up (h_TF = situ_glu(x @ gate_DF, x @ up_DF)), for every backend.

Same scheme as the grouped SiTU-GLU (pallas_kernels/grouped_matmul/vjp.py),
with one group holding every row. RECOMPUTE, not store: the fused forward
never writes the gate/up pre-activations, and storing them as f32 residuals
(8 * T * F bytes per layer) would outlive the forward, where recomputing costs
the forward's two products again. The backward, on the forward's backend
(``kernels``, dispatch.py's entry):
  gate_TF, up_TF = x @ gate_DF, x @ up_DF          recomputed (x's dtype)
  d_gate, d_up   = situ_glu_vjp_f32(gate, up, dh)  float32
  dx_TD          = [d_gate | d_up] @ [gate | up]^T  one 2F-wide contraction
  d_gate_DF, d_up_DF = x^T @ d_gate, x^T @ d_up
On XLA (an entry with ``dense_backward``) these are jnp.dot (f32
accumulate); on every other backend they run through the grouped ops with
G = 1: the public grouped_matmul on the same backend for the products (the
[2F, D] weight transpose is an XLA copy) and the grouped table's tgmm for
the weight gradients (pallas_kernels.grouped_matmul.dispatch).
Inside shard_map each output is typed varying like its inputs and each
cotangent gets its primal's varying axes
(pallas_kernels.vma.like_primal).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import dispatch as grouped_dispatch
from pallas_kernels.grouped_matmul.api import grouped_matmul
from pallas_kernels.situ import situ_glu_vjp_f32
from pallas_kernels.situ_mlp.dispatch import MlpKernels
from pallas_kernels.vma import like_primal, varying_like_inputs


def _all_rows_1(num_rows: int) -> jax.Array:
    """group_sizes of one group holding every row."""
    return jnp.full((1,), num_rows, jnp.int32)


def _matmul(a_TK: jax.Array, b_KN: jax.Array, kernels: MlpKernels) -> jax.Array:
    """a @ b on ``kernels``' backend (f32 accumulate), in a's dtype."""
    if kernels.dense_backward:
        return jnp.dot(a_TK, b_KN, preferred_element_type=jnp.float32).astype(a_TK.dtype)
    return grouped_matmul(a_TK, b_KN[None], _all_rows_1(a_TK.shape[0]), backend=kernels.backend)


def _matmul_tn(x_TK: jax.Array, dy_TN: jax.Array, kernels: MlpKernels, out_dtype) -> jax.Array:
    """x^T @ dy [K, N] on ``kernels``' backend (f32 accumulate), in out_dtype."""
    if kernels.dense_backward:
        return jnp.dot(x_TK.T, dy_TN, preferred_element_type=jnp.float32).astype(out_dtype)
    return grouped_dispatch.kernels(kernels.backend).tgmm(
        x_TK, dy_TN, _all_rows_1(x_TK.shape[0]), out_dtype)[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 4, 5))
def situ_mlp_up(kernels: MlpKernels, x_TD, gate_DF, up_DF, beta: float,
                linear_beta: float | None):
    """kernels.up(x_TD, gate_DF, up_DF, beta, linear_beta) with the VJP above."""
    h_TF = kernels.up(x_TD, gate_DF, up_DF, beta, linear_beta)
    return varying_like_inputs(h_TF, x_TD, gate_DF, up_DF)


def _situ_mlp_up_fwd(kernels, x_TD, gate_DF, up_DF, beta, linear_beta):
    h_TF = situ_mlp_up(kernels, x_TD, gate_DF, up_DF, beta, linear_beta)
    return h_TF, (x_TD, gate_DF, up_DF)


def _situ_mlp_up_bwd(kernels, beta, linear_beta, residuals, dh_TF):
    x_TD, gate_DF, up_DF = residuals
    gate_TF = _matmul(x_TD, gate_DF, kernels).astype(jnp.float32)
    up_TF = _matmul(x_TD, up_DF, kernels).astype(jnp.float32)
    d_gate_TF, d_up_TF = situ_glu_vjp_f32(gate_TF, up_TF, dh_TF.astype(jnp.float32), beta=beta,
                                          linear_beta=linear_beta)
    d_gate_TF, d_up_TF = d_gate_TF.astype(x_TD.dtype), d_up_TF.astype(x_TD.dtype)
    d_gateup_T2F = jnp.concatenate([d_gate_TF, d_up_TF], axis=1)
    dx_TD = _matmul(d_gateup_T2F, jnp.concatenate([gate_DF, up_DF], axis=1).T, kernels)
    d_gate_DF = _matmul_tn(x_TD, d_gate_TF, kernels, gate_DF.dtype)
    d_up_DF = _matmul_tn(x_TD, d_up_TF, kernels, up_DF.dtype)
    return (like_primal(dx_TD.astype(x_TD.dtype), x_TD), like_primal(d_gate_DF, gate_DF),
            like_primal(d_up_DF, up_DF))


situ_mlp_up.defvjp(_situ_mlp_up_fwd, _situ_mlp_up_bwd)
