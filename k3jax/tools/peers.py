"""Peer grouped matmuls the benchmark times beside ours (not used by the model).

``tokamax_ragged_dot``: tokamax 0.0.17's ``tokamax.ragged_dot`` (Mosaic GPU
kernels with H100 autotuning tables and heuristics; the library a JAX user
would reach for). implementation="mosaic" takes its GPU kernel; it picks that
kernel only when the default device is an NVIDIA GPU (in a deviceless
compile: k3jax/tools/kernel_ptxas.py puts the compile-only H200 in scope), and
raises rather than falling back to XLA. tokamax cannot fuse a gated
activation on Mosaic GPU, so the gate/up peer is two ragged_dots and the SiTU
in XLA.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

from pallas_kernels.situ import situ_glu

TOKAMAX_IMPLEMENTATION = "mosaic"


def tokamax_ragged_dot(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
    """y_MN = x_MK @ w_GKN[group(row)] by tokamax's Mosaic GPU kernel (x dtype)."""
    import tokamax
    return tokamax.ragged_dot(x_MK, w_GKN, group_sizes_G, implementation=TOKAMAX_IMPLEMENTATION)


def tokamax_situ_glu(*, beta: float, linear_beta: float | None) -> Callable:
    """f(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G) -> h_MN: two tokamax
    ragged_dots (f32 out), then situ_glu in XLA, cast to x's dtype."""
    import tokamax

    def fn(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G):
        gate, up = (tokamax.ragged_dot(x_MK, w, group_sizes_G, preferred_element_type="float32",
                                       implementation=TOKAMAX_IMPLEMENTATION)
                    for w in (w_gate_GKN, w_up_GKN))
        return situ_glu(gate, up, beta=beta, linear_beta=linear_beta).astype(x_MK.dtype)

    return fn


__all__ = ["TOKAMAX_IMPLEMENTATION", "tokamax_ragged_dot", "tokamax_situ_glu"]
