"""mosaic_sm90_swap_ab where the last cluster group overhangs N (C x block_w
not dividing N): the weights are not padded, the N-blocks past N read TMA's
out-of-bounds zero fill (GPU interpret mode fills the same zeros), in
interpret mode vs a float64 numpy loop; the launcher's jaxpr has no pad of
a weight; the cost model charges the overhanging CTAs' tiles but counts
only the in-bounds weight bytes and flops. (Columns past N only feed
output rows past N, which XLA drops: what the interpret cases check is the
partly in-bounds N-block and that the overhanging copies are accepted,
where interpret mode raises IndexError on an out-of-bounds copy it cannot fill.)

The sm_90a ptxas compile (0 spills) of the overhanging x-lean tilings of
the sweep's down rows is test_kernels_grouped_swap_ab.py's
test_table_and_x_lean_swap_ab_tiles_compile_for_sm90a_without_spills.

Measured on the 2-core host, nothing else running: the whole file ~40 s
(the three interpret cases 11-14 s each, the rest ~1 s).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_cases as kc  # noqa: E402
import tiers  # noqa: E402
from k3jax.tools import kernel_cost, tile_search  # noqa: E402
from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab as dec  # noqa: E402

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}
SwapABConfig = dec.SwapABConfig

# (m, k, n, sizes, dtype, config). Empty groups and a NaN tail past
# sum(sizes) in every case. 1: down-like N = 448 = 3.5 x 128 in a cluster
# of 4 x 128 columns (n_pad 512): the last N-block holds 64 columns, its
# second consumer's weights are all zero fill. 2: bf16x3 float32, N = 320
# in a cluster of 4 x 128 (n_pad 512): one N-block half past N, one wholly
# past it; 2 clusters walk 4 items. 3: N = 200 (not a multiple of 64) in a
# cluster of 2 x 64 (n_pad 256) with split-K (two K-range lengths).
CASES = [
    (40, 192, 448, [7, 0, 13, 1, 0], BF16,
     SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=16, max_concurrent_steps=2,
                  num_ctas=4, cluster=4)),
    tiers.slow((24, 128, 320, [0, 9, 5, 3], F32,
                SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=8, max_concurrent_steps=2,
                             num_ctas=8, cluster=4))),
    tiers.slow((30, 320, 200, [4, 0, 11, 6], BF16,
                SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, max_concurrent_steps=2,
                             split_k=2, num_ctas=2, cluster=2))),
]


def _weight_pads(fn, *args) -> list:
    """The pad equations of fn's jaxpr (nested jaxprs included) whose operand
    is 3-D: a weight [G, K, N] (x is 2-D, the schedule 1-D)."""
    pads = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pad" and eqn.invars[0].aval.ndim == 3:
                pads.append(eqn)
            for param in eqn.params.values():
                for sub in (param if isinstance(param, (list, tuple)) else [param]):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub)
    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return pads


@pytest.mark.parametrize("case", CASES, ids=kc.swap_ab_case_id)
def test_overhanging_cluster_matches_float64_without_weight_padding(case):
    """Neither launcher pads a weight, and both products match the float64
    loop (kc.check_swap_ab_products: tail rows exactly 0, no NaN from the
    poisoned tail of x)."""
    m, k, n, sizes, dtype, cfg = case
    plan = dec.plan_launch(m, k, n, len(sizes), 2, dtype, dtype, cfg)
    assert plan.n_pad % n and plan.n_pad > n  # the last superblock overhangs N
    sizes_j = jnp.asarray(sizes, jnp.int32)
    x, (wg, wu) = kc.grouped_inputs(0, m, k, n, len(sizes), dtype, 2)
    assert _weight_pads(lambda x, w, s: dec.grouped_matmul(x, w, s, config=cfg, interpret=True),
                        x, wg, sizes_j) == []
    assert _weight_pads(lambda x, a, b, s: dec.grouped_situ_glu(
        x, a, b, s, config=cfg, interpret=True, **SITU), x, wg, wu, sizes_j) == []
    kc.check_swap_ab_products(case, seed=m + k + n)


def test_weight_pitch_tma_cannot_take_is_padded_to_eight_columns():
    """N = 100 (a 200-byte row pitch, not a multiple of 16): the launcher pads
    the weights to 104 columns only, and the rest of n_pad = 128 is zero fill."""
    m, k, n, sizes = 16, 128, 100, np.asarray([5, 0, 7], np.int32)
    cfg = SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, max_concurrent_steps=2,
                       num_ctas=2, cluster=2)
    plan = dec.plan_launch(m, k, n, len(sizes), 1, BF16, BF16, cfg)
    assert (plan.w_cols, plan.n_pad) == (104, 128)
    x, (w,) = kc.grouped_inputs(5, m, k, n, len(sizes), BF16, 1)
    pads = _weight_pads(lambda x, w, s: dec.grouped_matmul(x, w, s, config=cfg, interpret=True),
                        x, w, jnp.asarray(sizes))
    assert [p.outvars[0].aval.shape for p in pads] == [(3, 128, 104)]


def test_model_counts_in_bounds_weights_and_charges_the_overhang():
    """N = 448 in a cluster of 4 x 128 columns (n_pad 512, the last N-block
    half past N) vs N = 512: the same tiles, x bytes and cluster time (the
    overhanging CTA runs its whole K loop), weight bytes and flops 448 / 512
    of them; x / w rises by 512 / 448."""
    cfg = SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=16, cluster=4)
    sizes = [9, 14, 0, 11]
    over = kernel_cost.swap_ab_cost(sizes, 40, 1024, 448, 1, config=cfg, num_sms=8)
    whole = kernel_cost.swap_ab_cost(sizes, 40, 1024, 512, 1, config=cfg, num_sms=8)
    assert over.tiles == whole.tiles
    assert over.x_bytes == whole.x_bytes
    assert over.weight_bytes == pytest.approx(whole.weight_bytes * 448 / 512)
    assert over.flops == pytest.approx(whole.flops * 448 / 512)
    assert over.x_bytes_over_weight_bytes == pytest.approx(
        whole.x_bytes_over_weight_bytes * 512 / 448)
    # Every cluster tile holds one in-bounds 128-column CTA tile at least:
    # the busiest cluster's time is unchanged (XLA's gather reads n rows).
    def gather_us(n):
        return 40 * n * (2 + 2) / kernel_cost.COPY_BYTES_PER_S * 1e6
    assert over.predicted_us - gather_us(448) == pytest.approx(
        whole.predicted_us - gather_us(512))


def test_candidates_overhang_n_where_no_divisor_meets_the_x_target():
    """down (N = 3584 = 7 x 512) at ~37 rows a group (1024 rows over 28
    groups, as EP 32 x 64 tokens): 64-token tiles need C x block_w >= 640
    for x / w <= 0.10, so the candidates take C x block_w = 1024, which
    overhangs N (n_pad 4096); every clustered candidate meets the target
    counting the overhanging CTAs' x shares (block_t / (block_w x C) x n_pad / N)."""
    n = 3584
    cands = tile_search.swap_ab_candidates(1024, n, 28, 1)
    clustered = [c for c in cands if c.cluster > 1]
    assert any(n % (c.block_w * c.cluster) for c in clustered)
    for c in clustered:
        n_pad = -(-n // (c.block_w * c.cluster)) * c.block_w * c.cluster
        assert c.block_t / (c.block_w * c.cluster) * n_pad / n <= tile_search.TARGETS.x_over_w, c
