"""Hopper (sm_90) transposed grouped matmul (tgmm) in Pallas Mosaic GPU: the
weight gradient of ``grouped_matmul``.

    dw_GKN[g] = x_MK[rows of g]^T @ dy_MN[rows of g]        [G, K, N]

Rows are sorted by group (as in the forward). Empty groups give exact zeros;
rows at or past sum(group_sizes) (and rows of other groups) contribute
nothing, even when they hold NaN.

Schedule. The kernel is persistent (one CTA per SM): every CTA strides over
the (group, K-block, N-block) output tiles (N-blocks snake-ordered in bands of
``grid_block_n``). For one tile a single warpgroup accumulates a
[block_k, block_n] f32 WGMMA accumulator over the group's row blocks: an
``emit_pipeline`` with a traced step count (the number of block_m-row blocks
the group touches) streams x [block_m, block_k] and dy [block_m, block_n]
tiles through SMEM with TMA (``max_concurrent_steps`` stages, each slot
released one step late so a WGMMA never waits for the previous one). The
WGMMA reads the x tile transposed (A = x^T, 16-bit types allow either major
order). Masking: a group's first and last row blocks may hold rows of its
neighbours or of the tail; on those two blocks only, the warpgroup loads the
staged tiles into registers, selects 0 for rows outside [start, end) (a
select, so NaN rows vanish too), writes them back and fences before the
WGMMA. Interior blocks are used as loaded.

Not warp-specialized (one warpgroup, a traced step count per tile); it
shares the launch, planes and tile fitting of the forward kernels
(mosaic_skeleton.launch, tiling) and its group table is
schedule.group_table_4G.

Dtypes follow the forward kernels: bf16/f16 natively; float32 as the
split-bf16 product (tiling.PRODUCTS), x_lo^T dy_hi + x_hi^T dy_lo + x_hi^T
dy_hi, float32-accurate to ~1e-5 relative. The result is cast to
``out_dtype``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_skeleton as skeleton
from pallas_kernels.grouped_matmul import tiling
from pallas_kernels.grouped_matmul.schedule import group_table_4G


@dataclasses.dataclass(frozen=True)
class TgmmConfig:
    """Tiling of one tgmm launch (one CTA per SM, one consumer warpgroup).

    block_k x block_n is the output tile (the f32 accumulator: block_k is the
    WGMMA M, so 64 or 128 for one warpgroup), block_m the rows reduced per
    pipeline step (the WGMMA K), max_concurrent_steps the SMEM stages,
    grid_block_n the band width of the snake-ordered tile sweep.
    """

    block_k: int = 128
    block_n: int = 128
    block_m: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 8

    def smem_bytes(self, in_bytes: int, out_bytes: int) -> int:
        """Pipeline stages (x and dy tiles, every plane) plus the output tile."""
        stage = self.block_m * (self.block_k + self.block_n) * in_bytes
        return self.max_concurrent_steps * stage + self.block_k * self.block_n * out_bytes


# H200 at K3 shapes (K, N in {3584, 3072}): a 128x128 f32 accumulator
# (128 registers/thread on one warpgroup), 64-row reduction steps; bf16:
# 4 stages x 32 KiB + a 32 KiB output tile = 160 KiB. float32 (two planes per
# operand, f32 output tile) is cut to fit by fit_smem: 2 stages x 64 KiB + 64 KiB.
DEFAULT = TgmmConfig()


def fit_smem(cfg: TgmmConfig, in_bytes: int, out_bytes: int) -> TgmmConfig:
    """Drop pipeline stages (to >= 2) until the kernel fits the SMEM limit."""
    return tiling.fit_stages(cfg, lambda c: c.smem_bytes(in_bytes, out_bytes))


def _make_body(*, cfg: TgmmConfig, planes: int, num_k_blocks: int, num_n_blocks: int):
    """Kernel body(table_4G, *x_planes_MK, *dy_planes_MN, o_GKN)."""
    products = tiling.PRODUCTS[planes]  # (x plane, dy plane) per K step
    bm, bk, bn = cfg.block_m, cfg.block_k, cfg.block_n

    def body(table_gmem, *refs):
        x_gmems, dy_gmems, o_gmem = refs[:planes], refs[planes:2 * planes], refs[-1]
        num_groups = table_gmem.shape[1]

        @plgpu.nd_loop((num_groups, num_k_blocks * num_n_blocks), collective_axes="sm")
        def _tile_loop(info: plgpu.NDLoopInfo):
            group = info.index[0]
            k_block, n_block = plgpu.planar_snake(
                info.index[1], (num_k_blocks, num_n_blocks), 1, cfg.grid_block_n)
            start = table_gmem[0, group]
            end = table_gmem[1, group]
            first = table_gmem[2, group]
            steps = table_gmem[3, group]

            def mask_rows(step, tile_smem):
                """Zero (select, NaN-proof) the staged rows outside [start, end)."""
                rows = plgpu.layout_cast(
                    lax.broadcasted_iota(jnp.int32, tile_smem.shape, 0), plgpu.Layout.WGMMA)
                rows = rows + (first + step) * bm
                tile = tile_smem[...]
                tile_smem[...] = jnp.where((rows >= start) & (rows < end), tile,
                                           jnp.zeros_like(tile))

            def acc_scope(acc_ref):
                def step_fn(indices, *smems):
                    step = indices[0]
                    x_smems, dy_smems = smems[:planes], smems[planes:]

                    @pl.when((step == 0) | (step == steps - 1))
                    def _mask():
                        for tile_smem in smems:
                            mask_rows(step, tile_smem)
                        plgpu.commit_smem()

                    for xp, dp in products:
                        plgpu.wgmma(acc_ref, x_smems[xp].transpose((1, 0)), dy_smems[dp])

                x_spec = plgpu.BlockSpec((bm, bk), lambda i: (first + i, k_block),
                                         delay_release=1)
                dy_spec = plgpu.BlockSpec((bm, bn), lambda i: (first + i, n_block),
                                          delay_release=1)

                @pl.when(steps > 0)  # empty groups keep the zero accumulator
                def _reduce():
                    plgpu.emit_pipeline(
                        step_fn, grid=(steps,), in_specs=[x_spec] * planes + [dy_spec] * planes,
                        max_concurrent_steps=cfg.max_concurrent_steps,
                    )(*x_gmems, *dy_gmems)

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bk, bn), jnp.float32))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bk, bn), o_gmem.dtype))
            def _store(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(
                    o_smem, o_gmem.at[group, pl.ds(k_block * bk, bk), pl.ds(n_block * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def tgmm(x_MK: jax.Array, dy_MN: jax.Array, group_sizes_G: jax.Array, *, out_dtype=None,
         config: TgmmConfig | None = None,
         interpret: bool | plgpu.InterpretGPUParams = False) -> jax.Array:
    """dw_GKN[g] = x_MK[rows of g]^T @ dy_MN[rows of g] (f32 accumulate).

    x_MK [M, K], dy_MN [M, N], group_sizes_G int [G] (traced ok). Returns
    [G, K, N] in out_dtype (default: x's dtype); empty groups are 0.
    """
    m, k = x_MK.shape
    n = dy_MN.shape[1]
    num_groups = group_sizes_G.shape[0]
    out_dtype = jnp.dtype(out_dtype or x_MK.dtype)
    if m == 0 or k == 0 or n == 0 or num_groups == 0:
        return jnp.zeros((num_groups, k, n), out_dtype)
    in_dtype = jnp.result_type(x_MK, dy_MN)
    planes = tiling.num_planes(in_dtype)
    cfg = config or DEFAULT
    # Output tile rows are the WGMMA M (64 per instruction); columns of >= 128
    # bytes keep the output tile's TMA store 128-byte aligned.
    min_n = max(tiling.MIN_BLOCK, 128 // out_dtype.itemsize)
    block_k = tiling.block_for(k, cfg.block_k, 64)
    block_n = tiling.block_for(n, cfg.block_n, min_n)
    cfg = fit_smem(dataclasses.replace(cfg, block_k=block_k, block_n=block_n), 2 * planes,
                   out_dtype.itemsize)
    k_pad, n_pad = tiling.round_up(k, block_k), tiling.round_up(n, block_n)
    m_pad = tiling.round_up(m, cfg.block_m)

    pad = tiling.pad_axis
    x_planes = tiling.to_planes(pad(pad(x_MK, 0, m_pad), 1, k_pad), in_dtype, planes)
    dy_planes = tiling.to_planes(pad(pad(dy_MN, 0, m_pad), 1, n_pad), in_dtype, planes)
    table_4G = group_table_4G(group_sizes_G, m, cfg.block_m)
    kernel = skeleton.launch(
        _make_body(cfg=cfg, planes=planes, num_k_blocks=k_pad // block_k,
                   num_n_blocks=n_pad // block_n),
        out_type=jax.ShapeDtypeStruct((num_groups, k_pad, n_pad), out_dtype),
        grid=(skeleton.num_sms(interpret),), interpret=interpret)
    dw_GKN = kernel(table_4G, *x_planes, *dy_planes)
    return dw_GKN if (k_pad, n_pad) == (k, n) else dw_GKN[:, :k, :n]
