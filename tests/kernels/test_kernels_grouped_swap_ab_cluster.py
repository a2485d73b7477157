"""mosaic_sm90_swap_ab with a CTA cluster (SwapABConfig.cluster = C > 1): the
x tile multicast over C CTAs that run C adjacent N-blocks of one (item, K
range), in GPU interpret mode vs a float64 numpy loop; the multicast split
rule and the cost model's cluster figures (x bytes / C, num_sms // C
clusters).

The sm_90a ptxas compile (0 spills) of the clustered tilings the tile table
holds for the sweep's decode rows is test_kernels_grouped_swap_ab.py's
test_table_and_x_lean_swap_ab_tiles_compile_for_sm90a_without_spills.

Measured on the 2-core host, nothing else running: the whole file 56 s (the
three interpret cases 24 + 18 + 13 s, the launcher dispatch 21 s, the
model and rule tests 3 s).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_cases as kc  # noqa: E402
import tiers  # noqa: E402
from k3jax.tools import kernel_cost, tile_search  # noqa: E402
from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab as dec  # noqa: E402

pytestmark = pytest.mark.tiers(slow=["test_launcher_dispatch_runs_a_cluster_tiling"])

BF16, F32 = jnp.bfloat16, jnp.float32
SwapABConfig = dec.SwapABConfig

# (m, k, n, sizes, dtype, config). Empty groups and a NaN tail past
# sum(sizes) in every case. 1: 2 clusters of 2 walk 5 items x 4 superblocks
# (the persistent loop, the cluster barriers' phases across tiles). 2: a
# cluster of 4 with split-K (two K-range lengths), one cluster for all the
# tiles. 3: bf16x3 float32 (two multicast x planes), N = 192 in superblocks
# of 2 x 128 columns (the last one overhangs N: zero fill, no weight padding),
# 3 CTAs = 1 cluster of 2 and an idle CTA.
CASES = [
    tiers.slow((40, 320, 512, [7, 0, 13, 1, 0], BF16,
                SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=16, max_concurrent_steps=2,
                             num_ctas=4, cluster=2))),
    tiers.slow((40, 320, 256, [7, 0, 13, 1, 0], BF16,
                SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, max_concurrent_steps=2,
                             split_k=2, num_ctas=4, cluster=4))),
    (24, 128, 192, [0, 9, 5, 3], F32,
     SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=16, max_concurrent_steps=2,
                  num_ctas=3, cluster=2)),
]


@pytest.mark.parametrize("case", CASES, ids=kc.swap_ab_case_id)
def test_cluster_decode_kernel_interpret_matches_float64(case):
    """Both products of one launch shape against the float64 loop; tail rows
    exactly 0, no NaN from the poisoned tail of x."""
    m, k, n, sizes, dtype, cfg = case
    plan = dec.plan_launch(m, k, n, len(sizes), 2, dtype, dtype, cfg)
    num_clusters = cfg.num_ctas // cfg.cluster
    assert plan.num_cluster_tiles > num_clusters  # the persistent loop runs
    kc.check_swap_ab_products(case, seed=m + k + n + cfg.cluster)


def test_multicast_split_rule():
    """Mosaic cuts the tiled x tile [block_t / 8, block_k / 64, 8] from the
    leading dim: block_t / 8 odd (24, 40, 56) takes no cluster, 48 (6 row
    tiles) only 2, 96 (12) 2 and 4; 8 and 16 rows split inside the 8-row tiles."""
    splits = {bt: [c for c in (2, 4, 8) if dec.multicast_splits(bt, 64, c)]
              for bt in (8, 16, 24, 40, 48, 56, 64, 96, 128)}
    assert splits == {8: [2, 4, 8], 16: [2, 4, 8], 24: [], 40: [], 48: [2], 56: [],
                      64: [2, 4, 8], 96: [2, 4], 128: [2, 4, 8]}


def test_bad_cluster_tiles_are_rejected():
    with pytest.raises(ValueError, match="cluster must be one of"):
        SwapABConfig(cluster=3)
    with pytest.raises(ValueError, match="num_ctas=2 holds no cluster of 4"):
        SwapABConfig(cluster=4, num_ctas=2)
    with pytest.raises(ValueError, match=r"x tile \[40, 64\] does not split over a cluster of 2"):
        dec.plan_launch(40, 320, 256, 5, 1, BF16, BF16,
                        SwapABConfig(block_t=40, max_concurrent_steps=2, cluster=2))


def test_cluster_plan_pads_n_to_whole_superblocks():
    plan = dec.plan_launch(24, 128, 192, 4, 1, BF16, BF16,
                           SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, cluster=4))
    assert plan.n_pad == 256 and plan.num_n_blocks == 4
    assert plan.w_cols == 192  # the weights are not padded: N-block 3 reads zero fill
    assert plan.num_cluster_tiles == plan.num_items  # one superblock, no split-K


def test_model_cluster_counts_match_a_hand_count():
    """The hand count of test_kernels_grouped_swap_ab (groups of 5 and 13 rows,
    M 24, K 256, N 256, 8-token tiles, one 64-wide consumer: 4 items x 4
    N-blocks) in a cluster of 2: the same 16 CTA tiles and weight bytes, x
    bytes halved (x / w = 8 / 64 / 2), the rest unchanged; 8 cluster tiles
    on 2 clusters of the 4 SMs run 4 each, as 16 tiles on 4 unclustered CTAs."""
    base = SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, max_concurrent_steps=2)
    one = kernel_cost.swap_ab_cost([5, 13], 24, 256, 256, 1, config=base, num_sms=4)
    two = kernel_cost.swap_ab_cost([5, 13], 24, 256, 256, 1,
                                 config=dataclasses.replace(base, cluster=2), num_sms=4)
    assert two.tiles == one.tiles == 16
    assert two.weight_bytes == one.weight_bytes == 16 * 256 * 64 * 2
    assert two.x_bytes == one.x_bytes / 2 == 16 * 256 * 8 * 2 / 2
    assert two.x_bytes_over_weight_bytes == pytest.approx(8 / 64 / 2)
    assert two.weight_reads_per_active_expert == one.weight_reads_per_active_expert
    assert two.flops == one.flops
    assert two.predicted_us == pytest.approx(one.predicted_us)
    assert two.sm_fill == pytest.approx(one.sm_fill)


def test_model_charges_the_sms_a_cluster_size_leaves_idle():
    """132 SMs hold 16 clusters of 8 (128 SMs): 128 equal cluster tiles take
    8 rounds, where unclustered 1024 CTA tiles on 132 SMs take 8 rounds
    (1024 / 132 = 7.8); the SM fill is 128 / 132 of the busy time. (K = 448:
    7 K steps, so the tiles drain and each pays the same overhead.)"""
    sizes = [8] * 128
    cfg = SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, cluster=8)
    assert not dec.plan_launch(8 * 128, 448, 512, 128, 1, jnp.bfloat16, jnp.bfloat16,
                               cfg).no_drain
    cost = kernel_cost.swap_ab_cost(sizes, 8 * 128, 448, 512, 1, config=cfg)
    assert cost.tiles == 128 * 8
    assert cost.sm_fill == pytest.approx(128 / 132)
    unclustered = kernel_cost.swap_ab_cost(sizes, 8 * 128, 448, 512, 1,
                                         config=SwapABConfig(num_compute_wgs=1, wg_block_w=64,
                                                             block_t=8))
    assert unclustered.sm_fill == pytest.approx(1024 / (132 * 8))


def test_candidates_add_the_smallest_cluster_that_meets_the_x_target():
    """gate_up (2 weights, N 3072) at ~18 rows a group: the 40-token tile of
    two 64-wide consumers has x / w = 40 / 256; 40 splits over no cluster, so
    it is raised to 48 tokens in a cluster of 2 (48 / (256 x 2) = 0.094 <=
    0.10). Every clustered candidate meets the target counting the x shares
    of CTAs past N (x / w x n_pad / N), its smaller cluster would not (or
    could not split x), and it has two consumers of <= 128 accumulator columns."""
    n = 3072

    def x_over_w(c, cluster):
        n_pad = -(-n // (c.block_w * cluster)) * c.block_w * cluster
        return c.block_t / (2 * c.block_w * cluster) * n_pad / n
    cands = tile_search.swap_ab_candidates(1024, n, 56, 2)
    clustered = {(c.num_compute_wgs, c.wg_block_w, c.block_t, c.cluster)
                 for c in cands if c.cluster > 1}
    assert (2, 64, 48, 2) in clustered
    for c in cands:
        if c.cluster > 1:
            assert x_over_w(c, c.cluster) <= tile_search.TARGETS.x_over_w, c
            assert x_over_w(c, c.cluster // 2) > tile_search.TARGETS.x_over_w \
                or not dec.multicast_splits(c.block_t, 64, c.cluster // 2), c
            assert c.acc_registers(2) <= 128, c
            assert c.num_compute_wgs == 2 and 2 * c.wg_block_w <= 128, c


def test_launcher_dispatch_runs_a_cluster_tiling(monkeypatch):
    """backend="interpret" runs a cluster tiling the tile table holds (~40
    rows a group, N 2048: two 64-wide consumers, 64 tokens, a cluster of 8:
    x / w = 64 / 1024) as one cluster of 8 CTAs (interpret mode has 4 "SMs")
    and matches float64, the NaN tail left out."""
    from pallas_kernels.grouped_matmul import api
    m, k, n = 320, 128, 2048
    cfg = SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=64, cluster=8)
    kc.use_tile_rows(monkeypatch, {("grouped", m, k, n, 8, 1, "bfloat16"): cfg})
    calls = kc.spy_swap_ab_launches(monkeypatch)
    sizes = np.asarray([41, 37, 0, 45, 40, 38, 44, 35], np.int32)  # 280 of 320 rows
    x, (w,) = kc.grouped_inputs(11, m, k, n, len(sizes), BF16, 1)
    x = kc.poison_tail(x, sizes)
    y = api.grouped_matmul(x, w, jnp.asarray(sizes), backend="interpret")
    assert [c.cluster for c in calls] == [8], calls
    kc.assert_grouped_output(y, kc.np_grouped_matmul(kc.f32(x), kc.f32(w), sizes), sizes,
                             kc.TOL_BF16, "dispatch cluster 8")
