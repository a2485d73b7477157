"""Fused gate/up projection + SiTU-GLU for the dense/shared MLP, in Triton
(sm_80 and newer), through jax-triton.

As in mosaic_sm90.py, the dense MLP is the grouped kernel with one group
holding every row (pallas_kernels/grouped_matmul/triton_sm80.py): the fused
two-accumulator dot and the in-register SiTU epilogue are reused, and adding
the G axis to the weights is a free reshape. Decode tiles below 128 tokens,
prefill tiles from 128.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import triton_sm80 as grouped


def situ_mlp_up(x_TD: jax.Array, gate_DF: jax.Array, up_DF: jax.Array, *, beta: float,
                linear_beta: float | None,
                config: grouped.TritonTiles | None = None) -> jax.Array:
    """x_TD [T, D], gate_DF / up_DF [D, F] -> h_TF [T, F] = situ_glu(x@gate, x@up), x dtype."""
    all_rows_1 = jnp.full((1,), x_TD.shape[0], jnp.int32)
    return grouped.grouped_situ_glu(x_TD, gate_DF[None], up_DF[None], all_rows_1, beta=beta,
                                    linear_beta=linear_beta, config=config)
