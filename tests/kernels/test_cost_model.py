"""k3jax.tools.kernel_cost: the model's own
arithmetic against hand counts (tiles, bytes, flops, SM fill, the chained
launch's overhead, the split-K tiles), and the one hardware description
it and the layer latency model (k3jax.tools.layer_schedule) read. What the
tile search picks is not tested (the table's currency is:
tests/kernels/test_tile_table.py)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from k3jax.tools import kernel_cost, layer_schedule, tile_search
from pallas_kernels.grouped_matmul import mosaic_sm90
from pallas_kernels.hardware import H200


def test_counts_match_a_hand_count():
    """Two groups of 65 and 3 rows on one-consumer 64-row tiles, K 256, N 256:
    group 0 takes 2 items (its weights read twice), group 1 one, so 3 items x
    2 N-blocks = 6 tiles; 3 x 64 rows computed for 68 useful rows; each tile
    loads 64 x 256 of x per 256 x 128 of weights (x/w = 0.5)."""
    cfg = mosaic_sm90.TileConfig(num_compute_wgs=1, block_n=128, max_concurrent_steps=2)
    cost = kernel_cost.grouped_cost([65, 3], 68, 256, 256, 1, config=cfg)
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
    full = kernel_cost.grouped_cost([64], 64, 256, 128 * 264, 1, config=cfg, static_sizes=True)
    assert full.tiles == 264 and full.sm_fill == pytest.approx(1.0)
    ragged = kernel_cost.grouped_cost([64], 64, 256, 128 * 133, 1, config=cfg, static_sizes=True)
    assert ragged.tiles == 133 and ragged.sm_fill == pytest.approx(133 / 264)
    traced = kernel_cost.grouped_cost([64], 64, 256, 128 * 264, 1, config=cfg)
    assert traced.tiles == 264 and traced.sm_fill < 1.0


def test_no_drain_pays_the_tile_overhead_once_per_cta():
    """264 equal tiles on 132 CTAs, K 256 = 4 K steps: at 2 stages every tile
    drains (two overheads per CTA); at 4 stages (4 divides 4) the launch
    chains them (LaunchPlan.no_drain) and pays one, for the CTA's first tile."""
    costs = {stages: kernel_cost.grouped_cost(
        [64], 64, 256, 128 * 264, 1, static_sizes=True,
        config=mosaic_sm90.TileConfig(num_compute_wgs=1, block_n=128,
                                      max_concurrent_steps=stages)) for stages in (2, 4)}
    assert not costs[2].config["no_drain"] and costs[4].config["no_drain"]
    assert costs[4].predicted_us == pytest.approx(
        costs[2].predicted_us - kernel_cost.TILE_OVERHEAD_S * 1e6)
    assert costs[4].sm_fill == pytest.approx(1.0)


def test_split_k_multiplies_the_tiles_and_adds_the_reduction():
    """tp 8's MLP (D 7168, F 768) at 8 tokens on one-consumer 128-wide tiles:
    6 N-blocks, one item; split-K S gives 6 S tiles, stores f32 partials
    (8 rows x 128 x 4 B x 2 weights a tile) and XLA's reduction reads S f32
    partials of the padded output and writes the bf16 output."""
    base = dataclasses.replace(mosaic_sm90.FUSED_DECODE, block_n=128)
    plain = kernel_cost.mlp_cost(8, 7168, 768, config=base)
    split = kernel_cost.mlp_cost(8, 7168, 768, config=dataclasses.replace(base, split_k=4))
    assert plain.tiles == 6 and split.tiles == 24
    assert split.flops == pytest.approx(plain.flops)
    assert split.weight_bytes == pytest.approx(plain.weight_bytes)
    launch = mosaic_sm90.plan_launch(8, 7168, 768, 1, 2, jnp.bfloat16, jnp.bfloat16, base)
    stores = 24 * 8 * 128 * 4 * 2
    reduce = 4 * 8 * launch.n_pad * 4 * 2 + 8 * launch.n_pad * 2
    assert split.out_bytes == pytest.approx(stores + reduce)
    assert plain.out_bytes == pytest.approx(6 * 8 * 128 * 2 * 1)


def test_roofline_takes_the_longer_of_compute_and_memory():
    assert kernel_cost.roofline_s(2e12, 1.0) == pytest.approx(2e12 / H200.dense_bf16_flops_per_s)
    assert kernel_cost.roofline_s(1.0, 4e9) == pytest.approx(4e9 / H200.hbm_copy_bytes_per_s)
    assert kernel_cost.roofline_s(1.0, 4e9, active_sms=66) == pytest.approx(
        2 * 4e9 / H200.hbm_copy_bytes_per_s)


def test_both_models_read_the_one_hardware_description():
    assert kernel_cost.DENSE_BF16_FLOPS == H200.dense_bf16_flops_per_s
    assert kernel_cost.COPY_BYTES_PER_S == layer_schedule.NVLINK.hbm_bytes_per_s \
        == H200.hbm_copy_bytes_per_s
    assert kernel_cost.H200_NUM_SMS == H200.num_sms
    assert kernel_cost.SM_LANE_OPS_PER_S == H200.sm_lane_ops_per_s
    assert layer_schedule.NVLINK.bytes_per_s == H200.nvlink_bus_bytes_per_s
    assert layer_schedule.NVLINK.latency_s == H200.collective_latency_s


def test_search_targets_are_validated():
    with pytest.raises(ValueError, match="x_over_w"):
        tile_search.SearchTargets(x_over_w=0.0)
    with pytest.raises(ValueError, match="proxy seed"):
        tile_search.SearchTargets(proxy_seeds=())


def test_proxy_routings_are_the_seeded_multinomials():
    draws = tile_search.proxy_group_sizes(1000, 7, seeds=(3, 5))
    assert len(draws) == 2 and all(int(d.sum()) == 1000 and d.shape == (7,) for d in draws)
    again = tile_search.proxy_group_sizes(1000, 7, seeds=(5,))
    assert (again[0] == draws[1]).all()
