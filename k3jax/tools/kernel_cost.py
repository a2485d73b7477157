"""Static cost model of the Mosaic GPU grouped kernels on an H200 (no GPU needed).

It replays the kernels' own schedules on concrete group sizes: the launch
plan (``mosaic_sm90.plan_launch``: fitted tiles, split-K), the work-item
table (``schedule.work_items_4W``), the snake order
(``plgpu.planar_snake``) and the persistent loop's assignment of tile i to
CTA i mod num_sms. From that:

  * tiles and SM fill: sum of the tiles' times / (num_sms x the busiest CTA's);
  * bytes the tiles load into SMEM (weights, x) and store (output, split-K
    partials); of these, HBM serves a group's weights once per N-block (its
    first item; later items re-read them from L2), x once (re-reads by other
    N-blocks hit L2) and every store: an assumption (50 MB L2), not measured;
  * weight reads per active expert: matmul work items per non-empty group
    (each item streams its group's weights once per N-block);
  * matmul rows computed per useful row: 64-row WGMMA slices issued / valid rows;
  * a roofline time: each tile takes max(flops / (F / num_sms),
    HBM bytes / (B / num_sms)) + TILE_OVERHEAD_S, a CTA's tiles run back to back,
    the launch takes the busiest CTA's time, plus the split-K reduction (read
    the f32 partials, write the output) at copy bandwidth. A launch whose
    tiles chain their pipelines (LaunchPlan.no_drain: no drain between a
    CTA's tiles) pays TILE_OVERHEAD_S once per CTA, for its first tile: an
    assumption (the producer streams the next tile's first stages while the
    consumers finish a tile, hiding the loads' latency), not measured.

F, B, the SM count and the lane rate are pallas_kernels.hardware.H200's
(public figures, not measured here). The per-SM bandwidth share assumes
every SM streams at B / num_sms: a launch that leaves SMs idle is charged
for it, which is the point of the SM-fill figure. These are predictions,
not measurements.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from k3jax.tools.golden_kernels import (
    GOLDEN_KERNELS,
    MXFP4_DEQUANT_SASS_PER_WEIGHT,
    MXFP4_SWAP_AB_DEQUANT_SASS_PER_WEIGHT,
)
from pallas_kernels.grouped_matmul import (
    mosaic_sm90,
    mosaic_sm90_mxfp4,
    mosaic_sm90_mxfp4_swap_ab,
    mosaic_sm90_swap_ab,
    schedule,
)
from pallas_kernels.hardware import H200

H200_NUM_SMS = H200.num_sms
DENSE_BF16_FLOPS = H200.dense_bf16_flops_per_s
COPY_BYTES_PER_S = H200.hbm_copy_bytes_per_s
# Per tile: the first TMA loads' HBM latency plus the pipeline drain before
# the next tile's loads start (an assumption, ~1 HBM round trip + issue).
# Launches without a drain between tiles (LaunchPlan.no_drain) pay it once per
# CTA (also an assumption).
TILE_OVERHEAD_S = 0.7e-6
WG_ROWS = 64  # WGMMA M of one warpgroup
SM_LANE_OPS_PER_S = H200.sm_lane_ops_per_s



@dataclasses.dataclass(frozen=True)
class KernelCost:
    """The model's figures for one launch (bytes are per launch, per device)."""

    tiles: int  # (work item, N-block, K-split) tiles that run a matmul or store zeros
    sm_fill: float  # sum of tile times / (num_sms x busiest CTA's time)
    weight_bytes: float  # weight tiles loaded (all planes)
    x_bytes: float  # x tiles loaded (all planes)
    out_bytes: float  # output (or f32 partial) rows stored, plus the split-K reduction
    weight_reads_per_active_expert: float
    rows_computed_per_useful_row: float
    flops: float  # WGMMA flops issued (incl. wasted rows, 3 products per f32 K step)
    predicted_us: float
    config: dict  # the fitted TileConfig and split-K of the launch

    @property
    def x_bytes_over_weight_bytes(self) -> float:
        return self.x_bytes / self.weight_bytes if self.weight_bytes else 0.0

    def fields(self) -> dict:
        """The JSON fields of a model row (benchmarks' --model-only)."""
        return {"tiles": self.tiles, "sm_fill": round(self.sm_fill, 4),
                "weight_reads_per_active_expert": round(self.weight_reads_per_active_expert, 4),
                "x_bytes_over_weight_bytes": round(self.x_bytes_over_weight_bytes, 4),
                "rows_computed_per_useful_row": round(self.rows_computed_per_useful_row, 4),
                "predicted_us": round(self.predicted_us, 2),
                "hbm_bytes": {"weights": self.weight_bytes, "x": self.x_bytes,
                              "out": self.out_bytes},
                "flops_issued": self.flops, "config": self.config}


@functools.lru_cache(maxsize=256)
def _tile_order(num_items: int, num_n_blocks: int, grid_block_n: int) -> np.ndarray:
    """item of each linear tile index, as the kernel's planar_snake maps it."""
    lin = jnp.arange(num_items * num_n_blocks, dtype=jnp.int32)
    snake = jax.jit(jax.vmap(lambda i: plgpu.planar_snake(i, (num_items, num_n_blocks), 1,
                                                          grid_block_n)[0]))
    return np.asarray(snake(lin))


@functools.lru_cache(maxsize=256)
def _static_schedule(sizes: tuple[int, ...], num_rows: int, block_m: int) -> np.ndarray:
    """The kernel's table for concrete sizes (schedule.schedule), once per shape."""
    return np.asarray(schedule.schedule(np.asarray(sizes, np.int32), num_rows, block_m))


# The kernel's schedule function, compiled once per (num_rows, block_m).
_schedule = jax.jit(schedule.work_items_4W, static_argnums=(1, 2))


@functools.lru_cache(maxsize=4096)
def _traced_schedule(sizes: tuple[int, ...], num_rows: int, block_m: int) -> np.ndarray:
    """_schedule's table for concrete sizes, once per (sizes, num_rows, block_m):
    the tile search models dozens of swap-AB tilings that share a token tile."""
    with schedule.host_eval():
        return np.asarray(_schedule(jnp.asarray(sizes, jnp.int32), num_rows, block_m))


def _first_tile_overhead(runner_T: np.ndarray, runs_T: np.ndarray, num_runners: int) -> np.ndarray:
    """[num_runners] TILE_OVERHEAD_S for each CTA (or cluster) that runs a
    matmul tile: a chained launch pays the tile overhead once per runner."""
    tiles = np.bincount(runner_T, weights=runs_T, minlength=num_runners)
    return np.where(tiles > 0, TILE_OVERHEAD_S, 0.0)


def roofline_s(flops: float, nbytes: float, num_sms: int = H200_NUM_SMS,
               active_sms: int | None = None) -> float:
    """max(compute, memory) time on ``active_sms`` of num_sms SMs."""
    share = (active_sms or num_sms) / num_sms
    return max(flops / (DENSE_BF16_FLOPS * share), nbytes / (COPY_BYTES_PER_S * share))


def grouped_cost(group_sizes_G, m: int, k: int, n: int, num_weights: int, *,
                 dtype=jnp.bfloat16, config: mosaic_sm90.TileConfig | None = None,
                 num_sms: int = H200_NUM_SMS, static_sizes: bool = False,
                 mxfp4: bool = False) -> KernelCost:
    """Model one grouped launch: x [m, k] (rows sorted by group) times
    num_weights weights [G, k, n] with the concrete ``group_sizes_G``, passed
    to the kernel traced (its table has the static bound's W columns) or,
    static_sizes=True, as numpy (the dense MLP: only the used items).

    mxfp4=True models mosaic_sm90_mxfp4's kernel: its launch plan, weight
    tiles of 0.53125 B per parameter (packed codes + scales), and per K step
    the dequant (MXFP4_DEQUANT_SASS_PER_WEIGHT on the consumer's lanes) in series
    with that consumer's WGMMAs."""
    sizes = np.asarray(group_sizes_G, np.int64)
    if mxfp4 and num_weights not in MXFP4_DEQUANT_SASS_PER_WEIGHT:
        raise ValueError(f"no counted dequant for the row-major MXFP4 kernel with {num_weights} "
                         f"weight(s) in {GOLDEN_KERNELS.name} (the dispatch never runs it)")
    if mxfp4:
        launch = mosaic_sm90_mxfp4.plan_launch(m, k, n, len(sizes), num_weights, dtype, config)
    else:
        launch = mosaic_sm90.plan_launch(m, k, n, len(sizes), num_weights, dtype, dtype, config)
    cfg = launch.cfg
    planes = launch.planes
    in_bytes = 2 * planes
    split_k = cfg.split_k
    out_bytes = 4 if split_k > 1 else jnp.dtype(dtype).itemsize
    num_out = cfg.num_outputs(num_weights)
    with schedule.host_eval():
        if static_sizes:
            meta = _static_schedule(tuple(int(v) for v in sizes), m, cfg.block_m)
        else:
            meta = np.asarray(_schedule(jnp.asarray(sizes, jnp.int32), m, cfg.block_m))
    group_W, offset_W, count_W = meta[0], meta[2], meta[3]
    num_items = meta.shape[1]
    n_blocks = launch.num_n_blocks

    # Per (K range, item): the consumers that issue WGMMAs, the K steps, the bytes.
    matmul_W = (count_W > 0) & (group_W >= 0)
    wgs_W = np.where(matmul_W, schedule.active_warpgroups(offset_W, count_W, cfg), 0)
    steps_S = np.array([schedule.k_range(s, launch.num_k_steps, split_k)[1]
                        for s in range(split_k)])
    products = (planes if mxfp4 else 1 if planes == 1 else 3)
    flops_SW = (steps_S[:, None] * wgs_W * WG_ROWS * cfg.block_n * cfg.block_k * 2
                * num_weights * products)
    x_SW = steps_S[:, None] * np.where(matmul_W, cfg.block_m * cfg.block_k * in_bytes, 0)
    w_bytes_per_param = 17 / 32 if mxfp4 else in_bytes
    w_SW = steps_S[:, None] * np.where(matmul_W, num_weights * cfg.block_k * cfg.block_n
                                       * w_bytes_per_param, 0)
    # MXFP4: each active consumer dequantizes the whole weight tile (in series with its WGMMAs).
    dequant_SW = (steps_S[:, None] * np.where(matmul_W, num_weights * cfg.block_k * cfg.block_n, 0)
                 * MXFP4_DEQUANT_SASS_PER_WEIGHT[num_weights] / SM_LANE_OPS_PER_S) if mxfp4 else 0.0
    # Stores: the item's rows (split-K: f32 partials, one per weight and K range).
    o_SW = np.broadcast_to(count_W * cfg.block_n * out_bytes * num_out, x_SW.shape)
    # HBM traffic of a tile: its weights when it is its group's first item
    # (later items of the group re-read them from L2), its share of x (read
    # from HBM once; the other N-blocks' re-reads hit L2) and its stores.
    first_W = matmul_W & np.concatenate([[True], group_W[1:] != group_W[:-1]])
    hbm_SW = np.where(first_W, w_SW, 0) + x_SW / n_blocks + o_SW
    per_sm_flops = DENSE_BF16_FLOPS / num_sms
    per_sm_bw = COPY_BYTES_PER_S / num_sms
    # The MXFP4 kernel drains every tile; mosaic_sm90 launches may chain them.
    no_drain = not mxfp4 and launch.no_drain
    tile_overhead = 0.0 if no_drain else TILE_OVERHEAD_S
    time_SW = np.where(count_W > 0, np.maximum(flops_SW / per_sm_flops + dequant_SW,
                                               hbm_SW / per_sm_bw) + tile_overhead, 0.0)

    # Linear tile index -> (K range, snake(item, N-block)) -> CTA index mod num_sms.
    with schedule.host_eval():
        item_T = np.tile(_tile_order(num_items, n_blocks, cfg.grid_block_n), split_k)
    split_T = np.repeat(np.arange(split_k), num_items * n_blocks)
    time_T = time_SW[split_T, item_T]
    cta_T = np.arange(len(time_T)) % num_sms
    cta_time = np.bincount(cta_T, weights=time_T, minlength=num_sms)
    if no_drain:
        cta_time = cta_time + _first_tile_overhead(cta_T, count_W[item_T] > 0, num_sms)
    busiest = float(cta_time.max())
    # Split-K: XLA reads the f32 partials and writes the output (one fusion).
    reduce_bytes = (split_k * min(m, launch.m_pad) * launch.n_pad * 4 * num_weights
                    + m * launch.n_pad * jnp.dtype(dtype).itemsize) if split_k > 1 else 0
    useful_rows = int(min(sizes.sum(), m))
    active = int(np.count_nonzero(sizes[np.cumsum(sizes) - sizes < m]))
    return KernelCost(
        tiles=int(np.count_nonzero(count_W)) * n_blocks * split_k,
        sm_fill=float(cta_time.sum() / (num_sms * busiest)) if busiest else 0.0,
        weight_bytes=float(w_SW.sum() * n_blocks), x_bytes=float(x_SW.sum() * n_blocks),
        out_bytes=float(o_SW.sum() * n_blocks + reduce_bytes),
        weight_reads_per_active_expert=float(np.count_nonzero(matmul_W) / active) if active else 0.0,
        rows_computed_per_useful_row=(float(wgs_W.sum() * WG_ROWS / useful_rows)
                                      if useful_rows else 0.0),
        flops=float(flops_SW.sum() * n_blocks),
        predicted_us=(busiest + reduce_bytes / COPY_BYTES_PER_S) * 1e6,
        config={**dataclasses.asdict(cfg), "planes": planes, "mxfp4": mxfp4,
                "no_drain": no_drain})


def swap_ab_cost(group_sizes_G, m: int, k: int, n: int, num_weights: int, *,
                 dtype=jnp.bfloat16,
                 config: mosaic_sm90_swap_ab.SwapABConfig | mosaic_sm90_mxfp4_swap_ab.Mxfp4SwapABConfig
                 | None, num_sms: int = H200_NUM_SMS, mxfp4: bool = False) -> KernelCost:
    """Model one launch of the swap-AB kernel (mosaic_sm90_swap_ab):
    weights [block_w, K] on WGMMA's M side, block_t tokens on N. Same
    conventions as grouped_cost; "rows computed" counts the block_t token
    columns of every matmul tile, and the output is the per-item transposed
    tiles (whole tiles stored) plus XLA's gather of y (read and write M x N).

    A cluster of C CTAs (config.cluster) runs each (item, superblock of C
    N-blocks, K range) tile, one N-block a CTA: each CTA loads 1/C of the x
    tile and multicasts it, so x bytes loaded are the x tile / C per CTA
    tile (x's HBM bytes are unchanged: once per item). The persistent grid
    is num_sms // C clusters; cluster tile j runs on cluster j mod that, and
    the C x clusters CTAs share the bandwidth of all num_sms SMs (SMs left
    idle when C does not divide num_sms are charged, as in the SM fill).
    A launch whose tiles chain (plan.no_drain) pays TILE_OVERHEAD_S once per
    cluster, as grouped_cost's.

    A last superblock that overhangs N (n_pad > N: the kernel reads the
    columns past N as TMA zero fill) counts only its in-bounds columns as
    weight HBM bytes and flops, but its CTAs still run the whole K loop
    (x multicast share, WGMMAs on zeros): a cluster tile takes its slowest
    CTA's time.

    mxfp4=True models mosaic_sm90_mxfp4_swap_ab's kernel (config None: its
    own choice): no cluster, no split-K, tiles drain; weight tiles of
    0.53125 B per parameter, and per K step the dequant
    (MXFP4_SWAP_AB_DEQUANT_SASS_PER_WEIGHT on the SM's lanes) in series with
    the WGMMAs."""
    sizes = np.asarray(group_sizes_G, np.int64)
    if mxfp4:
        plan = mosaic_sm90_mxfp4_swap_ab.plan_launch(m, k, n, len(sizes), num_weights, dtype,
                                                     config)
        block_k, cluster, split_k, no_drain = mosaic_sm90_mxfp4_swap_ab.BLOCK_K, 1, 1, False
    else:
        plan = mosaic_sm90_swap_ab.plan_launch(m, k, n, len(sizes), num_weights, dtype, dtype,
                                               config)
        block_k, cluster, split_k = plan.cfg.block_k, plan.cfg.cluster, plan.cfg.split_k
        no_drain = plan.no_drain
    cfg, planes = plan.cfg, plan.planes
    in_bytes = 2 * planes
    out_bytes = jnp.dtype(dtype).itemsize
    meta = _traced_schedule(tuple(int(v) for v in sizes), m, cfg.block_t)
    group_W, count_W = meta[0], meta[3]
    num_items = meta.shape[1]
    n_blocks = plan.num_n_blocks
    num_clusters = max((cfg.num_ctas or num_sms) // cluster, 1)  # as the kernel's grid
    steps = plan.num_k_steps
    products = planes if mxfp4 else 1 if planes == 1 else 3

    steps_S = np.array([schedule.k_range(s, steps, split_k)[1] for s in range(split_k)])
    tile_out_bytes = 4 * num_weights if split_k > 1 else out_bytes  # f32 partials per weight

    matmul_W = (count_W > 0) & (group_W >= 0)
    # The in-bounds fraction of each N-block's columns (the last superblock may overhang N).
    in_bounds_B = np.clip(n - np.arange(n_blocks) * cfg.block_w, 0, cfg.block_w) / cfg.block_w
    flops_SW = steps_S[:, None] * np.where(matmul_W, cfg.block_w * cfg.block_t * block_k
                                           * 2 * num_weights * products, 0)
    # x: a CTA tile's share of the multicast x tile.
    x_SW = steps_S[:, None] * np.where(matmul_W, cfg.block_t * block_k * in_bytes
                                       / cluster, 0)
    w_bytes_per_param = 17 / 32 if mxfp4 else in_bytes
    w_SW = steps_S[:, None] * np.where(matmul_W, num_weights * block_k * cfg.block_w
                                       * w_bytes_per_param, 0)
    # MXFP4: the consumers dequantize the tile's weights once (in series with the WGMMAs).
    dequant_SW = (steps_S[:, None] * np.where(matmul_W, num_weights * block_k * cfg.block_w, 0)
                  * MXFP4_SWAP_AB_DEQUANT_SASS_PER_WEIGHT[num_weights] / SM_LANE_OPS_PER_S
                  if mxfp4 else np.zeros_like(flops_SW, dtype=float))
    o_SW = np.broadcast_to(np.where(matmul_W, cfg.block_w * cfg.block_t * tile_out_bytes, 0),
                           x_SW.shape)
    first_W = matmul_W & np.concatenate([[True], group_W[1:] != group_W[:-1]])
    # [S, W, B]: CTA tile (K range, item, N-block).
    hbm_SWB = (np.where(first_W, w_SW, 0)[:, :, None] * in_bounds_B
               + (x_SW * cluster / n_blocks + o_SW)[:, :, None])
    tile_overhead = 0.0 if no_drain else TILE_OVERHEAD_S
    time_SWB = np.where(matmul_W[None, :, None],
                        np.maximum(flops_SW[:, :, None] / (DENSE_BF16_FLOPS / num_sms)
                                   + dequant_SW[:, :, None],
                                   hbm_SWB / (COPY_BYTES_PER_S / num_sms))
                        + tile_overhead, 0.0)
    # The kernel's item-major loop over cluster tiles (item, superblock, K
    # range); the C CTAs of a cluster run its C tiles side by side, the
    # cluster tile as long as its slowest CTA's.
    supers = n_blocks // cluster
    time_SWU = time_SWB.reshape(split_k, num_items, supers, cluster).max(axis=3)
    item_T = np.repeat(np.arange(num_items), supers * split_k)
    super_T = np.tile(np.repeat(np.arange(supers), split_k), num_items)
    split_T = np.tile(np.arange(split_k), num_items * supers)
    time_T = time_SWU[split_T, item_T, super_T]
    cluster_T = np.arange(len(time_T)) % num_clusters
    cluster_time = np.bincount(cluster_T, weights=time_T, minlength=num_clusters)
    if no_drain:
        cluster_time = cluster_time + _first_tile_overhead(cluster_T, matmul_W[item_T],
                                                           num_clusters)
    busiest = float(cluster_time.max())
    # XLA gathers y from the tiles: reads each row's column (of every K range's
    # f32 partials with split-K) and writes y.
    assemble_bytes = m * n * (split_k * tile_out_bytes + out_bytes)
    useful_rows = int(min(sizes.sum(), m))
    active = int(np.count_nonzero(sizes[np.cumsum(sizes) - sizes < m]))
    matmul_items = int(np.count_nonzero(matmul_W))
    return KernelCost(
        tiles=matmul_items * n_blocks * split_k,
        sm_fill=float(cluster * cluster_time.sum() / (num_sms * busiest)) if busiest else 0.0,
        weight_bytes=float(w_SW.sum() * in_bounds_B.sum()),
        x_bytes=float(x_SW.sum() * n_blocks),
        out_bytes=float(o_SW.sum() * n_blocks + assemble_bytes),
        weight_reads_per_active_expert=float(matmul_items / active) if active else 0.0,
        rows_computed_per_useful_row=(float(matmul_items * cfg.block_t / useful_rows)
                                      if useful_rows else 0.0),
        flops=float(flops_SW.sum() * in_bounds_B.sum()),
        predicted_us=(busiest + assemble_bytes / COPY_BYTES_PER_S) * 1e6,
        config={**dataclasses.asdict(cfg), "planes": planes, "mxfp4": mxfp4,
                "kernel": "mosaic_sm90_mxfp4_swap_ab" if mxfp4 else "mosaic_sm90_swap_ab",
                "no_drain": no_drain})




def mlp_cost(tokens: int, d: int, f: int, *, config: mosaic_sm90.TileConfig,
             dtype=jnp.bfloat16, num_sms: int = H200_NUM_SMS) -> KernelCost:
    """Model situ_mlp_up with ``config``: x [tokens, d] @ gate/up [d, f] (one
    group holding every row: the static schedule)."""
    return grouped_cost([tokens], tokens, d, f, 2, dtype=dtype, config=config, num_sms=num_sms,
                        static_sizes=True)


def launch_cost(group_sizes_G, m: int, k: int, n: int, num_weights: int, *,
                dtype=jnp.bfloat16, mxfp4: bool = False,
                num_sms: int = H200_NUM_SMS) -> KernelCost:
    """The launch the grouped launcher runs for these shapes (its tile table's
    entry, pallas_kernels.grouped_matmul.tile_choice; MXFP4 weights:
    mosaic_sm90_mxfp4_swap_ab where its block_t_for gives a block_t, else
    mosaic_sm90_mxfp4), costed on the actual group_sizes_G, with the kernel
    named in its config."""
    from pallas_kernels.grouped_matmul import tile_choice
    if mxfp4 and mosaic_sm90_mxfp4_swap_ab.block_t_for(m, len(group_sizes_G),
                                                       num_weights) is not None:
        return swap_ab_cost(group_sizes_G, m, k, n, num_weights, dtype=dtype, config=None,
                            num_sms=num_sms, mxfp4=True)
    if mxfp4:
        cost = grouped_cost(group_sizes_G, m, k, n, num_weights, dtype=dtype, mxfp4=True,
                            num_sms=num_sms)
        return dataclasses.replace(cost, config={**cost.config, "kernel": "mosaic_sm90_mxfp4"})
    swap_ab = tile_choice.grouped_config(m, k, n, len(group_sizes_G), num_weights,
                                         jnp.dtype(dtype).name)
    if swap_ab is not None:
        return swap_ab_cost(group_sizes_G, m, k, n, num_weights, dtype=dtype, config=swap_ab,
                            num_sms=num_sms)
    cost = grouped_cost(group_sizes_G, m, k, n, num_weights, dtype=dtype, num_sms=num_sms)
    return dataclasses.replace(cost, config={**cost.config, "kernel": "mosaic_sm90"})


def launch_mlp_cost(tokens: int, d: int, f: int, *, dtype=jnp.bfloat16,
                    num_sms: int = H200_NUM_SMS) -> KernelCost:
    """The launch situ_mlp_up runs for these shapes (its tile table's entry,
    else mosaic_sm90's default tiles), costed."""
    from pallas_kernels.grouped_matmul import tile_choice
    config = (tile_choice.mlp_config(tokens, d, f, jnp.dtype(dtype).name)
              or mosaic_sm90.default_config(tokens, 1, 2))
    return mlp_cost(tokens, d, f, config=config, dtype=dtype, num_sms=num_sms)


def xla_ragged_dot_dense_s(m: int, k: int, n: int, num_groups: int, num_weights: int) -> float:
    """Roofline of the lowering XLA gave jax.lax.ragged_dot in a deviceless
    H200 compile (ENVIRONMENT.md): one dense GEMM [m, G*k] x [G*k, n] per
    weight, G times the useful flops (a lower bound on its time)."""
    flops = 2.0 * m * num_groups * k * n * num_weights
    nbytes = 2.0 * (m * num_groups * k + num_groups * k * n + m * n) * num_weights
    return roofline_s(flops, nbytes)


def xla_mlp_roofline_s(tokens: int, d: int, f: int) -> float:
    """Roofline of the unfused XLA MLP up-projection (two dots writing bf16
    [T, F] products, then the SiTU reading them): the best XLA could do."""
    flops = 2.0 * 2 * tokens * d * f
    nbytes = 2.0 * (2 * d * f + 2 * tokens * d + 2 * tokens * f + 2 * tokens * f + tokens * f)
    return roofline_s(flops, nbytes)


__all__ = ["COPY_BYTES_PER_S", "DENSE_BF16_FLOPS", "H200_NUM_SMS", "MXFP4_DEQUANT_SASS_PER_WEIGHT",
           "MXFP4_SWAP_AB_DEQUANT_SASS_PER_WEIGHT",
           "SM_LANE_OPS_PER_S", "TILE_OVERHEAD_S", "WG_ROWS", "KernelCost", "grouped_cost",
           "launch_cost", "launch_mlp_cost", "mlp_cost", "roofline_s", "swap_ab_cost",
           "xla_mlp_roofline_s", "xla_ragged_dot_dense_s"]
