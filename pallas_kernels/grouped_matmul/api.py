"""Public grouped-matmul entry points: validate, gate, then run the backend's
entry of dispatch.py's table under the custom VJP.

``backend`` is a name ("auto" | "xla" | "pallas" | "interpret" | "triton"),
a BackendName or a resolved KernelBackend (pallas_kernels.backend). It is
resolved once, then the first-use gate (pallas_kernels.selfcheck.gate)
says which backend a configuration may run: its own once its check has
passed (or the check is off), else XLA. The launch runs dispatch.py's entry
for that backend's family: XLA the blocked scan (reference.py's
jax.lax.ragged_dot is the test oracle), Mosaic the sm_90 kernels (compiled,
or in the GPU interpret mode on a CPU; at decode sizes the swap-AB kernel
where the committed tile table holds its tiles), Triton the sm_80 kernels
through jax-triton. "auto" is Mosaic on sm_90, Triton on other CUDA GPUs,
else XLA. The Mosaic kernel runs bf16/f16 natively and float32 as a
split-bf16 (bf16x3) product, float32-accurate to ~1e-5 relative (see
mosaic_sm90.py).

Weights may be MXFP4 (``pallas_kernels.mxfp4.Mxfp4Weights``: codes packed
along K in the word layout + UE8M0 scales, and the static dequant the scale
bytes allow). Mosaic runs mosaic_sm90_mxfp4.py's kernels (TMA streams the
packed codes and scales; the dequant to bf16 happens in the kernel, by the
fast sequence for FAST weights, exactly for EXACT ones; bf16 or float32 x),
Triton its in-kernel dequantization, XLA the blocked path (one active group
dequantized at a time inside its loop; also, on every backend, when only
one of the fused pair is MXFP4). Every path reads the codes in place: no
program holds a reordered copy of the packed weights. A weight's
k_order_axis (the Mosaic kernels' K order along K or N, Mxfp4Weights) holds
on every path: the Mosaic kernels take it in place, the blocked path in
each dequantized expert, Triton's by permuting x or y in XLA.

Differentiable in x and the (float) weights on every backend through
vjp.py's jax.custom_vjp (on XLA: dx by the blocked scan contracting the
weights' N, dw by blocked_tgmm.py's scan; on Triton dw by blocked_tgmm too).
MXFP4 weights are frozen: x gets its gradient, the packed weights get none.
On Mosaic and XLA they go through mxfp4_vjp.py's custom VJP: the backend's
forward, x's gradient from an explicit blocked scan of dy @ W[g]^T (one
active expert dequantized at a time). """

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Backend, resolve
from pallas_kernels.grouped_matmul import dispatch, vjp
from pallas_kernels.mxfp4 import Mxfp4Weights
from pallas_kernels.selfcheck import gate as selfcheck
from pallas_kernels.situ import check_betas


def _check_ndim(name: str, a, ndim: int) -> None:
    if a.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {a.shape}")


def _check_floating(name: str, a) -> None:
    if not jnp.issubdtype(a.dtype, jnp.floating):
        raise ValueError(f"{name} must be a floating dtype, got {a.dtype}")


def validate_grouped(x_MK, w_GKN, group_sizes_G, *, w_name: str = "w_GKN") -> None:
    """Raise ValueError naming the argument when shapes/dtypes do not fit."""
    _check_ndim("x_MK", x_MK, 2)
    _check_ndim(w_name, w_GKN, 3)
    _check_ndim("group_sizes_G", group_sizes_G, 1)
    _check_floating("x_MK", x_MK)
    if isinstance(w_GKN, Mxfp4Weights):
        w_GKN.validate(w_name)
    else:
        _check_floating(w_name, w_GKN)
    if not jnp.issubdtype(group_sizes_G.dtype, jnp.integer):
        raise ValueError(f"group_sizes_G must be an integer array, got {group_sizes_G.dtype}")
    if x_MK.shape[1] != w_GKN.shape[1]:
        raise ValueError(
            f"x_MK K={x_MK.shape[1]} != {w_name} K={w_GKN.shape[1]} "
            f"(x_MK {x_MK.shape}, {w_name} {w_GKN.shape})")
    if group_sizes_G.shape[0] != w_GKN.shape[0]:
        raise ValueError(
            f"group_sizes_G length {group_sizes_G.shape[0]} != {w_name} G={w_GKN.shape[0]}")


def grouped_matmul(x_MK: jax.Array, w_GKN: jax.Array | Mxfp4Weights, group_sizes_G: jax.Array, *,
                   backend: Backend = "auto") -> jax.Array:
    """y_MN = x_MK @ w_GKN[g] for rows of group g (rows sorted by group).

    x_MK [M, K], w_GKN [G, K, N] (or Mxfp4Weights of that logical shape),
    group_sizes_G int [G] (traced ok, sum <= M).
    Returns [M, N] in x's dtype, accumulated in f32; rows >= sum(group_sizes) are 0.
    Differentiable in x_MK and w_GKN (vjp.grouped_matmul). A kernel
    configuration runs only once it has passed pallas_kernels.selfcheck's
    check (else the xla path; K3JAX_SELFCHECK).
    """
    validate_grouped(x_MK, w_GKN, group_sizes_G)
    kernels = dispatch.kernels(selfcheck.grouped("grouped_matmul", x_MK, w_GKN, resolve(backend)))
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    if isinstance(w_GKN, Mxfp4Weights):   # frozen: autodiff reaches x only
        return kernels.matmul(x_MK, w_GKN, group_sizes_G)
    return vjp.grouped_matmul(kernels, x_MK, w_GKN, group_sizes_G)


def grouped_situ_glu(x_MK: jax.Array, w_gate_GKN: jax.Array | Mxfp4Weights,
                     w_up_GKN: jax.Array | Mxfp4Weights,
                     group_sizes_G: jax.Array, *, beta: float, linear_beta: float | None,
                     backend: Backend = "auto") -> jax.Array:
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) per row's group, fused on Mosaic.

    x_MK [M, K], w_gate_GKN / w_up_GKN [G, K, N] (or Mxfp4Weights), group_sizes_G int [G].
    Returns [M, N] in x's dtype; rows >= sum(group_sizes) are 0. Differentiable in
    x_MK and both weights (vjp.grouped_situ_glu: recomputes gate/up in the backward).
    """
    validate_grouped(x_MK, w_gate_GKN, group_sizes_G, w_name="w_gate_GKN")
    validate_grouped(x_MK, w_up_GKN, group_sizes_G, w_name="w_up_GKN")
    if w_gate_GKN.shape != w_up_GKN.shape:
        raise ValueError(
            f"w_gate_GKN shape {w_gate_GKN.shape} != w_up_GKN shape {w_up_GKN.shape}")
    orders = {w.k_order_axis if isinstance(w, Mxfp4Weights) else None
              for w in (w_gate_GKN, w_up_GKN)}
    if len(orders) != 1:
        raise ValueError(f"w_gate_GKN and w_up_GKN must share k_order_axis, got {orders}")
    check_betas(beta, linear_beta)
    kernels = dispatch.kernels(selfcheck.grouped("grouped_situ_glu", x_MK, w_gate_GKN,
                                                 resolve(backend), beta, linear_beta))
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    if any(isinstance(w, Mxfp4Weights) for w in (w_gate_GKN, w_up_GKN)):   # frozen
        return kernels.situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta)
    return vjp.grouped_situ_glu(kernels, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                                linear_beta)
