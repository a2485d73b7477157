"""grouped_matmul / grouped_situ_glu: Mosaic kernel (GPU interpret mode on the
CPU) vs the XLA reference, the reference vs a float64 numpy loop, the work-item
schedule, sm_90 lowering at K3 shapes, dispatch and shape validation."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import PartitionSpec as P

import kernel_cases as kc
from pallas_kernels import grouped_matmul, grouped_situ_glu, resolve_backend
from pallas_kernels.grouped_matmul import blocked, mosaic_sm90, reference, schedule, tiling

pytestmark = pytest.mark.tiers(
    compile=["test_lowers_for_sm90_at_k3_shapes"],
    slow=["test_float32_prefill_tiles_run_in_interpret_mode", "test_interpret_race_detector_finds_no_races"])

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}

# (m, k, n, g, pattern, dtype, poison). K3 aspect ratios at small scale: a wide
# K to a narrower N (latent -> intermediate) and back (down). Cases sharing a
# shape reuse one compiled executable (group sizes are traced): interpret mode
# is slow, so the list is short and shapes repeat.
PLAIN_CASES = [
    (96, 128, 96, 4, "zeros_skewed", BF16, False),
    (96, 128, 96, 4, "sum_lt_m", BF16, True),
    (96, 128, 96, 4, "one_group_all", BF16, False),
    (96, 128, 96, 4, "all_empty", BF16, True),
    (50, 96, 128, 3, "uniform", F32, False),
    # >= 128 rows per group: prefill tiles (2 consumer warpgroups, 128-row tiles);
    # a group spans 3 M-blocks and the tail starts mid-block.
    (300, 32, 64, 2, "sum_lt_m", BF16, True),
]
FUSED_CASES = [
    (300, 64, 64, 3, "sum_lt_m", BF16, True),  # 100 rows a group: 3-consumer tall tiles
    (100, 112, 96, 4, "zeros_skewed", BF16, False),  # K = 7 x 16: block_k falls to 16
    (100, 112, 96, 4, "sum_lt_m", BF16, True),
    (100, 112, 96, 4, "sum_lt_m", F32, True),  # bf16x3 split, NaN tail rows
]  # prefill tiles: the race test


# Module-level jits so cases with equal shapes hit the compilation cache.
_plain_interpret = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, backend="interpret"))
_fused_interpret = jax.jit(
    lambda x, wg, wu, s: grouped_situ_glu(x, wg, wu, s, backend="interpret", **SITU))


def _case_id(case) -> str:
    m, k, n, g, pattern, dtype, poison = case
    return f"{m}x{k}x{n}_g{g}_{pattern}_{jnp.dtype(dtype).name}" + ("_nan" if poison else "")


def _inputs(case, num_weights):
    m, k, n, g, pattern, dtype, poison = case
    x, ws = kc.grouped_inputs(m + k + n + g, m, k, n, g, dtype, num_weights)
    sizes = kc.group_pattern(pattern, m, g)
    if poison:
        x = kc.poison_tail(x, sizes)
    return x, ws, sizes


# Tolerance by input dtype (kc.kernel_tol): bf16 inputs get bf16's, float32
# inputs run the split-bf16 (bf16x3) product and must be float32-accurate.
@pytest.mark.parametrize("case", PLAIN_CASES, ids=_case_id)
def test_grouped_matmul_interpret_matches_reference(case):
    x, (w,), sizes = _inputs(case, 1)
    out = _plain_interpret(x, w, jnp.asarray(sizes))
    ref = reference.grouped_matmul(kc.f32(x), kc.f32(w), jnp.asarray(sizes))
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[2])
    kc.assert_grouped_output(out, ref, sizes, kc.kernel_tol(x.dtype), _case_id(case))


@pytest.mark.parametrize("case", FUSED_CASES, ids=_case_id)
def test_grouped_situ_glu_interpret_matches_reference(case):
    x, (wg, wu), sizes = _inputs(case, 2)
    out = _fused_interpret(x, wg, wu, jnp.asarray(sizes))
    ref = reference.grouped_situ_glu(kc.f32(x), kc.f32(wg), kc.f32(wu), jnp.asarray(sizes), **SITU)
    assert out.dtype == x.dtype and out.shape == (x.shape[0], wg.shape[2])
    kc.assert_grouped_output(out, ref, sizes, kc.kernel_tol(x.dtype), _case_id(case))


# float32 inputs on the prefill tiles (>= 128 rows per group; ~300 here, past
# the decode kernel's MAX_SWAP_AB_ROWS = 256, so the launcher keeps the
# row-major tiles): two bf16 planes per element, so fit_smem shrinks the
# tiles as at K3 shapes (K = 64 = one full block_k): the fused tile to 3
# stages, then 2 (plan_launch: float32 on two consumers, 3 stages spilled in
# ptxas), the plain one to block_n 128 / 2 stages. Sum < M with NaN tail
# rows; N = 128 spans two fused N-blocks.
F32_PREFILL_CASES = {
    "fused": ((600, 64, 128, 2, "sum_lt_m", F32, True), (64, 2)),
    "plain": ((600, 64, 128, 2, "sum_lt_m", F32, True), (128, 2)),
}


@pytest.mark.parametrize("kind", list(F32_PREFILL_CASES))
def test_float32_prefill_tiles_run_in_interpret_mode(kind, monkeypatch):
    case, (block_n, stages) = F32_PREFILL_CASES[kind]
    fused = kind == "fused"
    configs = []
    make_body = mosaic_sm90._make_body

    def spy(**kwargs):
        configs.append(kwargs["cfg"])
        return make_body(**kwargs)

    monkeypatch.setattr(mosaic_sm90, "_make_body", spy)
    x, ws, sizes = _inputs(case, 2 if fused else 1)
    if fused:
        out = jax.jit(lambda x, a, b, s: grouped_situ_glu(x, a, b, s, backend="interpret", **SITU))(
            x, *ws, jnp.asarray(sizes))
        ref = kc.np_grouped_situ_glu(x, *ws, sizes)
    else:
        out = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, backend="interpret"))(
            x, *ws, jnp.asarray(sizes))
        ref = kc.np_grouped_matmul(x, *ws, sizes)
    prefill = mosaic_sm90.FUSED_PREFILL if fused else mosaic_sm90.PLAIN_PREFILL
    assert [(c.num_compute_wgs, c.block_m, c.block_k, c.block_n, c.max_concurrent_steps)
            for c in configs] == [(prefill.num_compute_wgs, 128, 64, block_n, stages)]
    assert out.dtype == F32
    kc.assert_grouped_output(out, ref, sizes, kc.TOL_F32_KERNEL, f"{kind} f32 prefill")


def test_interpret_race_detector_finds_no_races():
    """GPU interpret mode's happens-before race detector over SMEM/TMA traffic, on
    the prefill tiles (2 consumer warpgroups + the TMA producer, 128-row blocks);
    also covers linear_beta=None, a non-default beta and NaN rows past the sum."""
    # A private module: imported plainly so that a JAX upgrade moving it FAILS here.
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as races_mod
    x, (wg, wu), sizes = _inputs((400, 96, 64, 2, "sum_lt_m", BF16, True), 2)
    assert mosaic_sm90.default_config(400, 2, 2) == mosaic_sm90.FUSED_PREFILL
    params = plgpu.InterpretGPUParams(detect_races=True)
    out = mosaic_sm90.grouped_situ_glu(x, wg, wu, jnp.asarray(sizes), beta=2.0,
                                       linear_beta=None, interpret=params)
    out.block_until_ready()
    assert not races_mod.get_races().races_found
    ref = kc.np_grouped_situ_glu(kc.f32(x), kc.f32(wg), kc.f32(wu), sizes, 2.0, None)
    kc.assert_grouped_output(out, ref, sizes, kc.TOL_BF16, "race-detector run")


def test_interpret_inside_shard_map_on_two_devices(eight_devices):
    """EP-style use: shard_map over 2 devices, each with its own rows, experts and
    traced group sizes (one device's all empty), float32 (bf16x3) inputs. The
    simulated devices interpret their kernels concurrently in one shared memory
    (pallas_kernels/interpret_compat.py keeps them apart).

    Two devices, not eight: with 8 devices on a 2-core host the interpreter's
    nested XLA executions exhaust XLA:CPU's thread pool and deadlock about one
    run in two (measured); 2 devices ran clean in every trial."""
    devices, m, k, n, g = 2, 24, 32, 32, 2
    x, (w,) = kc.grouped_inputs(11, devices * m, k, n, devices * g, F32, 1)
    sizes = np.concatenate([kc.group_pattern(p, m, g) for p in ["sum_lt_m", "all_empty"]])
    x = jnp.concatenate([kc.poison_tail(x[d * m:(d + 1) * m], sizes[d * g:(d + 1) * g])
                         for d in range(devices)])
    mesh = jax.sharding.Mesh(np.array(eight_devices[:devices]), ("ep",),
                             axis_types=(jax.sharding.AxisType.Auto,))
    fn = jax.jit(jax.shard_map(lambda a, b, s: grouped_matmul(a, b, s, backend="interpret"),
                               mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep")),
                               out_specs=P("ep")))
    out = np.asarray(fn(x, w, jnp.asarray(sizes)))
    for d in range(devices):
        rows, groups = slice(d * m, (d + 1) * m), slice(d * g, (d + 1) * g)
        ref = kc.np_grouped_matmul(x[rows], w[groups], sizes[groups])
        kc.assert_grouped_output(out[rows], ref, sizes[groups], kc.TOL_F32_KERNEL, f"device {d}")


def test_split_bf16_planes():
    """hi + lo carries ~16 significand bits; hi is the bf16 rounding; inf stays inf."""
    x = kc.normal(jax.random.key(5), (4096,), F32, scale=3.0)
    hi, lo = tiling.split_bf16(x)
    assert hi.dtype == lo.dtype == BF16
    np.testing.assert_array_equal(hi, x.astype(BF16))
    x64 = np.asarray(x, np.float64)
    resid = np.abs(np.asarray(hi, np.float64) + np.asarray(lo, np.float64) - x64)
    assert np.all(resid <= 2.0 ** -16 * np.abs(x64)), float(np.max(resid / np.abs(x64)))
    assert np.max(resid / np.abs(x64)) < 2.0 ** -8 / 4  # far better than bf16 alone
    special = jnp.array([jnp.inf, -jnp.inf, 0.0, 1e-40, 3.4e38], F32)
    hi_s, lo_s = tiling.split_bf16(special)
    assert list(np.isposinf(np.asarray(hi_s, np.float32))) == [True, False, False, False, True]
    assert np.all(np.isfinite(np.asarray(lo_s, np.float32)))
    assert tiling.num_planes(BF16) == tiling.num_planes(jnp.float16) == 1
    assert tiling.num_planes(F32) == 2
    with pytest.raises(ValueError, match="bfloat16, float16 or float32"):
        tiling.num_planes(jnp.int8)


@pytest.mark.parametrize("pattern", ["zeros_skewed", "sum_lt_m", "uniform", "one_group_all"])
def test_reference_matches_float64_numpy_loop(pattern):
    m, k, n, g = 37, 24, 40, 5
    x, (wg, wu), _ = _inputs((m, k, n, g, pattern, F32, False), 2)
    sizes = kc.group_pattern(pattern, m, g)
    x = kc.poison_tail(x, sizes)
    y = reference.grouped_matmul(x, wg, jnp.asarray(sizes))
    kc.assert_grouped_output(y, kc.np_grouped_matmul(x, wg, sizes), sizes, kc.TOL_F32, pattern)
    h = reference.grouped_situ_glu(x, wg, wu, jnp.asarray(sizes), **SITU)
    kc.assert_grouped_output(h, kc.np_grouped_situ_glu(x, wg, wu, sizes), sizes, kc.TOL_F32,
                             pattern)


@pytest.mark.parametrize("block_m", [8, 64, 128])
def test_work_items_cover_every_row_exactly_once(block_m):
    """Every row is in exactly one item, of its own group (or -1 past the sum);
    items never mix groups; x tiles start at multiples of 8 inside x; a group
    of <= block_m - 7 rows is one item (its weights read once per N-block)."""
    rng = np.random.default_rng(block_m)
    for m, g in [(1, 1), (63, 5), (64, 3), (65, 11), (300, 7)]:
        table = jax.jit(functools.partial(schedule.work_items_4W, num_rows=m, block_m=block_m))
        x_rows = schedule.x_rows(m, block_m)
        for trial in range(8):
            cuts = np.sort(rng.integers(0, m + 1, size=g))  # sum(sizes) = cuts[-1] <= m
            if trial == 0:
                cuts[:] = m  # every row in the first group
            sizes = np.diff(np.concatenate([[0], cuts])).astype(np.int32)
            meta = np.asarray(table(jnp.asarray(sizes)))
            assert meta.shape == (4, schedule.num_work_items(m, g, block_m))
            owner = np.full(m, -2)
            items_of = np.zeros(g + 1, int)
            for group, x_row0, offset, count in meta.T:
                assert 0 <= count and offset + count <= block_m
                if count == 0:
                    continue
                assert x_row0 % 8 == 0 and 0 <= x_row0 <= x_rows - block_m
                rows = x_row0 + offset + np.arange(count)
                assert (owner[rows] == -2).all(), (sizes, "row covered twice")
                owner[rows] = group
                items_of[group] += 1
            expected = np.concatenate([np.repeat(np.arange(g), sizes),
                                       np.full(m - sizes.sum(), -1)])
            np.testing.assert_array_equal(owner, expected, err_msg=str(sizes))
            small = (sizes > 0) & (sizes <= block_m - 7)
            assert (items_of[:g][small] == 1).all(), (sizes, items_of)


# K3 local experts at EP 8 / 32 (112 / 28): decode tiles (M / G < 128) at EP 8,
# prefill tiles (2 consumer warpgroups) at EP 32; float32 inputs stage two bf16
# planes per element (twice the SMEM per stage: fewer stages or narrower N).
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("num_groups,m", [(112, 300), (28, 4096)])
def test_lowers_for_sm90_at_k3_shapes(num_groups, m, dtype):
    """Mosaic GPU lowering + layout inference + the 227 KiB SMEM budget (no GPU needed)."""
    S = jax.ShapeDtypeStruct
    sizes = S((num_groups,), jnp.int32)
    fused = kc.lower_for_sm90(
        lambda x, a, b, s: grouped_situ_glu(x, a, b, s, backend="pallas", **SITU),
        S((m, 3584), dtype), S((num_groups, 3584, 3072), dtype),
        S((num_groups, 3584, 3072), dtype), sizes)
    plain = kc.lower_for_sm90(lambda x, w, s: grouped_matmul(x, w, s, backend="pallas"),
                              S((m, 3072), dtype), S((num_groups, 3072, 3584), dtype), sizes)
    assert "mosaic_gpu" in fused and "mosaic_gpu" in plain


def test_tile_configs_fit_smem_and_are_chosen_by_rows_per_group(monkeypatch):
    limit = tiling.SMEM_LIMIT
    for cfg, num_w in [(mosaic_sm90.FUSED_DECODE, 2), (mosaic_sm90.FUSED_PREFILL, 2),
                       (mosaic_sm90.PLAIN_DECODE, 1), (mosaic_sm90.PLAIN_PREFILL, 1),
                       (mosaic_sm90.FUSED_TALL, 2), (mosaic_sm90.PLAIN_TALL, 1)]:
        assert cfg.smem_bytes(num_w, 2, 2) <= limit, cfg
        assert mosaic_sm90.fit_smem(cfg, num_w, 2, 2) == cfg  # bf16 tiles are used as is
        # float32: two bf16 planes (4 B/element) and f32 output tiles still fit
        fitted = mosaic_sm90.fit_smem(cfg, num_w, 4, 4, min_block_n=32)
        assert fitted.smem_bytes(num_w, 4, 4) <= limit and fitted.max_concurrent_steps >= 2, cfg
        assert fitted.block_m == cfg.block_m and fitted.block_k == cfg.block_k
    # Two f32 stages of the fused prefill tile overflow: N narrows to 64 instead.
    f32_prefill = mosaic_sm90.fit_smem(mosaic_sm90.FUSED_PREFILL, 2, 4, 4, min_block_n=32)
    assert (f32_prefill.block_n, f32_prefill.max_concurrent_steps) == (64, 3)
    # The shortest tile that holds a routed group's mean + 3 sigma rows.
    assert mosaic_sm90.default_config(256, 112, 2) == mosaic_sm90.FUSED_DECODE  # 2.3 rows
    assert mosaic_sm90.default_config(4096, 56, 1) == mosaic_sm90.PLAIN_PREFILL  # 73 -> 99
    assert mosaic_sm90.default_config(4096, 28, 2) == mosaic_sm90.FUSED_TALL  # 146 -> 183
    assert mosaic_sm90.default_config(4096, 28, 1) == mosaic_sm90.PLAIN_TALL
    assert mosaic_sm90.default_config(256 * 112, 112, 2) == mosaic_sm90.FUSED_PREFILL
    assert mosaic_sm90.default_config(128, 1, 2) == mosaic_sm90.FUSED_PREFILL  # one group: exact
    # Mosaic's own SMEM check agrees with smem_bytes: one stage too many fails to
    # lower (bf16), and so do the unshrunk decode tiles with float32 planes (the
    # two-consumer ones drop to 2 stages for float32 in plan_launch).
    too_deep = dataclasses.replace(mosaic_sm90.FUSED_PREFILL, max_concurrent_steps=7)
    assert too_deep.smem_bytes(2, 2, 2) > limit
    monkeypatch.setattr(mosaic_sm90, "fit_smem", lambda cfg, *_: cfg)
    S = jax.ShapeDtypeStruct
    for cfg, dtype in [(too_deep, BF16), (mosaic_sm90.FUSED_DECODE, F32)]:
        with pytest.raises(ValueError, match="shared memory"):
            kc.lower_for_sm90(
                lambda x, a, b, s, cfg=cfg: mosaic_sm90.grouped_situ_glu(x, a, b, s, config=cfg,
                                                                         **SITU),
                S((256, 3584), dtype), S((8, 3584, 3072), dtype), S((8, 3584, 3072), dtype),
                S((8,), jnp.int32))


def test_backend_dispatch(monkeypatch):
    assert resolve_backend("xla") == "xla"
    assert resolve_backend("interpret") == "interpret"
    assert resolve_backend("pallas") == "pallas"
    if jax.default_backend() != "gpu":
        assert resolve_backend("auto") == "xla"
    # Which implementation each backend name really calls (spies; the kernel is not run).
    calls = []
    for module, label in ((blocked, "xla"), (mosaic_sm90, "mosaic")):
        for fn in ("grouped_matmul", "grouped_situ_glu"):
            def spy(*args, _label=label, _fn=fn, _orig=getattr(module, fn), **kwargs):
                calls.append((_fn, _label, kwargs.get("interpret")))
                if _label == "xla":
                    return _orig(*args, **kwargs)
                return jnp.zeros((args[0].shape[0], args[1].shape[2]), args[0].dtype)
            monkeypatch.setattr(module, fn, spy)
    x, (wg, wu), sizes = _inputs((37, 24, 40, 5, "sum_lt_m", F32, False), 2)
    sizes = jnp.asarray(sizes)
    auto = {"xla": ("xla", None), "pallas": ("mosaic", False)}[resolve_backend("auto")]
    for backend, expected in [("auto", auto), ("xla", ("xla", None)),
                              ("interpret", ("mosaic", True)), ("pallas", ("mosaic", False))]:
        calls.clear()
        y = grouped_matmul(x, wg, sizes, backend=backend)
        h = grouped_situ_glu(x, wg, wu, sizes, backend=backend, **SITU)
        assert calls == [("grouped_matmul", *expected), ("grouped_situ_glu", *expected)], backend
        if expected[0] == "xla":  # random inputs: the dispatched result is the reference's
            kc.assert_grouped_output(y, kc.np_grouped_matmul(x, wg, sizes), sizes, kc.TOL_F32,
                                     backend)
            kc.assert_grouped_output(h, kc.np_grouped_situ_glu(x, wg, wu, sizes), sizes,
                                     kc.TOL_F32, backend)
    x, (w,), sizes = _inputs((16, 8, 8, 2, "uniform", F32, False), 1)
    with pytest.raises(ValueError, match="'cuda'"):
        grouped_matmul(x, w, jnp.asarray(sizes), backend="cuda")


def test_shape_validation():
    x = jnp.zeros((16, 8))
    w = jnp.zeros((2, 8, 4))
    sizes = jnp.array([8, 8], jnp.int32)
    with pytest.raises(ValueError, match="x_MK K=8 != w_GKN K=6"):
        grouped_matmul(x, jnp.zeros((2, 6, 4)), sizes, backend="xla")
    with pytest.raises(ValueError, match="group_sizes_G length 3 != w_GKN G=2"):
        grouped_matmul(x, w, jnp.array([4, 4, 8], jnp.int32), backend="xla")
    with pytest.raises(ValueError, match="x_MK must be 2-D"):
        grouped_matmul(jnp.zeros((2, 16, 8)), w, sizes, backend="xla")
    with pytest.raises(ValueError, match="w_GKN must be 3-D"):
        grouped_matmul(x, jnp.zeros((8, 4)), sizes, backend="xla")
    with pytest.raises(ValueError, match="group_sizes_G must be 1-D"):
        grouped_matmul(x, w, sizes[None], backend="xla")
    with pytest.raises(ValueError, match="group_sizes_G must be an integer"):
        grouped_matmul(x, w, sizes.astype(jnp.float32), backend="xla")
    with pytest.raises(ValueError, match="w_gate_GKN shape .* != w_up_GKN shape"):
        grouped_situ_glu(x, w, jnp.zeros((2, 8, 5)), sizes, backend="xla", **SITU)
    with pytest.raises(ValueError, match="x_MK K=8 != w_up_GKN K=6"):
        grouped_situ_glu(x, w, jnp.zeros((2, 6, 4)), sizes, backend="xla", **SITU)
    with pytest.raises(ValueError, match="beta must be > 0"):
        grouped_situ_glu(x, w, w, sizes, beta=0.0, linear_beta=None, backend="xla")
