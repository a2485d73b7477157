"""Hopper (sm_90) grouped matmul for decode: the weights on WGMMA's M side.

Same products as mosaic_sm90.py (``grouped_matmul``: y = x @ w[g];
``grouped_situ_glu``: h = situ_glu(x @ w_gate[g], x @ w_up[g])), computed
transposed: per tile, out^T [block_w, block_t] = w^T [block_w, K] @ x^T [K, block_t].
The weight columns are WGMMA's M (each consumer warpgroup owns wg_block_w of
them, a multiple of 64, read from SMEM transposed) and the tokens are its N
(block_t: 8..256 in steps of 8). At decode a group has a few rows, so a
64-row x tile (the M of the row-major kernel) is mostly padding: here an
x tile is block_t rows, and the x bytes a tile loads are block_t / (num_w x
block_w) of its weight bytes instead of 64 / (num_w x block_n).

Scheduling: mosaic_sm90.work_items_4W with block_m = block_t (group-aligned
items: a group of <= block_t rows (plus its start's alignment slack) is one
item and streams its weights once per N-block). The persistent loop walks
(item, N-block, K range) tiles item-major, so the tiles that run form a
prefix of the loop and tile i runs on CTA i mod num_sms (with clusters:
cluster i mod num_sms // C); items of the tail segment (rows past
sum(sizes)) and unused items cost nothing. Split-K
(split_k = S > 1) cuts K into S ranges when the tiles are too few for the
SMs: f32 partials, summed by XLA, the SiTU applied after the sum.

Clusters (cluster = C in 2, 4, 8): C CTAs form a cluster that runs one
(item, N-superblock, K range) tile at a time, CTA c taking N-block
superblock * C + c; each CTA's TMA loads 1/C of the x tile and multicasts
it to all C (BlockSpec collective_axes, the pipeline's "consumed" barrier
becomes a ClusterBarrier), so the x bytes a tile loads are block_t /
(num_w x block_w x C) of its weight bytes. The grid is num_ctas // C
clusters; every CTA of a cluster walks the same tiles (the multicast and
the cluster barriers need all C in each pipeline), so the output has whole
superblocks (n_pad rows). The weights are not padded: where C x block_w
does not divide N, the N-blocks of the last superblock that lie partly or
wholly past N read TMA's out-of-bounds zero fill (GPU interpret mode fills
the same zeros), run their K loop on it and store rows past N that XLA
never reads. Mosaic must be able to split the x tile over C
(multicast_splits: block_t / 8 a multiple of C, or 8 / 16 tokens cut
inside the 8-row tiles; an odd block_t / 8 never splits). C = 1 launches
no cluster.

Output: each tile writes its whole transposed tile to its own columns of
out^T [N_pad, W * block_t] (item w owns columns [w * block_t, (w + 1) * block_t)),
so items sharing x rows never overwrite each other. XLA then gathers y [M, N]:
row r takes column w(r) * block_t + r - x_row0[w(r)] of the item holding it,
and rows past sum(sizes) are set to 0. A column of out^T depends only on its
own x row, so x rows of a neighbour's group or of the (possibly NaN) tail
never reach a valid output row. The extra write and read of out^T are small
at decode (y is tiny next to the weights).

Dtypes: bf16/f16 natively; float32 as mosaic_sm90's split-bf16 (bf16x3)
product: both planes of x and of each weight stream through SMEM, three
WGMMAs per K step (w_hi x_lo + w_lo x_hi + w_hi x_hi).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_sm90
from pallas_kernels.situ import situ_glu_f32

WG_ROWS = 64  # WGMMA M of one instruction: weight columns are taken in multiples of it
MAX_BLOCK_T = 256  # WGMMA N limit
# Largest expected rows per group (mean + ROUTING_SIGMAS sigma) the decode
# kernel takes (one token tile); larger groups go to mosaic_sm90's row-major
# tiles. Below it the cost model decides (accumulators <= 128 registers a
# thread cap block_t at 128 / 256 for 128-wide / 64-wide weight columns).
MAX_DECODE_ROWS = MAX_BLOCK_T
CLUSTER_SIZES = (1, 2, 4, 8)  # CTAs a cluster (portable Hopper cluster sizes)
# Accumulator registers a consumer thread may hold: 128 in general, up to 192
# in a cluster of two consumers whose producer keeps WIDE_ACC_MEMORY_REGISTERS
# (the consumers get (512 - 24) / 2 -> 240; memory_registers).
MAX_ACC_REGISTERS = 128
MAX_CLUSTER_ACC_REGISTERS = 192
WIDE_ACC_MEMORY_REGISTERS = 24
# TMA needs a 16-byte row pitch: the weights' N (2-byte planes) is padded to
# a multiple of 8 only where it is not one already (never for the K3 shapes).
W_N_ALIGN = 8


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Tiling of one decode launch (one CTA per SM, persistent).

    ``num_compute_wgs`` consumer warpgroups plus one TMA producer; consumer
    c owns weight columns [c * wg_block_w, (c + 1) * wg_block_w) of the
    CTA's block_w-wide weight tile and all block_t tokens, one f32
    accumulator [wg_block_w, block_t] per weight (wg_block_w * block_t / 128
    registers a thread each). ``cluster`` C > 1: clusters of C CTAs share
    each x tile (multicast), CTA c of a cluster takes the c-th N-block of
    each superblock of C; num_ctas counts CTAs (num_ctas // C clusters).
    """

    num_compute_wgs: int = 2
    wg_block_w: int = 64
    block_t: int = 16
    block_k: int = 64
    max_concurrent_steps: int = 6
    split_k: int = 1
    num_ctas: int | None = None  # persistent CTAs; None: the device's SM count
    cluster: int = 1  # C: CTAs of a cluster share each x tile (TMA multicast)

    def __post_init__(self):
        if self.wg_block_w % WG_ROWS or self.wg_block_w <= 0:
            raise ValueError(f"wg_block_w must be a positive multiple of {WG_ROWS}, "
                             f"got {self.wg_block_w}")
        if self.block_t % mosaic_sm90.X_ROW_ALIGN or not 0 < self.block_t <= MAX_BLOCK_T:
            raise ValueError(f"block_t must be a multiple of {mosaic_sm90.X_ROW_ALIGN} in "
                             f"[8, {MAX_BLOCK_T}], got {self.block_t}")
        if self.cluster not in CLUSTER_SIZES:
            raise ValueError(f"cluster must be one of {CLUSTER_SIZES}, got {self.cluster}")
        if self.num_ctas is not None and self.num_ctas < self.cluster:
            raise ValueError(f"num_ctas={self.num_ctas} holds no cluster of {self.cluster}")

    @property
    def block_w(self) -> int:
        """Weight columns (output N) per tile."""
        return self.num_compute_wgs * self.wg_block_w

    def acc_registers(self, num_weights: int) -> int:
        """f32 accumulator registers per consumer thread."""
        return num_weights * self.wg_block_w * self.block_t // 128

    def num_outputs(self, num_weights: int) -> int:
        """Output tiles per tile: the epilogue's, or (split-K) one f32 partial per weight."""
        return num_weights if self.split_k > 1 else 1

    def smem_bytes(self, num_weights: int, in_bytes: int, out_bytes: int) -> int:
        """Pipeline stages (x tile + weight tiles) + the output tiles
        (out_bytes: 4 with split-K)."""
        stage = (self.block_t + num_weights * self.block_w) * self.block_k * in_bytes
        return (self.max_concurrent_steps * stage
                + self.num_outputs(num_weights) * self.block_w * self.block_t * out_bytes)


def expected_rows(num_rows: int, num_groups: int) -> float:
    """Rows a group's item must hold: mean + ROUTING_SIGMAS sigma of the
    multinomial routing (the whole of it for one group)."""
    mean = num_rows / num_groups
    return mean + (mosaic_sm90.ROUTING_SIGMAS * math.sqrt(mean) if num_groups > 1 else 0.0)


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """The static shape of one decode launch (fitted tiles, padded sizes)."""

    cfg: DecodeConfig
    planes: int
    x_rows: int  # rows of the padded x (>= block_t, a multiple of 8)
    k_pad: int
    n_pad: int  # output rows: whole superblocks of cluster x block_w columns
    w_cols: int  # weight columns the kernel reads (n rounded up to W_N_ALIGN; not n_pad)
    num_items: int  # W: columns of the work-item table (the static bound)
    no_drain: bool  # a CTA's tiles chain their pipelines (mosaic_sm90.chain_stages; never
    # with over MAX_ACC_REGISTERS accumulator registers a thread)
    approx_math: bool  # bf16 / f16 output (no split-K): approximate tanh / exp

    @property
    def num_k_steps(self) -> int:
        return self.k_pad // self.cfg.block_k

    @property
    def num_n_blocks(self) -> int:
        return self.n_pad // self.cfg.block_w

    @property
    def num_cluster_tiles(self) -> int:
        """(item, N-superblock of cluster x block_w columns, K range) tiles."""
        return self.cfg.split_k * self.num_items * self.num_n_blocks // self.cfg.cluster


def multicast_splits(block_t: int, block_k: int, cluster: int) -> bool:
    """Whether Mosaic can split the x tile [block_t, block_k] over a cluster
    of ``cluster`` CTAs (each CTA's TMA loads one part and multicasts it):
    Mosaic cuts the leading dims of the tiled tile [block_t / 8, block_k /
    swizzle_k, 8] (the swizzled minor dim is never cut) in order, each dim
    taking the whole remaining count or a divisor of it equal to its size."""
    tile_k = _swizzle_transforms(block_k, 2)[0].tiling[1]
    remaining = cluster
    for size in (block_t // 8, block_k // tile_k, 8):
        if size % remaining == 0:
            return True
        if remaining % size:
            return False
        remaining //= size
    return remaining == 1


def fit_smem(cfg: DecodeConfig, num_weights: int, in_bytes: int, out_bytes: int) -> DecodeConfig:
    """Drop pipeline stages (to >= 2) until the kernel fits the SMEM limit."""
    limit = mosaic_sm90.SMEM_LIMIT - mosaic_sm90._SMEM_RESERVE
    while cfg.max_concurrent_steps > 2 and cfg.smem_bytes(num_weights, in_bytes, out_bytes) > limit:
        cfg = dataclasses.replace(cfg, max_concurrent_steps=cfg.max_concurrent_steps - 1)
    return cfg


def plan_launch(m: int, k: int, n: int, num_groups: int, num_weights: int, in_dtype,
                out_dtype, cfg: DecodeConfig) -> DecodePlan:
    """Fit the tiles of a [m, k] x num_weights x [G, k, n] decode launch
    (what the launcher runs; analysis.kernel_cost.swap_ab_cost replays it). With
    cfg.split_k > 1 the kernel writes f32 partials, and every K range needs
    at least max_concurrent_steps K steps, and with cfg.cluster = C > 1 the
    output has whole superblocks of C N-blocks (n_pad; the weights keep N
    columns, read past N as zero fill) and the x tile must split over
    the C CTAs (multicast_splits) (ValueError otherwise). As in
    mosaic_sm90.plan_launch, a stage count in [3, fitted] that divides every
    K range's steps chains each CTA's tiles without draining (no_drain)."""
    planes = mosaic_sm90.num_planes(in_dtype)
    block_k = (mosaic_sm90._fit_block(k, cfg.block_k, mosaic_sm90._MIN_BLOCK)
               or mosaic_sm90._padded_block(k, cfg.block_k, mosaic_sm90._MIN_BLOCK))
    cfg = dataclasses.replace(cfg, block_k=block_k)
    out_bytes = 4 if cfg.split_k > 1 else jnp.dtype(out_dtype).itemsize
    cfg = fit_smem(cfg, num_weights, 2 * planes, out_bytes)
    k_pad = mosaic_sm90._round_up(k, block_k)
    # Tiles over MAX_ACC_REGISTERS accumulator registers drain: chained, their
    # consumers spill (memory_registers).
    stages = (mosaic_sm90.chain_stages(k_pad // block_k, cfg.split_k, cfg.max_concurrent_steps)
              if cfg.acc_registers(num_weights) <= MAX_ACC_REGISTERS else 0)
    if stages:
        cfg = dataclasses.replace(cfg, max_concurrent_steps=stages)
    plan = DecodePlan(cfg=cfg, planes=planes, x_rows=mosaic_sm90.x_rows(m, cfg.block_t),
                      k_pad=k_pad,
                      n_pad=mosaic_sm90._round_up(n, cfg.cluster * cfg.block_w),
                      w_cols=mosaic_sm90._round_up(n, W_N_ALIGN),
                      num_items=mosaic_sm90.num_work_items(m, num_groups, cfg.block_t),
                      no_drain=bool(stages),
                      approx_math=cfg.split_k == 1 and jnp.dtype(out_dtype).itemsize == 2)
    smem = cfg.smem_bytes(num_weights, 2 * planes, out_bytes)
    if smem > mosaic_sm90.SMEM_LIMIT - mosaic_sm90._SMEM_RESERVE:
        raise ValueError(f"decode tiles {cfg} need {smem} bytes of shared memory at 2 stages, "
                         f"over the {mosaic_sm90.SMEM_LIMIT}-byte limit")
    if not multicast_splits(cfg.block_t, block_k, cfg.cluster):
        raise ValueError(f"the x tile [{cfg.block_t}, {block_k}] does not split over a "
                         f"cluster of {cfg.cluster} CTAs (Mosaic's multicast TMA)")
    if cfg.split_k > 1 and plan.num_k_steps // cfg.split_k < cfg.max_concurrent_steps:
        raise ValueError(
            f"split_k={cfg.split_k} leaves K ranges of {plan.num_k_steps // cfg.split_k} "
            f"K steps, fewer than the {cfg.max_concurrent_steps} pipeline stages")
    return plan


def _swizzle_transforms(minor_elems: int, itemsize: int):
    """SMEM tiling + swizzle for a tile with ``minor_elems`` elements a row."""
    swizzle = plgpu.find_swizzle(minor_elems * itemsize * 8)
    return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def memory_registers(cfg: DecodeConfig, num_weights: int) -> int:
    """Registers per thread of the TMA producer warpgroup: mosaic_sm90's,
    but for a cluster with two or more consumers (its producer issues the
    multicast x loads and waits on cluster barriers) 104, or
    WIDE_ACC_MEMORY_REGISTERS where the accumulators take over 128 registers
    a thread. Measured with ptxas for sm_90a (fused SiTU, 2026-12-01): at 40
    the producer of 2 x 64-column consumers spilled 36-40 bytes at 64-96
    tokens in clusters of 2-8; at 80, 0 with drained tiles, but 8 + 8 bytes
    once the tiles chain (three pipeline variants: START / STEADY / STOP) at
    64 tokens in a cluster of 4; at 104, 0 (the consumers keep 200). With
    2 x 64 columns x 192 tokens (192 accumulator registers, cluster 8,
    drained) the consumers spilled 1196 bytes at 104 and 16 at 40, 0 at 24
    (their 240 registers: 24 is setmaxnreg's floor, 16 fails to compile);
    chained (K = 1024, 16 K steps) 8 + 8 bytes at 24 and 32, so plan_launch
    never chains such tiles; drained, 8 + 8 bytes at 24 with N = 1024 (one
    superblock of 8 x 128 columns), 0 with N = 2048 or 3072, so the cost
    model's candidates take them over two superblocks or more only."""
    if cfg.cluster > 1 and cfg.num_compute_wgs > 1:
        return (WIDE_ACC_MEMORY_REGISTERS if cfg.acc_registers(num_weights) > MAX_ACC_REGISTERS
                else 104)
    return mosaic_sm90._memory_registers(cfg.num_compute_wgs)


def _pipeline(step_fn, compute_context, *, cfg: DecodeConfig, num_w: int, planes: int,
              num_k_steps: int, first_k_step=0,
              pipeline_state: plgpu.PipelinePipeline | None = None):
    """Warp-specialized K pipeline of one tile: ``planes`` x tiles [block_t,
    block_k] and num_w x ``planes`` weight tiles [block_k, block_w] per step,
    K steps [first_k_step, first_k_step + num_k_steps); pipeline_state as in
    mosaic_sm90._pipeline (None: drain the ring after the tile)."""
    x_spec = plgpu.BlockSpec((cfg.block_t, cfg.block_k), lambda k: (0, k + first_k_step),
                             transforms=_swizzle_transforms(cfg.block_k, 2),
                             collective_axes=("cluster",) if cfg.cluster > 1 else ())
    w_spec = plgpu.BlockSpec((cfg.block_k, cfg.block_w), lambda k: (k + first_k_step, 0),
                             transforms=_swizzle_transforms(cfg.block_w, 2))
    return plgpu.emit_pipeline_warp_specialized(
        step_fn, grid=(num_k_steps,),
        memory_registers=memory_registers(cfg, num_w),
        in_specs=[x_spec] * planes + [w_spec] * (num_w * planes),
        wg_axis="wg", num_compute_wgs=cfg.num_compute_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps, compute_context=compute_context,
        pipeline_state=pipeline_state)


def _make_body(*, epilogue: Callable, num_w: int, planes: int, cfg: DecodeConfig,
               num_k_steps: int, n_pad: int, out_dtype, no_drain: bool):
    """Kernel body(meta_4W, [bounds_2C,] *x_planes_MK, *w_planes_GKN, *o_Ts): each o_T is
    [S * n_pad, W * block_t]; item w's transposed tiles fill its columns
    [w * block_t, (w + 1) * block_t), K range s its rows [s * n_pad, (s + 1) * n_pad).

    epilogue(*acc_tiles) -> tuple of output tiles (the SiTU, or with split-K
    S > 1 the f32 products themselves: the caller sums and applies it).
    Every warpgroup walks the same (item, N-block, K range) sequence.
    no_drain: bounds_2C (mosaic_sm90.chain_bounds_2C, per cluster) gives the
    first and last tile that runs a matmul; the tiles chain their pipelines
    START / STEADY / STOP as in mosaic_sm90._make_body (every CTA of a
    cluster takes the same states: they walk the same tiles).
    """
    wg_w = cfg.wg_block_w
    split_k = cfg.split_k
    num_out = cfg.num_outputs(num_w)
    num_supers = n_pad // (cfg.cluster * cfg.block_w)
    pipeline_for = functools.partial(_pipeline, cfg=cfg, num_w=num_w, planes=planes)
    products = mosaic_sm90._PRODUCTS[planes]

    def body(meta_gmem, *refs):
        bounds_gmem, refs = (refs[0], refs[1:]) if no_drain else (None, refs)
        x_gmems, w_gmems = refs[:planes], refs[planes:planes + num_w * planes]
        o_gmems = refs[planes + num_w * planes:]
        num_items = meta_gmem.shape[1]

        def ignore(*_, **__):
            return None
        allocs = pipeline_for(ignore, ignore, num_k_steps=num_k_steps).get_allocations(
            *x_gmems, *[w.at[0] for w in w_gmems])

        @functools.partial(pl.run_scoped, allocs=allocs,
                           o_smem=plgpu.SMEM((num_out * cfg.num_compute_wgs, wg_w, cfg.block_t),
                                             out_dtype),
                           collective_axes="wg")
        def _scope(allocs, o_smem):
            wg = lax.axis_index("wg")  # consumers 0..num_compute_wgs-1, producer last
            # The CTA's place in its cluster: its N-block of each superblock.
            cta = lax.axis_index("cluster") if cfg.cluster > 1 else 0

            @plgpu.nd_loop((split_k * num_items * num_supers,), collective_axes="sm")
            def _tile_loop(info: plgpu.NDLoopInfo):
                # Item-major order: the used items come first in the table, so
                # the tiles that run are a prefix of the loop and spread evenly
                # over the CTAs (a snake would leave the unused items' idle
                # tiles between them). A weight tile is read by one item only.
                # All CTAs of a cluster walk the same (item, superblock, K
                # range) tiles (the multicast x tile and the cluster barriers
                # need every one of them in each pipeline).
                lin, split = jnp.divmod(info.index[0], split_k)
                item, n_super = jnp.divmod(lin, num_supers)
                n_block = n_super * cfg.cluster + cta
                group = meta_gmem[0, item]
                x_row0 = meta_gmem[1, item]
                count = meta_gmem[3, item]
                w_cols = pl.ds(wg * wg_w, wg_w)

                def mma(_, *rest):
                    smems, accs = rest[:-1], rest[-1]
                    xt_smems = [x.transpose((1, 0)) for x in smems[:planes]]  # [K, T]
                    for i, acc in enumerate(accs):
                        w_smems = smems[planes + i * planes:planes + (i + 1) * planes]
                        for xp, wp in products:
                            plgpu.wgmma(acc, w_smems[wp].at[:, w_cols].transpose((1, 0)),
                                        xt_smems[xp])
                    # The slot is released when this step returns (delay_release=0).
                    plgpu.wgmma_wait(0)
                    return accs

                def compute_context(run_pipeline):
                    accs = [plgpu.ACC((wg_w, cfg.block_t), jnp.float32)] * num_w

                    @functools.partial(pl.run_scoped, accs=accs)
                    def _acc_scope(accs):
                        run_pipeline(tuple(accs))
                        tiles = epilogue(*[acc[...] for acc in accs])
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous tile's store
                        for o, tile in enumerate(tiles):
                            o_smem[o * cfg.num_compute_wgs + wg] = tile.astype(out_dtype)
                        plgpu.commit_smem()
                        for o, o_gmem in enumerate(o_gmems):
                            plgpu.copy_smem_to_gmem(
                                o_smem.at[o * cfg.num_compute_wgs + wg],
                                o_gmem.at[pl.ds(split * n_pad + n_block * cfg.block_w
                                                + wg * wg_w, wg_w),
                                          pl.ds(item * cfg.block_t, cfg.block_t)])

                first, steps = mosaic_sm90.k_range(split, num_k_steps, split_k)
                # K ranges have one of <= 2 static lengths: one pipeline each.
                for length in sorted({mosaic_sm90.k_range(s, num_k_steps, split_k)[1]
                                      for s in range(split_k)}):
                    @pl.when((count > 0) & (group >= 0) & (steps == length))
                    def _matmul(length=length):
                        rows = pl.ds(pl.multiple_of(x_row0, mosaic_sm90.X_ROW_ALIGN),
                                     cfg.block_t)
                        cols = pl.ds(n_block * cfg.block_w, cfg.block_w)

                        def run(pipeline_state):
                            pipeline_for(mma, compute_context, num_k_steps=length,
                                         first_k_step=first, pipeline_state=pipeline_state)(
                                *[x.at[rows, :] for x in x_gmems],
                                *[w.at[jnp.maximum(group, 0), :, cols] for w in w_gmems],
                                allocations=allocs)

                        if no_drain:
                            state = mosaic_sm90.chain_state(info.index[0], bounds_gmem,
                                                            lax.axis_index("sm"))
                            lax.switch(state, [functools.partial(run, st) for st in (
                                plgpu.PipelinePipeline.START, plgpu.PipelinePipeline.STEADY,
                                plgpu.PipelinePipeline.STOP)])
                        else:
                            run(None)

            if no_drain:  # a CTA whose only matmul tile ran as START
                first_tile = bounds_gmem[0, lax.axis_index("sm")]

                @pl.when((wg == cfg.num_compute_wgs) & (first_tile >= 0)
                         & (first_tile == bounds_gmem[1, lax.axis_index("sm")]))
                def _quiesce():
                    mosaic_sm90.quiesce_ring(allocs, cfg.max_concurrent_steps)

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def chain_bounds_2C(meta_4W, plan: DecodePlan, num_clusters: int) -> jax.Array:
    """int32 [2, num_clusters]: each cluster's first and last tile (the
    kernel's item-major (item, N-superblock, K range) index) that runs a
    matmul, -1 when none (XLA, from the traced table)."""
    tile_T = jnp.arange(plan.num_cluster_tiles, dtype=jnp.int32)
    item_T = tile_T // (plan.cfg.split_k * (plan.num_n_blocks // plan.cfg.cluster))
    runs_T = (meta_4W[3, item_T] > 0) & (meta_4W[0, item_T] >= 0)
    return mosaic_sm90.chain_bounds_2C(runs_T, num_clusters)


def row_columns(meta_4W, num_rows: int, block_t: int):
    """(column of out^T holding row r, row r is valid) for r in [0, num_rows):
    row r lives in the item w whose rows hold it, at column w * block_t + r -
    x_row0[w]; rows of the tail segment (past sum(sizes)) are not valid."""
    group_W, x_row0_W, offset_W, count_W = meta_4W
    # Used items cover [0, num_rows) in row order; unused ones (count 0) sort last.
    end_W = jnp.where(count_W > 0, x_row0_W + offset_W + count_W, num_rows + 1)
    r_M = jnp.arange(num_rows, dtype=jnp.int32)
    item_M = jnp.searchsorted(end_W, r_M, side="right", method="compare_all").astype(jnp.int32)
    item_M = jnp.minimum(item_M, end_W.shape[0] - 1)
    return item_M * block_t + r_M - x_row0_W[item_M], group_W[item_M] >= 0


def _grouped_call(x_MK, w_GKNs, group_sizes_G, *, epilogue, cfg: DecodeConfig, interpret):
    """Launcher: fit, pad, schedule, run the transposed kernel, assemble y
    (split-K: sum the f32 partials of each row's column, then the epilogue)."""
    m, k = x_MK.shape
    num_groups, _, n = w_GKNs[0].shape
    num_w = len(w_GKNs)
    out_dtype = x_MK.dtype
    in_dtype = jnp.result_type(x_MK, *w_GKNs)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    plan = plan_launch(m, k, n, num_groups, num_w, in_dtype, out_dtype, cfg)
    cfg, planes = plan.cfg, plan.planes
    split_k = cfg.split_k
    pad = mosaic_sm90._pad_axis
    x_planes = mosaic_sm90._to_planes(pad(pad(x_MK, 0, plan.x_rows), 1, plan.k_pad),
                                      in_dtype, planes)
    # N is not padded to n_pad: N-blocks past n read TMA's zero fill (only a
    # row pitch TMA cannot take, n not a multiple of W_N_ALIGN, is padded).
    w_planes = [p for w in w_GKNs
                for p in mosaic_sm90._to_planes(pad(pad(w, 1, plan.k_pad), 2, plan.w_cols),
                                                in_dtype, planes)]
    meta_4W = mosaic_sm90.schedule(group_sizes_G, m, cfg.block_t)
    if split_k > 1:
        kernel_epilogue, kernel_dtype = (lambda *accs: accs), jnp.float32
    else:
        kernel_epilogue, kernel_dtype = (lambda *accs: (epilogue(*accs),)), out_dtype
    body = _make_body(epilogue=kernel_epilogue, num_w=num_w, planes=planes, cfg=cfg,
                      num_k_steps=plan.num_k_steps, n_pad=plan.n_pad, out_dtype=kernel_dtype,
                      no_drain=plan.no_drain)
    o_type = jax.ShapeDtypeStruct((split_k * plan.n_pad, meta_4W.shape[1] * cfg.block_t),
                                  kernel_dtype)
    num_ctas = cfg.num_ctas or mosaic_sm90._num_sms(interpret)
    num_clusters = max(num_ctas // cfg.cluster, 1)  # interpret mode has 4 "SMs"
    bounds = [chain_bounds_2C(meta_4W, plan, num_clusters)] if plan.no_drain else []
    cluster_args = (dict(cluster=(cfg.cluster,), cluster_names=("cluster",))
                    if cfg.cluster > 1 else {})
    kernel = plgpu.kernel(
        body,
        out_type=[o_type] * cfg.num_outputs(num_w),
        grid=(num_clusters,),
        grid_names=("sm",),
        **cluster_args,
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        kernel_name=(f"{'grouped_situ_glu' if num_w == 2 else 'grouped_matmul'}"
                     f"_decode_t{cfg.block_t}"
                     + (f"_c{cfg.cluster}" if cfg.cluster > 1 else "")),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=plan.approx_math),
        interpret=mosaic_sm90._interpret_params(interpret),
    )
    o_Ts = kernel(meta_4W, *bounds, *x_planes, *w_planes)
    col_M, valid_M = row_columns(meta_4W, m, cfg.block_t)
    # [S, n_pad, C] -> the rows' columns [S, n, M], summed over the K ranges.
    rows_NM = [jnp.take(o.reshape(split_k, plan.n_pad, -1)[:, :n], col_M, axis=2,
                        mode="clip").astype(jnp.float32).sum(axis=0) for o in o_Ts]
    y_NM = epilogue(*rows_NM) if split_k > 1 else rows_NM[0]
    return jnp.where(valid_M[:, None], y_NM.T, 0).astype(out_dtype)


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, config: DecodeConfig,
                   interpret: bool | plgpu.InterpretGPUParams = False):
    """y_MN = x_MK @ w_GKN[group(row)] with the transposed decode tiles; tail rows are 0."""
    return _grouped_call(x_MK, [w_GKN], group_sizes_G, epilogue=lambda acc: acc,
                         cfg=config, interpret=interpret)


def grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, *, beta: float,
                     linear_beta: float | None, config: DecodeConfig,
                     interpret: bool | plgpu.InterpretGPUParams = False):
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) with the transposed decode
    tiles (the SiTU runs on the two transposed accumulators); tail rows are 0."""
    epilogue = functools.partial(situ_glu_f32, beta=beta, linear_beta=linear_beta)
    return _grouped_call(x_MK, [w_gate_GKN, w_up_GKN], group_sizes_G, epilogue=epilogue,
                         cfg=config, interpret=interpret)
