"""The tile search: which launch the grouped and MLP launchers should run for
a shape, chosen by the kernel cost model (k3jax.tools.kernel_cost) against
explicit targets (SearchTargets). scripts.write_tile_table runs it over the
K3 shapes and commits the picks to pallas_kernels/data/tile_table.json;
the launchers read that table and never run this search.

Grouped products (best_grouped_config): the row-major tiles (mosaic_sm90's
default) against every swap-AB tiling (mosaic_sm90_swap_ab) of
swap_ab_candidates, each costed over SearchTargets.proxy_seeds routings
(uniform multinomial draws of the rows over the groups: the launcher sees
traced group sizes). The dense MLP (best_mlp_config): mosaic_sm90's fused
tiles at a few N widths and split-K factors, costed on the static schedule.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
import numpy as np

from k3jax.tools.kernel_cost import H200_NUM_SMS, KernelCost, grouped_cost, mlp_cost, swap_ab_cost
from pallas_kernels.grouped_matmul import mosaic_sm90, mosaic_sm90_swap_ab, schedule, tiling


@dataclasses.dataclass(frozen=True)
class SearchTargets:
    """What the search aims for; every pick is a function of these and the shape.

    Grouped: a swap-AB launch is preferred when it keeps x bytes <= x_over_w
    of the weight bytes and <= max_reads weight reads per active expert on
    every proxy routing, and is predicted at most ``tie`` slower than the
    row-major tiles (the model's SM-fill quantization moves predictions by
    ~1 / tiles-per-SM, and its roofline does not credit the L2 -> SMEM x
    traffic the lean tilings save). MLP: the fastest launch that fills >=
    mlp_sm_fill of the SMs; else, within mlp_split_tie of the fastest, the
    fullest."""

    x_over_w: float = 0.10
    max_reads: float = 1.05
    tie: float = 0.02
    swap_ab_splits: tuple[int, ...] = (1, 2, 3, 4)   # split-K factors of the swap-AB candidates
    proxy_seeds: tuple[int, ...] = tuple(range(16))   # numpy default_rng seeds of the routings
    mlp_sm_fill: float = 0.9
    mlp_split_tie: float = 0.05
    mlp_split_fill_screen: float = 0.85   # split-K factors whose equal tiles fill less: skipped

    def __post_init__(self) -> None:
        if not self.proxy_seeds or not self.swap_ab_splits:
            raise ValueError("SearchTargets needs at least one proxy seed and one split-K factor")
        for name in ("x_over_w", "max_reads", "mlp_sm_fill", "mlp_split_fill_screen"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SearchTargets.{name} must be > 0, got {getattr(self, name)!r}")


TARGETS = SearchTargets()


def proxy_group_sizes(num_rows: int, num_groups: int,
                      seeds: tuple[int, ...] = TARGETS.proxy_seeds) -> list[np.ndarray]:
    """int32 [num_groups] per seed: num_rows rows drawn uniformly over the groups."""
    return [np.random.default_rng(seed).multinomial(
        num_rows, np.full(num_groups, 1.0 / num_groups)).astype(np.int32) for seed in seeds]


def swap_ab_candidates(m: int, n: int, num_groups: int, num_weights: int,
                       targets: SearchTargets = TARGETS) -> list[mosaic_sm90_swap_ab.SwapABConfig]:
    """Swap-AB tilings worth modelling: token tiles from mean + 1 sigma of the
    rows per group to one step of 8 past mean + ROUTING_SIGMAS sigma, widths
    whose accumulators take <= MAX_ACC_REGISTERS a thread and divide N; empty
    above MAX_SWAP_AB_ROWS. Each tiling unclustered and, where its x tile is
    over targets.x_over_w of its weight tiles, in the smallest cluster C that
    brings it under, with the token tile raised (in steps of 8) to the first
    one whose x tile splits over C CTAs (accumulators <=
    MAX_CLUSTER_ACC_REGISTERS where N holds two superblocks or more: the
    clustered kernel's producer then keeps WIDE_ACC_MEMORY_REGISTERS and its
    tiles drain). C x block_w need not divide N: the last superblock
    overhangs N (the kernel reads zero fill past N) and its x / w counts the
    overhanging CTAs' x shares (block_t / (num_weights x block_w x C) x
    n_pad / N). Clusters only with two consumers of <= 128 accumulator
    columns (num_weights x wg_block_w) each: with one consumer, or two of
    2 x 128 columns, ptxas for sm_90a spills. Each tiling at every split-K
    factor of targets.swap_ab_splits."""
    rows = schedule.expected_rows(m, num_groups)
    if rows > mosaic_sm90_swap_ab.MAX_SWAP_AB_ROWS:
        return []
    mean = m / num_groups
    low = tiling.round_up(max(int(np.ceil(mean + np.sqrt(mean))), 1),
                                schedule.X_ROW_ALIGN)
    high = tiling.round_up(int(np.ceil(rows)), schedule.X_ROW_ALIGN) + 8
    max_acc = mosaic_sm90_swap_ab.MAX_ACC_REGISTERS
    max_cluster_acc = mosaic_sm90_swap_ab.MAX_CLUSTER_ACC_REGISTERS
    x_over_w = targets.x_over_w
    tilings = []
    for block_t in range(low, min(high, mosaic_sm90_swap_ab.MAX_SWAP_AB_ROWS) + 1, 8):
        for wgs, wg_w in ((1, 64), (1, 128), (2, 64), (2, 128), (1, 256), (2, 256)):
            cfg = mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=wgs, wg_block_w=wg_w,
                                                  block_t=block_t)
            if n % cfg.block_w or cfg.acc_registers(num_weights) > max_cluster_acc:
                continue
            if cfg.acc_registers(num_weights) <= max_acc:
                tilings.append(cfg)
            if (block_t <= x_over_w * num_weights * cfg.block_w or wgs == 1
                    or num_weights * wg_w > 128):
                continue
            for c in mosaic_sm90_swap_ab.CLUSTER_SIZES[1:]:
                t = next(t for t in range(block_t, mosaic_sm90_swap_ab.MAX_BLOCK_T + 1, 8)
                         if mosaic_sm90_swap_ab.multicast_splits(t, 64, c))
                clustered = dataclasses.replace(cfg, block_t=t, cluster=c)
                # x / w of the launch: the overhanging CTAs load their x shares too.
                n_pad = tiling.round_up(n, c * cfg.block_w)
                acc = clustered.acc_registers(num_weights)
                # Wide accumulators only over >= 2 superblocks (with one, ptxas spills).
                if ((acc <= max_acc or (acc <= max_cluster_acc and n_pad >= 2 * c * cfg.block_w))
                        and t * n_pad <= x_over_w * num_weights * cfg.block_w * c * n):
                    tilings.append(clustered)
                    break
    return [dataclasses.replace(cfg, split_k=s) for cfg in dict.fromkeys(tilings)
            for s in targets.swap_ab_splits]


@dataclasses.dataclass(frozen=True)
class CandidateCost:
    """One launch candidate of a grouped product, costed on every proxy routing."""

    config: mosaic_sm90_swap_ab.SwapABConfig | None  # None: mosaic_sm90's row-major tiles
    mean_us: float  # mean predicted time over the routings
    worst_x_over_w: float  # the largest x bytes / weight bytes of a routing
    worst_reads: float  # the most weight reads per active expert of a routing

    def meets(self, targets: SearchTargets) -> bool:
        """x <= targets.x_over_w of the weight bytes and <= targets.max_reads
        weight reads per active expert on every routing."""
        return self.worst_x_over_w <= targets.x_over_w and self.worst_reads <= targets.max_reads


@functools.lru_cache(maxsize=256)
def candidate_costs(m: int, k: int, n: int, num_groups: int, num_weights: int,
                    dtype_name: str = "bfloat16", targets: SearchTargets = TARGETS,
                    num_sms: int = H200_NUM_SMS) -> tuple[CandidateCost, ...]:
    """The row-major tiles (first) and every swap_ab_candidates tiling that
    fits (K ranges at least the pipeline, SMEM), each over the proxy
    routings: a candidate's time is its mean over them (the SM fill of a few
    hundred tiles jumps by up to 1 / tiles-per-SM with the item count, so one
    routing decides little)."""
    dtype = jnp.dtype(dtype_name)
    draws = proxy_group_sizes(m, num_groups, targets.proxy_seeds)

    def over_draws(config, cost_fn) -> CandidateCost:
        costs = [cost_fn(sizes) for sizes in draws]
        return CandidateCost(config, float(np.mean([c.predicted_us for c in costs])),
                             max(c.x_bytes_over_weight_bytes for c in costs),
                             max(c.weight_reads_per_active_expert for c in costs))

    with schedule.host_eval():
        costs = [over_draws(None, lambda s: grouped_cost(s, m, k, n, num_weights, dtype=dtype,
                                                         num_sms=num_sms))]
        for cfg in swap_ab_candidates(m, n, num_groups, num_weights, targets):
            try:
                costs.append(over_draws(cfg, lambda s, cfg=cfg: swap_ab_cost(
                    s, m, k, n, num_weights, dtype=dtype, config=cfg, num_sms=num_sms)))
            except ValueError:  # K ranges shorter than the pipeline, or SMEM overflow
                continue
    return tuple(costs)


@functools.lru_cache(maxsize=256)
def best_grouped_config(m: int, k: int, n: int, num_groups: int, num_weights: int,
                        dtype_name: str = "bfloat16", targets: SearchTargets = TARGETS,
                        num_sms: int = H200_NUM_SMS) -> mosaic_sm90_swap_ab.SwapABConfig | None:
    """A swap-AB tiling (SwapABConfig), or None for mosaic_sm90's row-major
    default tiles. The fastest swap-AB tiling that meets the targets and is
    within targets.tie of the row-major tiles wins; without one, of the
    candidates (row-major included) within targets.tie of the fastest, the
    one with the least x bytes over weight bytes. No swap-AB candidate: None."""
    if not swap_ab_candidates(m, n, num_groups, num_weights, targets):
        return None
    costs = candidate_costs(m, k, n, num_groups, num_weights, dtype_name, targets, num_sms)
    row_major_us = costs[0].mean_us
    lean = [c for c in costs[1:] if c.mean_us <= row_major_us * (1 + targets.tie)
            and c.meets(targets)]
    if lean:
        return min(lean, key=lambda c: c.mean_us).config
    fastest_us = min(c.mean_us for c in costs)
    near = [c for c in costs if c.mean_us <= fastest_us * (1 + targets.tie)]
    return min(near, key=lambda c: (c.worst_x_over_w, c.mean_us)).config


def x_lean_candidate(m: int, k: int, n: int, num_groups: int, num_weights: int,
                     dtype_name: str = "bfloat16", targets: SearchTargets = TARGETS,
                     num_sms: int = H200_NUM_SMS) -> CandidateCost | None:
    """The fastest swap-AB tiling that meets the targets whatever its
    predicted price (None if no candidate does): the device sweep times it
    beside the launcher's pick where that pick misses targets.x_over_w (the
    model's roofline has no L2 -> SMEM term, so x re-reads cost it nothing)."""
    lean = [c for c in candidate_costs(m, k, n, num_groups, num_weights, dtype_name, targets,
                                       num_sms)[1:] if c.meets(targets)]
    return min(lean, key=lambda c: c.mean_us, default=None)


def _uniform_fill(tiles: int, num_sms: int) -> float:
    """SM fill of ``tiles`` equal tiles on num_sms CTAs (the model's upper bound)."""
    return tiles / (num_sms * -(-tiles // num_sms))


def mlp_candidates(tokens: int, d: int, f: int, *, dtype=jnp.bfloat16,
                   targets: SearchTargets = TARGETS,
                   num_sms: int = H200_NUM_SMS) -> list[mosaic_sm90.TileConfig]:
    """The tile configurations best_mlp_config weighs for situ_mlp_up: the
    one-consumer fused tile (FUSED_DECODE) at block_n 128, 64 or 32, and the
    two-consumer one (FUSED_PREFILL) at 64 unsplit or 32 with split-K
    (block_n 32 only with f32 split-K partials: output rows of 128 bytes);
    unsplit or split-K S >= 2 for every S whose K ranges keep >= the
    pipeline's stages and whose equal tiles could fill >=
    targets.mlp_split_fill_screen of the SMs (S <= 4 always). Two consumers
    run at ptxas's 168-register cap for 3 warpgroups; with split-K ptxas
    spills them at block_n 128 and 64, not at 32."""
    out = []
    for tile, widths in ((mosaic_sm90.FUSED_DECODE, (128, 64, 32)),
                         (mosaic_sm90.FUSED_PREFILL, (64, 32))):
        for block_n in widths:
            for split_k in range(1, 2 * num_sms):
                if tile.num_compute_wgs > 1 and (split_k > 1) != (block_n == 32):
                    continue
                cfg = dataclasses.replace(tile, block_n=block_n, split_k=split_k)
                try:
                    launch = mosaic_sm90.plan_launch(tokens, d, f, 1, 2, dtype, dtype, cfg)
                except ValueError:  # K ranges shorter than the pipeline: no larger split
                    break
                out_bytes = 4 if split_k > 1 else jnp.dtype(dtype).itemsize
                if launch.cfg.block_n != block_n or block_n * out_bytes < 128:
                    continue  # fitted to another width (listed there), or output
                    # rows under 128 bytes (row-offset TMA stores need 128-byte rows)
                tiles = -(-tokens // launch.cfg.block_m) * launch.num_n_blocks * split_k
                if split_k <= 4 or _uniform_fill(tiles, num_sms) >= targets.mlp_split_fill_screen:
                    out.append(cfg)
    return out


@functools.lru_cache(maxsize=128)
def best_mlp_config(tokens: int, d: int, f: int, *, dtype=jnp.bfloat16,
                    targets: SearchTargets = TARGETS,
                    num_sms: int = H200_NUM_SMS) -> mosaic_sm90.TileConfig:
    """The tiles situ_mlp_up should launch, from mlp_candidates: the fastest
    predicted launch that fills >= targets.mlp_sm_fill of the SMs; if none
    does, within targets.mlp_split_tie of the fastest, the fullest launch
    (then the fewest splits): the model's per-SM bandwidth share is its least
    certain part. Split-K only wins where the tiles leave SMs idle (the f32
    partials cost a write and a read)."""
    costs: list[tuple[KernelCost, mosaic_sm90.TileConfig]] = []
    with schedule.host_eval():
        for cfg in mlp_candidates(tokens, d, f, dtype=dtype, targets=targets, num_sms=num_sms):
            try:
                costs.append((mlp_cost(tokens, d, f, dtype=dtype, config=cfg,
                                       num_sms=num_sms), cfg))
            except ValueError:  # K ranges shorter than the fitted pipeline
                continue
    fastest = min(cost.predicted_us for cost, _ in costs)
    full = [(cost, cfg) for cost, cfg in costs if cost.sm_fill >= targets.mlp_sm_fill]
    if full:
        return min(full, key=lambda c: (c[0].predicted_us, c[1].split_k))[1]
    near = [(cost, cfg) for cost, cfg in costs
            if cost.predicted_us <= fastest * (1 + targets.mlp_split_tie)]
    return max(near, key=lambda c: (round(c[0].sm_fill, 2), -c[1].split_k))[1]


__all__ = ["TARGETS", "CandidateCost", "SearchTargets", "best_grouped_config", "best_mlp_config",
           "candidate_costs", "mlp_candidates", "proxy_group_sizes", "swap_ab_candidates",
           "x_lean_candidate"]
