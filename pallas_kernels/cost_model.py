"""Static cost model of the Mosaic GPU grouped kernel on an H200 (no GPU needed).

It replays the kernel's own schedule on concrete group sizes: the launch plan
(``mosaic_sm90.plan_launch``: fitted tiles, split-K), the work-item table
(``mosaic_sm90.work_items_4W``), the snake order (``plgpu.planar_snake``) and
the persistent loop's assignment of tile i to CTA i mod num_sms. From that:

  * tiles and SM fill: sum of the tiles' times / (num_sms x the busiest CTA's);
  * bytes each tile moves (weights, x, output; counted at HBM bandwidth, so x
    re-reads that hit L2 are charged in full) and the split-K partials;
  * weight reads per active expert: matmul work items per non-empty group
    (each item streams its group's weights once per N-block);
  * matmul rows computed per useful row: 64-row WGMMA slices issued / valid rows;
  * a roofline time: each tile takes max(flops / (F / num_sms),
    bytes / (B / num_sms)) + TILE_OVERHEAD_S, a CTA's tiles run back to back,
    the launch takes the busiest CTA's time, plus the split-K reduction (read
    the f32 partials, write the output) at copy bandwidth.

F = DENSE_BF16_FLOPS and B = COPY_BYTES_PER_S are this project's H200
measurements (SPEC section 7). The per-SM bandwidth share assumes every SM
streams at B / num_sms: a launch that leaves SMs idle is charged for it,
which is the point of the SM-fill figure. These are predictions, not
measurements; benchmarks/gpu_kernels.py puts measured next to them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels.grouped_matmul import mosaic_sm90

H200_NUM_SMS = 132
DENSE_BF16_FLOPS = 790e12  # dense bf16 matmul measured on this project's H200 (SPEC 7)
COPY_BYTES_PER_S = 4.3e12  # device copy (read + write) measured on this project's H200
# Per tile: the first TMA loads' HBM latency plus the pipeline drain before
# the next tile's loads start (an assumption, ~1 HBM round trip + issue).
TILE_OVERHEAD_S = 0.7e-6
WG_ROWS = 64  # WGMMA M of one warpgroup


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
        """The JSON fields of ``--model-only`` rows."""
        return {"tiles": self.tiles, "sm_fill": round(self.sm_fill, 4),
                "weight_reads_per_active_expert": round(self.weight_reads_per_active_expert, 4),
                "x_bytes_over_weight_bytes": round(self.x_bytes_over_weight_bytes, 4),
                "rows_computed_per_useful_row": round(self.rows_computed_per_useful_row, 4),
                "predicted_us": round(self.predicted_us, 2),
                "hbm_bytes": {"weights": self.weight_bytes, "x": self.x_bytes,
                              "out": self.out_bytes},
                "flops_issued": self.flops, "config": self.config}


def _tile_order(num_items: int, num_n_blocks: int, grid_block_n: int) -> np.ndarray:
    """item of each linear tile index, as the kernel's planar_snake maps it."""
    lin = jnp.arange(num_items * num_n_blocks, dtype=jnp.int32)
    snake = jax.vmap(lambda i: plgpu.planar_snake(i, (num_items, num_n_blocks), 1,
                                                  grid_block_n)[0])
    return np.asarray(snake(lin))


def roofline_s(flops: float, nbytes: float, num_sms: int = H200_NUM_SMS,
               active_sms: int | None = None) -> float:
    """max(compute, memory) time on ``active_sms`` of num_sms SMs."""
    share = (active_sms or num_sms) / num_sms
    return max(flops / (DENSE_BF16_FLOPS * share), nbytes / (COPY_BYTES_PER_S * share))


def grouped_cost(group_sizes_G, m: int, k: int, n: int, num_weights: int, *,
                 dtype=jnp.bfloat16, config: mosaic_sm90.TileConfig | None = None,
                 num_sms: int = H200_NUM_SMS) -> KernelCost:
    """Model one grouped launch: x [m, k] (rows sorted by group) times
    num_weights weights [G, k, n] with the concrete ``group_sizes_G``."""
    sizes = np.asarray(group_sizes_G, np.int64)
    launch = mosaic_sm90.plan_launch(m, k, n, len(sizes), num_weights, dtype, dtype, config)
    cfg = launch.cfg
    planes = launch.planes
    in_bytes = 2 * planes
    out_bytes = jnp.dtype(dtype).itemsize
    meta = np.asarray(mosaic_sm90.work_items_4W(jnp.asarray(sizes, jnp.int32), m, cfg.block_m))
    group_W, offset_W, count_W = meta[0], meta[2], meta[3]
    num_items = meta.shape[1]
    k_steps = launch.num_k_steps

    # 64-row warpgroup slices that run WGMMAs: every consumer of a matmul item.
    matmul_W = (count_W > 0) & (group_W >= 0)
    wgs_W = np.where(matmul_W, cfg.num_compute_wgs, 0)
    products = 1 if planes == 1 else 3
    flops_W = wgs_W * WG_ROWS * cfg.block_n * k_steps * cfg.block_k * 2 * num_weights * products
    x_W = np.where(matmul_W, cfg.block_m * k_steps * cfg.block_k * in_bytes, 0)
    w_W = np.where(matmul_W, num_weights * k_steps * cfg.block_k * cfg.block_n * in_bytes, 0)
    o_W = count_W * cfg.block_n * out_bytes
    per_sm_flops = DENSE_BF16_FLOPS / num_sms
    per_sm_bw = COPY_BYTES_PER_S / num_sms
    time_W = np.where(count_W > 0, np.maximum(flops_W / per_sm_flops, (x_W + w_W + o_W) / per_sm_bw)
                      + TILE_OVERHEAD_S, 0.0)

    item_T = _tile_order(num_items, launch.num_n_blocks, cfg.grid_block_n)
    time_T = time_W[item_T]
    cta_time = np.bincount(np.arange(len(time_T)) % num_sms, weights=time_T, minlength=num_sms)
    busiest = float(cta_time.max())
    n_blocks = launch.num_n_blocks
    useful_rows = int(min(sizes.sum(), m))
    active = int(np.count_nonzero(sizes[np.cumsum(sizes) - sizes < m]))
    return KernelCost(
        tiles=int(np.count_nonzero(count_W)) * n_blocks,
        sm_fill=float(time_T.sum() / (num_sms * busiest)) if busiest else 0.0,
        weight_bytes=float(w_W.sum() * n_blocks), x_bytes=float(x_W.sum() * n_blocks),
        out_bytes=float(o_W.sum() * n_blocks),
        weight_reads_per_active_expert=float(np.count_nonzero(matmul_W) / active) if active else 0.0,
        rows_computed_per_useful_row=(float(wgs_W.sum() * WG_ROWS / useful_rows)
                                      if useful_rows else 0.0),
        flops=float(flops_W.sum() * n_blocks),
        predicted_us=busiest * 1e6,
        config={**dataclasses.asdict(cfg), "planes": planes})


def mlp_cost(tokens: int, d: int, f: int, *, dtype=jnp.bfloat16,
             config: mosaic_sm90.TileConfig | None = None,
             num_sms: int = H200_NUM_SMS) -> KernelCost:
    """Model situ_mlp_up: x [tokens, d] @ gate/up [d, f] (one group, every row)."""
    return grouped_cost([tokens], tokens, d, f, 2, dtype=dtype, config=config, num_sms=num_sms)


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


__all__ = ["COPY_BYTES_PER_S", "DENSE_BF16_FLOPS", "H200_NUM_SMS", "KernelCost",
           "TILE_OVERHEAD_S", "grouped_cost", "mlp_cost", "roofline_s", "xla_mlp_roofline_s",
           "xla_ragged_dot_dense_s"]
