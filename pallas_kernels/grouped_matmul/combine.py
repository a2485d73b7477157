"""A grouped matmul whose rows are weighted and summed into tokens, one op:

    r_TN[t] = sum over rows m with token_M[m] == t of
              weight_M[m] * float32(y_MN[m]),    y_MN = x_MK @ w_GKN[group(m)]

(the routed experts' down projection followed by the top-k combine: rows are
the (token, expert) pairs sorted by expert, T tokens; r_TN float32 [T, N]).

The forward is the two steps as written (``api.grouped_matmul``, then
``combine_rows``), on every backend. The point of the single op is the
backward on XLA: composed, autodiff holds the [M, N] cotangent of y
(weight * dr_TN[token], M = T * top-k rows: 3.5 GiB per device for K3 at
32768 tokens under EP 8) beside the down projection's [M, F] input and its
[M, F] gradient, and keeps y itself for the weights' gradient. Here one
blocked scan (blocked_tgmm.grouped_matmul_combine_vjp) gathers dr_TN's rows
per block instead and returns dx_MK, dw_GKN and dweight_M, so the backward
holds nothing of size [M, N]. Other backends, and frozen MXFP4 weights,
differentiate the composition (vjp.py / mxfp4_vjp.py, then autodiff of the
scatter-add).

Numerics on XLA: the forward is the composition's, bit for bit. The
backward rounds dr's gathered rows to x's dtype for u = dr @ w[g]^T (f32
accumulation) and takes dx = weight * u (one cast) and dweight = <x, u>
(float32; equal to <y, dr> up to the rounding of y in the forward), and
dw[g] = x^T @ round(weight * dr) as the composition's tgmm does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Backend, Family, resolve
from pallas_kernels.grouped_matmul import blocked, blocked_tgmm
from pallas_kernels.grouped_matmul.api import grouped_matmul, validate_grouped
from pallas_kernels.mxfp4 import Mxfp4Weights
from pallas_kernels.vma import like_primal, varying_like_inputs


def combine_rows(y_MN: jax.Array, token_M: jax.Array, weight_M: jax.Array,
                 num_tokens: int) -> jax.Array:
    """float32 [num_tokens, N]: each row of y_MN [M, N] times its weight_M [M],
    scatter-added into row token_M [M] (indices outside [0, num_tokens) are
    dropped)."""
    contrib_MN = y_MN.astype(jnp.float32) * weight_M[:, None]
    return jnp.zeros((num_tokens, y_MN.shape[1]), jnp.float32).at[token_M].add(contrib_MN)


def grouped_matmul_combine(x_MK: jax.Array, w_GKN: jax.Array | Mxfp4Weights,
                           group_sizes_G: jax.Array, token_M: jax.Array, weight_M: jax.Array,
                           num_tokens: int, *, backend: Backend = "auto", pinned=None):
    """r_TN float32 [num_tokens, N] (module docstring). x_MK [M, K] with rows
    sorted by group, w_GKN [G, K, N] (or Mxfp4Weights, frozen),
    group_sizes_G int [G] (rows >= sum(group_sizes) contribute nothing),
    token_M int [M] in [0, num_tokens), weight_M floating [M] and finite (a
    row past sum(group_sizes) adds weight * 0). Differentiable in x_MK,
    w_GKN (float) and weight_M.

    ``pinned``: a pytree of arrays held beside y_MN by one
    ``lax.optimization_barrier`` (both exist before either is used: a
    collective producing ``pinned`` completes after the grouped matmul, which
    it may run under, and before the combine) and returned unchanged, its
    cotangent passed through; then the result is (r_TN, pinned)."""
    validate_grouped(x_MK, w_GKN, group_sizes_G)
    m = x_MK.shape[0]
    for name, a in (("token_M", token_M), ("weight_M", weight_M)):
        if a.shape != (m,):
            raise ValueError(f"{name} must be [M={m}], got {list(a.shape)}")
    if not jnp.issubdtype(token_M.dtype, jnp.integer):
        raise ValueError(f"token_M must be an integer array, got {token_M.dtype}")
    if not jnp.issubdtype(weight_M.dtype, jnp.floating):
        raise ValueError(f"weight_M must be a floating dtype, got {weight_M.dtype}")
    if resolve(backend).family is Family.XLA and not isinstance(w_GKN, Mxfp4Weights):
        r_TN, pinned_out = _xla(x_MK, w_GKN, group_sizes_G.astype(jnp.int32),
                                token_M.astype(jnp.int32), weight_M, pinned, num_tokens)
    else:
        y_MN, pinned_out = _pin(grouped_matmul(x_MK, w_GKN, group_sizes_G, backend=backend),
                                pinned)
        r_TN = combine_rows(y_MN, token_M, weight_M, num_tokens)
    return r_TN if pinned is None else (r_TN, pinned_out)


def _pin(y_MN: jax.Array, pinned):
    """(y_MN, pinned) through one optimization barrier; unchanged without pinned."""
    return (y_MN, pinned) if pinned is None else jax.lax.optimization_barrier((y_MN, pinned))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _xla(x_MK, w_GKN, group_sizes_G, token_M, weight_M, pinned, num_tokens):
    """The XLA op: blocked.grouped_matmul, (pin), combine_rows; the fused
    backward. Returns (r_TN, pinned)."""
    y_MN, pinned = _pin(blocked.grouped_matmul(x_MK, w_GKN, group_sizes_G), pinned)
    r_TN = combine_rows(y_MN, token_M, weight_M, num_tokens)
    return varying_like_inputs(r_TN, x_MK, w_GKN, group_sizes_G, token_M, weight_M), pinned


def _xla_fwd(x_MK, w_GKN, group_sizes_G, token_M, weight_M, pinned, num_tokens):
    out = _xla(x_MK, w_GKN, group_sizes_G, token_M, weight_M, pinned, num_tokens)
    return out, (x_MK, w_GKN, group_sizes_G, token_M, weight_M)


def _xla_bwd(num_tokens, residuals, cotangents):
    del num_tokens
    x_MK, w_GKN, group_sizes_G, token_M, weight_M = residuals
    dr_TN, d_pinned = cotangents   # pinned's own cotangent, typed as pinned is
    dx_MK, dw_GKN, dweight_M = blocked_tgmm.grouped_matmul_combine_vjp(
        x_MK, w_GKN, dr_TN, token_M, weight_M, group_sizes_G)
    return (like_primal(dx_MK, x_MK), like_primal(dw_GKN, w_GKN), None, None,
            like_primal(dweight_M, weight_M), d_pinned)


_xla.defvjp(_xla_fwd, _xla_bwd)


__all__ = ["combine_rows", "grouped_matmul_combine"]
