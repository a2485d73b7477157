"""Hopper (sm_90) grouped matmul kernels in Pallas Mosaic GPU.

Two products share one kernel body:
  * ``grouped_matmul``:   y_MN = x_MK @ w_GKN[group(row)]
  * ``grouped_situ_glu``: h_MN = situ_glu(x @ w_gate[g], x @ w_up[g]); both products
    accumulate in two WGMMA register accumulators of the same tile and the SiTU
    epilogue runs on those registers, so the 2N-wide intermediate never exists
    in HBM.

Scheduling ("group metadata" scheme). Rows are sorted by group. The row range
[0, M) is cut into segments: one per group plus a tail segment [sum(sizes), M)
that must come out as zeros. Work items are group-aligned: a segment of n rows
is cut into cdiv(n, block_m) items starting at its own first row, so a group
of <= block_m rows is one item and streams its weights once per N-block
(items cut at global M-block boundaries read a straddling group's weights once
per block). An item's x tile is the block_m rows from its first row, moved
back to end at row M when it would run past it. There are at most
cdiv(M, block_m) + G items. ``work_items_4W`` computes them in XLA (O(G + W)
scalar work, jittable with a traced group_sizes) as an int32 [4, W] table:
(group or -1 for the tail, first x row of the tile, first item row within the
tile, number of rows).

Split-K (TileConfig.split_k = S > 1, for launches with too few tiles to fill
the SMs, e.g. the dense MLP at small T): every tile runs once per K range
(S near-equal ranges of K steps: at most two lengths, one static pipeline
each), its f32 products
go to S partial outputs per weight, and the caller's XLA sums them and applies
the epilogue (the SiTU after the reduction).

The kernel is persistent (one CTA per SM) and warp-specialized: every
warpgroup loops over the same (work item, N-block) pairs; a producer
warpgroup streams x and weight tiles into SMEM with TMA
(``max_concurrent_steps`` stages) while 1 (decode tiles) or 2 (prefill tiles,
sharing each weight tile) consumer warpgroups run WGMMA into f32 register
accumulators, one per weight, and apply the epilogue in registers. Empty items
and size-0 groups cost nothing; a tail item skips the matmul and writes zeros;
a consumer whose 64 rows hold none of the item's rows issues no WGMMA.
Each consumer stores only the item's rows of its 64-row slice, with a
logarithmic ladder of fixed-size TMA stores (as in jax's ragged_dot_mgpu.py),
so items sharing an M-block never overwrite each other's rows and rows of x
past sum(sizes) (possibly NaN) never reach a valid output row.

Tiles chain without draining the TMA ring (LaunchPlan.no_drain) when a stage
count >= 3 divides every K range's step count: a CTA's first matmul tile
runs jax's START pipeline, its last STOP, the ones between STEADY, so the
producer streams the next tile's first stages during the previous tile's
last WGMMAs and epilogue. XLA computes each CTA's first and last matmul tile
from the work-item table (pipeline_bounds_2C). bf16/f16 outputs compile with
approximate tanh / exp (LaunchPlan.approx_math).

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

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
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
#   MMA work per byte loaded: fused 64-wide N, 4 x 32 KiB + 16 KiB = 144 KiB
#   (two 64x64 f32 accumulators per consumer; at 128-wide N the two 64x128
#   accumulators, 128 registers/thread, sit at ptxas's 168-register cap for
#   3 warpgroups and spilled 12-52 B at EP 16 / 4096 and EP 8 / 16384 tokens
#   and K 512, at 2 to 4 stages; 64-wide at 5 or 6 stages spilled 8-40 B at
#   K 512); plain uses 256-wide N (one 64x256 accumulator per consumer),
#   3 x 48 KiB + 64 KiB.
# Between them, taller tiles keep a whole group in one item (its weights read
# once per N-block): 2 consumers x 64 rows (the prefill tiles) and 3
# consumers x 64 rows (4 warpgroups: <= 128 registers a thread, so fused
# narrows N to 64: 5 x 40 KiB + 24 KiB; plain 3 x 40 KiB + 48 KiB).
# Stage counts and widths are the ones ptxas compiles without spills
# (e.g. plain 2 x 64 x 128 tiles spilled 8-56 bytes at 4-6 stages).
FUSED_DECODE = TileConfig(num_compute_wgs=1, block_n=128, max_concurrent_steps=5)
PLAIN_DECODE = TileConfig(num_compute_wgs=1, block_n=128, max_concurrent_steps=8)
FUSED_PREFILL = TileConfig(num_compute_wgs=2, block_n=64, max_concurrent_steps=4)
PLAIN_PREFILL = TileConfig(num_compute_wgs=2, block_n=256, max_concurrent_steps=3)
FUSED_TALL = TileConfig(num_compute_wgs=3, block_n=64, max_concurrent_steps=5)
PLAIN_TALL = TileConfig(num_compute_wgs=3, block_n=128, max_concurrent_steps=3)
# Routed groups (G > 1) are multinomial: a tile holds mean + ROUTING_SIGMAS x
# sqrt(mean) rows, so a group rarely needs a second item.
ROUTING_SIGMAS = 3.0


def default_config(num_rows: int, num_groups: int, num_weights: int) -> TileConfig:
    """Static tile choice from the rows per group: the shortest tile that holds
    a group's rows (mean + ROUTING_SIGMAS sigma when G > 1), up to 192 rows;
    larger groups get the prefill tiles."""
    mean = num_rows / num_groups
    rows = mean + (ROUTING_SIGMAS * math.sqrt(mean) if num_groups > 1 else 0.0)
    fused = num_weights == 2
    if rows <= 64:
        return FUSED_DECODE if fused else PLAIN_DECODE
    if rows <= 128:
        return FUSED_PREFILL if fused else PLAIN_PREFILL
    if rows <= 192 and num_groups > 1:
        return FUSED_TALL if fused else PLAIN_TALL
    return FUSED_PREFILL if fused else PLAIN_PREFILL


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


X_ROW_ALIGN = 8  # an x tile starts at a multiple of 8 rows (the SMEM tiling's rows)


def num_work_items(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound W on the work items of ``work_items_4W``: G + 1
    segments, each <= X_ROW_ALIGN - 1 rows longer once its start is aligned."""
    segments = num_groups + 1
    return (num_rows + (X_ROW_ALIGN - 1) * segments) // block_m + segments


def x_rows(num_rows: int, block_m: int) -> int:
    """Rows of the x the kernel reads: >= one tile, a multiple of X_ROW_ALIGN."""
    return _round_up(max(num_rows, block_m), X_ROW_ALIGN)


def work_items_4W(group_sizes_G: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """int32 [4, W] group-aligned schedule, one column per work item:
    (group | -1 tail, x_row0, offset, count): the item's rows are
    [x_row0 + offset, x_row0 + offset + count) and its x tile is rows
    [x_row0, x_row0 + block_m) of x padded to x_rows(num_rows, block_m) rows.

    Segment s < G is group s's rows; segment G is the tail [sum(sizes), M).
    Group ends are clamped to num_rows. A segment's tiles start at its first
    row rounded down to X_ROW_ALIGN (Mosaic's TMA needs x tiles at multiples
    of 8 rows), every block_m rows. Unused trailing items have count 0.
    """
    num_groups = group_sizes_G.shape[0]
    ends_G = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), num_rows)
    seg_end_S = jnp.concatenate([ends_G, jnp.array([num_rows], jnp.int32)])
    seg_start_S = jnp.concatenate([jnp.zeros((1,), jnp.int32), seg_end_S[:-1]])
    tile0_S = seg_start_S // X_ROW_ALIGN * X_ROW_ALIGN
    count_S = jnp.where(seg_end_S > seg_start_S,
                        (seg_end_S - tile0_S + block_m - 1) // block_m, 0)
    item_end_S = jnp.cumsum(count_S)
    item_start_S = item_end_S - count_S

    w_W = jnp.arange(num_work_items(num_rows, num_groups, block_m), dtype=jnp.int32)
    # compare_all: one [W, G+1] comparison, no while loop in the launch path
    seg_W = jnp.searchsorted(item_end_S, w_W, side="right", method="compare_all").astype(jnp.int32)
    used_W = seg_W <= num_groups
    seg_W = jnp.minimum(seg_W, num_groups)
    tile_start_W = tile0_S[seg_W] + (w_W - item_start_S[seg_W]) * block_m
    row_start_W = jnp.maximum(seg_start_S[seg_W], tile_start_W)
    row_end_W = jnp.minimum(seg_end_S[seg_W], tile_start_W + block_m)
    count_W = jnp.where(used_W, row_end_W - row_start_W, 0)
    x_row0_W = jnp.where(used_W, jnp.minimum(tile_start_W,
                                             x_rows(num_rows, block_m) - block_m), 0)
    offset_W = jnp.where(used_W, row_start_W - x_row0_W, 0)
    group_W = jnp.where(seg_W < num_groups, seg_W, -1)
    return jnp.stack([group_W, x_row0_W, offset_W, count_W]).astype(jnp.int32)


@contextlib.contextmanager
def host_eval():
    """Evaluate jax ops eagerly on the host CPU, also inside a jit trace and in
    a deviceless compile (whose default device cannot run anything)."""
    with jax.ensure_compile_time_eval(), jax.default_device(jax.local_devices(backend="cpu")[0]):
        yield


def schedule(group_sizes_G, num_rows: int, block_m: int) -> jax.Array:
    """The kernel's work-item table: work_items_4W on traced sizes (W columns,
    the static bound), or, for concrete numpy sizes (the dense MLP), only the
    used items (so the persistent loop has no idle tiles to spread)."""
    if not isinstance(group_sizes_G, np.ndarray):
        return work_items_4W(group_sizes_G, num_rows, block_m)
    with host_eval():  # one compiled computation (eager ops compile one by one: seconds)
        meta = np.asarray(_work_items_4W_jit(jnp.asarray(group_sizes_G, jnp.int32), num_rows,
                                             block_m))
    return jnp.asarray(meta[:, :max(int(np.count_nonzero(meta[3])), 1)])


_work_items_4W_jit = jax.jit(work_items_4W, static_argnums=(1, 2))


def active_warpgroups(offset, count, cfg: TileConfig):
    """Consumer warpgroups of a tile that hold some of rows [offset, offset +
    count) (the ones that issue WGMMAs); works on ints and arrays."""
    return sum(((offset < (w + 1) * cfg.wg_block_m) & (offset + count > w * cfg.wg_block_m)
                & (count > 0)) * 1 for w in range(cfg.num_compute_wgs))


def k_range(split, num_k_steps: int, split_k: int):
    """(first K step, number of K steps) of K range ``split`` of ``split_k``
    near-equal ranges (ints or traced scalars)."""
    first = split * num_k_steps // split_k
    return first, (split + 1) * num_k_steps // split_k - first


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


def _memory_registers(num_compute_wgs: int) -> int:
    """Registers per thread of the TMA producer warpgroup (setmaxnreg); the
    consumers share the rest of 512 (jax's _compute_registers). Measured with
    ptxas for sm_90a: at 40, one-consumer tiles spilled 8-112 bytes (split-K,
    plain 128-wide); one consumer needs <= 256, so the producer gets 240 there.
    With 2 or 3 consumers, 80 made the fused prefill tile spill: 40 stays."""
    return 240 if num_compute_wgs == 1 else 40


def _pipeline(step_fn, compute_context, *, cfg: TileConfig, num_w: int, planes: int,
              num_k_steps, first_k_step=0, pipeline_state: plgpu.PipelinePipeline | None = None):
    """Warp-specialized K pipeline over one tile: ``planes`` x [block_m, K] planes
    and num_w x ``planes`` weight planes [K, block_n] stream through SMEM (TMA,
    producer warpgroup), K steps [first_k_step, first_k_step + num_k_steps)
    (traced with split-K). Operand order: x planes, then each weight's planes.
    pipeline_state: None drains the ring at the end of the tile; START /
    STEADY / STOP chain the tiles of a CTA (see _make_body)."""
    # delay_release stays 0: with 1, the last step of a tile never arrives on
    # its "consumed" barrier, so the producer could refill that slot for the
    # next tile of this persistent loop while its WGMMA still reads it.
    x_spec = plgpu.BlockSpec((cfg.block_m, cfg.block_k), lambda k: (0, k + first_k_step))
    w_spec = plgpu.BlockSpec((cfg.block_k, cfg.block_n), lambda k: (k + first_k_step, 0))
    return plgpu.emit_pipeline_warp_specialized(
        step_fn, grid=(num_k_steps,), memory_registers=_memory_registers(cfg.num_compute_wgs),
        in_specs=[x_spec] * planes + [w_spec] * (num_w * planes),
        wg_axis="wg", num_compute_wgs=cfg.num_compute_wgs,
        max_concurrent_steps=cfg.max_concurrent_steps, compute_context=compute_context,
        pipeline_state=pipeline_state)


_START, _STEADY, _STOP = (plgpu.PipelinePipeline.START, plgpu.PipelinePipeline.STEADY,
                          plgpu.PipelinePipeline.STOP)


def matmul_tiles_T(meta_4W: jax.Array, num_n_blocks: int, split_k: int,
                   grid_block_n: int) -> jax.Array:
    """bool [T]: whether linear tile t (the persistent loop's index: K range
    t // (W * N-blocks), then planar_snake over (work item, N-block)) runs a
    matmul (a non-empty item of a group; tail items store zeros)."""
    num_items = meta_4W.shape[1]
    lin_T = jnp.arange(split_k * num_items * num_n_blocks, dtype=jnp.int32) % (
        num_items * num_n_blocks)
    item_T = jax.vmap(lambda i: plgpu.planar_snake(i, (num_items, num_n_blocks), 1,
                                                   grid_block_n)[0])(lin_T)
    return (meta_4W[3, item_T] > 0) & (meta_4W[0, item_T] >= 0)


def pipeline_bounds_2C(meta_4W: jax.Array, num_n_blocks: int, split_k: int, grid_block_n: int,
                       num_ctas: int) -> jax.Array:
    """int32 [2, C]: per CTA c (which runs linear tiles c, c + C, ...), the
    first and the last tile that runs a matmul (-1 when it runs none); XLA,
    jittable with a traced table (O(T) work, T = split_k * W * N-blocks)."""
    return chain_bounds_2C(matmul_tiles_T(meta_4W, num_n_blocks, split_k, grid_block_n),
                           num_ctas)


def chain_bounds_2C(runs_T: jax.Array, num_ctas: int) -> jax.Array:
    """int32 [2, C]: for a persistent loop that gives linear tile t to CTA
    t mod C, each CTA's first and last tile with runs_T[t] (-1 when none)."""
    t_T = jnp.arange(runs_T.shape[0], dtype=jnp.int32)
    cta_T = t_T % num_ctas
    first_C = jax.ops.segment_min(jnp.where(runs_T, t_T, runs_T.shape[0]), cta_T,
                                  num_segments=num_ctas)
    last_C = jax.ops.segment_max(jnp.where(runs_T, t_T, -1), cta_T, num_segments=num_ctas)
    first_C = jnp.where(last_C >= 0, first_C, -1)
    return jnp.stack([first_C, last_C]).astype(jnp.int32)


def no_drain_stages(step_counts: list[int] | set[int], max_stages: int) -> int:
    """Stage count of a launch whose tiles chain without draining the ring:
    the largest divisor of every K range's step count in [3, max_stages] (jax's
    START/STEADY/STOP pipelines need num_steps % stages == 0), or 0 if none."""
    for stages in range(max_stages, 2, -1):
        if all(steps % stages == 0 for steps in step_counts):
            return stages
    return 0


def chain_stages(num_k_steps: int, split_k: int, max_stages: int) -> int:
    """no_drain_stages of the K ranges that split_k cuts num_k_steps into."""
    return no_drain_stages({k_range(s, num_k_steps, split_k)[1] for s in range(split_k)},
                           max_stages)


def chain_state(tile, bounds_gmem, cta) -> jax.Array:
    """0 / 1 / 2 = START / STEADY / STOP: linear tile ``tile``'s place in
    the chain of pipelines of CTA (or cluster) ``cta``, whose first and last
    matmul tiles are bounds_gmem[:, cta] (chain_bounds_2C)."""
    return jnp.where(tile == bounds_gmem[0, cta], int(_START),
                     jnp.where(tile == bounds_gmem[1, cta], int(_STOP), int(_STEADY)))


def quiesce_ring(allocs: dict, stages: int) -> None:
    """The producer's wait for the consumers' release of the ring's last
    ``stages`` steps (jax's STOP quiesce), for a CTA whose only chained tile
    ran as START (jax has no state that is both START and STOP). ``allocs``
    is the pipeline's get_allocations() dict: its "flat_consumed_barrier_refs"
    key is jax 0.11.2's, so a rename fails loudly here."""
    for barrier in allocs["flat_consumed_barrier_refs"]:
        for slot in range(stages):
            plgpu.barrier_wait(barrier.at[slot])


# (x plane, w plane) products per K step and weight. One plane: the native
# product. Two planes (hi, lo) of float32 operands: bf16x3, small terms first.
_PRODUCTS = {1: ((0, 0),), 2: ((1, 0), (0, 1), (0, 0))}


def _make_body(*, epilogue: Callable, num_w: int, planes: int, cfg: TileConfig, num_rows: int,
               num_k_steps: int, num_n_blocks: int, out_dtype, no_drain: bool):
    """Kernel body(meta_4W, [bounds_2C,] *x_planes_MK, *w_planes_GKN, *o_MNs) for
    num_w weights of ``planes`` planes each (1: bf16/f16; 2: hi/lo bf16 split of
    float32).

    no_drain=False: every tile's pipeline drains the TMA ring. no_drain=True
    (LaunchPlan.no_drain: the stage count divides every K range's steps):
    bounds_2C = pipeline_bounds_2C(...) gives each CTA the first and last
    linear tile index that runs a matmul; that tile's pipeline is START (the
    ring's prologue), the last one STOP (the producer waits until the
    consumers released every slot), the ones between STEADY (the producer
    streams the next tile's first stages while the consumers finish the
    previous tile and run its epilogue). A CTA with one matmul tile runs it
    as START, and after the tile loop its producer waits for the consumers'
    release of the last stages (STOP's quiesce, done by hand: jax has no state
    that is both START and STOP, and a drained fourth variant would add one
    more copy of the pipeline's code). jax 0.11.2 needs a static state
    (a traced one reaches an unrolled fori_loop with traced bounds), so each
    state is its own static pipeline, chosen by one lax.switch.

    epilogue(*acc_tiles) -> tuple of output tiles, one per output. With
    split_k = S (one group), the outputs are f32 partials [S * X, N], X =
    x_rows(M, block_m): K range s writes the item's rows at rows s * X + row
    (rows no item covers are never written; the caller reads rows < M only
    and masks the tail rows past sum(group_sizes)).
    Every warpgroup walks the same (K range, work item, N-block) sequence, so
    the producer and the consumers always agree on which tiles run a pipeline.
    """
    wg_m = cfg.wg_block_m
    split_k = cfg.split_k
    x_rows_pad = x_rows(num_rows, cfg.block_m)
    num_out = cfg.num_outputs(num_w)
    pipeline_for = functools.partial(_pipeline, cfg=cfg, num_w=num_w, planes=planes)
    products = _PRODUCTS[planes]

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
                           o_smem=plgpu.SMEM((num_out * cfg.num_compute_wgs, wg_m, cfg.block_n),
                                             out_dtype),
                           collective_axes="wg")
        def _scope(allocs, o_smem):
            wg = lax.axis_index("wg")  # consumers 0..num_compute_wgs-1, producer last

            # Static shapes only: a traced item count in the snake's divisions
            # made ptxas spill (16-40 bytes) in the fused tiles.
            @plgpu.nd_loop((split_k * num_items * num_n_blocks,), collective_axes="sm")
            def _tile_loop(info: plgpu.NDLoopInfo):
                split, lin = jnp.divmod(info.index[0], num_items * num_n_blocks)
                item, n_block = plgpu.planar_snake(
                    lin, (num_items, num_n_blocks), 1, cfg.grid_block_n)
                group = meta_gmem[0, item]
                x_row0 = meta_gmem[1, item]
                offset = meta_gmem[2, item]
                count = meta_gmem[3, item]
                # This consumer's share of the item's rows [offset, offset + count).
                lo = jnp.clip(offset - wg * wg_m, 0, wg_m)
                hi = jnp.clip(offset + count - wg * wg_m, 0, wg_m)

                def store(tiles):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # previous tile's store
                    for o, tile in enumerate(tiles):
                        o_smem[o * cfg.num_compute_wgs + wg] = tile.astype(out_dtype)
                    plgpu.commit_smem()
                    # split-K: K range ``split`` writes its f32 partial rows at
                    # split * x_rows_pad + row (the padded partials).
                    row0 = x_row0 + wg * wg_m + (split * x_rows_pad if split_k > 1 else 0)
                    for o, o_gmem in enumerate(o_gmems):
                        _store_rows(o_smem.at[o * cfg.num_compute_wgs + wg], o_gmem,
                                    row0=row0, offset=lo,
                                    count=hi - lo, col0=n_block * cfg.block_n,
                                    block_n=cfg.block_n, max_rows=min(wg_m, num_rows))

                def mma(_, *rest):
                    smems, accs = rest[:-1], rest[-1]
                    x_smems = [x.at[pl.ds(wg * wg_m, wg_m)] for x in smems[:planes]]

                    @pl.when(hi > lo)  # no WGMMA for a consumer without rows
                    def _issue():
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
                        store(epilogue(*[acc[...] for acc in accs]))

                first, steps = k_range(split, num_k_steps, split_k)

                # K ranges have one of <= 2 static lengths: one pipeline each
                # (a static trip count; a traced one costs registers and spills).
                for length in sorted({k_range(s, num_k_steps, split_k)[1]
                                      for s in range(split_k)}):
                    @pl.when((count > 0) & (group >= 0) & (steps == length))
                    def _matmul(length=length):
                        rows = pl.ds(pl.multiple_of(x_row0, X_ROW_ALIGN), cfg.block_m)
                        cols = pl.ds(n_block * cfg.block_n, cfg.block_n)

                        def run(pipeline_state):
                            pipeline_for(mma, compute_context, num_k_steps=length,
                                         first_k_step=first, pipeline_state=pipeline_state)(
                                *[x.at[rows, :] for x in x_gmems],
                                *[w.at[jnp.maximum(group, 0), :, cols] for w in w_gmems],
                                allocations=allocs)

                        if no_drain:  # one switch: no value stays live across the states
                            state = chain_state(info.index[0], bounds_gmem, lax.axis_index("sm"))
                            lax.switch(state, [functools.partial(run, st)
                                               for st in (_START, _STEADY, _STOP)])
                        else:
                            run(None)

                if split_k == 1:  # (split-K: the caller masks the tail rows)
                    @pl.when((count > 0) & (group < 0) & (wg < cfg.num_compute_wgs))
                    def _zeros():  # tail rows past sum(group_sizes): no matmul
                        store([jnp.zeros((wg_m, cfg.block_n), out_dtype)] * num_out)

            if no_drain:
                sm = lax.axis_index("sm")
                first, last = bounds_gmem[0, sm], bounds_gmem[1, sm]

                # A CTA whose only matmul tile ran as START: its producer waits
                # for the consumers' release of the last max_concurrent_steps
                # steps, as STOP's quiesce does (the num_steps % stages == 0
                # steps end on slot stages - 1), so the ring's barriers leave
                # the scope with every phase observed.
                @pl.when((wg == cfg.num_compute_wgs) & (first >= 0) & (first == last))
                def _quiesce():
                    quiesce_ring(allocs, cfg.max_concurrent_steps)

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
    no_drain: a CTA's tiles chain their pipelines (START / STEADY / STOP, no
    drain of the TMA ring between tiles; cfg.max_concurrent_steps is then
    no_drain_stages(...) of the fitted count); False: every tile drains.
    approx_math: the kernel writes a bf16 / f16 output (no split-K), so its
    epilogue may use PTX's approximate exp (ex2.approx.ftz.f32) and tanh
    (tanh.approx.f32), Mosaic's CompilerParams(approx_math=True); their
    documented errors are far below the output's rounding (see
    tests/kernels/test_situ_approx.py). Divisions stay IEEE (div.rn.f32):
    Mosaic has no approximate divide.
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
    launcher runs; analysis/kernel_cost.py replays it).

    With cfg.split_k > 1 the kernel writes f32 partials (out_dtype is then
    ignored for the kernel's own output) and every K range needs at least
    max_concurrent_steps K steps (ValueError otherwise).

    When some stage count in [3, fitted stages] divides every K range's step
    count (no_drain_stages), the launch takes the largest such count and
    chains each CTA's tiles without draining (LaunchPlan.no_drain).
    """
    planes = num_planes(in_dtype)
    cfg = cfg or default_config(m, num_groups, num_weights)
    out_bytes = 4 if cfg.split_k > 1 else jnp.dtype(out_dtype).itemsize
    # block_k >= 16: the bf16 WGMMA K step. block_n: output tile rows of >= 128
    # bytes keep every row-offset TMA store from SMEM 128-byte aligned.
    block_k = (_fit_block(k, cfg.block_k, _MIN_BLOCK)
               or _padded_block(k, cfg.block_k, _MIN_BLOCK))
    min_n = max(_MIN_BLOCK, 128 // out_bytes)
    block_n = _fit_block(n, cfg.block_n, min_n) or _padded_block(n, cfg.block_n, min_n)
    cfg = dataclasses.replace(cfg, block_k=block_k, block_n=block_n)
    cfg = fit_smem(cfg, num_weights, 2 * planes, out_bytes, min_n)
    if planes == 2 and cfg.num_compute_wgs > 1:
        # float32 on two consumers: 3 stages (what fits) spilled 296 B in ptxas
        # for sm_90a (K 512, block_n 64); 2 compile without.
        cfg = dataclasses.replace(cfg, max_concurrent_steps=2)
    k_pad = _round_up(k, block_k)
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
                      n_pad=_round_up(n, cfg.block_n), no_drain=bool(stages),
                      approx_math=cfg.split_k == 1 and jnp.dtype(out_dtype).itemsize == 2)


def _grouped_call(x_MK, w_GKNs, group_sizes_G, *, epilogue, cfg: TileConfig | None, interpret):
    """Shared launcher: fit blocks to the shapes, pad if needed, build metadata, run.

    epilogue(*f32 products) -> [M, N] f32; applied in the kernel, or (split-K)
    by XLA after summing the kernel's f32 partials.
    """
    m, k = x_MK.shape
    num_groups, _, n = w_GKNs[0].shape
    num_w = len(w_GKNs)
    out_dtype = x_MK.dtype
    in_dtype = jnp.result_type(x_MK, *w_GKNs)
    if m == 0 or n == 0:
        return jnp.zeros((m, n), out_dtype)
    launch = plan_launch(m, k, n, num_groups, num_w, in_dtype, out_dtype, cfg)
    cfg, planes = launch.cfg, launch.planes
    k_pad, n_pad, m_pad = launch.k_pad, launch.n_pad, launch.m_pad
    split_k = cfg.split_k

    # x gets rows only when it has fewer than one tile or M is not a multiple
    # of 8 (every x tile is block_m rows inside x); K/N are padded only when no allowed power-of-two
    # block divides them (never for K3 shapes).
    x_planes = _to_planes(_pad_axis(_pad_axis(x_MK, 0, m_pad), 1, k_pad), in_dtype, planes)
    w_planes = [p for w in w_GKNs
                for p in _to_planes(_pad_axis(_pad_axis(w, 1, k_pad), 2, n_pad), in_dtype, planes)]
    meta_4W = schedule(group_sizes_G, m, cfg.block_m)

    if split_k > 1:
        kernel_epilogue, kernel_dtype = (lambda *accs: accs), jnp.float32
        out_type = [jax.ShapeDtypeStruct((split_k * m_pad, n_pad), jnp.float32)] * num_w
    else:
        kernel_epilogue, kernel_dtype = (lambda *accs: (epilogue(*accs),)), out_dtype
        out_type = jax.ShapeDtypeStruct((m, n_pad), out_dtype)
    body = _make_body(epilogue=kernel_epilogue, num_w=num_w, planes=planes, cfg=cfg, num_rows=m,
                      num_k_steps=launch.num_k_steps, num_n_blocks=launch.num_n_blocks,
                      out_dtype=kernel_dtype, no_drain=launch.no_drain)
    num_ctas = cfg.num_ctas or _num_sms(interpret)
    # no_drain: each CTA's first and last matmul tile (XLA, from the same table).
    bounds = ([pipeline_bounds_2C(meta_4W, launch.num_n_blocks, split_k, cfg.grid_block_n,
                                  num_ctas)] if launch.no_drain else [])
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_ctas,),
        grid_names=("sm",),
        num_threads=cfg.num_compute_wgs + 1,
        thread_name="wg",
        # Named per op and row tile, so ptxas reports (k3jax.aot.ptxas_dump) tell kernels apart.
        kernel_name=f"{'grouped_situ_glu' if len(w_GKNs) == 2 else 'grouped_matmul'}_m{cfg.block_m}",
        compiler_params=plgpu.CompilerParams(
            lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=launch.approx_math),
        interpret=_interpret_params(interpret),
    )
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
