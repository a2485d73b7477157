"""Public grouped-matmul entry points: validate shapes, then dispatch on backend.

"xla" -> blocked.py (a sorted, blocked scan; reference.py's jax.lax.ragged_dot
is the test oracle: XLA expands it densely), "pallas" -> mosaic_sm90.py on a
Hopper GPU, "interpret" -> the same Mosaic kernel in GPU interpret mode (CPU),
"triton" -> triton_sm80.py through jax-triton (CUDA sm_80+), "auto" -> "pallas"
on sm_90, "triton" on other CUDA GPUs, else "xla" (see pallas_kernels.backend).
At decode sizes the Mosaic launch takes mosaic_sm90_swap_ab.py (weights on
WGMMA's M side) where the committed tile table holds swap-AB tiles (swap_ab_config).
The Mosaic kernel runs bf16/f16 natively and float32 as a split-bf16 (bf16x3)
product, float32-accurate to ~1e-5 relative (see mosaic_sm90.py).

Weights may be MXFP4 (``pallas_kernels.mxfp4.Mxfp4Weights``: codes packed
along K in the word layout + UE8M0 scales, and the static dequant the scale
bytes allow). They run mosaic_sm90_mxfp4.py's kernels on "pallas" (the
default on Hopper) and "interpret" (TMA streams the packed codes and scales;
the dequant to bf16 happens in the kernel, by the fast sequence for FAST
weights, exactly for EXACT ones; bf16 or float32 x), Triton's in-kernel
dequantization on "triton", and the blocked path on "xla" (one active group
dequantized at a time inside its loop; also when only one of the fused pair
is MXFP4). Every path reads the codes in place: no program holds a
reordered copy of the packed weights. A weight's k_order_axis (the Mosaic
kernels' K order along K or N, Mxfp4Weights) holds on every path: the
Mosaic kernels take it in place, the blocked path in each dequantized
expert, Triton's by permuting x or y in XLA.

Differentiable in x and the (float) weights on every backend through
vjp.py's jax.custom_vjp (on "xla": dx by the blocked scan contracting the
weights' N, dw by blocked_tgmm.py's scan; on "triton" dw by blocked_tgmm too).
MXFP4 weights are frozen: x gets its gradient, the packed weights get none.
On "pallas", "interpret" and "xla" they go through mxfp4_vjp.py's custom VJP:
the backend's forward, x's gradient from an explicit blocked scan of
dy @ W[g]^T (one active expert dequantized at a time). """

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Backend, resolve_backend
from pallas_kernels.grouped_matmul import (
    blocked,
    mosaic_sm90,
    mosaic_sm90_mxfp4,
    mosaic_sm90_swap_ab,
    mxfp4_vjp,
    tile_choice,
    vjp,
)
from pallas_kernels.mxfp4 import Mxfp4Weights, k_order
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


def triton_kernels():
    """pallas_kernels.grouped_matmul.triton_sm80, imported on first use: it
    needs the optional ``triton`` extra (jax-triton, triton)."""
    try:
        from pallas_kernels.grouped_matmul import triton_sm80
    except ImportError as e:
        raise RuntimeError(f"backend='triton' needs jax-triton and triton: pip install "
                           f"'k3jax[triton]' ({e})") from None
    return triton_sm80


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
    impl = selfcheck.grouped("grouped_matmul", x_MK, w_GKN, resolve_backend(backend))
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    if isinstance(w_GKN, Mxfp4Weights):   # frozen: autodiff reaches x only
        return _grouped_matmul_forward(x_MK, w_GKN, group_sizes_G, impl)
    return vjp.grouped_matmul(_FORWARDS, impl, x_MK, w_GKN, group_sizes_G)


def _grouped_matmul_forward(x_MK, w_GKN, group_sizes_G, impl):
    """The forward dispatch of grouped_matmul (validated inputs, resolved backend)."""
    if isinstance(w_GKN, Mxfp4Weights):
        if impl == "triton":   # in-kernel dequantization (W4A16) of the word layout, in place
            x_MK = triton_x(x_MK, [w_GKN])
            return triton_y(triton_kernels().grouped_matmul_mxfp4(
                x_MK, w_GKN.packed_GNK, w_GKN.scale_GKN, group_sizes_G), [w_GKN])
        # pallas / interpret: in-kernel dequant + bf16 WGMMA (W4A16); xla: blocked
        return mxfp4_vjp.grouped_matmul(x_MK, w_GKN, group_sizes_G, impl)
    if impl == "xla":
        return blocked.grouped_matmul(x_MK, w_GKN, group_sizes_G)
    if impl == "triton":
        return triton_kernels().grouped_matmul(x_MK, w_GKN, group_sizes_G)
    swap_ab = swap_ab_config(x_MK, w_GKN, 1)
    if swap_ab is not None:
        return mosaic_sm90_swap_ab.grouped_matmul(x_MK, w_GKN, group_sizes_G, config=swap_ab,
                                                  interpret=impl == "interpret")
    return mosaic_sm90.grouped_matmul(x_MK, w_GKN, group_sizes_G,
                                      interpret=impl == "interpret")


def grouped_situ_glu(x_MK: jax.Array, w_gate_GKN: jax.Array | Mxfp4Weights,
                     w_up_GKN: jax.Array | Mxfp4Weights,
                     group_sizes_G: jax.Array, *, beta: float, linear_beta: float | None,
                     backend: Backend = "auto") -> jax.Array:
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) per row's group, fused on "pallas".

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
    impl = selfcheck.grouped("grouped_situ_glu", x_MK, w_gate_GKN, resolve_backend(backend),
                             beta, linear_beta)
    group_sizes_G = group_sizes_G.astype(jnp.int32)
    if any(isinstance(w, Mxfp4Weights) for w in (w_gate_GKN, w_up_GKN)):   # frozen
        return _grouped_situ_glu_forward(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                                         linear_beta, impl)
    return vjp.grouped_situ_glu(_FORWARDS, impl, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G,
                                beta, linear_beta)


def _grouped_situ_glu_forward(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta,
                              impl):
    """The forward dispatch of grouped_situ_glu (validated inputs, resolved backend)."""
    packed = [isinstance(w, Mxfp4Weights) for w in (w_gate_GKN, w_up_GKN)]
    if all(packed) and impl == "triton":   # in-kernel dequantization (W4A16), word layout
        pair = [w_gate_GKN, w_up_GKN]
        return triton_y(triton_kernels().grouped_situ_glu_mxfp4(
            triton_x(x_MK, pair), w_gate_GKN.packed_GNK, w_gate_GKN.scale_GKN,
            w_up_GKN.packed_GNK, w_up_GKN.scale_GKN, group_sizes_G, beta=beta,
            linear_beta=linear_beta), pair)
    if all(packed) and impl in mxfp4_vjp.IMPLS:   # kernel dequant + bf16 WGMMA, or blocked
        return mxfp4_vjp.grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                                          linear_beta, impl)
    if impl == "xla" or any(packed):
        return blocked.grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G,
                                        beta=beta, linear_beta=linear_beta)
    if impl == "triton":
        return triton_kernels().grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G,
                                                 beta=beta, linear_beta=linear_beta)
    swap_ab = swap_ab_config(x_MK, w_gate_GKN, 2)
    if swap_ab is not None:
        return mosaic_sm90_swap_ab.grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G,
                                                    beta=beta, linear_beta=linear_beta,
                                                    config=swap_ab, interpret=impl == "interpret")
    return mosaic_sm90.grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G,
                                        beta=beta, linear_beta=linear_beta,
                                        interpret=impl == "interpret")


def triton_x(x_MK, weights: list[Mxfp4Weights]):
    """x for Triton's MXFP4 kernels, which read the weights as stored: out
    of k_order for weights of k_order_axis 1."""
    axis = mosaic_sm90_mxfp4.k_order_axis(weights)
    return k_order(x_MK, 1, inverse=True) if axis == 1 else x_MK


def triton_y(y_MN, weights: list[Mxfp4Weights]):
    """y of Triton's MXFP4 kernels in k_order for weights of k_order_axis 2."""
    return k_order(y_MN, 1) if mosaic_sm90_mxfp4.k_order_axis(weights) == 2 else y_MN


def swap_ab_config(x_MK, w_GKN, num_weights: int) -> mosaic_sm90_swap_ab.SwapABConfig | None:
    """The Mosaic launch's kernel: the swap-AB tiles (mosaic_sm90_swap_ab) the
    committed tile table holds for this shape (tile_choice.grouped_config),
    else None (mosaic_sm90's row-major tiles)."""
    m, k = x_MK.shape
    num_groups, _, n = w_GKN.shape
    if m == 0 or n == 0:
        return None
    return tile_choice.grouped_config(m, k, n, num_groups, num_weights,
                                      jnp.result_type(x_MK, w_GKN).name)


_FORWARDS = vjp.GroupedForwards(plain=_grouped_matmul_forward, fused=_grouped_situ_glu_forward)
