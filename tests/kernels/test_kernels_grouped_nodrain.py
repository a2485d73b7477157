"""mosaic_sm90 without a pipeline drain between a CTA's tiles (LaunchPlan.no_drain):
the launcher's stage choice, the per-CTA first / last matmul tile that XLA
computes (pipeline_bounds_2C) against a plain replay of the persistent loop,
and the chained kernel (START / STEADY / STOP pipelines) against float64 in
GPU interpret mode, whose barrier model rejects a wrong chain (tried on
this branch: START on every tile fails "threads must observe each barrier
completion before any arrivals in the next phase"; a single-tile CTA without
the quiesce fails "when barrier ... was deallocated, thread ... had only
observed barrier up to phase 0"). Each case forces a few CTAs so that a CTA
runs many tiles and the ring wraps within and across tiles.

Measured on the 2-core machine: 5-7 s per interpret case and about 40 s for
the file when idle, 12-30 s per case when loaded."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax.experimental.pallas import mosaic_gpu as plgpu

import kernel_cases as kc
import tiers
from pallas_kernels.grouped_matmul import mosaic_sm90, schedule

pytestmark = pytest.mark.tiers(
    slow=["test_interpret_race_detector_finds_no_races_in_the_chain"])

BF16, F32 = jnp.bfloat16, jnp.float32


def test_no_drain_stages_is_the_largest_common_divisor_from_3():
    assert schedule.no_drain_stages({56}, 5) == 4      # K 3584 / 64, FUSED_DECODE's 5
    assert schedule.no_drain_stages({56}, 8) == 8      # PLAIN_DECODE keeps 8
    assert schedule.no_drain_stages({48}, 5) == 4
    assert schedule.no_drain_stages({56}, 3) == 0      # 3 does not divide 56: drain
    assert schedule.no_drain_stages({12, 16}, 8) == 4
    assert schedule.no_drain_stages({7, 8}, 8) == 0    # split-K ranges of two lengths
    assert schedule.no_drain_stages({4}, 2) == 0       # fewer than 3 stages: drain


@pytest.mark.parametrize("m,k,n,g,w,dtype,cfg,stages,no_drain", [
    (64, 3584, 3072, 1, 2, BF16, mosaic_sm90.FUSED_DECODE, 4, True),
    (64, 3072, 3584, 1, 1, BF16, mosaic_sm90.PLAIN_DECODE, 8, True),
    (512, 3584, 3072, 2, 1, BF16, mosaic_sm90.PLAIN_PREFILL, 3, False),  # 56 % 3
    (512, 3072, 3584, 2, 1, BF16, mosaic_sm90.PLAIN_PREFILL, 3, True),
    (512, 3072, 3584, 2, 2, F32, mosaic_sm90.FUSED_PREFILL, 2, False),   # f32 x 2 consumers
    # split-K: ranges of one length chain, two lengths (always coprime) drain
    (8, 3584, 768, 1, 2, BF16, mosaic_sm90.TileConfig(block_n=64, max_concurrent_steps=5,
                                                      split_k=7), 4, True),
    (8, 3584, 768, 1, 2, BF16, mosaic_sm90.TileConfig(block_n=64, max_concurrent_steps=5,
                                                      split_k=11), 5, False),
])
def test_plan_launch_records_the_no_drain_choice(m, k, n, g, w, dtype, cfg, stages, no_drain):
    plan = mosaic_sm90.plan_launch(m, k, n, g, w, dtype, dtype, cfg)
    assert (plan.cfg.max_concurrent_steps, plan.no_drain) == (stages, no_drain)


def _replay_bounds(meta_4W, num_n_blocks, split_k, grid_block_n, num_ctas):
    """The persistent loop replayed in Python: CTA c runs tiles c, c + C, ...;
    tile t is K range t // (W * NB), then (item, N-block) = planar_snake."""
    meta = np.asarray(meta_4W)
    num_items = meta.shape[1]
    item_L = np.asarray(jax.jit(jax.vmap(lambda i: plgpu.planar_snake(
        i, (num_items, num_n_blocks), 1, grid_block_n)[0]))(
        jnp.arange(num_items * num_n_blocks)))
    bounds = np.full((2, num_ctas), -1)
    for t in range(split_k * num_items * num_n_blocks):
        item = item_L[t % (num_items * num_n_blocks)]
        if meta[3, item] > 0 and meta[0, item] >= 0:
            c = t % num_ctas
            bounds[0, c] = t if bounds[0, c] < 0 else bounds[0, c]
            bounds[1, c] = t
    return bounds


def test_pipeline_bounds_match_a_replay_of_the_loop():
    """Empty groups, a tail item and a snake whose matmul tiles are no prefix;
    some CTAs run no matmul tile (-1)."""
    sizes = jnp.asarray([0, 30, 0, 41, 25, 0], jnp.int32)
    for block_m, num_n_blocks, split_k, grid_block_n, num_ctas in (
            (64, 4, 1, 2, 3), (64, 3, 2, 2, 5), (128, 5, 1, 3, 11), (64, 4, 1, 2, 40)):
        meta = schedule.work_items_4W(sizes, 160, block_m)
        got = schedule.pipeline_bounds_2C(meta, num_n_blocks, split_k, grid_block_n, num_ctas)
        want = _replay_bounds(meta, num_n_blocks, split_k, grid_block_n, num_ctas)
        np.testing.assert_array_equal(np.asarray(got), want)
    assert (want[0] == -1).any()  # the last layout leaves CTAs without a matmul tile


def _chain_facts(sizes, m, k, n, num_weights, dtype, cfg, static=False):
    """Per CTA of the launch: matmul tiles, and whether a tail (zeros) tile runs
    between its first and last matmul tile."""
    plan = mosaic_sm90.plan_launch(m, k, n, len(sizes), num_weights, dtype, dtype, cfg)
    c = plan.cfg
    meta = np.asarray(schedule.schedule(np.asarray(sizes, np.int32) if static
                                           else jnp.asarray(sizes), m, c.block_m))
    runs_T = np.asarray(schedule.matmul_tiles_T(jnp.asarray(meta), plan.num_n_blocks,
                                                   c.split_k, c.grid_block_n))
    bounds = np.asarray(schedule.pipeline_bounds_2C(
        jnp.asarray(meta), plan.num_n_blocks, c.split_k, c.grid_block_n, c.num_ctas))
    num_items = meta.shape[1]
    snake = jax.jit(jax.vmap(lambda i: plgpu.planar_snake(
        i, (num_items, plan.num_n_blocks), 1, c.grid_block_n)[0]))
    t_T = np.arange(runs_T.shape[0])
    item_T = np.asarray(snake(jnp.asarray(t_T % (num_items * plan.num_n_blocks))))
    zeros_T = (meta[3, item_T] > 0) & (meta[0, item_T] < 0)
    cta_T = t_T % c.num_ctas
    tiles = [int(runs_T[cta_T == j].sum()) for j in range(c.num_ctas)]
    between = [bool((zeros_T & (cta_T == j) & (t_T > bounds[0, j]) & (t_T < bounds[1, j])).any())
               for j in range(c.num_ctas)]
    return plan, tiles, between


ONE_WG = dict(num_compute_wgs=1, block_n=32, max_concurrent_steps=4, grid_block_n=2)
SIZES = [30, 0, 41, 0, 25]  # 96 of 160 rows: empty groups and a 64-row tail that stores zeros


def _run(kind, x, ws, sizes, cfg):
    if kind == "matmul":
        out = mosaic_sm90.grouped_matmul(x, *ws, sizes, config=cfg, interpret=True)
        return out, kc.np_grouped_matmul(x, *ws, np.asarray(sizes))
    out = mosaic_sm90.grouped_situ_glu(x, *ws, sizes, beta=kc.BETA, linear_beta=kc.LINEAR_BETA,
                                       config=cfg, interpret=True)
    return out, kc.np_grouped_situ_glu(x, *ws, np.asarray(sizes))


# (kind, m, k, n, dtype, cfg, the launch's shape of the chain)
CHAIN_CASES = {
    # 3 CTAs x 4 matmul tiles (START, STEADY, STEADY, STOP), 8 K steps on 4
    # stages, tail tiles between matmul tiles in every CTA.
    "matmul_bf16_3cta": ("matmul", 160, 512, 128, BF16,
                         mosaic_sm90.TileConfig(**ONE_WG, num_ctas=3), "many"),
    # 7 CTAs: two run a single matmul tile (START, then the quiesce after the
    # loop), one runs a tail tile between its two.
    "situ_bf16_7cta": ("situ", 160, 512, 128, BF16,
                       mosaic_sm90.TileConfig(**ONE_WG, num_ctas=7), "single"),
    # float32 (bf16x3, two planes): 6 K steps, 4 fitted stages -> 3.
    "matmul_f32_2cta": ("matmul", 160, 384, 128, F32,
                        mosaic_sm90.TileConfig(**ONE_WG, num_ctas=2), "many"),
}  # the prefill tiles (2 consumers): the race-detector test below
# The everyday tier runs situ_bf16_7cta; the other two are in the slow tier.


@pytest.mark.parametrize("name", [n if n == "situ_bf16_7cta" else tiers.slow(n) for n in CHAIN_CASES])
def test_chained_tiles_match_float64(name):
    kind, m, k, n, dtype, cfg, shape = CHAIN_CASES[name]
    num_w = 1 if kind == "matmul" else 2
    plan, tiles, between = _chain_facts(SIZES, m, k, n, num_w, dtype, cfg)
    assert plan.no_drain and plan.num_k_steps > plan.cfg.max_concurrent_steps >= 3, plan
    if shape == "many":
        assert min(tiles) >= 2 and any(t >= 3 for t in tiles) and any(between), (tiles, between)
    else:
        assert 1 in tiles and any(between), (tiles, between)
    x, ws = kc.grouped_inputs(7 + m + k + num_w, m, k, n, len(SIZES), dtype, num_w)
    x = kc.poison_tail(x, SIZES)
    out, ref = _run(kind, x, ws, jnp.asarray(SIZES), cfg)
    assert out.dtype == dtype
    kc.assert_grouped_output(out, ref, SIZES, kc.kernel_tol(dtype), name)


def test_chained_split_k_dense_matches_float64():
    """The dense MLP's split-K (static sizes: only the used item): 12 K steps of
    16 in 3 ranges of 4 on 4 stages, 2 CTAs x 6 tiles, f32 partials summed by XLA."""
    m, k, n = 24, 192, 128
    cfg = mosaic_sm90.TileConfig(num_compute_wgs=1, block_n=32, block_k=16,
                                 max_concurrent_steps=4, split_k=3, num_ctas=2)
    sizes = np.asarray([m], np.int32)
    plan, tiles, _ = _chain_facts(sizes, m, k, n, 2, BF16, cfg, static=True)
    assert plan.no_drain and plan.num_k_steps == 12 and tiles == [6, 6], (plan, tiles)
    x, ws = kc.grouped_inputs(11, m, k, n, 1, BF16, 2)
    out, ref = _run("situ", x, ws, sizes, cfg)
    kc.assert_grouped_output(out, ref, sizes, kc.TOL_BF16, "split-K chain")


def test_interpret_race_detector_finds_no_races_in_the_chain():
    """The producer streams the next tile's stages while the consumers still
    run the previous tile's WGMMAs and epilogue: the race detector on a chain
    with 2 consumer warpgroups (prefill tiles) and tail tiles in between."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as races_mod
    m, k, n = 160, 512, 128
    cfg = mosaic_sm90.TileConfig(num_compute_wgs=2, block_n=64, max_concurrent_steps=4,
                                 grid_block_n=1, num_ctas=2)
    plan, tiles, between = _chain_facts(SIZES, m, k, n, 2, BF16, cfg)
    assert plan.no_drain and min(tiles) >= 2 and any(between), (plan, tiles, between)
    x, (wg, wu) = kc.grouped_inputs(5, m, k, n, len(SIZES), BF16, 2)
    out = mosaic_sm90.grouped_situ_glu(
        kc.poison_tail(x, SIZES), wg, wu, jnp.asarray(SIZES), beta=kc.BETA,
        linear_beta=kc.LINEAR_BETA, config=cfg,
        interpret=plgpu.InterpretGPUParams(detect_races=True))
    out.block_until_ready()
    assert not races_mod.get_races().races_found
    kc.assert_grouped_output(out, kc.np_grouped_situ_glu(x, wg, wu, SIZES), SIZES,
                             kc.TOL_BF16, "race-detector chain")


def test_the_sweeps_prefill_launches_chain_their_tiles():
    """The row-major launches of the benchmark sweep (benchmarks.cases) at >= 1024 tokens
    (K 3584 = 56 and 3072 = 48 K steps, default_config) run without a drain, so
    tests/test_aot_kernels.py's ptxas check (0 spills) compiles the chained
    kernel: fused 1/2/3-consumer tiles at 4 stages, plain prefill at 3."""
    from benchmarks import cases
    plans = {}
    for case in cases.grouped_cases(cases.FULL):
        if case.tokens >= 1024:
            plan = mosaic_sm90.plan_launch(case.rows, case.k, case.n, case.local_experts,
                                           case.num_weights, BF16, BF16)
            plans[case.name] = (plan.no_drain, plan.cfg.max_concurrent_steps)
    assert len(plans) == 18 and all(nd for nd, _ in plans.values()), plans
