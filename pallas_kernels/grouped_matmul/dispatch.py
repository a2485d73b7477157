"""The grouped ops' implementations: one table, keyed by kernel family.

``IMPLEMENTATIONS`` maps each Family to the class that runs grouped_matmul's
and grouped_situ_glu's forwards on it; ``kernels(backend)`` binds one to a
resolved KernelBackend (Mosaic's interpret mode is that value's flag, read
here and nowhere above). api.py takes its launches through this table after
the first-use gate, and pallas_kernels.selfcheck runs the same entries to
check them, so what is checked is what runs.

Every forward takes validated inputs: x_MK [M, K] floating, weights
w_GKN [G, K, N] (a floating array or pallas_kernels.mxfp4.Mxfp4Weights of
that logical shape), group_sizes_G int32 [G] with sum <= M, rows sorted by
group; it returns [M, N] in x's dtype with rows >= sum(group_sizes) zero.

  XLA     blocked.py (a sorted, blocked scan); MXFP4 weights through
          mxfp4_vjp's custom VJP. The whole backward is one blocked scan
          (``backward_scan``; vjp.py).
  MOSAIC  mosaic_sm90.py, or mosaic_sm90_swap_ab.py where the committed tile
          table holds swap-AB tiles for the shape (``swap_ab_config``); MXFP4
          weights on mosaic_sm90_mxfp4(_swap_ab).py (``mxfp4_module``) through
          mxfp4_vjp; tgmm on mosaic_sm90_tgmm.py.
  TRITON  triton_sm80.py through jax-triton (imported on first use:
          ``triton_kernels``); MXFP4 weights dequantized in the kernel, read as
          stored (``triton_x`` / ``triton_y`` apply the K order in XLA).

On every family a fused pair with only one MXFP4 weight runs blocked.py,
and tgmm is blocked_tgmm.py's scan unless the family has its own kernel.
Kernel modules are looked up when a launch is traced, so a test's spy on a
module attribute sees the launch.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from pallas_kernels.backend import Family, KernelBackend
from pallas_kernels.grouped_matmul import (
    blocked,
    blocked_tgmm,
    mosaic_sm90,
    mosaic_sm90_mxfp4,
    mosaic_sm90_mxfp4_swap_ab,
    mosaic_sm90_swap_ab,
    mosaic_sm90_tgmm,
    mxfp4_vjp,
    tile_choice,
)
from pallas_kernels.mxfp4 import Mxfp4Weights, k_order


@dataclasses.dataclass(frozen=True)
class GroupedKernels:
    """The forwards of one backend (a table entry bound to ``backend``).

    ``matmul`` / ``situ_glu`` take dense or MXFP4 weights (the module
    docstring's shapes); a subclass gives the dense and MXFP4 forwards of
    its family. ``backward_scan``: the family's backward is one blocked
    scan (blocked_tgmm.*_vjp) rather than composed from its forward and
    ``tgmm``. Frozen and hashable: the custom VJPs take it as a static
    argument.
    """

    backend: KernelBackend
    backward_scan: ClassVar[bool] = False

    def matmul(self, x_MK, w_GKN, group_sizes_G) -> jax.Array:
        """y_MN = x_MK @ w_GKN[g] per row's group."""
        if isinstance(w_GKN, Mxfp4Weights):
            return self.matmul_mxfp4(x_MK, w_GKN, group_sizes_G)
        return self.matmul_dense(x_MK, w_GKN, group_sizes_G)

    def situ_glu(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta: float,
                 linear_beta: float | None) -> jax.Array:
        """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) per row's group."""
        packed = [isinstance(w, Mxfp4Weights) for w in (w_gate_GKN, w_up_GKN)]
        if all(packed):
            return self.situ_glu_mxfp4(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                                       linear_beta)
        if any(packed):   # one weight of the pair packed: the blocked path, on every family
            return blocked.grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G,
                                            beta=beta, linear_beta=linear_beta)
        return self.situ_glu_dense(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                                   linear_beta)

    def tgmm(self, x_MK, dy_MN, group_sizes_G, out_dtype) -> jax.Array:
        """dw_GKN[g] = x_g^T @ dy_g; [G, K, N] in out_dtype (blocked_tgmm's scan:
        O(block) memory besides its output)."""
        return blocked_tgmm.tgmm(x_MK, dy_MN, group_sizes_G, out_dtype=out_dtype)

    def matmul_dense(self, x_MK, w_GKN, group_sizes_G) -> jax.Array:
        raise NotImplementedError

    def situ_glu_dense(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                       linear_beta) -> jax.Array:
        raise NotImplementedError

    def matmul_mxfp4(self, x_MK, w_GKN, group_sizes_G) -> jax.Array:
        raise NotImplementedError

    def situ_glu_mxfp4(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                       linear_beta) -> jax.Array:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class XlaGrouped(GroupedKernels):
    """Family.XLA: blocked.py's scan (one active group's weights, dequantized
    when packed, at a time)."""

    backward_scan: ClassVar[bool] = True

    def matmul_dense(self, x_MK, w_GKN, group_sizes_G):
        return blocked.grouped_matmul(x_MK, w_GKN, group_sizes_G)

    def situ_glu_dense(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta):
        return blocked.grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta=beta,
                                        linear_beta=linear_beta)

    def matmul_mxfp4(self, x_MK, w_GKN, group_sizes_G):
        return mxfp4_vjp.grouped_matmul(self.matmul_dense, x_MK, w_GKN, group_sizes_G)

    def situ_glu_mxfp4(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta):
        return mxfp4_vjp.grouped_situ_glu(self.situ_glu_dense, x_MK, w_gate_GKN, w_up_GKN,
                                          group_sizes_G, beta, linear_beta)


@dataclasses.dataclass(frozen=True)
class MosaicGrouped(GroupedKernels):
    """Family.MOSAIC, compiled or (``backend.interpret``) in interpret mode."""

    def matmul_dense(self, x_MK, w_GKN, group_sizes_G):
        interpret = self.backend.interpret
        swap_ab = swap_ab_config(x_MK, w_GKN, 1)
        if swap_ab is not None:
            return mosaic_sm90_swap_ab.grouped_matmul(x_MK, w_GKN, group_sizes_G, config=swap_ab,
                                                      interpret=interpret)
        return mosaic_sm90.grouped_matmul(x_MK, w_GKN, group_sizes_G, interpret=interpret)

    def situ_glu_dense(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta):
        interpret = self.backend.interpret
        swap_ab = swap_ab_config(x_MK, w_gate_GKN, 2)
        if swap_ab is not None:
            return mosaic_sm90_swap_ab.grouped_situ_glu(
                x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta=beta, linear_beta=linear_beta,
                config=swap_ab, interpret=interpret)
        return mosaic_sm90.grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G,
                                            beta=beta, linear_beta=linear_beta,
                                            interpret=interpret)

    def matmul_mxfp4(self, x_MK, w_GKN, group_sizes_G):
        return mxfp4_vjp.grouped_matmul(self._matmul_mxfp4_kernel, x_MK, w_GKN, group_sizes_G)

    def situ_glu_mxfp4(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta):
        return mxfp4_vjp.grouped_situ_glu(self._situ_glu_mxfp4_kernel, x_MK, w_gate_GKN,
                                          w_up_GKN, group_sizes_G, beta, linear_beta)

    def _matmul_mxfp4_kernel(self, x_MK, w_GKN, group_sizes_G):
        """In-kernel dequant + bf16 WGMMA (W4A16)."""
        return mxfp4_module(x_MK, w_GKN, 1).grouped_matmul_mxfp4(
            x_MK, w_GKN, group_sizes_G, interpret=self.backend.interpret)

    def _situ_glu_mxfp4_kernel(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta,
                               linear_beta):
        return mxfp4_module(x_MK, w_gate_GKN, 2).grouped_situ_glu_mxfp4(
            x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta=beta, linear_beta=linear_beta,
            interpret=self.backend.interpret)

    def tgmm(self, x_MK, dy_MN, group_sizes_G, out_dtype):
        return mosaic_sm90_tgmm.tgmm(x_MK, dy_MN, group_sizes_G, out_dtype=out_dtype,
                                     interpret=self.backend.interpret)


@dataclasses.dataclass(frozen=True)
class TritonGrouped(GroupedKernels):
    """Family.TRITON: triton_sm80.py (W4A16 in-kernel dequantization for
    MXFP4, the codes read in place, as stored)."""

    def matmul_dense(self, x_MK, w_GKN, group_sizes_G):
        return triton_kernels().grouped_matmul(x_MK, w_GKN, group_sizes_G)

    def situ_glu_dense(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta):
        return triton_kernels().grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G,
                                                 beta=beta, linear_beta=linear_beta)

    def matmul_mxfp4(self, x_MK, w_GKN, group_sizes_G):
        y_MN = triton_kernels().grouped_matmul_mxfp4(
            triton_x(x_MK, [w_GKN]), w_GKN.packed_GNK, w_GKN.scale_GKN, group_sizes_G)
        return triton_y(y_MN, [w_GKN])

    def situ_glu_mxfp4(self, x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, beta, linear_beta):
        pair = [w_gate_GKN, w_up_GKN]
        h_MN = triton_kernels().grouped_situ_glu_mxfp4(
            triton_x(x_MK, pair), w_gate_GKN.packed_GNK, w_gate_GKN.scale_GKN,
            w_up_GKN.packed_GNK, w_up_GKN.scale_GKN, group_sizes_G, beta=beta,
            linear_beta=linear_beta)
        return triton_y(h_MN, pair)


# The table: exactly one implementation per family.
IMPLEMENTATIONS: dict[Family, type[GroupedKernels]] = {
    Family.XLA: XlaGrouped,
    Family.MOSAIC: MosaicGrouped,
    Family.TRITON: TritonGrouped,
}


def kernels(backend: KernelBackend) -> GroupedKernels:
    """The table's entry for ``backend``'s family, bound to ``backend``."""
    return IMPLEMENTATIONS[backend.family](backend)


def triton_kernels():
    """pallas_kernels.grouped_matmul.triton_sm80, imported on first use: it
    needs the optional ``triton`` extra (jax-triton, triton)."""
    try:
        from pallas_kernels.grouped_matmul import triton_sm80
    except ImportError as e:
        raise RuntimeError(f"backend='triton' needs jax-triton and triton: pip install "
                           f"'k3jax[triton]' ({e})") from None
    return triton_sm80


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


def mxfp4_module(x_MK: jax.Array, w_GKN: Mxfp4Weights, num_weights: int):
    """The Mosaic MXFP4 kernel module a launch runs: mosaic_sm90_mxfp4_swap_ab,
    or mosaic_sm90_mxfp4 where block_t_for says its row-major tiles read each
    group's weights fewer times."""
    block_t = mosaic_sm90_mxfp4_swap_ab.block_t_for(x_MK.shape[0], w_GKN.shape[0], num_weights)
    return mosaic_sm90_mxfp4 if block_t is None else mosaic_sm90_mxfp4_swap_ab
