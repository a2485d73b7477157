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
M-block, first row within the block, number of rows). The kernel is persistent
(one CTA per SM) and loops over (work item, N-block) pairs; empty items and
size-0 groups cost nothing. A group item runs a K pipeline (TMA -> SMEM ->
WGMMA, ``max_concurrent_steps`` stages) with one accumulator per weight; a tail
item skips the matmul and writes zeros. Only the item's rows are stored, with a
logarithmic ladder of fixed-size TMA stores (as in jax's ragged_dot_mgpu.py),
so several items that share an M-block never overwrite each other's rows and
rows of x past sum(sizes) (possibly NaN) never reach a valid output row.

Dtypes: bf16/f16 run natively. float32 inputs are cast to bfloat16 for the
WGMMA (Hopper's tf32 WGMMA needs a K-major B operand, our weights are N-major)
and accumulate in f32; the output keeps the input dtype. This costs one extra
pass over the weights and bf16 input rounding; it exists for tests/debugging,
production weights are bf16.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.situ import situ_glu_f32

# H100/H200 SXM have 132 SMs; used when the device does not report a count.
_DEFAULT_NUM_SMS = 132
# Interpret mode simulates every "SM" on the CPU: keep it small but > 1 so the
# persistent loop really strides over several work items per CTA.
_INTERPRET_NUM_SMS = 4
_MIN_BLOCK = 16  # bf16 WGMMA: K step of 16; SMEM swizzle needs >= 32 B rows.


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """Block sizes of one kernel launch.

    block_m rows of x per WGMMA tile (64 = one warpgroup's WGMMA M), block_n
    output columns per tile, block_k the K step of the TMA pipeline (64 bf16 =
    one 128-byte swizzle row), max_concurrent_steps the number of SMEM stages,
    grid_block_n the width (in N-blocks) of the snake-ordered tile sweep.
    """

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    grid_block_n: int = 8

    def smem_bytes(self, num_weights: int, in_itemsize: int, out_itemsize: int) -> int:
        """Shared memory the kernel allocates (pipeline stages + epilogue tile)."""
        stage = (self.block_m * self.block_k
                 + num_weights * self.block_k * self.block_n) * in_itemsize
        return self.max_concurrent_steps * stage + self.block_m * self.block_n * out_itemsize


# H200 choices for K3 shapes (K, N in {3584, 3072}; both are multiples of 128).
#  * block_m = 64: one warpgroup's WGMMA height. Decode puts 1-4 rows in each
#    expert, so a taller tile only wastes MMA work; the fused kernel keeps two
#    64x128 f32 accumulators = 128 registers/thread.
#  * block_n = 128: 16 KiB weight tiles per stage and 256-byte output rows
#    (TMA-aligned ladder stores).
#  * stages: fused = 4 x 40 KiB + 16 KiB epilogue = 176 KiB; plain = 6 x 24 KiB
#    + 16 KiB = 160 KiB, both under the 227 KiB sm_90 limit. At decode the
#    kernel streams weights, and 4-6 stages keep >= 96 KiB of TMA loads in
#    flight per SM, enough to cover HBM latency at 4.8 TB/s over 132 SMs.
FUSED_CONFIG = TileConfig(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4)
PLAIN_CONFIG = TileConfig(block_m=64, block_n=128, block_k=64, max_concurrent_steps=6)


def _fit_block(dim: int, preferred: int) -> int:
    """Largest power-of-two block <= preferred dividing dim (0 when none >= 16 does)."""
    block = preferred
    while block >= _MIN_BLOCK:
        if dim % block == 0:
            return block
        block //= 2
    return 0


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
    seg_W = jnp.searchsorted(item_end_S, w_W, side="right").astype(jnp.int32)
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


def _accumulate(x_gmem, w_gmems, *, group, m_block, n_block, cfg: TileConfig, num_k_steps: int):
    """Run the K pipeline for one tile; returns one f32 [block_m, block_n] value per weight."""
    num_w = len(w_gmems)

    def scope(*acc_refs):
        def step(_, x_smem, *w_smems):
            for acc_ref, w_smem in zip(acc_refs, w_smems):
                plgpu.wgmma(acc_ref, x_smem, w_smem)
            # Keep this step's WGMMAs in flight; the previous step's are done,
            # so its SMEM slot (held one extra step by delay_release) is free.
            plgpu.wgmma_wait(num_w)

        x_spec = plgpu.BlockSpec((cfg.block_m, cfg.block_k), lambda k: (m_block, k),
                                 delay_release=1)
        w_spec = plgpu.BlockSpec((cfg.block_k, cfg.block_n), lambda k: (k, n_block),
                                 delay_release=1)
        plgpu.emit_pipeline(
            step, grid=(num_k_steps,), in_specs=[x_spec] + [w_spec] * num_w,
            max_concurrent_steps=cfg.max_concurrent_steps,
        )(x_gmem, *[w.at[group] for w in w_gmems])
        return tuple(acc_ref[...] for acc_ref in acc_refs)

    accs = [plgpu.ACC((cfg.block_m, cfg.block_n), jnp.float32)] * num_w
    return pl.run_scoped(scope, *accs)


def _make_body(*, epilogue: Callable, num_w: int, cfg: TileConfig, num_rows: int,
               num_k_steps: int, num_n_blocks: int, out_dtype):
    """Kernel body(meta_4W, x_MK, *w_GKN, o_MN) for num_w weight operands."""

    def body(meta_gmem, x_gmem, *refs):
        w_gmems, o_gmem = refs[:num_w], refs[num_w]
        num_items = meta_gmem.shape[1]

        @plgpu.nd_loop((num_items * num_n_blocks,), collective_axes="sm")
        def _tile_loop(info: plgpu.NDLoopInfo):
            item, n_block = plgpu.planar_snake(
                info.index[0], (num_items, num_n_blocks), 1, cfg.grid_block_n)
            group = meta_gmem[0, item]
            m_block = meta_gmem[1, item]
            offset = meta_gmem[2, item]
            count = meta_gmem[3, item]

            @pl.when(count > 0)
            def _tile():
                @functools.partial(
                    pl.run_scoped, o_smem=plgpu.SMEM((cfg.block_m, cfg.block_n), out_dtype))
                def _epilogue_scope(o_smem):
                    @pl.when(group >= 0)
                    def _matmul():
                        accs = _accumulate(x_gmem, w_gmems, group=jnp.maximum(group, 0),
                                           m_block=m_block, n_block=n_block, cfg=cfg,
                                           num_k_steps=num_k_steps)
                        o_smem[...] = epilogue(*accs).astype(out_dtype)

                    @pl.when(group < 0)
                    def _zeros():
                        o_smem[...] = jnp.zeros((cfg.block_m, cfg.block_n), out_dtype)

                    plgpu.commit_smem()
                    _store_rows(o_smem, o_gmem, row0=m_block * cfg.block_m, offset=offset,
                                count=count, col0=n_block * cfg.block_n,
                                block_n=cfg.block_n, max_rows=min(cfg.block_m, num_rows))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return body


def _interpret_params(interpret) -> plgpu.InterpretGPUParams | None:
    """None (compile for the GPU), or the GPU interpret-mode parameters to use."""
    if isinstance(interpret, plgpu.InterpretGPUParams):
        return interpret
    return plgpu.InterpretGPUParams() if interpret else None


def _num_sms(interpret) -> int:
    """Persistent grid size: the device's SM count (132 on H200)."""
    if interpret:
        return _INTERPRET_NUM_SMS
    return int(getattr(jax.devices()[0], "core_count", 0) or _DEFAULT_NUM_SMS)


def _compute_dtype(dtype) -> jnp.dtype:
    """WGMMA input dtype: bf16/f16 as is, anything else (f32) as bf16."""
    dtype = jnp.dtype(dtype)
    return dtype if dtype in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)) else jnp.dtype(jnp.bfloat16)


def _grouped_call(x_MK, w_GKNs, group_sizes_G, *, epilogue, cfg: TileConfig, interpret):
    """Shared launcher: fit blocks to the shapes, pad if needed, build metadata, run."""
    m, k = x_MK.shape
    n = w_GKNs[0].shape[2]
    out_dtype = x_MK.dtype
    in_dtype = _compute_dtype(x_MK.dtype)
    block_k = _fit_block(k, cfg.block_k) or cfg.block_k
    block_n = _fit_block(n, cfg.block_n) or cfg.block_n
    cfg = dataclasses.replace(cfg, block_k=block_k, block_n=block_n)
    k_pad, n_pad, m_pad = _round_up(k, block_k), _round_up(n, block_n), _round_up(m, cfg.block_m)

    # x rows are padded so every M-block read is in bounds; K/N are padded only
    # when no power-of-two block >= 16 divides them (never for K3 shapes).
    x_MK = _pad_axis(_pad_axis(x_MK.astype(in_dtype), 0, m_pad), 1, k_pad)
    w_GKNs = [_pad_axis(_pad_axis(w.astype(in_dtype), 1, k_pad), 2, n_pad) for w in w_GKNs]
    meta_4W = work_items_4W(group_sizes_G, m, cfg.block_m)

    body = _make_body(epilogue=epilogue, num_w=len(w_GKNs), cfg=cfg, num_rows=m,
                      num_k_steps=k_pad // block_k, num_n_blocks=n_pad // block_n,
                      out_dtype=out_dtype)
    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n_pad), out_dtype),
        grid=(_num_sms(interpret),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=_interpret_params(interpret),
    )
    y_MN = kernel(meta_4W, x_MK, *w_GKNs)
    return y_MN if n_pad == n else y_MN[:, :n]


def grouped_matmul(x_MK, w_GKN, group_sizes_G, *, config: TileConfig = PLAIN_CONFIG,
                   interpret: bool | plgpu.InterpretGPUParams = False):
    """y_MN = x_MK @ w_GKN[group(row)] (f32 accumulate, x dtype); tail rows are 0."""
    return _grouped_call(x_MK, [w_GKN], group_sizes_G, epilogue=lambda acc: acc,
                         cfg=config, interpret=interpret)


def grouped_situ_glu(x_MK, w_gate_GKN, w_up_GKN, group_sizes_G, *, beta: float,
                     linear_beta: float | None, config: TileConfig = FUSED_CONFIG,
                     interpret: bool | plgpu.InterpretGPUParams = False):
    """h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]) fused in one kernel; tail rows are 0."""
    epilogue = functools.partial(situ_glu_f32, beta=beta, linear_beta=linear_beta)
    return _grouped_call(x_MK, [w_gate_GKN, w_up_GKN], group_sizes_G, epilogue=epilogue,
                         cfg=config, interpret=interpret)
