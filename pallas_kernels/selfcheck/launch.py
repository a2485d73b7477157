"""The launchers a check runs: (x, weights, group_sizes) -> y for one
KernelConfig, below the public ops (no first-use gate, no custom VJP).

x [m, k]; weights a list of 1 (grouped_matmul) or 2 (the fused ops) arrays
[g, k, n] or Mxfp4Weights (situ_mlp_up: g = 1, its [k, n] weights are
weights[i][0]); group_sizes int32 [g]; y [m, n] in x's dtype.

``launcher``          the op's forward on a backend, through the op's
                      dispatch.py entry: what the public op runs after the gate
``tiling_launcher``   one tiling of the Mosaic kernels (a table entry, or the
                      row-major kernel's default tiles), for tuning candidates
``fixed_tiling_launcher``  config's own tiling on inputs with fewer groups
                      (a check of a launch too large to check whole)

A fixed tiling runs the family's kernel module with that tiling: the dispatch
would re-pick tiles from the smaller shape.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp

from pallas_kernels.backend import Backend, Family, resolve
from pallas_kernels.selfcheck.config import KernelConfig, mxfp4_dtypes, table_key


def launcher(config: KernelConfig, backend: Backend) -> Callable:
    """(x, weights, group_sizes) -> y through the op's dispatch.py entry on ``backend``."""
    from pallas_kernels.grouped_matmul import dispatch
    from pallas_kernels.situ_mlp import dispatch as mlp_dispatch

    resolved = resolve(backend)
    beta, linear_beta = config.beta, config.linear_beta
    if config.op == "situ_mlp_up":
        mlp = mlp_dispatch.kernels(resolved)
        return lambda x, ws, gs: mlp.up(x, ws[0][0], ws[1][0], beta, linear_beta)
    grouped = dispatch.kernels(resolved)
    if config.op == "grouped_matmul":
        return lambda x, ws, gs: grouped.matmul(x, ws[0], gs)
    return lambda x, ws, gs: grouped.situ_glu(x, ws[0], ws[1], gs, beta, linear_beta)


def committed_entry(config: KernelConfig) -> dict:
    """The committed table's pick for a Mosaic launch of dense weights, as a
    table entry ({"kernel": ..., **fields}; tile_choice.entry_of): the table's
    row, else the row-major kernel (situ_mlp_up: the grouped kernel's default
    tiles of one group)."""
    from pallas_kernels.grouped_matmul import mosaic_sm90, tile_choice

    op, m, k, n, groups, num_weights, dtype = table_key(config)
    own = tile_choice.lookup(op, m, k, n, groups, num_weights, dtype, tuned=False)[1]
    if op == "mlp":
        own = own or mosaic_sm90.default_config(m, 1, 2)
    return tile_choice.entry_of(own, op)


def tiling_launcher(config: KernelConfig, entry: dict) -> Callable:
    """(x, weights, group_sizes) -> y with the tiling ``entry`` (row-major: the
    default tiles of config's shape), on config's Mosaic backend; the tiling
    stays fixed when the inputs have fewer groups than ``config``."""
    from pallas_kernels.grouped_matmul import mosaic_sm90, mosaic_sm90_swap_ab, tile_choice
    from pallas_kernels.situ_mlp import mosaic_sm90 as mlp_kernel

    cfg = tile_choice.row_config(entry)
    interpret = config.backend.interpret
    beta, linear_beta = config.beta, config.linear_beta
    if config.op == "situ_mlp_up":
        return lambda x, ws, gs: mlp_kernel.situ_mlp_up(x, ws[0][0], ws[1][0], beta=beta,
                                                        linear_beta=linear_beta, config=cfg,
                                                        interpret=interpret)
    module = mosaic_sm90 if cfg is None else mosaic_sm90_swap_ab
    # row-major: the default tiles of config's own shape, also on fewer groups
    extra = {"config": cfg or mosaic_sm90.default_config(config.m, config.groups,
                                                           config.num_weights)}
    if config.op == "grouped_matmul":
        return lambda x, ws, gs: module.grouped_matmul(x, ws[0], gs, interpret=interpret, **extra)
    return lambda x, ws, gs: module.grouped_situ_glu(x, ws[0], ws[1], gs, beta=beta,
                                                     linear_beta=linear_beta,
                                                     interpret=interpret, **extra)


def fixed_tiling_launcher(config: KernelConfig) -> Callable:
    """A launcher that runs config's own tiling on inputs with fewer groups
    (the dispatch would re-pick tiles from the smaller shape): the committed
    pick through tiling_launcher on Mosaic, the Triton entry's tiles passed
    explicitly (with its K-order handling of MXFP4 weights), and the MXFP4
    Mosaic kernel the dispatch takes for config's shape, with its block_t."""
    if config.backend.family is Family.TRITON:
        return _triton_launcher(config)
    if config.w_dtype in mxfp4_dtypes():
        return _mxfp4_launcher(config)
    return tiling_launcher(config, committed_entry(config))


def _triton_launcher(config: KernelConfig) -> Callable:
    from pallas_kernels.grouped_matmul import dispatch
    from pallas_kernels.grouped_matmul.triton_sm80 import default_tiles

    t = default_tiles(config.m, config.groups, config.num_weights,
                      jnp.dtype(config.x_dtype).itemsize, config.w_dtype in mxfp4_dtypes())
    k = dispatch.triton_kernels()
    b = dict(beta=config.beta, linear_beta=config.linear_beta)
    tx, ty = dispatch.triton_x, dispatch.triton_y
    if config.w_dtype in mxfp4_dtypes() and config.op == "grouped_matmul":
        return lambda x, ws, gs: ty(k.grouped_matmul_mxfp4(
            tx(x, ws), ws[0].packed_GNK, ws[0].scale_GKN, gs, config=t), ws)
    if config.w_dtype in mxfp4_dtypes():
        return lambda x, ws, gs: ty(k.grouped_situ_glu_mxfp4(
            tx(x, ws), ws[0].packed_GNK, ws[0].scale_GKN, ws[1].packed_GNK,
            ws[1].scale_GKN, gs, config=t, **b), ws)
    if config.op == "grouped_matmul":
        return lambda x, ws, gs: k.grouped_matmul(x, ws[0], gs, config=t)
    return lambda x, ws, gs: k.grouped_situ_glu(x, ws[0], ws[1], gs, config=t, **b)


def _mxfp4_launcher(config: KernelConfig) -> Callable:
    """The Mosaic MXFP4 kernel the dispatch takes for config's own shape
    (config.tiles), with its block_t, on any groups."""
    from pallas_kernels.grouped_matmul import mosaic_sm90_mxfp4, mosaic_sm90_mxfp4_swap_ab

    block_t = mosaic_sm90_mxfp4_swap_ab.block_t_for(config.m, config.groups, config.num_weights)
    if block_t is None:
        module, kwargs = mosaic_sm90_mxfp4, {}
    else:
        module = mosaic_sm90_mxfp4_swap_ab
        kwargs = {"config": mosaic_sm90_mxfp4_swap_ab.Mxfp4SwapABConfig(block_t=block_t)}
    kwargs["interpret"] = config.backend.interpret
    if config.op == "grouped_matmul":
        return lambda x, ws, gs: module.grouped_matmul_mxfp4(x, ws[0], gs, **kwargs)
    return lambda x, ws, gs: module.grouped_situ_glu_mxfp4(
        x, ws[0], ws[1], gs, beta=config.beta, linear_beta=config.linear_beta, **kwargs)
