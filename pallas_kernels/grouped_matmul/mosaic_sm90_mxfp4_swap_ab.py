"""Hopper (sm_90) grouped matmul with MXFP4 weights dequantized into WGMMA's
register A operand (swap-AB, W4A16).

Same products as mosaic_sm90_mxfp4.py (``grouped_matmul_mxfp4``: y = x @ W[g];
``grouped_situ_glu_mxfp4``: h = situ_glu(x @ W_gate[g], x @ W_up[g])),
computed transposed like mosaic_sm90_swap_ab.py: per tile,
out^T [block_w, block_t] = W^T [block_w, K] @ x^T [K, block_t], the weight
rows on WGMMA's M side and block_t tokens (8..MAX_BLOCK_T, steps of 8) on N.
A group with up to block_t rows is one work item, so each active expert's
codes are read from HBM once per launch at decode; a larger group reads them
once per block_t rows (block_t_for picks this kernel or the row-major one).

Per K step (BLOCK_K = 128 K elements) the producer warpgroup TMA-streams the
x tile [block_t, 128] bf16 (mxfp4_dequant.k_order, swizzled for WGMMA's
B) and, per weight, the packed codes [block_w, 64] uint8 and the scales
[4, block_w] uint8. Consumer warpgroup c owns weight rows [64c, 64c + 64) of
the tile: it dequantizes their codes (the word layout, each thread 16 bytes
a row in one load) with the fast sequence (mxfp4_dequant.fast_chunk) into a
bf16 [64, 128] register fragment, and issues the WGMMA with that fragment as
A (no SMEM tile, no fence) and the x tile read transposed as B. The fragment's
registers stay live until the step's WGMMAs complete (wgmma_wait(0)).
GPU interpret mode runs the fast sequence's jnp emulation and, as its WGMMA
takes A from SMEM only, stores the fragment to a scratch SMEM tile first:
there the products, the K order and the schedule are checked, not the
register-A issue itself (the sm_90a compile checks that it lowers).

Only the fast sequence runs here (scale bytes in mxfp4_fast.FAST_SCALES);
the dispatcher (``grouped_matmul_mxfp4``) sends EXACT weights
(Mxfp4Weights.dequant, static) to mosaic_sm90_mxfp4's exact row-major kernel.

Output: as mosaic_sm90_swap_ab, each tile writes its transposed tile to its
own columns of out^T [n_pad, W * block_t] (item w owns [w * block_t, (w + 1)
* block_t)); XLA gathers y [M, N] (schedule.row_columns) and sets rows past
sum(sizes) to 0. float32 x runs as two bf16 planes against the one exact
bf16 weight fragment (two WGMMAs per K step). Weights in K order
(Mxfp4Weights.k_order_axis): with 1, x is taken as it comes
(row_major_mxfp4.kernel_operands); with 2, that gather takes y's columns
in k_order (decode sizes: y is small).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_skeleton as skeleton
from pallas_kernels.grouped_matmul import mosaic_sm90_mxfp4 as row_major_mxfp4
from pallas_kernels.grouped_matmul import mxfp4_dequant, tiling
from pallas_kernels.grouped_matmul.schedule import (
    X_ROW_ALIGN,
    expected_rows,
    num_work_items,
    row_columns,
    schedule,
    x_rows,
)
from pallas_kernels.mxfp4 import BLOCK_SIZE, Mxfp4Weights, k_order_index
from pallas_kernels.situ import situ_glu_f32

BLOCK_K = row_major_mxfp4.BLOCK_K
WG_ROWS = mxfp4_dequant.ROWS   # weight rows a consumer warpgroup dequantizes and multiplies
# Tokens a tile holds (WGMMA N), by weights a launch: the f32 accumulators
# take num_weights x 64 x block_t / 128 registers a consumer thread beside the
# bf16 A fragment (64) and its codes, under the 168 a thread of three
# warpgroups gets; ptxas spills the fused gate / up tile from block_t 56.
MAX_BLOCK_T = {1: 128, 2: 48}
# The smallest block_t taken: 16 tokens cost the WGMMA no more than 8 (the A
# fragment dominates), and hold the groups routing puts over 8 rows in one item.
MIN_BLOCK_T = 16


@dataclasses.dataclass(frozen=True)
class Mxfp4SwapABConfig:
    """Tiling of one launch: ``num_compute_wgs`` consumer warpgroups (64
    weight rows each, block_w = 64 x num_compute_wgs) plus one TMA producer,
    block_t tokens, ``max_concurrent_steps`` SMEM stages (fitted down to
    SMEM); num_ctas persistent CTAs (None: the device's SM count)."""

    block_t: int
    num_compute_wgs: int = 2
    max_concurrent_steps: int = 8
    num_ctas: int | None = None

    def __post_init__(self):
        if self.block_t % X_ROW_ALIGN or not 0 < self.block_t <= max(MAX_BLOCK_T.values()):
            raise ValueError(f"block_t must be a multiple of {X_ROW_ALIGN} in "
                             f"[{X_ROW_ALIGN}, {max(MAX_BLOCK_T.values())}], got {self.block_t}")
        if self.num_compute_wgs not in (1, 2):
            raise ValueError(f"num_compute_wgs must be 1 or 2, got {self.num_compute_wgs}")

    @property
    def block_w(self) -> int:
        """Weight rows (output N) per tile."""
        return self.num_compute_wgs * WG_ROWS

    def smem_bytes(self, num_weights: int, planes: int, out_bytes: int) -> int:
        """Pipeline stages (x planes + packed codes + scales per weight) and
        the output tiles (one per consumer)."""
        stage = (planes * self.block_t * BLOCK_K * 2
                 + num_weights * (BLOCK_K // 2 + BLOCK_K // BLOCK_SIZE) * self.block_w)
        return (self.max_concurrent_steps * stage
                + self.num_compute_wgs * WG_ROWS * self.block_t * out_bytes)


def block_t_for(m: int, num_groups: int, num_weights: int) -> int | None:
    """The block_t a launch of m rows over num_groups groups takes, or None
    where mosaic_sm90_mxfp4's row-major tiles read each group's weights
    fewer times.

    block_t: a group's expected rows (schedule.expected_rows: mean + 3 sigma)
    rounded up to 8, at least MIN_BLOCK_T and at most MAX_BLOCK_T[num_weights]
    (a larger group spans several work items). A group of r rows reads its
    weights ceil(r / block_t) times here and ceil(r / block_m) times in the
    row-major kernel (block_m 64 rows, each dequantizing its own copy): this
    kernel is taken unless that count, at the mean rows of a group, is
    larger here (the fused tile's 48 tokens against 64 rows)."""
    limit = MAX_BLOCK_T[num_weights]
    row_major_rows = row_major_mxfp4.DEFAULT.block_m
    mean = m / num_groups
    if math.ceil(mean / limit) > math.ceil(mean / row_major_rows):
        return None
    rows = math.ceil(expected_rows(max(m, 1), num_groups))
    return min(tiling.round_up(max(rows, MIN_BLOCK_T), X_ROW_ALIGN), limit)


@dataclasses.dataclass(frozen=True)
class Mxfp4SwapABPlan:
    """The static shape of one launch: fitted tiles, x planes (1 bf16, 2
    float32) and padded sizes (K to BLOCK_K, N to block_w)."""

    cfg: Mxfp4SwapABConfig
    planes: int
    x_rows: int
    k_pad: int
    n_pad: int
    num_items: int

    @property
    def num_k_steps(self) -> int:
        return self.k_pad // BLOCK_K

    @property
    def num_n_blocks(self) -> int:
        return self.n_pad // self.cfg.block_w


def plan_launch(m: int, k: int, n: int, num_groups: int, num_weights: int, x_dtype,
                cfg: Mxfp4SwapABConfig | None = None) -> Mxfp4SwapABPlan:
    """Fit the tiles of an [m, k] x num_weights x MXFP4 [G, k, n] launch:
    cfg (default: block_t_for's) with fewer stages (>= 2) until SMEM fits.
    ValueError for an x dtype other than bf16 / float32, a block_t over
    MAX_BLOCK_T[num_weights], or a shape no stage count fits."""
    x_dtype = jnp.dtype(x_dtype)
    if x_dtype not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"the MXFP4 swap-AB kernel takes bfloat16 or float32 x, got {x_dtype}")
    planes = 2 if x_dtype == jnp.dtype(jnp.float32) else 1
    if cfg is None:
        block_t = block_t_for(m, num_groups, num_weights)
        if block_t is None:
            raise ValueError(f"{m} rows over {num_groups} groups: mosaic_sm90_mxfp4's row-major "
                             f"tiles read the weights fewer times (block_t_for)")
        cfg = Mxfp4SwapABConfig(block_t=block_t)
    if cfg.block_t > MAX_BLOCK_T[num_weights]:
        raise ValueError(f"block_t={cfg.block_t} is over {MAX_BLOCK_T[num_weights]} for "
                         f"{num_weights} weights (accumulator registers)")
    cfg = tiling.fit_stages(cfg, lambda c: c.smem_bytes(num_weights, planes, x_dtype.itemsize))
    smem = cfg.smem_bytes(num_weights, planes, x_dtype.itemsize)
    if smem > tiling.SMEM_BUDGET:
        raise ValueError(f"MXFP4 swap-AB tiles {cfg} need {smem} bytes of shared memory, "
                         f"over the {tiling.SMEM_LIMIT}-byte limit")
    return Mxfp4SwapABPlan(cfg=cfg, planes=planes, x_rows=x_rows(m, cfg.block_t),
                           k_pad=tiling.round_up(k, BLOCK_K),
                           n_pad=tiling.round_up(n, cfg.block_w),
                           num_items=num_work_items(m, num_groups, cfg.block_t))


def pipeline(cfg: Mxfp4SwapABConfig, num_w: int, planes: int) -> skeleton.Pipeline:
    """Per K step: ``planes`` x tiles [block_t, BLOCK_K] (swizzled: WGMMA's B)
    and, per weight, packed [block_w, BLOCK_K / 2] + scale [BLOCK_K / 32,
    block_w] uint8 tiles."""
    def in_specs(_first_k_step):
        x_spec = plgpu.BlockSpec((cfg.block_t, BLOCK_K), lambda k: (0, k),
                                 transforms=tiling.swizzle_transforms(BLOCK_K, 2))
        packed_spec = plgpu.BlockSpec((cfg.block_w, BLOCK_K // 2), lambda k: (0, k))
        scale_spec = plgpu.BlockSpec((BLOCK_K // BLOCK_SIZE, cfg.block_w), lambda k: (k, 0))
        return [x_spec] * planes + [packed_spec, scale_spec] * num_w
    return skeleton.Pipeline(in_specs, cfg.num_compute_wgs, cfg.max_concurrent_steps,
                             skeleton.memory_registers(cfg.num_compute_wgs))


def _make_body(*, epilogue: Callable, num_w: int, planes: int, plan: Mxfp4SwapABPlan,
               out_dtype, interpret: bool):
    """Kernel body(meta_4W, *x_planes_MK, (packed_GNK, scale_GKN) * num_w, o_T):
    o_T is [n_pad, W * block_t]; item w's transposed tiles fill its columns."""
    cfg = plan.cfg
    num_n_blocks = plan.num_n_blocks

    def tile_order(num_items):
        def coords(index):   # item-major: the used items are a prefix of the table
            item, n_block = jnp.divmod(index, num_n_blocks)
            return None, item, n_block
        return num_items * num_n_blocks, coords

    def tile_body(t: skeleton.Tile):
        wg, o_smem = t.wg, t.scratch["o_smem"]
        w_rows = pl.ds(wg * WG_ROWS, WG_ROWS)

        def mma(_, *rest):
            x_planes, w_refs, accs = skeleton.step_operands(rest, planes, 2)
            xt_smems = [x.transpose((1, 0)) for x in x_planes]   # [K, T]
            for acc, (packed_smem, scale_smem) in zip(accs, w_refs):
                w_a = mxfp4_dequant.fast_chunk(packed_smem.at[w_rows, :],
                                               scale_smem.at[:, w_rows], interpret)
                if interpret:   # the interpreter's WGMMA reads A from SMEM only
                    a_smem = t.scratch["a_smem"].at[wg]
                    a_smem[...] = w_a
                    w_a = a_smem
                for xt in xt_smems[::-1]:   # lo plane (if any) first
                    plgpu.wgmma(acc, w_a, xt)
                # The A fragment's registers (and, after the last weight, the
                # pipeline slot, released when this step returns) must outlive
                # its WGMMAs; waiting per weight keeps one fragment live.
                plgpu.wgmma_wait(0)
            return accs

        def finish(accs):
            tile = epilogue(*[acc[...] for acc in accs])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # previous tile's store
            o_smem[wg] = tile.astype(out_dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[wg],
                t.o_gmems[0].at[pl.ds(t.n_block * cfg.block_w + wg * WG_ROWS, WG_ROWS),
                                pl.ds(t.item * cfg.block_t, cfg.block_t)])

        compute_context = skeleton.scoped_accumulators((WG_ROWS, cfg.block_t), num_w, finish)
        return mma, compute_context, None

    return skeleton.persistent_body(
        pipeline=pipeline(cfg, num_w, planes), num_x=planes, num_w=2 * num_w,
        num_k_steps=plan.num_k_steps, split_k=None, x_tile_rows=cfg.block_t,
        w_tile_cols=cfg.block_w,
        scratch={"o_smem": plgpu.SMEM((cfg.num_compute_wgs, WG_ROWS, cfg.block_t), out_dtype),
                 **({"a_smem": plgpu.SMEM((cfg.num_compute_wgs, WG_ROWS, BLOCK_K), jnp.bfloat16)}
                    if interpret else {})},
        tile_order=tile_order, tile_body=tile_body, no_drain=False, read_offset=False,
        w_n_axes=(1, 2) * num_w)


def swap_ab_fast(x_MK, weights: list[Mxfp4Weights], group_sizes_G, *, epilogue,
                 cfg: Mxfp4SwapABConfig | None, interpret) -> jax.Array:
    """One launch of this kernel (fast sequence only: every scale byte must
    be in FAST_SCALES): pad, K-order x, run, gather y [m, n] (rows past
    sum(sizes) are 0; columns in k_order for weights of k_order_axis 2)."""
    m, k, n, num_groups, num_w = skeleton.launch_dims(x_MK, weights)
    out_dtype = x_MK.dtype
    plan = plan_launch(m, k, n, num_groups, num_w, out_dtype, cfg)
    block_t = plan.cfg.block_t
    x_planes, w_refs = row_major_mxfp4.kernel_operands(
        x_MK, weights, rows=plan.x_rows, k_pad=plan.k_pad, n_pad=plan.n_pad, planes=plan.planes)
    meta_4W = schedule(group_sizes_G, m, block_t)
    body = _make_body(epilogue=epilogue, num_w=num_w, planes=plan.planes, plan=plan,
                      out_dtype=out_dtype, interpret=bool(interpret))
    name = "grouped_situ_glu" if num_w == 2 else "grouped_matmul"
    kernel = skeleton.launch(
        body, out_type=jax.ShapeDtypeStruct((plan.n_pad, meta_4W.shape[1] * block_t), out_dtype),
        grid=(plan.cfg.num_ctas or skeleton.num_sms(interpret),), interpret=interpret,
        num_compute_wgs=plan.cfg.num_compute_wgs,
        kernel_name=f"{name}_mxfp4_swap_ab_t{block_t}")
    o_T = kernel(meta_4W, *x_planes, *w_refs)
    col_M, valid_M = row_columns(meta_4W, m, block_t)
    rows_T = o_T[:n]
    if row_major_mxfp4.k_order_axis(weights) == 2:
        rows_T = jnp.take(rows_T, k_order_index(n), axis=0)
    y_MN = jnp.take(rows_T, col_M, axis=1, mode="clip").T
    return jnp.where(valid_M[:, None], y_MN, 0).astype(out_dtype)


def _call(x_MK, weights: list[Mxfp4Weights], group_sizes_G, *, epilogue,
          cfg: Mxfp4SwapABConfig | None, interpret):
    """This kernel for FAST weights, mosaic_sm90_mxfp4's exact row-major
    kernel when any weight is EXACT (static: Mxfp4Weights.dequant)."""
    m, _, n, _, _ = skeleton.launch_dims(x_MK, weights)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), x_MK.dtype)
    if row_major_mxfp4.all_fast(weights):
        return swap_ab_fast(x_MK, weights, group_sizes_G, epilogue=epilogue, cfg=cfg,
                            interpret=interpret)
    return row_major_mxfp4.row_major(x_MK, weights, group_sizes_G, epilogue=epilogue, cfg=None,
                                     interpret=interpret, fast=False)


def grouped_matmul_mxfp4(x_MK, w_GKN: Mxfp4Weights, group_sizes_G, *,
                         config: Mxfp4SwapABConfig | None = None,
                         interpret: bool | plgpu.InterpretGPUParams = False):
    """y_MN = x_MK @ dequant(w_GKN)[group(row)] (f32 accumulate, x dtype); tail rows are 0."""
    return _call(x_MK, [w_GKN], group_sizes_G, epilogue=lambda acc: acc, cfg=config,
                 interpret=interpret)


def grouped_situ_glu_mxfp4(x_MK, w_gate_GKN: Mxfp4Weights, w_up_GKN: Mxfp4Weights,
                           group_sizes_G, *, beta: float, linear_beta: float | None,
                           config: Mxfp4SwapABConfig | None = None,
                           interpret: bool | plgpu.InterpretGPUParams = False):
    """h_MN = situ_glu(x @ dequant(w_gate)[g], x @ dequant(w_up)[g]) fused; tail rows are 0."""
    epilogue = functools.partial(situ_glu_f32, beta=beta, linear_beta=linear_beta)
    return _call(x_MK, [w_gate_GKN, w_up_GKN], group_sizes_G, epilogue=epilogue, cfg=config,
                 interpret=interpret)
