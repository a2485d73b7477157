"""Hopper (sm_90) grouped matmul with the weights on WGMMA's M side (swap-AB).

Same products as mosaic_sm90.py (``grouped_matmul``: y = x @ w[g];
``grouped_situ_glu``: h = situ_glu(x @ w_gate[g], x @ w_up[g])), computed
transposed: per tile, out^T [block_w, block_t] = w^T [block_w, K] @ x^T [K, block_t].
The weight columns are WGMMA's M (each consumer warpgroup owns wg_block_w of
them, a multiple of 64, read from SMEM transposed) and the tokens are its N
(block_t: 8..256 in steps of 8). With few rows per group a 64-row x tile is
mostly padding; here an x tile is block_t rows, so the x bytes a tile loads
are block_t / (num_w x block_w) of its weight bytes.

Schedule: schedule.work_items_4W with block_m = block_t. The persistent loop
(mosaic_skeleton.persistent_body) walks (item, N-superblock, K range) tiles
item-major, so the tiles that run form a prefix of the loop and tile i runs
on cluster i mod num_clusters. Split-K (split_k = S > 1) cuts K into S
ranges: f32 partials, summed by XLA, the SiTU applied after the sum.

Clusters (cluster = C in 2, 4, 8): C CTAs run one (item, N-superblock, K
range) tile at a time, CTA c taking N-block superblock * C + c; each CTA's
TMA loads 1/C of the x tile and multicasts it to all C (BlockSpec
collective_axes), so the output has whole superblocks (n_pad rows). The
weights are not padded: N-blocks of the last superblock past N read TMA's
out-of-bounds zero fill and store rows past N that XLA never reads. The x
tile must split over C (multicast_splits). C = 1 launches no cluster.

Output: each tile writes its whole transposed tile to its own columns of
out^T [S * n_pad, W * block_t] (item w owns columns [w * block_t, (w + 1) *
block_t), K range s rows [s * n_pad, (s + 1) * n_pad)). XLA then gathers y
[M, N] (schedule.row_columns) and sets rows past sum(sizes) to 0. A column
of out^T depends only on its own x row, so rows of a neighbour's group or of
the (possibly NaN) tail never reach a valid output row.

Dtypes: bf16/f16 natively; float32 as the split-bf16 product (tiling.PRODUCTS:
w_hi x_lo + w_lo x_hi + w_hi x_hi).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_skeleton as skeleton
from pallas_kernels.grouped_matmul import tiling
from pallas_kernels.grouped_matmul.schedule import (
    X_ROW_ALIGN,
    chain_stages,
    num_work_items,
    row_columns,
    schedule,
    swap_ab_bounds_2C,
    x_rows,
)
from pallas_kernels.situ import situ_glu_f32

WG_ROWS = 64  # WGMMA M of one instruction: weight columns are taken in multiples of it
MAX_BLOCK_T = 256  # WGMMA N limit
# Largest expected rows per group (schedule.expected_rows) the swap-AB kernel
# takes (one token tile); larger groups go to mosaic_sm90's row-major tiles.
MAX_SWAP_AB_ROWS = MAX_BLOCK_T
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
class SwapABConfig:
    """Tiling of one swap-AB launch (one CTA per SM, persistent).

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
        if self.block_t % X_ROW_ALIGN or not 0 < self.block_t <= MAX_BLOCK_T:
            raise ValueError(f"block_t must be a multiple of {X_ROW_ALIGN} in "
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


@dataclasses.dataclass(frozen=True)
class SwapABPlan:
    """The static shape of one swap-AB launch (fitted tiles, padded sizes)."""

    cfg: SwapABConfig
    planes: int
    x_rows: int  # rows of the padded x (>= block_t, a multiple of 8)
    k_pad: int
    n_pad: int  # output rows: whole superblocks of cluster x block_w columns
    w_cols: int  # weight columns the kernel reads (n rounded up to W_N_ALIGN; not n_pad)
    num_items: int  # W: columns of the work-item table (the static bound)
    no_drain: bool  # a CTA's tiles chain their pipelines (schedule.chain_stages; never
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
    tile_k = tiling.swizzle_transforms(block_k, 2)[0].tiling[1]
    remaining = cluster
    for size in (block_t // 8, block_k // tile_k, 8):
        if size % remaining == 0:
            return True
        if remaining % size:
            return False
        remaining //= size
    return remaining == 1


def fit_smem(cfg: SwapABConfig, num_weights: int, in_bytes: int, out_bytes: int) -> SwapABConfig:
    """Drop pipeline stages (to >= 2) until the kernel fits the SMEM limit."""
    return tiling.fit_stages(cfg, lambda c: c.smem_bytes(num_weights, in_bytes, out_bytes))


def plan_launch(m: int, k: int, n: int, num_groups: int, num_weights: int, in_dtype,
                out_dtype, cfg: SwapABConfig) -> SwapABPlan:
    """Fit the tiles of a [m, k] x num_weights x [G, k, n] swap-AB launch
    (what the launcher runs; k3jax/tools/kernel_cost.py replays it). With
    cfg.split_k > 1 the kernel writes f32 partials, and every K range needs
    at least max_concurrent_steps K steps; with cfg.cluster = C > 1 the
    output has whole superblocks of C N-blocks (n_pad; the weights keep N
    columns, read past N as zero fill) and the x tile must split over the
    C CTAs (multicast_splits) (ValueError otherwise). A stage count in [3,
    fitted] that divides every K range's steps chains each CTA's tiles
    without draining (no_drain), unless the accumulators take over
    MAX_ACC_REGISTERS registers a thread (chained, their consumers spill)."""
    planes = tiling.num_planes(in_dtype)
    block_k = tiling.block_for(k, cfg.block_k, tiling.MIN_BLOCK)
    cfg = dataclasses.replace(cfg, block_k=block_k)
    out_bytes = 4 if cfg.split_k > 1 else jnp.dtype(out_dtype).itemsize
    cfg = fit_smem(cfg, num_weights, 2 * planes, out_bytes)
    k_pad = tiling.round_up(k, block_k)
    stages = (chain_stages(k_pad // block_k, cfg.split_k, cfg.max_concurrent_steps)
              if cfg.acc_registers(num_weights) <= MAX_ACC_REGISTERS else 0)
    if stages:
        cfg = dataclasses.replace(cfg, max_concurrent_steps=stages)
    plan = SwapABPlan(cfg=cfg, planes=planes, x_rows=x_rows(m, cfg.block_t), k_pad=k_pad,
                      n_pad=tiling.round_up(n, cfg.cluster * cfg.block_w),
                      w_cols=tiling.round_up(n, W_N_ALIGN),
                      num_items=num_work_items(m, num_groups, cfg.block_t),
                      no_drain=bool(stages),
                      approx_math=cfg.split_k == 1 and jnp.dtype(out_dtype).itemsize == 2)
    smem = cfg.smem_bytes(num_weights, 2 * planes, out_bytes)
    if smem > tiling.SMEM_BUDGET:
        raise ValueError(f"swap-AB tiles {cfg} need {smem} bytes of shared memory at 2 stages, "
                         f"over the {tiling.SMEM_LIMIT}-byte limit")
    if not multicast_splits(cfg.block_t, block_k, cfg.cluster):
        raise ValueError(f"the x tile [{cfg.block_t}, {block_k}] does not split over a "
                         f"cluster of {cfg.cluster} CTAs (Mosaic's multicast TMA)")
    if cfg.split_k > 1 and plan.num_k_steps // cfg.split_k < cfg.max_concurrent_steps:
        raise ValueError(
            f"split_k={cfg.split_k} leaves K ranges of {plan.num_k_steps // cfg.split_k} "
            f"K steps, fewer than the {cfg.max_concurrent_steps} pipeline stages")
    return plan


def memory_registers(cfg: SwapABConfig, num_weights: int) -> int:
    """Registers per thread of the TMA producer warpgroup. In a cluster with
    two or more consumers (the producer issues the multicast x loads and waits
    on cluster barriers): 104, or WIDE_ACC_MEMORY_REGISTERS (setmaxnreg's
    floor) where the accumulators take over MAX_ACC_REGISTERS registers a
    thread; otherwise mosaic_skeleton.memory_registers. These are the counts
    ptxas compiles without spills for sm_90a."""
    if cfg.cluster > 1 and cfg.num_compute_wgs > 1:
        return (WIDE_ACC_MEMORY_REGISTERS if cfg.acc_registers(num_weights) > MAX_ACC_REGISTERS
                else 104)
    return skeleton.memory_registers(cfg.num_compute_wgs)


def pipeline(cfg: SwapABConfig, num_w: int, planes: int) -> skeleton.Pipeline:
    """``planes`` x tiles [block_t, block_k] (multicast over the cluster) and
    num_w x ``planes`` weight tiles [block_k, block_w] per K step."""
    def in_specs(first_k_step):
        x_spec = plgpu.BlockSpec((cfg.block_t, cfg.block_k), lambda k: (0, k + first_k_step),
                                 transforms=tiling.swizzle_transforms(cfg.block_k, 2),
                                 collective_axes=("cluster",) if cfg.cluster > 1 else ())
        w_spec = plgpu.BlockSpec((cfg.block_k, cfg.block_w), lambda k: (k + first_k_step, 0),
                                 transforms=tiling.swizzle_transforms(cfg.block_w, 2))
        return [x_spec] * planes + [w_spec] * (num_w * planes)
    return skeleton.Pipeline(in_specs, cfg.num_compute_wgs, cfg.max_concurrent_steps,
                             memory_registers(cfg, num_w))


def _make_body(*, epilogue: Callable, num_w: int, planes: int, cfg: SwapABConfig,
               num_k_steps: int, n_pad: int, out_dtype, no_drain: bool):
    """Kernel body(meta_4W, [bounds_2C,] *x_planes_MK, *w_planes_GKN, *o_Ts): each o_T is
    [S * n_pad, W * block_t]; item w's transposed tiles fill its columns
    [w * block_t, (w + 1) * block_t), K range s its rows [s * n_pad, (s + 1) * n_pad).

    epilogue(*acc_tiles) -> tuple of output tiles (the SiTU, or with split-K
    S > 1 the f32 products themselves: the caller sums and applies it).
    All CTAs of a cluster walk the same tiles and take the same chain states
    (the multicast x tile and the cluster barriers need every one of them).
    """
    wg_w = cfg.wg_block_w
    split_k = cfg.split_k
    num_out = cfg.num_outputs(num_w)
    num_supers = n_pad // (cfg.cluster * cfg.block_w)
    products = tiling.PRODUCTS[planes]

    def tile_order(num_items):
        # The CTA's place in its cluster: its N-block of each superblock.
        cta = lax.axis_index("cluster") if cfg.cluster > 1 else 0

        def coords(index):
            # Item-major: the used items come first in the table, so the tiles
            # that run are a prefix of the loop and spread evenly over the CTAs.
            lin, split = jnp.divmod(index, split_k)
            item, n_super = jnp.divmod(lin, num_supers)
            return split, item, n_super * cfg.cluster + cta
        return split_k * num_items * num_supers, coords

    def tile_body(t: skeleton.Tile):
        wg, o_smem = t.wg, t.scratch["o_smem"]
        w_cols = pl.ds(wg * wg_w, wg_w)

        def mma(_, *rest):
            x_planes, w_planes, accs = skeleton.step_operands(rest, planes, planes)
            xt_smems = [x.transpose((1, 0)) for x in x_planes]  # [K, T]
            for acc, w_smems in zip(accs, w_planes):
                for xp, wp in products:
                    plgpu.wgmma(acc, w_smems[wp].at[:, w_cols].transpose((1, 0)),
                                xt_smems[xp])
            # The slot is released when this step returns (delay_release=0).
            plgpu.wgmma_wait(0)
            return accs

        def finish(accs):
            tiles = epilogue(*[acc[...] for acc in accs])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous tile's store
            for o, tile in enumerate(tiles):
                o_smem[o * cfg.num_compute_wgs + wg] = tile.astype(out_dtype)
            plgpu.commit_smem()
            for o, o_gmem in enumerate(t.o_gmems):
                plgpu.copy_smem_to_gmem(
                    o_smem.at[o * cfg.num_compute_wgs + wg],
                    o_gmem.at[pl.ds(t.split * n_pad + t.n_block * cfg.block_w
                                    + wg * wg_w, wg_w),
                              pl.ds(t.item * cfg.block_t, cfg.block_t)])

        compute_context = skeleton.scoped_accumulators((wg_w, cfg.block_t), num_w, finish)
        return mma, compute_context, None

    return skeleton.persistent_body(
        pipeline=pipeline(cfg, num_w, planes), num_x=planes, num_w=num_w * planes,
        num_k_steps=num_k_steps, split_k=split_k, x_tile_rows=cfg.block_t,
        w_tile_cols=cfg.block_w,
        scratch={"o_smem": plgpu.SMEM((num_out * cfg.num_compute_wgs, wg_w, cfg.block_t),
                                      out_dtype)},
        tile_order=tile_order, tile_body=tile_body, no_drain=no_drain, read_offset=False)


def chain_bounds_2C(meta_4W, plan: SwapABPlan, num_clusters: int) -> jax.Array:
    """int32 [2, num_clusters]: each cluster's first and last tile that runs a
    matmul, -1 when none (schedule.swap_ab_bounds_2C)."""
    return swap_ab_bounds_2C(meta_4W, split_k=plan.cfg.split_k,
                             num_supers=plan.num_n_blocks // plan.cfg.cluster,
                             num_clusters=num_clusters)


def _grouped_call(x_MK, w_GKNs, group_sizes_G, *, epilogue, cfg: SwapABConfig, interpret):
    """Launcher: fit, pad, schedule, run the transposed kernel, assemble y
    (split-K: sum the f32 partials of each row's column, then the epilogue)."""
    m, k, n, num_groups, num_w = skeleton.launch_dims(x_MK, w_GKNs)
    out_dtype = x_MK.dtype
    in_dtype = jnp.result_type(x_MK, *w_GKNs)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    plan = plan_launch(m, k, n, num_groups, num_w, in_dtype, out_dtype, cfg)
    cfg, planes = plan.cfg, plan.planes
    split_k = cfg.split_k
    pad = tiling.pad_axis
    x_planes = tiling.to_planes(pad(pad(x_MK, 0, plan.x_rows), 1, plan.k_pad), in_dtype, planes)
    # N is not padded to n_pad: N-blocks past n read TMA's zero fill (only a
    # row pitch TMA cannot take, n not a multiple of W_N_ALIGN, is padded).
    w_planes = [p for w in w_GKNs
                for p in tiling.to_planes(pad(pad(w, 1, plan.k_pad), 2, plan.w_cols),
                                          in_dtype, planes)]
    meta_4W = schedule(group_sizes_G, m, cfg.block_t)
    kernel_epilogue, kernel_dtype = skeleton.kernel_epilogue(epilogue, split_k, out_dtype)
    body = _make_body(epilogue=kernel_epilogue, num_w=num_w, planes=planes, cfg=cfg,
                      num_k_steps=plan.num_k_steps, n_pad=plan.n_pad, out_dtype=kernel_dtype,
                      no_drain=plan.no_drain)
    o_type = jax.ShapeDtypeStruct((split_k * plan.n_pad, meta_4W.shape[1] * cfg.block_t),
                                  kernel_dtype)
    num_ctas = cfg.num_ctas or skeleton.num_sms(interpret)
    num_clusters = max(num_ctas // cfg.cluster, 1)  # interpret mode has 4 "SMs"
    bounds = [chain_bounds_2C(meta_4W, plan, num_clusters)] if plan.no_drain else []
    kernel = skeleton.launch(
        body, out_type=[o_type] * cfg.num_outputs(num_w), grid=(num_clusters,),
        interpret=interpret, num_compute_wgs=cfg.num_compute_wgs, cluster=cfg.cluster,
        approx_math=plan.approx_math,
        kernel_name=(f"{'grouped_situ_glu' if num_w == 2 else 'grouped_matmul'}"
                     f"_swap_ab_t{cfg.block_t}"
                     + (f"_c{cfg.cluster}" if cfg.cluster > 1 else "")))
    o_Ts = kernel(meta_4W, *bounds, *x_planes, *w_planes)
    col_M, valid_M = row_columns(meta_4W, m, cfg.block_t)
    # [S, n_pad, C] -> the rows' columns [S, n, M], summed over the K ranges.
    rows_NM = [jnp.take(o.reshape(split_k, plan.n_pad, -1)[:, :n], col_M, axis=2,
                        mode="clip").astype(jnp.float32).sum(axis=0) for o in o_Ts]
    y_NM = epilogue(*rows_NM) if split_k > 1 else rows_NM[0]
    return jnp.where(valid_M[:, None], y_NM.T, 0).astype(out_dtype)


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, config: SwapABConfig,
                   interpret: bool | plgpu.InterpretGPUParams = False):
    """y_MN = x_MK @ w_GKN[group(row)] with the swap-AB tiles; tail rows are 0."""
    return _grouped_call(x_MK, [w_GKN], group_sizes_G, epilogue=lambda acc: acc,
                         cfg=config, interpret=interpret)


def grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, *, beta: float,
                     linear_beta: float | None, config: SwapABConfig,
                     interpret: bool | plgpu.InterpretGPUParams = False):
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) with the swap-AB tiles (the
    SiTU runs on the two transposed accumulators); tail rows are 0."""
    epilogue = functools.partial(situ_glu_f32, beta=beta, linear_beta=linear_beta)
    return _grouped_call(x_MK, [w_gate_GKN, w_up_GKN], group_sizes_G, epilogue=epilogue,
                         cfg=config, interpret=interpret)
