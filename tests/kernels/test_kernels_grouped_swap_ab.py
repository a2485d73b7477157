"""mosaic_sm90_swap_ab: the swap-AB kernel (weights on WGMMA's M side) in GPU
interpret mode vs a float64 numpy loop, the sm_90a ptxas compile (0 spills)
of the swap-AB tilings the tile table holds at the sweep's decode shapes and
of the x-lean tilings the device sweep times beside them (CTA clusters
included; their interpret cases: test_kernels_grouped_swap_ab_cluster.py), the
cost model's swap-AB arithmetic, and the launcher's dispatch on the table.
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
from k3jax.tools import kernel_cost, tile_search
from pallas_kernels.grouped_matmul import api, dispatch, schedule, tile_choice  # noqa: E402
from pallas_kernels.grouped_matmul import mosaic_sm90_swap_ab as dec
from scripts import write_tile_table  # noqa: E402

pytestmark = pytest.mark.tiers(
    compile=["test_table_and_x_lean_swap_ab_tiles_compile_for_sm90a_without_spills",
             "test_every_table_swap_ab_tiling_compiles_for_sm90a_without_spills"])

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}
SwapABConfig = dec.SwapABConfig

# (m, k, n, sizes, dtype, config). Odd sizes, empty groups, a NaN tail past
# sum(sizes); 2-3 CTAs walk 8-30 tiles each (the persistent loop, barrier
# phases and output SMEM reuse across tiles); split-K with two K-range lengths
# (5 K steps into 2 ranges); M below one token tile; bf16x3 float32.
CASES = [
    tiers.slow((40, 320, 256, [7, 0, 13, 1, 0], BF16,
                SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=16, max_concurrent_steps=2,
                             num_ctas=2))),
    (40, 320, 256, [7, 0, 13, 1, 0], BF16,
     SwapABConfig(num_compute_wgs=1, wg_block_w=128, block_t=8, max_concurrent_steps=2,
                  split_k=2, num_ctas=3)),
    (5, 128, 128, [2, 0, 1], F32,
     SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=16, max_concurrent_steps=2,
                  num_ctas=2)),
    tiers.slow((24, 320, 128, [0, 9, 5, 3], F32,
                SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=8, max_concurrent_steps=2,
                             split_k=2, num_ctas=2))),
]


@pytest.mark.parametrize("case", CASES, ids=kc.swap_ab_case_id)
def test_decode_kernel_interpret_matches_float64(case):
    """Both products of one launch shape: the plain and the fused kernel
    against the float64 loop; tail rows exactly 0, no NaN from the poisoned
    tail of x. (K of 2 or 5 steps: no stage count >= 3 divides it, so these
    tiles drain; the chained ones are CHAINED below.)"""
    m, k, n, sizes, dtype, cfg = case
    assert not dec.plan_launch(m, k, n, len(sizes), 1, dtype, dtype, cfg).no_drain
    kc.check_swap_ab_products(case, seed=sum(case[:3]))


# Chained tiles (SwapABPlan.no_drain): 8 K steps, 4 stages. (m, k, n, sizes,
# dtype, config): 2 CTAs over 20 tiles with empty groups and a NaN tail;
# 4 CTAs of which 2 get one tile and 2 none (the single-tile quiesce);
# clusters of 2 (the chain's states shared by the cluster); bf16x3 float32.
CHAINED = [
    tiers.slow((40, 512, 256, [7, 0, 13, 1, 0], BF16,
                SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=16, max_concurrent_steps=4,
                             num_ctas=2))),
    (16, 512, 128, [16], BF16,
     SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=16, max_concurrent_steps=4,
                  num_ctas=4)),
    tiers.slow((40, 512, 256, [7, 0, 13, 1, 0], BF16,
                SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=16, max_concurrent_steps=4,
                             num_ctas=4, cluster=2))),
    tiers.slow((24, 512, 128, [0, 9, 5, 3], F32,
                SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, max_concurrent_steps=4,
                             num_ctas=3))),
]


@pytest.mark.parametrize("case", CHAINED, ids=kc.swap_ab_case_id)
def test_chained_swap_ab_tiles_match_float64(case):
    """No drain between a CTA's tiles (START / STEADY / STOP, and a lone
    START tile quiesced after the loop): both products against float64. The
    interpreter checks the barrier phases, so a wrong chain fails here."""
    m, k, n, sizes, dtype, cfg = case
    for num_w in (1, 2):
        assert dec.plan_launch(m, k, n, len(sizes), num_w, dtype, dtype, cfg).no_drain
    kc.check_swap_ab_products(case, seed=sum(case[:3]))


def test_chain_bounds_are_each_clusters_first_and_last_matmul_tile():
    """chain_bounds_2C against a replay of the kernel's item-major loop:
    cluster c runs tiles c, c + C, ...; a tile runs a matmul when its item is
    a non-empty item of a group (not the tail)."""
    sizes = jnp.asarray([3, 0, 20, 1, 0, 9], jnp.int32)
    m, k, n = 40, 512, 512
    cfg = SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, max_concurrent_steps=4,
                       split_k=2, cluster=2)
    plan = dec.plan_launch(m, k, n, len(sizes), 1, BF16, BF16, cfg)
    meta = np.asarray(schedule.work_items_4W(sizes, m, cfg.block_t))
    for num_clusters in (1, 3, 7, 64):
        bounds = np.asarray(dec.chain_bounds_2C(jnp.asarray(meta), plan, num_clusters))
        supers = plan.num_n_blocks // cfg.cluster
        runs = [(meta[3, t // (cfg.split_k * supers)] > 0)
                and (meta[0, t // (cfg.split_k * supers)] >= 0)
                for t in range(plan.num_cluster_tiles)]
        for c in range(num_clusters):
            mine = [t for t in range(c, plan.num_cluster_tiles, num_clusters) if runs[t]]
            want = (mine[0], mine[-1]) if mine else (-1, -1)
            assert tuple(bounds[:, c]) == want, (num_clusters, c)


def test_row_columns_point_each_row_at_its_items_column():
    """The XLA assembly's map: every valid row reads the column of the item
    that holds it (item w's columns start at w * block_t), tail rows are
    invalid."""
    sizes = jnp.asarray([3, 0, 20, 1], jnp.int32)
    m, block_t = 30, 8
    meta = np.asarray(schedule.work_items_4W(sizes, m, block_t))
    col, valid = (np.asarray(a) for a in dec.row_columns(jnp.asarray(meta), m, block_t))
    for r in range(m):
        item, j = divmod(int(col[r]), block_t)
        group, x_row0, offset, count = meta[:, item]
        assert x_row0 + offset <= r < x_row0 + offset + count and x_row0 + j == r, r
        assert valid[r] == (r < 24) == (group >= 0), r


def test_bad_swap_ab_tiles_are_rejected():
    with pytest.raises(ValueError, match="wg_block_w"):
        SwapABConfig(wg_block_w=96)
    with pytest.raises(ValueError, match="block_t"):
        SwapABConfig(block_t=12)
    with pytest.raises(ValueError, match="split_k=4"):
        dec.plan_launch(40, 320, 256, 5, 1, BF16, BF16,
                        SwapABConfig(block_t=8, max_concurrent_steps=2, split_k=4))
    with pytest.raises(ValueError, match="shared memory"):
        dec.plan_launch(40, 3584, 3072, 5, 2, F32, F32,
                        SwapABConfig(num_compute_wgs=2, wg_block_w=256, block_t=64))


SWEEP_TOKENS = (16, 64, 256)  # the device sweep's decode token counts (benchmarks.kernel_sweep)

# Table tilings that spill today, with the reason. The test fails on a spill
# not named here and on an entry that no longer spills, so this cannot go stale.
KNOWN_SWAP_AB_SPILLS = {
    ("gate_up_situ", SwapABConfig(num_compute_wgs=2, wg_block_w=64, block_t=96, block_k=64,
                                  max_concurrent_steps=6, split_k=1, cluster=4)):
        "K3 EP 8 at 512 tokens (M 8192): 168 registers, 16 B + 24 B of spill through ptxas, the same "
        "before the kernels moved onto the shared skeleton; the tile search does not see registers",
}


def _k3_rows(tokens=None):
    """(op, key, entry) of the table's K3 routed-expert rows (at ``tokens``
    x top_k rows, or all), op "gate_up_situ" (two weights) or "down"."""
    inp = write_tile_table.K3_SHAPES
    out = []
    for key, entry in tile_choice.tiles().items():
        op, m, k, n, _, num_w, _ = key
        if op != "grouped" or (k, n) not in ((inp.latent, inp.inter), (inp.inter, inp.latent)):
            continue
        if tokens is None or m in {t * inp.top_k for t in tokens}:
            out.append(("gate_up_situ" if num_w == 2 else "down", key, entry))
    return out


def _swap_ab_tilings(tokens=None):
    """{(op, tiling): key}: each distinct swap-AB tiling of the table's K3 rows."""
    seen = {}
    for op, key, entry in _k3_rows(tokens):
        cfg = tile_choice.row_config(entry)
        if cfg is not None:
            seen.setdefault((op, cfg), key)
    return seen


def _lean_tilings():
    """{(op, tiling): key}: the x-lean tiling (tile_search.x_lean_candidate)
    of each of the table's K3 rows at the sweep's decode token counts whose
    own launch misses the search's x / weight-reads targets on some proxy
    routing: the device sweep times it beside the launcher's."""
    seen = {}
    for op, key, entry in _k3_rows(SWEEP_TOKENS):
        _, m, k, n, groups, num_w, dtype = key
        pick = tile_choice.row_config(entry)
        costs = tile_search.candidate_costs(m, k, n, groups, num_w, dtype)
        if next(c for c in costs if c.config == pick).meets(tile_search.TARGETS):
            continue
        lean = tile_search.x_lean_candidate(m, k, n, groups, num_w, dtype)
        if lean is not None:
            seen.setdefault((op, lean.config), key)
    return seen


def _compile_without_spills(tilings) -> None:
    """Each (op, tiling) at its key's shapes through ptxas for sm_90a: 0
    spill bytes, no serialized WGMMA warning."""
    from compile_cache import cached_reports

    from k3jax.tools.kernel_ptxas import ptxas_reports
    S = jax.ShapeDtypeStruct
    for (op, cfg), (_, m, k, n, groups, _, dtype) in tilings.items():
        x, w, sizes = S((m, k), dtype), S((groups, k, n), dtype), S((groups,), jnp.int32)
        if op == "gate_up_situ":
            def fn(x, a, b, s, cfg=cfg):
                return dec.grouped_situ_glu(x, a, b, s, config=cfg, **SITU)
            specs = (x, w, w, sizes)
        else:
            def fn(x, w, s, cfg=cfg):
                return dec.grouped_matmul(x, w, s, config=cfg)
            specs = (x, w, sizes)
        name = f"swap-AB {op} m={m} k={k} n={n} g={groups} {jnp.dtype(dtype).name} {cfg!r}"
        reports = cached_reports(name, lambda fn=fn, specs=specs: ptxas_reports(fn, *specs))
        assert reports, (op, cfg)
        spilled = [rep for rep in reports if rep.spill_store_bytes or rep.spill_load_bytes]
        if (op, cfg) in KNOWN_SWAP_AB_SPILLS:
            assert spilled, (f"{op} {cfg} no longer spills: remove it from KNOWN_SWAP_AB_SPILLS "
                             f"({KNOWN_SWAP_AB_SPILLS[op, cfg]!r})")
        else:
            assert not spilled, (op, cfg, spilled)
        for rep in reports:
            assert "swap_ab" in rep.name, rep
            assert not any("serializ" in w.lower() for w in rep.warnings), (op, cfg, rep)


def test_table_and_x_lean_swap_ab_tiles_compile_for_sm90a_without_spills():
    """Every swap-AB tiling the table holds for the sweep's K3 decode rows
    (EP 8/16/32, both ops), and every x-lean tiling the sweep may time
    beside them, through ptxas for sm_90a. One compile per distinct (op, tiling)."""
    tilings = {**_swap_ab_tilings(SWEEP_TOKENS), **_lean_tilings()}
    assert tilings, "no swap-AB tiling at the sweep's decode rows"
    _compile_without_spills(tilings)


@pytest.mark.slow
def test_every_table_swap_ab_tiling_compiles_for_sm90a_without_spills():
    """The same for the table's other K3 rows (every token count it holds)."""
    done = {**_swap_ab_tilings(SWEEP_TOKENS), **_lean_tilings()}
    _compile_without_spills({t: key for t, key in _swap_ab_tilings().items() if t not in done})


def test_model_counts_match_a_hand_count():
    """Two groups of 5 and 13 rows, M 24, K 256, N 256, 8-token tiles, one
    64-wide consumer: group 0 is one item (rows 0..4), group 1 starts at row
    5 (tile at row 0): rows 5..7, 8..15, 16..17 -> 3 items; the tail (rows
    18..23) has no matmul. 4 items x 4 N-blocks = 16 tiles; x / w = 8 / 64."""
    cfg = SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, max_concurrent_steps=2)
    cost = kernel_cost.swap_ab_cost([5, 13], 24, 256, 256, 1, config=cfg)
    assert cost.tiles == 16
    assert cost.weight_reads_per_active_expert == pytest.approx(4 / 2)
    assert cost.x_bytes_over_weight_bytes == pytest.approx(8 / 64)
    assert cost.rows_computed_per_useful_row == pytest.approx(4 * 8 / 18)
    assert cost.weight_bytes == 16 * 256 * 64 * 2
    assert cost.flops == 16 * 64 * 8 * 256 * 2


def test_launcher_dispatch_runs_the_tables_swap_ab_tiling(monkeypatch):
    """backend="interpret" runs the swap-AB kernel with the tiling the tile
    table holds for the shape (M rounded up to the row's bucket) and matches
    float64; without a row the launcher takes the row-major tiles."""
    m, k, n, sizes = 24, 128, 256, np.asarray([3, 0, 5, 2, 4, 0, 1, 6], np.int32)
    cfg = SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=8, max_concurrent_steps=2)
    specs = (jax.ShapeDtypeStruct((m, k), BF16), jax.ShapeDtypeStruct((8, k, n), BF16))
    kc.use_tile_rows(monkeypatch, {})
    assert dispatch.swap_ab_config(*specs, 1) is None
    kc.use_tile_rows(monkeypatch, {("grouped", 32, k, n, 8, 1, "bfloat16"): cfg})
    assert dispatch.swap_ab_config(*specs, 1) == cfg
    calls = kc.spy_swap_ab_launches(monkeypatch)
    x, (w,) = kc.grouped_inputs(3, m, k, n, len(sizes), BF16, 1)
    x = kc.poison_tail(x, sizes)
    y = api.grouped_matmul(x, w, jnp.asarray(sizes), backend="interpret")
    assert calls == [cfg]
    kc.assert_grouped_output(y, kc.np_grouped_matmul(kc.f32(x), kc.f32(w), sizes), sizes,
                             kc.TOL_BF16, "dispatch")
