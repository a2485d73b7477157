"""The committed tile table (pallas_kernels/data/tile_table.json) and
the launchers' lookup in it (tile_choice): every row builds a config the
kernel launches at every M of its bucket, and the kernel's invariants hold
over the tilings the table holds on random shapes (every row computed once,
by one group-aligned work item, every tile in bounds, the K ranges and
N-blocks covering K and N once). No test here asserts what the search picks;
the slow test checks the table is current (the search, re-run, writes the
same row).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_cases as kc  # noqa: E402
from pallas_kernels.grouped_matmul import (  # noqa: E402
    mosaic_sm90,
    mosaic_sm90_swap_ab,
    schedule,
    tile_choice,
)

REPO = pathlib.Path(__file__).resolve().parents[2]
TABLE_FILE = REPO / "pallas_kernels" / "data" / "tile_table.json"
ROWS = list(tile_choice.tiles().items())
SWAP_AB_ROWS = [(key, tile_choice.row_config(e)) for key, e in ROWS if e["kernel"] == "swap_ab"]
MLP_ROWS = [(key, tile_choice.row_config(e)) for key, e in ROWS if e["kernel"] == "mlp"]


def _bucket_floor(key) -> int:
    """The largest M of the next smaller bucket of key's shape (0 if none)."""
    op, m, *shape = key
    below = [k[1] for k in tile_choice.tiles() if k[0] == op and list(k[2:]) == shape and k[1] < m]
    return max(below, default=0)


def test_table_holds_both_kernels_and_the_mlp():
    kinds = {e["kernel"] for _, e in ROWS}
    assert kinds == {tile_choice.ROW_MAJOR, tile_choice.SWAP_AB, tile_choice.MLP}
    for (op, m, k, n, groups, num_weights, dtype), entry in ROWS:
        assert op in ("grouped", "mlp") and min(m, k, n, groups) > 0 and num_weights in (1, 2)
        assert jnp.dtype(dtype).name == dtype
        assert (op == "mlp") == (entry["kernel"] == tile_choice.MLP)
        if op == "mlp":
            assert (groups, num_weights) == (1, 2)


def test_header_names_the_command_and_the_hardware():
    from pallas_kernels.hardware import H200
    table = json.loads(TABLE_FILE.read_text())
    assert table["generated_by"] == "python -m scripts.write_tile_table"
    doc = "\n".join(table["description"])
    assert f"{H200.num_sms} SMs" in doc
    assert f"dense bf16 {H200.dense_bf16_flops_per_s:.4g} FLOP/s" in doc
    assert f"HBM copy {H200.hbm_copy_bytes_per_s:.4g} B/s" in doc
    assert "seeds [0, 1, 2" in doc


def test_the_file_is_what_the_writer_renders():
    """Header (inputs, targets, hardware numbers) and rows as the writer
    writes them today, without re-running the search; the reader reads the
    package's file, the one the writer writes."""
    from scripts import write_tile_table as w
    assert pathlib.Path(str(tile_choice.table_file())) == TABLE_FILE == pathlib.Path(w.TABLE_PATH)
    assert TABLE_FILE.read_text() == w.render(tile_choice.tiles(), w.INPUTS, w.TARGETS)


@pytest.mark.parametrize("key,cfg", SWAP_AB_ROWS, ids=lambda v: str(v) if isinstance(v, tuple) else "")
def test_every_swap_ab_row_launches_across_its_bucket(key, cfg):
    """At the bucket's M and at M just above the next smaller bucket: the plan
    fits (SMEM, K ranges >= the pipeline), its N-blocks cover N in whole
    superblocks overhanging by less than one, and its K ranges cover K once."""
    _, m, k, n, groups, num_weights, dtype = key
    for rows in sorted({m, _bucket_floor(key) + 1}):
        dt = jnp.dtype(dtype)
        plan = mosaic_sm90_swap_ab.plan_launch(rows, k, n, groups, num_weights, dt, dt, cfg)
        c = plan.cfg
        assert plan.num_n_blocks * c.block_w == plan.n_pad >= n
        assert plan.num_n_blocks % c.cluster == 0 and plan.n_pad - n < c.cluster * c.block_w
        assert plan.k_pad >= k and plan.k_pad == plan.num_k_steps * c.block_k
        ranges = [schedule.k_range(s, plan.num_k_steps, c.split_k) for s in range(c.split_k)]
        assert [first for first, _ in ranges] == list(np.cumsum([0] + [s for _, s in ranges])[:-1])
        assert sum(s for _, s in ranges) == plan.num_k_steps
        assert plan.x_rows >= c.block_t
        assert tile_choice.grouped_config(rows, k, n, groups, num_weights, dtype) == cfg


@pytest.mark.parametrize("key,cfg", MLP_ROWS, ids=lambda v: str(v) if isinstance(v, tuple) else "")
def test_every_mlp_row_launches_across_its_bucket(key, cfg):
    _, m, d, f, _, _, dtype = key
    for tokens in sorted({m, _bucket_floor(key) + 1}):
        dt = jnp.dtype(dtype)
        plan = mosaic_sm90.plan_launch(tokens, d, f, 1, 2, dt, dt, cfg)
        c = plan.cfg
        assert plan.n_pad >= f and plan.k_pad >= d and plan.m_pad >= tokens
        steps = [schedule.k_range(s, plan.num_k_steps, c.split_k)[1] for s in range(c.split_k)]
        assert sum(steps) == plan.num_k_steps and min(steps) >= 1
        assert tile_choice.mlp_config(tokens, d, f, dtype) == cfg


def _check_schedule(sizes, m: int, block: int) -> None:
    """The kernel's work-item table: each valid row [0, min(sum, m)) in exactly
    one item, of its own group; the tail rows in tail items; every item's rows
    inside its block-row x tile, every x tile inside the padded x."""
    with schedule.host_eval():
        meta = np.asarray(schedule.work_items_4W(jnp.asarray(sizes, jnp.int32), m, block))
    assert meta.shape[1] == schedule.num_work_items(m, len(sizes), block)
    ends = np.minimum(np.cumsum(sizes), m)
    group_of_row = np.searchsorted(ends, np.arange(m), side="right")
    seen = np.zeros(m, np.int32)
    x_rows = schedule.x_rows(m, block)
    for group, x_row0, offset, count in meta.T:
        if count == 0:
            continue
        rows = np.arange(x_row0 + offset, x_row0 + offset + count)
        assert 0 <= offset and offset + count <= block, (group, x_row0, offset, count)
        assert x_row0 % schedule.X_ROW_ALIGN == 0 and x_row0 + block <= x_rows
        want = np.where(group_of_row[rows] < len(sizes), group_of_row[rows], -1)
        assert np.all(want == group), (group, rows)
        seen[rows] += 1
    assert np.all(seen == 1), np.nonzero(seen != 1)


def _random_sizes(rng, m: int, groups: int) -> np.ndarray:
    """Skewed sizes with empty groups, summing to at most m (a tail) or more (clamped)."""
    weights = rng.dirichlet(np.full(groups, 0.3))
    total = int(rng.integers(0, 2 * m))
    return rng.multinomial(total, weights).astype(np.int32)


def test_schedule_invariants_over_the_tables_tilings_and_random_shapes():
    """Every token tile (swap-AB block_t) and row tile (MLP block_m) the table
    holds, on random M, group counts and skewed sizes."""
    blocks = sorted({cfg.block_t for _, cfg in SWAP_AB_ROWS}
                    | {mosaic_sm90.plan_launch(k[1], k[2], k[3], 1, 2, jnp.dtype(k[6]), jnp.dtype(k[6]),
                                               cfg).cfg.block_m
                       for k, cfg in MLP_ROWS})
    assert blocks
    rng = np.random.default_rng(0)
    for block in blocks:
        m = int(rng.integers(1, 4 * block + 40))
        groups = int(rng.integers(1, 24))
        _check_schedule(_random_sizes(rng, m, groups), m, block)


def test_swap_ab_row_columns_cover_each_valid_row_once():
    """XLA's gather of y from the swap-AB tiles: every valid row reads one
    column, of the item that computed it; rows past sum(sizes) read none."""
    rng = np.random.default_rng(1)
    for block_t in sorted({cfg.block_t for _, cfg in SWAP_AB_ROWS}):
        m, groups = int(rng.integers(1, 3 * block_t + 20)), int(rng.integers(1, 20))
        sizes = _random_sizes(rng, m, groups)
        with schedule.host_eval():
            meta = schedule.work_items_4W(jnp.asarray(sizes), m, block_t)
            col, valid = (np.asarray(a) for a in
                          mosaic_sm90_swap_ab.row_columns(meta, m, block_t))
        meta = np.asarray(meta)
        for r in range(m):
            item, j = divmod(int(col[r]), block_t)
            group, x_row0, offset, count = meta[:, item]
            assert valid[r] == (r < min(int(sizes.sum()), m))
            if valid[r]:
                assert x_row0 + offset <= r < x_row0 + offset + count and x_row0 + j == r


def test_lookup_rounds_m_up_to_the_next_bucket(monkeypatch):
    """A launch takes the row of the smallest bucket >= M; past the largest
    bucket, or for a shape the table lacks, the default (None)."""
    a = mosaic_sm90_swap_ab.SwapABConfig(num_compute_wgs=1, wg_block_w=64, block_t=16)
    b = dataclasses.replace(a, block_t=32)
    kc.use_tile_rows(monkeypatch, {("grouped", 64, 256, 512, 8, 1, "bfloat16"): a,
                                   ("grouped", 256, 256, 512, 8, 1, "bfloat16"): b,
                                   ("grouped", 1024, 256, 512, 8, 1, "bfloat16"): None})
    pick = lambda m, n=512, w=1: tile_choice.grouped_config(m, 256, n, 8, w, "bfloat16")  # noqa: E731
    assert [pick(m) for m in (1, 64, 65, 256, 257, 1024, 1025)] == [a, a, b, b, None, None, None]
    assert tile_choice.lookup("grouped", 1025, 256, 512, 8, 1, "bfloat16") == (False, None)
    assert tile_choice.lookup("grouped", 1000, 256, 512, 8, 1, "bfloat16") == (True, None)
    assert pick(64, n=640) is None and pick(64, w=2) is None
    assert tile_choice.grouped_config(64, 256, 512, 8, 1, "float32") is None


def test_a_bad_entry_is_named():
    with pytest.raises(ValueError, match="unknown kernel 'tgmm'"):
        tile_choice.row_config({"kernel": "tgmm"})
    with pytest.raises(ValueError, match="takes no fields"):
        tile_choice.row_config({"kernel": "row_major", "block_t": 16})


@pytest.mark.slow
def test_table_is_current():
    """Every row is what the search writes for its key today (re-run it:
    python -m scripts.write_tile_table)."""
    from scripts import write_tile_table
    assert [k for k, _ in ROWS] == (write_tile_table.INPUTS.grouped_keys()
                                    + write_tile_table.INPUTS.mlp_keys())
    stale = {key: (entry, fresh) for key, entry in ROWS
             if (fresh := write_tile_table.search(key)) != entry}
    assert not stale, stale
