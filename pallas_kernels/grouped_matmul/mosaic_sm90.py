"""Hopper (sm_90) grouped matmul kernels in Pallas Mosaic GPU, row-major tiles.

Two products share one kernel body (mosaic_skeleton.persistent_body):
  * ``grouped_matmul``:   y_MN = x_MK @ w_GKN[group(row)]
  * ``grouped_situ_glu``: h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]); both products
    accumulate in two WGMMA register accumulators of the same tile and the SiTU
    epilogue runs on those registers, so the 2N-wide intermediate never exists
    in HBM.

Layout: rows sorted by group; x [M, K], weights [G, K, N] (N-major), y [M, N].
Schedule: schedule.work_items_4W (group-aligned items). The persistent loop
walks (K range, work item, N-block) tiles, the (item, N-block) plane in
plgpu.planar_snake order (bands of grid_block_n N-blocks).

A CTA is num_compute_wgs consumer warpgroups (64 rows of the block_m-row x
tile each, all block_n columns, one f32 accumulator per weight) and one TMA
producer. A tail item (rows past sum(sizes)) skips the matmul and writes
zeros; a consumer whose 64 rows hold none of the item's rows issues no WGMMA.
Each consumer stores only the item's rows of its slice (store_rows: a
logarithmic ladder of fixed-size TMA stores), so items sharing an M-block
never overwrite each other's rows and rows of x past sum(sizes) (possibly
NaN) never reach a valid output row.

Split-K (TileConfig.split_k = S > 1, one group: the dense MLP at small T):
every tile runs once per K range, its f32 products go to S partial outputs
per weight, and XLA sums them and applies the epilogue.

Tiles chain without draining the TMA ring (LaunchPlan.no_drain) when a stage
count >= 3 divides every K range's step count; bounds_2C comes from
schedule.pipeline_bounds_2C. bf16/f16 outputs compile with approximate tanh /
exp (LaunchPlan.approx_math).

Dtypes: bf16/f16 natively (one WGMMA per weight per K step); float32 as the
split-bf16 product (tiling.PRODUCTS: three WGMMAs into one f32 accumulator,
both planes of every operand in SMEM, ~1e-5 relative error against float32);
the output keeps the input dtype.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_skeleton as skeleton
from pallas_kernels.grouped_matmul import tiling
from pallas_kernels.grouped_matmul.schedule import (
    chain_stages,
    expected_rows,
    pipeline_bounds_2C,
    schedule,
    x_rows,
)
from pallas_kernels.situ import situ_glu_f32


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Tiling of one kernel launch (one CTA per SM, persistent).

    A CTA is ``num_compute_wgs`` consumer warpgroups plus one TMA producer
    warpgroup (warp specialization). Each consumer owns ``wg_block_m`` rows
    (64 = the WGMMA M of one warpgroup) of the CTA's block_m-row x tile and
    all ``block_n`` columns, with one f32 register accumulator per weight.
    block_k is the K step of the TMA pipeline (64 bf16 = one 128-byte swizzle
    row), max_concurrent_steps the number of SMEM stages, grid_block_n the
    width (in N-blocks) of the snake-ordered tile sweep.
    """

    num_compute_wgs: int = 1
    wg_block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 8
    split_k: int = 1
    num_ctas: int | None = None  # persistent grid size; None: the device's SM count

    @property
    def block_m(self) -> int:
        return self.wg_block_m * self.num_compute_wgs

    def num_outputs(self, num_weights: int) -> int:
        """Output tiles per tile: one epilogue result, or (split-K) one f32
        partial per weight."""
        return num_weights if self.split_k > 1 else 1

    def smem_bytes(self, num_weights: int, in_bytes: int, out_bytes: int) -> int:
        """Shared memory the kernel allocates (pipeline stages + epilogue tiles).

        in_bytes: SMEM bytes per input element over all its planes (2 for
        bf16/f16, 4 for float32 = hi + lo bf16 planes); out_bytes: output
        itemsize (4 with split_k > 1: f32 partials).
        """
        stage = (self.block_m * self.block_k
                 + num_weights * self.block_k * self.block_n) * in_bytes
        out_tiles = self.num_outputs(num_weights) * self.block_m * self.block_n * out_bytes
        return self.max_concurrent_steps * stage + out_tiles


# H200 tiles for K3 shapes (K, N multiples of 256), each compiling without
# ptxas spills. Decode-size groups: one consumer, 64-row tiles, 128-wide N,
# deep rings (fused 5 x 40 KiB + 16 KiB, plain 8 x 24 KiB + 16 KiB). Prefill:
# two consumers share each weight tile over 128 rows (fused 64-wide N,
# 4 x 32 KiB + 16 KiB; plain 256-wide N, 3 x 48 KiB + 64 KiB). Tall: three
# consumers keep a group of <= 192 rows in one item (<= 128 registers a
# thread: fused 64-wide N, 5 x 40 KiB + 24 KiB; plain 3 x 40 KiB + 48 KiB).
FUSED_DECODE = TileConfig(num_compute_wgs=1, block_n=128, max_concurrent_steps=5)
PLAIN_DECODE = TileConfig(num_compute_wgs=1, block_n=128, max_concurrent_steps=8)
FUSED_PREFILL = TileConfig(num_compute_wgs=2, block_n=64, max_concurrent_steps=4)
PLAIN_PREFILL = TileConfig(num_compute_wgs=2, block_n=256, max_concurrent_steps=3)
FUSED_TALL = TileConfig(num_compute_wgs=3, block_n=64, max_concurrent_steps=5)
PLAIN_TALL = TileConfig(num_compute_wgs=3, block_n=128, max_concurrent_steps=3)


def default_config(num_rows: int, num_groups: int, num_weights: int) -> TileConfig:
    """Static tile choice from the rows per group: the shortest tile that holds
    a group's rows (schedule.expected_rows), up to 192 rows; larger groups get
    the prefill tiles."""
    rows = expected_rows(num_rows, num_groups)
    fused = num_weights == 2
    if rows <= 64:
        return FUSED_DECODE if fused else PLAIN_DECODE
    if rows <= 128:
        return FUSED_PREFILL if fused else PLAIN_PREFILL
    if rows <= 192 and num_groups > 1:
        return FUSED_TALL if fused else PLAIN_TALL
    return FUSED_PREFILL if fused else PLAIN_PREFILL


def fit_smem(cfg: TileConfig, num_weights: int, in_bytes: int, out_bytes: int,
             min_block_n: int = tiling.MIN_BLOCK) -> TileConfig:
    """tiling.fit_smem of cfg's smem_bytes: fewer stages (>= 2), then a
    narrower N block (>= min_block_n)."""
    return tiling.fit_smem(cfg, lambda c: c.smem_bytes(num_weights, in_bytes, out_bytes),
                           min_block_n)


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """The static shape of one launch: the fitted tiles and padded sizes.

    cfg: the TileConfig after fitting block_k / block_n to K / N and the SMEM
    limit; planes: bf16 planes per input element (tiling.num_planes).
    no_drain: a CTA's tiles chain their pipelines (START / STEADY / STOP, no
    drain of the TMA ring between tiles; cfg.max_concurrent_steps is then
    chain_stages(...) of the fitted count); False: every tile drains.
    approx_math: the kernel writes a bf16 / f16 output (no split-K), so its
    epilogue uses PTX's approximate exp (ex2.approx.ftz.f32) and tanh
    (tanh.approx.f32), whose documented errors are far below the output's
    rounding; divisions stay IEEE (div.rn.f32).
    """

    cfg: TileConfig
    planes: int
    m_pad: int
    k_pad: int
    n_pad: int
    no_drain: bool
    approx_math: bool

    @property
    def num_k_steps(self) -> int:
        return self.k_pad // self.cfg.block_k

    @property
    def num_n_blocks(self) -> int:
        return self.n_pad // self.cfg.block_n


def plan_launch(m: int, k: int, n: int, num_groups: int, num_weights: int, in_dtype,
                out_dtype, cfg: TileConfig | None = None) -> LaunchPlan:
    """Fit the tiles of a [m, k] x num_weights x [G, k, n] launch (what the
    launcher runs; k3jax/tools/kernel_cost.py replays it).

    With cfg.split_k > 1 the kernel writes f32 partials (out_dtype is then
    ignored for the kernel's own output) and every K range needs at least
    max_concurrent_steps K steps (ValueError otherwise).

    When some stage count in [3, fitted stages] divides every K range's step
    count (schedule.chain_stages), the launch takes the largest such count and
    chains each CTA's tiles without draining (LaunchPlan.no_drain).
    """
    planes = tiling.num_planes(in_dtype)
    cfg = cfg or default_config(m, num_groups, num_weights)
    out_bytes = 4 if cfg.split_k > 1 else jnp.dtype(out_dtype).itemsize
    # block_k >= 16: the bf16 WGMMA K step. block_n: output tile rows of >= 128
    # bytes keep every row-offset TMA store from SMEM 128-byte aligned.
    block_k = tiling.block_for(k, cfg.block_k, tiling.MIN_BLOCK)
    min_n = max(tiling.MIN_BLOCK, 128 // out_bytes)
    block_n = tiling.block_for(n, cfg.block_n, min_n)
    cfg = dataclasses.replace(cfg, block_k=block_k, block_n=block_n)
    cfg = fit_smem(cfg, num_weights, 2 * planes, out_bytes, min_n)
    if planes == 2 and cfg.num_compute_wgs > 1:
        # float32 on two consumers: 3 stages spill in ptxas; 2 do not.
        cfg = dataclasses.replace(cfg, max_concurrent_steps=2)
    k_pad = tiling.round_up(k, block_k)
    if cfg.split_k > 1 and num_groups != 1:
        raise ValueError(f"split_k={cfg.split_k} needs one group (the dense MLP), got {num_groups}")
    num_k_steps = k_pad // block_k
    if cfg.split_k > 1 and num_k_steps // cfg.split_k < cfg.max_concurrent_steps:
        raise ValueError(
            f"split_k={cfg.split_k} leaves K ranges of {num_k_steps // cfg.split_k} "
            f"K steps, fewer than the {cfg.max_concurrent_steps} pipeline stages")
    stages = chain_stages(num_k_steps, cfg.split_k, cfg.max_concurrent_steps)
    if stages:
        cfg = dataclasses.replace(cfg, max_concurrent_steps=stages)
    return LaunchPlan(cfg=cfg, planes=planes, m_pad=x_rows(m, cfg.block_m), k_pad=k_pad,
                      n_pad=tiling.round_up(n, cfg.block_n), no_drain=bool(stages),
                      approx_math=cfg.split_k == 1 and jnp.dtype(out_dtype).itemsize == 2)


def pipeline(cfg: TileConfig, num_w: int, planes: int) -> skeleton.Pipeline:
    """``planes`` x tiles [block_m, block_k], then num_w x ``planes`` weight
    tiles [block_k, block_n] per K step. delay_release stays 0: with 1, a
    tile's last step never arrives on its "consumed" barrier, so the producer
    could refill that slot for the next tile while its WGMMA still reads it."""
    def in_specs(first_k_step):
        x_spec = plgpu.BlockSpec((cfg.block_m, cfg.block_k), lambda k: (0, k + first_k_step))
        w_spec = plgpu.BlockSpec((cfg.block_k, cfg.block_n), lambda k: (k + first_k_step, 0))
        return [x_spec] * planes + [w_spec] * (num_w * planes)
    return skeleton.Pipeline(in_specs, cfg.num_compute_wgs, cfg.max_concurrent_steps,
                             skeleton.memory_registers(cfg.num_compute_wgs))


def _make_body(*, epilogue: Callable, num_w: int, planes: int, cfg: TileConfig, num_rows: int,
               num_k_steps: int, num_n_blocks: int, out_dtype, no_drain: bool):
    """Kernel body(meta_4W, [bounds_2C,] *x_planes_MK, *w_planes_GKN, *o_MNs) for
    num_w weights of ``planes`` planes each.

    epilogue(*acc_tiles) -> tuple of output tiles, one per output. With
    split_k = S (one group), the outputs are f32 partials [S * X, N], X =
    x_rows(M, block_m): K range s writes the item's rows at rows s * X + row
    (rows no item covers are never written; the caller reads rows < M only
    and masks the tail rows past sum(group_sizes)).
    """
    wg_m = cfg.wg_block_m
    split_k = cfg.split_k
    x_rows_pad = x_rows(num_rows, cfg.block_m)
    num_out = cfg.num_outputs(num_w)
    products = tiling.PRODUCTS[planes]

    def tile_order(num_items):
        def coords(index):
            split, lin = jnp.divmod(index, num_items * num_n_blocks)
            item, n_block = plgpu.planar_snake(lin, (num_items, num_n_blocks), 1,
                                               cfg.grid_block_n)
            return split, item, n_block
        return split_k * num_items * num_n_blocks, coords

    def tile_body(t: skeleton.Tile):
        wg, o_smem = t.wg, t.scratch["o_smem"]
        # This consumer's share of the item's rows [offset, offset + count).
        lo = jnp.clip(t.offset - wg * wg_m, 0, wg_m)
        hi = jnp.clip(t.offset + t.count - wg * wg_m, 0, wg_m)

        def store(tiles):
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous tile's store
            for o, tile in enumerate(tiles):
                o_smem[o * cfg.num_compute_wgs + wg] = tile.astype(out_dtype)
            plgpu.commit_smem()
            # split-K: K range ``split`` writes its f32 partial rows at
            # split * x_rows_pad + row (the padded partials).
            row0 = t.x_row0 + wg * wg_m + (t.split * x_rows_pad if split_k > 1 else 0)
            for o, o_gmem in enumerate(t.o_gmems):
                skeleton.store_rows(o_smem.at[o * cfg.num_compute_wgs + wg], o_gmem,
                                    row0=row0, offset=lo, count=hi - lo,
                                    col0=t.n_block * cfg.block_n, block_n=cfg.block_n,
                                    max_rows=min(wg_m, num_rows))

        def mma(_, *rest):
            x_planes, w_planes, accs = skeleton.step_operands(rest, planes, planes)
            x_smems = [x.at[pl.ds(wg * wg_m, wg_m)] for x in x_planes]

            @pl.when(hi > lo)  # no WGMMA for a consumer without rows
            def _issue():
                for acc, w_smems in zip(accs, w_planes):
                    for xp, wp in products:
                        plgpu.wgmma(acc, x_smems[xp], w_smems[wp])
            # The slot is released when this step returns (delay_release=0),
            # so its WGMMAs must be done reading it; the other consumer
            # warpgroup's WGMMAs keep the tensor cores busy meanwhile.
            plgpu.wgmma_wait(0)
            return accs

        compute_context = skeleton.scoped_accumulators(
            (wg_m, cfg.block_n), num_w,
            lambda accs: store(epilogue(*[acc[...] for acc in accs])))

        def tail():  # tail rows past sum(group_sizes): no matmul, zeros
            @pl.when((t.count > 0) & (t.group < 0) & (wg < cfg.num_compute_wgs))
            def _zeros():
                store([jnp.zeros((wg_m, cfg.block_n), out_dtype)] * num_out)

        # (split-K: the caller masks the tail rows)
        return mma, compute_context, tail if split_k == 1 else None

    return skeleton.persistent_body(
        pipeline=pipeline(cfg, num_w, planes), num_x=planes, num_w=num_w * planes,
        num_k_steps=num_k_steps, split_k=split_k, x_tile_rows=cfg.block_m,
        w_tile_cols=cfg.block_n,
        scratch={"o_smem": plgpu.SMEM((num_out * cfg.num_compute_wgs, wg_m, cfg.block_n),
                                      out_dtype)},
        tile_order=tile_order, tile_body=tile_body, no_drain=no_drain)


def _grouped_call(x_MK, w_GKNs, group_sizes_G, *, epilogue, cfg: TileConfig | None, interpret):
    """Launcher: fit blocks to the shapes, pad if needed, build the schedule, run.

    epilogue(*f32 products) -> [M, N] f32; applied in the kernel, or (split-K)
    by XLA after summing the kernel's f32 partials.
    """
    m, k, n, num_groups, num_w = skeleton.launch_dims(x_MK, w_GKNs)
    out_dtype = x_MK.dtype
    in_dtype = jnp.result_type(x_MK, *w_GKNs)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    launch = plan_launch(m, k, n, num_groups, num_w, in_dtype, out_dtype, cfg)
    cfg, planes = launch.cfg, launch.planes
    k_pad, n_pad, m_pad = launch.k_pad, launch.n_pad, launch.m_pad
    split_k = cfg.split_k
    pad = tiling.pad_axis

    # x gets rows only when it has fewer than one tile or M is not a multiple
    # of 8; K / N are padded only where no allowed block divides them.
    x_planes = tiling.to_planes(pad(pad(x_MK, 0, m_pad), 1, k_pad), in_dtype, planes)
    w_planes = [p for w in w_GKNs
                for p in tiling.to_planes(pad(pad(w, 1, k_pad), 2, n_pad), in_dtype, planes)]
    meta_4W = schedule(group_sizes_G, m, cfg.block_m)

    kernel_epilogue, kernel_dtype = skeleton.kernel_epilogue(epilogue, split_k, out_dtype)
    if split_k > 1:
        out_type = [jax.ShapeDtypeStruct((split_k * m_pad, n_pad), jnp.float32)] * num_w
    else:
        out_type = jax.ShapeDtypeStruct((m, n_pad), out_dtype)
    body = _make_body(epilogue=kernel_epilogue, num_w=num_w, planes=planes, cfg=cfg, num_rows=m,
                      num_k_steps=launch.num_k_steps, num_n_blocks=launch.num_n_blocks,
                      out_dtype=kernel_dtype, no_drain=launch.no_drain)
    num_ctas = cfg.num_ctas or skeleton.num_sms(interpret)
    bounds = ([pipeline_bounds_2C(meta_4W, launch.num_n_blocks, split_k, cfg.grid_block_n,
                                  num_ctas)] if launch.no_drain else [])
    kernel = skeleton.launch(
        body, out_type=out_type, grid=(num_ctas,), interpret=interpret,
        num_compute_wgs=cfg.num_compute_wgs, approx_math=launch.approx_math,
        # Named per op and row tile, so ptxas reports tell kernels apart.
        kernel_name=f"{'grouped_situ_glu' if num_w == 2 else 'grouped_matmul'}_m{cfg.block_m}")
    if split_k > 1:  # sum the K ranges' f32 partials, then the epilogue (fused by XLA)
        partials = kernel(meta_4W, *bounds, *x_planes, *w_planes)
        y_MN = epilogue(*[p.reshape(split_k, m_pad, n_pad)[:, :m].sum(axis=0) for p in partials])
        valid_M1 = (jnp.arange(m) < jnp.sum(group_sizes_G))[:, None]
        y_MN = jnp.where(valid_M1, y_MN, 0).astype(out_dtype)
    else:
        y_MN = kernel(meta_4W, *bounds, *x_planes, *w_planes)
    return y_MN if n_pad == n else y_MN[:, :n]


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, config: TileConfig | None = None,
                   interpret: bool | plgpu.InterpretGPUParams = False):
    """y_MN = x_MK @ w_GKN[group(row)] (f32 accumulate, x dtype); tail rows are 0.

    config=None picks the tiles from M / G (default_config).
    """
    return _grouped_call(x_MK, [w_GKN], group_sizes_G, epilogue=lambda acc: acc,
                         cfg=config, interpret=interpret)


def grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, *, beta: float,
                     linear_beta: float | None, config: TileConfig | None = None,
                     interpret: bool | plgpu.InterpretGPUParams = False):
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) fused in one kernel; tail rows are 0.

    config=None picks the tiles from M / G (default_config).
    """
    epilogue = functools.partial(situ_glu_f32, beta=beta, linear_beta=linear_beta)
    return _grouped_call(x_MK, [w_gate_GKN, w_up_GKN], group_sizes_G, epilogue=epilogue,
                         cfg=config, interpret=interpret)
