"""The grouped kernels' schedule: work items, K ranges and pipeline-chain bounds.

Rows are sorted by group. The row range [0, M) is cut into segments: one per
group plus a tail segment [sum(sizes), M) that must come out as zeros. Work
items are group-aligned: a segment of n rows is cut into cdiv(n, block_m)
items starting at its own first row (rounded down to X_ROW_ALIGN), so a group
of <= block_m rows is one item and streams its weights once per N-block. An
item's x tile is the block_m rows from its first row, moved back to end at
row x_rows(M, block_m) when it would run past it. There are at most
num_work_items(M, G, block_m) items.

The kernels (mosaic_sm90*.py, triton_sm80.py) launch from these tables, and
k3jax/tools/kernel_cost.py replays the same functions on concrete sizes.
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul.tiling import round_up

X_ROW_ALIGN = 8  # an x tile starts at a multiple of 8 rows (the SMEM tiling's rows)
# Routed groups (G > 1) are multinomial: a tile holds mean + ROUTING_SIGMAS x
# sqrt(mean) rows, so a group rarely needs a second item.
ROUTING_SIGMAS = 3.0


def expected_rows(num_rows: int, num_groups: int) -> float:
    """Rows a group's item must hold: mean + ROUTING_SIGMAS sigma of the
    multinomial routing (the whole of it for one group)."""
    mean = num_rows / num_groups
    return mean + (ROUTING_SIGMAS * math.sqrt(mean) if num_groups > 1 else 0.0)


def num_work_items(num_rows: int, num_groups: int, block_m: int) -> int:
    """Static upper bound W on the work items of ``work_items_4W``: G + 1
    segments, each <= X_ROW_ALIGN - 1 rows longer once its start is aligned."""
    segments = num_groups + 1
    return (num_rows + (X_ROW_ALIGN - 1) * segments) // block_m + segments


def x_rows(num_rows: int, block_m: int) -> int:
    """Rows of the x the kernel reads: >= one tile, a multiple of X_ROW_ALIGN."""
    return round_up(max(num_rows, block_m), X_ROW_ALIGN)


def work_items_4W(group_sizes_G: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """int32 [4, W] group-aligned schedule, one column per work item:
    (group | -1 tail, x_row0, offset, count): the item's rows are
    [x_row0 + offset, x_row0 + offset + count) and its x tile is rows
    [x_row0, x_row0 + block_m) of x padded to x_rows(num_rows, block_m) rows.

    Segment s < G is group s's rows; segment G is the tail [sum(sizes), M).
    Group ends are clamped to num_rows. A segment's tiles start at its first
    row rounded down to X_ROW_ALIGN (Mosaic's TMA needs x tiles at multiples
    of 8 rows), every block_m rows. Unused trailing items have count 0.
    O(G + W) scalar work, jittable with traced sizes.
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


_work_items_4W_jit = jax.jit(work_items_4W, static_argnums=(1, 2))


def schedule(group_sizes_G, num_rows: int, block_m: int) -> jax.Array:
    """The kernel's work-item table: work_items_4W on traced sizes (W columns,
    the static bound), or, for concrete numpy sizes (the dense MLP), only the
    used items (so the persistent loop has no idle tiles to spread)."""
    if not isinstance(group_sizes_G, np.ndarray):
        return work_items_4W(group_sizes_G, num_rows, block_m)
    with host_eval():  # one compiled computation, not one per eager op
        meta = np.asarray(_work_items_4W_jit(jnp.asarray(group_sizes_G, jnp.int32), num_rows,
                                             block_m))
    return jnp.asarray(meta[:, :max(int(np.count_nonzero(meta[3])), 1)])


def active_warpgroups(offset, count, cfg):
    """Consumer warpgroups of a row-major tile (cfg: num_compute_wgs,
    wg_block_m) that hold some of rows [offset, offset + count) (the ones that
    issue WGMMAs); works on ints and arrays."""
    return sum(((offset < (w + 1) * cfg.wg_block_m) & (offset + count > w * cfg.wg_block_m)
                & (count > 0)) * 1 for w in range(cfg.num_compute_wgs))


def k_range(split, num_k_steps: int, split_k: int):
    """(first K step, number of K steps) of K range ``split`` of ``split_k``
    near-equal ranges (ints or traced scalars)."""
    first = split * num_k_steps // split_k
    return first, (split + 1) * num_k_steps // split_k - first


def k_range_lengths(num_k_steps: int, split_k: int) -> list[int]:
    """The <= 2 distinct step counts of the split_k K ranges, ascending."""
    return sorted({k_range(s, num_k_steps, split_k)[1] for s in range(split_k)})


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
    return no_drain_stages(set(k_range_lengths(num_k_steps, split_k)), max_stages)


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


def matmul_tiles_T(meta_4W: jax.Array, num_n_blocks: int, split_k: int,
                   grid_block_n: int) -> jax.Array:
    """bool [T]: whether the row-major kernel's linear tile t (K range
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
    """int32 [2, C]: per CTA c of the row-major kernel (which runs linear tiles
    c, c + C, ...), the first and the last tile that runs a matmul (-1 when it
    runs none); jittable with a traced table (O(T), T = split_k * W * N-blocks)."""
    return chain_bounds_2C(matmul_tiles_T(meta_4W, num_n_blocks, split_k, grid_block_n),
                           num_ctas)


def swap_ab_bounds_2C(meta_4W: jax.Array, *, split_k: int, num_supers: int,
                      num_clusters: int) -> jax.Array:
    """int32 [2, num_clusters]: the swap-AB kernel's first and last tile per
    cluster (its item-major (item, N-superblock, K range) index) that runs a
    matmul, -1 when none."""
    tile_T = jnp.arange(split_k * meta_4W.shape[1] * num_supers, dtype=jnp.int32)
    item_T = tile_T // (split_k * num_supers)
    runs_T = (meta_4W[3, item_T] > 0) & (meta_4W[0, item_T] >= 0)
    return chain_bounds_2C(runs_T, num_clusters)


def row_columns(meta_4W, num_rows: int, block_t: int):
    """(column of the swap-AB output out^T holding row r, row r is valid) for
    r in [0, num_rows): row r lives in the item w whose rows hold it, at column
    w * block_t + r - x_row0[w]; rows of the tail segment are not valid."""
    group_W, x_row0_W, offset_W, count_W = meta_4W
    # Used items cover [0, num_rows) in row order; unused ones (count 0) sort last.
    end_W = jnp.where(count_W > 0, x_row0_W + offset_W + count_W, num_rows + 1)
    r_M = jnp.arange(num_rows, dtype=jnp.int32)
    item_M = jnp.searchsorted(end_W, r_M, side="right", method="compare_all").astype(jnp.int32)
    item_M = jnp.minimum(item_M, end_W.shape[0] - 1)
    return item_M * block_t + r_M - x_row0_W[item_M], group_W[item_M] >= 0


def group_table_4G(group_sizes_G: jax.Array, num_rows: int, block_m: int) -> jax.Array:
    """int32 [4, G] of the tgmm kernel: per group (first row, end row, first
    row block, row blocks). Group ends are clamped to num_rows; an empty group
    has 0 row blocks."""
    ends_G = jnp.minimum(jnp.cumsum(group_sizes_G.astype(jnp.int32)), num_rows)
    starts_G = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends_G[:-1]])
    first_G = starts_G // block_m
    blocks_G = jnp.where(ends_G > starts_G, (ends_G + block_m - 1) // block_m - first_G, 0)
    return jnp.stack([starts_G, ends_G, first_G, blocks_G]).astype(jnp.int32)
