"""Hopper (sm_90) fused gate/up projection + SiTU-GLU for the dense/shared MLP.

The dense MLP is the grouped kernel with a single group holding every row: the
schedule table is then a compile-time constant (cdiv(T, block_m) full-width
items), split-K fills the SMs where those tiles are few, so this reuses the
grouped kernel's pipeline, two-accumulator WGMMA and in-register SiTU
epilogue (pallas_kernels/grouped_matmul/mosaic_sm90.py) instead of
duplicating them. Adding the G axis to the weights is a free
reshape. Dtype policy is the grouped one: bf16/f16 natively, float32 as a
split-bf16 (bf16x3) product, three WGMMAs per tile, ~1e-5 relative error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.grouped_matmul import mosaic_sm90 as grouped
from pallas_kernels.grouped_matmul import tile_choice


def situ_mlp_up(x_TD: jax.Array, gate_DF: jax.Array, up_DF: jax.Array, *, beta: float,
                linear_beta: float | None, config: grouped.TileConfig | None = None,
                interpret: bool | grouped.plgpu.InterpretGPUParams = False) -> jax.Array:
    """x_TD [T, D], gate_DF / up_DF [D, F] -> h_TF [T, F] = situ_glu(x@gate, x@up).

    Dense shapes: D = 7168 (K), F = 6144 / tp (N). config=None uses the
    tiles the committed tile table holds for this shape (tile_choice.mlp_config:
    the fused grouped tile, one or two consumers, N width and split-K), else
    the grouped kernel's default tiles.
    """
    if config is None and x_TD.shape[0] > 0:
        config = tile_choice.mlp_config(x_TD.shape[0], x_TD.shape[1], gate_DF.shape[1],
                                        jnp.result_type(x_TD, gate_DF, up_DF).name)
    all_rows_1 = np.full((1,), x_TD.shape[0], np.int32)  # static: exact schedule
    return grouped.grouped_situ_glu(x_TD, gate_DF[None], up_DF[None], all_rows_1,
                                    beta=beta, linear_beta=linear_beta, config=config,
                                    interpret=interpret)
