"""Hopper (sm_90) grouped matmul kernels in Pallas Mosaic GPU.

Two products share one kernel body:
  * ``grouped_matmul``:   y_MN = x_MK @ w_GKN[group(row)]
  * ``grouped_situ_glu``: h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]); both products
    accumulate in two WGMMA register accumulators of the same tile and the SiTU
    epilogue runs on those registers, so the 2N-wide intermediate never exists
    in HBM.

Scheduling ("group metadata" scheme). Rows are sorted by group. The row range
[0, M) is cut into segments: one per group plus a tail segment [sum(sizes), M)
that must come out as zeros. A *work item* is one (segment, M-block) pair with
a non-empty intersection; there are at most cdiv(M, block_m) + G of them.
``work_items_4W`` computes them in XLA (O(G + W) scalar work, jittable with a
traced group_sizes) as an int32 [4, W] table: (group or -1 for the tail,
M-block, first row within the block, number of rows).

The kernel is persistent (one CTA per SM) and warp-specialized: every
warpgroup loops over the same (work item, N-block) pairs; a producer
warpgroup streams x and weight tiles into SMEM with TMA
(``max_concurrent_steps`` stages) while 1 (decode tiles) or 2 (prefill tiles,
sharing each weight tile) consumer warpgroups run WGMMA into f32 register
accumulators, one per weight, and apply the epilogue in registers. Empty items
and size-0 groups cost nothing; a tail item skips the matmul and writes zeros.
Each consumer stores only the item's rows of its 64-row slice, with a
logarithmic ladder of fixed-size TMA stores (as in jax's ragged_dot_mgpu.py),
so items sharing an M-block never overwrite each other's rows and rows of x
past sum(sizes) (possibly NaN) never reach a valid output row.

Dtypes: bf16/f16 run natively (one WGMMA per weight per K step). float32
inputs run a split-bf16 product ("bf16x3"): the launcher splits
x = x_hi + x_lo and w = w_hi + w_lo (x_hi = bf16(x), x_lo = bf16(x - x_hi)),
both planes of every operand stream through SMEM, and each K step issues three
WGMMAs into the same f32 accumulator: x_lo @ w_hi + x_hi @ w_lo + x_hi @ w_hi
(x_lo @ w_lo, ~2^-16 relative, is dropped). Measured vs the float32 XLA
reference in interpret mode: 4e-6..8e-6 max-abs relative error, where a plain
bf16 cast gave 2e-3..5e-3 (Hopper's tf32 WGMMA would need a K-major B operand;
our weights are N-major). So fp32 costs 3 MMAs per tile and twice the SMEM per
stage (fewer stages, or a narrower N block where two stages do not fit);
the output keeps the input dtype. It exists for exact tests and debugging:
production weights are bf16 and take the 1-MMA path.
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

from pallas_kernels import interpret_compat
from pallas_kernels.situ import situ_glu_f32

# H100/H200 SXM have 132 SMs; used when the device does not report a count.
_DEFAULT_NUM_SMS = 132
# Interpret mode simulates every "SM" on the CPU: keep it small but > 1 so the
# persistent loop really strides over several work items per CTA.
_INTERPRET_NUM_SMS = 4
_MIN_BLOCK = 16  # bf16 WGMMA: K step of 16; SMEM swizzle needs >= 32 B rows.


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

    @property
    def block_m(self) -> int:
        return self.wg_block_m * self.num_compute_wgs

    def smem_bytes(self, num_weights: int, in_bytes: int, out_bytes: int) -> int:
        """Shared memory the kernel allocates (pipeline stages + epilogue tiles).

        in_bytes: SMEM bytes per input element over all its planes (2 for
        bf16/f16, 4 for float32 = hi + lo bf16 planes); out_bytes: output itemsize.
        """
        stage = (self.block_m * self.block_k
                 + num_weights * self.block_k * self.block_n) * in_bytes
        return self.max_concurrent_steps * stage + self.block_m * self.block_n * out_bytes


SMEM_LIMIT = 227 * 1024  # sm_90 opt-in shared memory per block
_SMEM_RESERVE = 1024  # barriers and alignment

# H200 configurations for K3 shapes (K, N in {3584, 3072}: multiples of 256).
# Decode (few rows per expert, the kernel streams weights, memory bound):
#   one consumer warpgroup, 64-row tiles (a taller tile only adds wasted MMA
#   and x traffic), 128-wide N, deep pipelines keep >= 190 KiB of TMA loads
#   in flight per SM: fused 5 x 40 KiB + 16 KiB epilogue = 216 KiB, plain
#   8 x 24 KiB + 16 KiB = 208 KiB.
# Prefill (>= 128 rows per expert on average, compute bound): two consumer
#   warpgroups share each weight tile over a 128-row x tile, doubling the
#   MMA work per byte loaded: fused 4 x 48 KiB + 32 KiB = 224 KiB (two
#   64x128 f32 accumulators = 128 registers/thread per consumer); plain uses
#   256-wide N (one 64x256 accumulator per consumer), 3 x 48 KiB + 64 KiB.
FUSED_DECODE = TileConfig(num_compute_wgs=1, block_n=128, max_concurrent_steps=5)
PLAIN_DECODE = TileConfig(num_compute_wgs=1, block_n=128, max_concurrent_steps=8)
FUSED_PREFILL = TileConfig(num_compute_wgs=2, block_n=128, max_concurrent_steps=4)
PLAIN_PREFILL = TileConfig(num_compute_wgs=2, block_n=256, max_concurrent_steps=3)
PREFILL_ROWS_PER_GROUP = 128  # average rows per group at which prefill tiles win


def default_config(num_rows: int, num_groups: int, num_weights: int) -> TileConfig:
    """Static tile choice from the average rows per group (M / G)."""
    prefill = num_rows >= PREFILL_ROWS_PER_GROUP * num_groups
    if num_weights == 2:
        return FUSED_PREFILL if prefill else FUSED_DECODE
    return PLAIN_PREFILL if prefill else PLAIN_DECODE


def _fit_block(dim: int, preferred: int, minimum: int) -> int:
    """Largest power-of-two block in [minimum, preferred] dividing dim (0 if none)."""
    block = preferred
    while block >= minimum:
        if dim % block == 0:
            return block
        block //= 2
    return 0


def _padded_block(dim: int, preferred: int, minimum: int) -> int:
    """Block for a dim no allowed block divides (dim is then zero-padded to a
    multiple of it): the smallest power of two >= dim in [minimum, preferred],
    so tiny per-device dims (e.g. 16 columns at tp 8) pad to one small block."""
    return min(preferred, max(minimum, 1 << max(dim - 1, 0).bit_length()))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _pad_axis(a: jax.Array, axis: int, size: int) -> jax.Array:
    """Zero-pad ``a`` along ``axis`` up to ``size`` (no-op when already that size)."""
    if a.shape[axis] == size:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (0, size - a.shape[axis])
    return jnp.pad(a, widths)


def num_work_items(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound W on (segment, M-block) intersections."""
    return pl.cdiv(num_rows, block_m) + num_groups


def work_items_4W(group_sizes_G: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """int32 [4, W] schedule: rows (group | -1 tail, m_block, row offset, row count).

    Segment s < G is group s's rows; segment G is the tail [sum(sizes), M).
    Group ends are clamped to num_rows. Unused trailing items have count 0.
    """
    num_groups = group_sizes_G.shape[0]
    ends_G = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), num_rows)
    seg_end_S = jnp.concatenate([ends_G, jnp.array([num_rows], jnp.int32)])
    seg_start_S = jnp.concatenate([jnp.zeros((1,), jnp.int32), seg_end_S[:-1]])
    first_block_S = seg_start_S // block_m
    last_block_S = (seg_end_S - 1) // block_m
    count_S = jnp.where(seg_end_S > seg_start_S, last_block_S - first_block_S + 1, 0)
    item_end_S = jnp.cumsum(count_S)
    item_start_S = item_end_S - count_S

    w_W = jnp.arange(num_work_items(num_rows, num_groups, block_m), dtype=jnp.int32)
    # compare_all: one [W, G+1] comparison, no while loop in the launch path
    seg_W = jnp.searchsorted(item_end_S, w_W, side="right", method="compare_all").astype(jnp.int32)
    used_W = seg_W <= num_groups
    seg_W = jnp.minimum(seg_W, num_groups)
    block_W = first_block_S[seg_W] + w_W - item_start_S[seg_W]
    row_start_W = jnp.maximum(seg_start_S[seg_W], block_W * block_m)
    row_end_W = jnp.minimum(seg_end_S[seg_W], (block_W + 1) * block_m)
    group_W = jnp.where(seg_W < num_groups, seg_W, -1)
    count_W = jnp.where(used_W, row_end_W - row_start_W, 0)
    block_W = jnp.where(used_W, block_W, 0)
    offset_W = jnp.where(used_W, row_start_W - block_W * block_m, 0)
    return jnp.stack([group_W, block_W, offset_W, count_W]).astype(jnp.int32)


def _store_rows(o_smem, o_gmem, *, row0, offset, count, col0, block_n: int, max_rows: int):
    """TMA-store rows [offset, offset + count) of o_smem to o_gmem[row0 + offset...].

    TMA needs static box sizes, so count is written as a sum of powers of two
    (one descriptor per power, each issued only when that bit of count is set).
    """
    rows = 1 << int(math.log2(max_rows))
    start = offset
    while rows >= 1:
        @pl.when((count & rows) != 0)
        def _store(rows=rows, start=start):
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(start, rows)],
                o_gmem.at[pl.ds(row0 + start, rows), pl.ds(col0, block_n)])
        start = start + (count & rows)
        rows //= 2


def _pipeline(step_fn, compute_context, *, cfg: TileConfig, num_w: int, planes: int,
              num_k_steps: int):
    """Warp-specialized K pipeline over one tile: ``planes`` x [block_m, K] planes
    and num_w x ``planes`` weight planes [K, block_n] stream through SMEM (TMA,
    producer warpgroup). Operand order: x planes, then each weight's planes."""
    # delay_release stays 0: with 1, the last step of a tile never arrives on
    # its "consumed" barrier, so the producer could refill that slot for the
    # next tile of this persistent loop while its WGMMA still reads it.
    x_spec = plgpu.BlockSpec((cfg.block_m, cfg.block_k), lambda k: (0, k))
    w_spec = plgpu.BlockSpec((cfg.block_k, cfg.block_n), lambda k: (k, 0))
    return plgpu.emit_pipeline_warp_specialized(
        step_fn, grid=(num_k_steps,), memory_registers=40,
        in_specs=[x_spec] * planes + [w_spec] * (num_w * planes),
        wg_axis="wg", num_compute_wgs=cfg.num_compute_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps, compute_context=compute_context)


# (x plane, w plane) products per K step and weight. One plane: the native
# product. Two planes (hi, lo) of float32 operands: bf16x3, small terms first.
_PRODUCTS = {1: ((0, 0),), 2: ((1, 0), (0, 1), (0, 0))}


def _make_body(*, epilogue: Callable, num_w: int, planes: int, cfg: TileConfig, num_rows: int,
               num_k_steps: int, num_n_blocks: int, out_dtype):
    """Kernel body(meta_4W, *x_planes_MK, *w_planes_GKN, o_MN) for num_w weights
    of ``planes`` planes each (1: bf16/f16; 2: hi/lo bf16 split of float32).

    Every warpgroup walks the same (work item, N-block) sequence, so the
    producer and the consumers always agree on which tiles run a pipeline.
    """
    wg_m = cfg.wg_block_m
    pipeline_for = functools.partial(_pipeline, cfg=cfg, num_w=num_w, planes=planes,
                                     num_k_steps=num_k_steps)
    products = _PRODUCTS[planes]

    def body(meta_gmem, *refs):
        x_gmems, w_gmems, o_gmem = refs[:planes], refs[planes:-1], refs[-1]
        num_items = meta_gmem.shape[1]
        def ignore(*_, **__):
            return None
        allocs = pipeline_for(ignore, ignore).get_allocations(*x_gmems,
                                                              *[w.at[0] for w in w_gmems])

        @functools.partial(pl.run_scoped, allocs=allocs,
                           o_smem=plgpu.SMEM((cfg.num_compute_wgs, wg_m, cfg.block_n), out_dtype),
                           collective_axes="wg")
        def _scope(allocs, o_smem):
            wg = lax.axis_index("wg")  # consumers 0..num_compute_wgs-1, producer last

            @plgpu.nd_loop((num_items * num_n_blocks,), collective_axes="sm")
            def _tile_loop(info: plgpu.NDLoopInfo):
                item, n_block = plgpu.planar_snake(
                    info.index[0], (num_items, num_n_blocks), 1, cfg.grid_block_n)
                group = meta_gmem[0, item]
                m_block = meta_gmem[1, item]
                offset = meta_gmem[2, item]
                count = meta_gmem[3, item]
                # This consumer's share of the item's rows [offset, offset + count).
                lo = jnp.clip(offset - wg * wg_m, 0, wg_m)
                hi = jnp.clip(offset + count - wg * wg_m, 0, wg_m)

                def store(tile):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous tile's store
                    o_smem[wg] = tile
                    plgpu.commit_smem()
                    _store_rows(o_smem.at[wg], o_gmem, row0=m_block * cfg.block_m + wg * wg_m,
                                offset=lo, count=hi - lo, col0=n_block * cfg.block_n,
                                block_n=cfg.block_n, max_rows=min(wg_m, num_rows))

                def mma(_, *rest):
                    smems, accs = rest[:-1], rest[-1]
                    x_smems = [x.at[pl.ds(wg * wg_m, wg_m)] for x in smems[:planes]]
                    for i, acc in enumerate(accs):
                        w_smems = smems[planes + i * planes:planes + (i + 1) * planes]
                        for xp, wp in products:
                            plgpu.wgmma(acc, x_smems[xp], w_smems[wp])
                    # The slot is released when this step returns (delay_release=0),
                    # so its WGMMAs must be done reading it; the other consumer
                    # warpgroup's WGMMAs keep the tensor cores busy meanwhile.
                    plgpu.wgmma_wait(0)
                    return accs

                def compute_context(run_pipeline):
                    accs = [plgpu.ACC((wg_m, cfg.block_n), jnp.float32)] * num_w

                    @functools.partial(pl.run_scoped, accs=accs)
                    def _acc_scope(accs):
                        run_pipeline(tuple(accs))
                        store(epilogue(*[acc[...] for acc in accs]).astype(out_dtype))

                @pl.when((count > 0) & (group >= 0))
                def _matmul():
                    rows = pl.ds(m_block * cfg.block_m, cfg.block_m)
                    cols = pl.ds(n_block * cfg.block_n, cfg.block_n)
                    pipeline_for(mma, compute_context)(
                        *[x.at[rows, :] for x in x_gmems],
                        *[w.at[jnp.maximum(group, 0), :, cols] for w in w_gmems],
                        allocations=allocs)

                @pl.when((count > 0) & (group < 0) & (wg < cfg.num_compute_wgs))
                def _zeros():  # tail rows past sum(group_sizes): no matmul
                    store(jnp.zeros((wg_m, cfg.block_n), out_dtype))

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def fit_smem(cfg: TileConfig, num_weights: int, in_bytes: int, out_bytes: int,
             min_block_n: int = _MIN_BLOCK) -> TileConfig:
    """Shrink cfg until the kernel fits the SMEM limit: drop pipeline stages
    (to >= 2); if two stages still do not fit (float32 = two bf16 planes with
    the prefill tiles), halve block_n (>= min_block_n) and start over."""
    limit = SMEM_LIMIT - _SMEM_RESERVE
    stages = cfg.max_concurrent_steps
    while True:
        fitted = cfg
        while (fitted.max_concurrent_steps > 2
               and fitted.smem_bytes(num_weights, in_bytes, out_bytes) > limit):
            fitted = dataclasses.replace(fitted, max_concurrent_steps=fitted.max_concurrent_steps - 1)
        if (fitted.smem_bytes(num_weights, in_bytes, out_bytes) <= limit
                or cfg.block_n // 2 < min_block_n):
            return fitted  # a config that still does not fit fails in Mosaic's SMEM check
        cfg = dataclasses.replace(cfg, block_n=cfg.block_n // 2, max_concurrent_steps=stages)


def _interpret_params(interpret) -> plgpu.InterpretGPUParams | None:
    """None (compile for the GPU), or the GPU interpret-mode parameters to use."""
    if not interpret:
        return None
    interpret_compat.install()
    return interpret if isinstance(interpret, plgpu.InterpretGPUParams) else plgpu.InterpretGPUParams()


def _num_sms(interpret) -> int:
    """Persistent grid size: the device's SM count (132 on H200)."""
    if interpret:
        return _INTERPRET_NUM_SMS
    return int(getattr(jax.devices()[0], "core_count", 0) or _DEFAULT_NUM_SMS)


def num_planes(dtype) -> int:
    """bf16 planes per input element: 1 for bf16/f16 (native WGMMA), 2 for
    float32 (bf16x3 split); other dtypes raise ValueError."""
    dtype = jnp.dtype(dtype)
    if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return 1
    if dtype == jnp.dtype(jnp.float32):
        return 2
    raise ValueError(f"Mosaic GPU kernels take bfloat16, float16 or float32 inputs, got {dtype}")


def split_bf16(a: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 a -> (hi, lo) bf16 with hi = bf16(a), lo = bf16(a - hi).

    hi + lo carries ~16 of float32's 24 significand bits. Non-finite entries
    (and values that round to +-inf in bf16) get lo = 0, so inf stays inf.
    """
    a = a.astype(jnp.float32)
    hi = a.astype(jnp.bfloat16)
    hi_f32 = hi.astype(jnp.float32)
    lo = jnp.where(jnp.isfinite(hi_f32), a - hi_f32, 0.0).astype(jnp.bfloat16)
    return hi, lo


def _to_planes(a: jax.Array, compute_dtype, planes: int) -> list[jax.Array]:
    """The operand's SMEM planes: [a in compute_dtype], or [hi, lo] bf16."""
    if planes == 1:
        return [a.astype(compute_dtype)]
    return list(split_bf16(a))


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """The static shape of one launch: the fitted tiles and padded sizes.

    cfg: the TileConfig after fitting block_k / block_n to K / N and the SMEM
    limit; planes: bf16 planes per input element (1 or 2, see num_planes).
    """

    cfg: TileConfig
    planes: int
    m_pad: int
    k_pad: int
    n_pad: int

    @property
    def num_k_steps(self) -> int:
        return self.k_pad // self.cfg.block_k

    @property
    def num_n_blocks(self) -> int:
        return self.n_pad // self.cfg.block_n


def plan_launch(m: int, k: int, n: int, num_groups: int, num_weights: int, in_dtype,
                out_dtype, cfg: TileConfig | None = None) -> LaunchPlan:
    """Fit the tiles of a [m, k] x num_weights x [G, k, n] launch (what the
    launcher runs; benchmarks/.. cost model calls it too)."""
    planes = num_planes(in_dtype)
    out_bytes = jnp.dtype(out_dtype).itemsize
    cfg = cfg or default_config(m, num_groups, num_weights)
    # block_k >= 16: the bf16 WGMMA K step. block_n: output tile rows of >= 128
    # bytes keep every row-offset TMA store from SMEM 128-byte aligned.
    block_k = (_fit_block(k, cfg.block_k, _MIN_BLOCK)
               or _padded_block(k, cfg.block_k, _MIN_BLOCK))
    min_n = max(_MIN_BLOCK, 128 // out_bytes)
    block_n = _fit_block(n, cfg.block_n, min_n) or _padded_block(n, cfg.block_n, min_n)
    cfg = dataclasses.replace(cfg, block_k=block_k, block_n=block_n)
    cfg = fit_smem(cfg, num_weights, 2 * planes, out_bytes, min_n)
    return LaunchPlan(cfg=cfg, planes=planes, m_pad=_round_up(m, cfg.block_m),
                      k_pad=_round_up(k, block_k), n_pad=_round_up(n, cfg.block_n))


def _grouped_call(x_MK, w_GKNs, group_sizes_G, *, epilogue, cfg: TileConfig | None, interpret):
    """Shared launcher: fit blocks to the shapes, pad if needed, build metadata, run."""
    m, k = x_MK.shape
    num_groups, _, n = w_GKNs[0].shape
    out_dtype = x_MK.dtype
    in_dtype = jnp.result_type(x_MK, *w_GKNs)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    launch = plan_launch(m, k, n, num_groups, len(w_GKNs), in_dtype, out_dtype, cfg)
    cfg, planes = launch.cfg, launch.planes
    block_k, block_n = cfg.block_k, cfg.block_n
    k_pad, n_pad, m_pad = launch.k_pad, launch.n_pad, launch.m_pad

    # x rows are padded so every M-block read is in bounds; K/N are padded only
    # when no allowed power-of-two block divides them (never for K3 shapes).
    x_planes = _to_planes(_pad_axis(_pad_axis(x_MK, 0, m_pad), 1, k_pad), in_dtype, planes)
    w_planes = [p for w in w_GKNs
                for p in _to_planes(_pad_axis(_pad_axis(w, 1, k_pad), 2, n_pad), in_dtype, planes)]
    meta_4W = work_items_4W(group_sizes_G, m, cfg.block_m)

    body = _make_body(epilogue=epilogue, num_w=len(w_GKNs), planes=planes, cfg=cfg, num_rows=m,
                      num_k_steps=k_pad // block_k, num_n_blocks=n_pad // block_n,
                      out_dtype=out_dtype)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n_pad), out_dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret),
    )
    y_MN = kernel(meta_4W, *x_planes, *w_planes)
    return y_MN if n_pad == n else y_MN[:, :n]


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, config: TileConfig | None = None,
                   interpret: bool | plgpu.InterpretGPUParams = False):
    """y_MN = x_MK @ w_GKN[group(row)] (f32 accumulate, x dtype); tail rows are 0.

    config=None picks PLAIN_DECODE / PLAIN_PREFILL from M / G (default_config).
    """
    return _grouped_call(x_MK, [w_GKN], group_sizes_G, epilogue=lambda acc: acc,
                         cfg=config, interpret=interpret)


def grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, *, beta: float,
                     linear_beta: float | None, config: TileConfig | None = None,
                     interpret: bool | plgpu.InterpretGPUParams = False):
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) fused in one kernel; tail rows are 0.

    config=None picks FUSED_DECODE / FUSED_PREFILL from M / G (default_config).
    """
    epilogue = functools.partial(situ_glu_f32, beta=beta, linear_beta=linear_beta)
    return _grouped_call(x_MK, [w_gate_GKN, w_up_GKN], group_sizes_G, epilogue=epilogue,
                         cfg=config, interpret=interpret)
