"""pallas_kernels/cost_model.py: the static H200 model replays the kernel's
schedule (hand-counted cases), and the tiles it picks meet issue 12's static
targets at K3 shapes with the benchmark sweep's routing."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import cases  # the sweep's cases and routing
from pallas_kernels import cost_model
from pallas_kernels.grouped_matmul import mosaic_sm90


def test_counts_match_a_hand_count():
    """Two groups of 65 and 3 rows on one-consumer 64-row tiles, K 256, N 256:
    group 0 takes 2 items (its weights read twice), group 1 one, so 3 items x
    2 N-blocks = 6 tiles; 3 x 64 rows computed for 68 useful rows; each tile
    loads 64 x 256 of x per 256 x 128 of weights (x/w = 0.5)."""
    cfg = mosaic_sm90.TileConfig(num_compute_wgs=1, block_n=128, max_concurrent_steps=2)
    cost = cost_model.grouped_cost([65, 3], 68, 256, 256, 1, config=cfg)
    assert cost.tiles == 6
    assert cost.weight_reads_per_active_expert == pytest.approx(1.5)
    assert cost.rows_computed_per_useful_row == pytest.approx(3 * 64 / 68)
    assert cost.x_bytes_over_weight_bytes == pytest.approx(0.5)
    assert cost.weight_bytes == 6 * 256 * 128 * 2 and cost.flops == 6 * 64 * 128 * 256 * 2


def test_sm_fill_counts_the_busiest_cta():
    """Static sizes (the MLP's exact schedule): 264 equal tiles on 132 CTAs
    fill every SM; 133 leave one CTA with two. Traced sizes: the table's
    W-bound slack items are idle loop steps that unbalance the CTAs."""
    cfg = mosaic_sm90.TileConfig(num_compute_wgs=1, block_n=128, max_concurrent_steps=2)
    full = cost_model.grouped_cost([64], 64, 256, 128 * 264, 1, config=cfg, static_sizes=True)
    assert full.tiles == 264 and full.sm_fill == pytest.approx(1.0)
    ragged = cost_model.grouped_cost([64], 64, 256, 128 * 133, 1, config=cfg, static_sizes=True)
    assert ragged.tiles == 133 and ragged.sm_fill == pytest.approx(133 / 264)
    traced = cost_model.grouped_cost([64], 64, 256, 128 * 264, 1, config=cfg)
    assert traced.tiles == 264 and traced.sm_fill < 1.0


def test_no_drain_pays_the_tile_overhead_once_per_cta():
    """264 equal tiles on 132 CTAs, K 256 = 4 K steps: at 2 stages every tile
    drains (two overheads per CTA); at 4 stages (4 divides 4) the launch
    chains them (LaunchPlan.no_drain) and pays one, for the CTA's first tile."""
    costs = {stages: cost_model.grouped_cost(
        [64], 64, 256, 128 * 264, 1, static_sizes=True,
        config=mosaic_sm90.TileConfig(num_compute_wgs=1, block_n=128,
                                      max_concurrent_steps=stages)) for stages in (2, 4)}
    assert not costs[2].config["no_drain"] and costs[4].config["no_drain"]
    assert costs[4].predicted_us == pytest.approx(
        costs[2].predicted_us - cost_model.TILE_OVERHEAD_S * 1e6)
    assert costs[4].sm_fill == pytest.approx(1.0)


def test_split_k_fills_the_sms_for_the_decode_mlp():
    """tp 8 (F 768) at 8 tokens: 6 tiles without split-K; the chosen split
    fills >= 0.9 of the SMs and the model predicts it faster."""
    cfg = cost_model.best_mlp_config(8, 7168, 768)
    assert cfg.split_k > 1
    split = cost_model.mlp_cost(8, 7168, 768, config=cfg)
    plain = cost_model.mlp_cost(8, 7168, 768, config=mosaic_sm90.default_config(8, 1, 2))
    assert plain.tiles == 6 and split.sm_fill >= 0.9
    assert split.predicted_us < plain.predicted_us / 4


@pytest.mark.parametrize("ep", [8, 16, 32])
def test_decode_reads_each_active_experts_weights_about_once(ep):
    """Issue 12's target with the sweep's routing: <= 1.05 weight reads per
    active expert at 256 tokens (the hardest decode size), both ops, for the
    kernel the launcher picks (launch_cost; the row-major tiles at these sizes)."""
    plan = cases.FULL
    for case in cases.grouped_cases(plan):
        if case.ep != ep or case.tokens != 256:
            continue
        cost = cost_model.launch_cost(cases.grouped_sizes(case), case.rows, case.k,
                                      case.n, case.num_weights)
        assert cost.weight_reads_per_active_expert <= 1.05, (case.name, cost)
        assert np.isfinite(cost.predicted_us) and cost.predicted_us > 0


def test_every_mlp_row_fills_the_sms():
    """Issue 12's target for every MLP row of the sweep (tp 1 / 4 / 8, T 8 to
    2048): the tiles situ_mlp_up launches fill >= 0.9 of the SMs, predicted
    at most SPLIT_TIE slower than the unsplit default tile (tp 4, T 2048: 3.9%
    slower for fill 0.96 instead of 0.86; every other row faster or equal)."""
    low = {}
    for case in cases.mlp_cases(cases.FULL):
        cost = cost_model.mlp_cost(case.tokens, case.d, case.f)
        plain = cost_model.mlp_cost(case.tokens, case.d, case.f,
                                    config=mosaic_sm90.default_config(case.tokens, 1, 2))
        assert np.isfinite(cost.predicted_us), case
        assert cost.predicted_us <= plain.predicted_us * (1 + cost_model.SPLIT_TIE), case
        if cost.sm_fill < cost_model.SM_FILL_TARGET:
            low[case.name] = (cost.sm_fill, cost.config)
    assert not low, low
