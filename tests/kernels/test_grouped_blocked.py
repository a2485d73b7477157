"""The "xla" backend's sorted, blocked grouped matmul (blocked.py) and MXFP4
weights (pallas_kernels.mxfp4.Mxfp4Weights): float64 numpy references, the
item schedule, dequantization bit-identical to the codec, and the memory the
formulation exists for (no dense [M, G*K] expansion). Measured: 46 s wall, 28 s CPU
on 2 shared cores."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_cases as kc
import tiers
from pallas_kernels import grouped_matmul, grouped_situ_glu
from pallas_kernels.grouped_matmul import blocked, reference
from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights, dequant, dequant_numpy

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}

# (m, k, n, g, pattern): odd group sizes, empty groups, a tail, M below one
# block (m=5), several blocks per group (m=300: 64-row blocks, 4 groups).
CASES = [(37, 64, 40, 5, "zeros_skewed"), (37, 64, 40, 5, "sum_lt_m"),
         (5, 64, 24, 3, "uniform"), (300, 32, 48, 4, "sum_lt_m"), (64, 32, 16, 6, "all_empty"),
         (96, 64, 32, 4, "one_group_all")]

_plain = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, backend="xla"))
_fused = jax.jit(lambda x, wg, wu, s: grouped_situ_glu(x, wg, wu, s, backend="xla", **SITU))


def _case_id(case):
    return "{}x{}x{}_g{}_{}".format(*case)


@pytest.mark.parametrize("case, dtype", tiers.dtype_diagonal(CASES, [F32, BF16], _case_id))
def test_blocked_matches_float64(case, dtype):
    m, k, n, g, pattern = case
    x, (wg, wu) = kc.grouped_inputs(m + g, m, k, n, g, dtype, 2)
    sizes = kc.group_pattern(pattern, m, g)
    x = kc.poison_tail(x, sizes)            # NaN rows past sum(sizes) must not leak
    tol = kc.TOL_F32 if dtype == F32 else kc.TOL_BF16
    y = _plain(x, wg, jnp.asarray(sizes))
    assert y.dtype == dtype and y.shape == (m, n)
    kc.assert_grouped_output(y, kc.np_grouped_matmul(x, wg, sizes), sizes, tol, "plain")
    h = _fused(x, wg, wu, jnp.asarray(sizes))
    kc.assert_grouped_output(h, kc.np_grouped_situ_glu(x, wg, wu, sizes), sizes, tol, "fused")


@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_items_cover_every_valid_row_exactly_once(block_m):
    rng = np.random.default_rng(block_m)
    for m, g in [(1, 1), (15, 4), (16, 3), (17, 9), (70, 6)]:
        table = jax.jit(lambda s, m=m: blocked.items_3W(s, m, block_m))
        for trial in range(6):
            cuts = np.sort(rng.integers(0, m + 1, size=g))
            if trial == 0:
                cuts[:] = m
            sizes = np.diff(np.concatenate([[0], cuts])).astype(np.int32)
            items = np.asarray(table(jnp.asarray(sizes)))
            assert items.shape == (3, blocked.num_items(m, g, block_m))
            owner = np.full(m, -1)
            for group, first, end in items.T:
                assert first <= end and (end == first or (end - 1) // block_m == first // block_m)
                assert (owner[first:end] == -1).all(), (sizes, "row covered twice")
                owner[first:end] = group
            expected = np.concatenate([np.repeat(np.arange(g), sizes), np.full(m - sizes.sum(), -1)])
            np.testing.assert_array_equal(owner, expected, err_msg=str(sizes))


def test_block_rows():
    assert blocked.block_rows(256, 112) == 16      # decode: a few rows per group
    assert blocked.block_rows(131072, 112) == 256  # prefill
    assert blocked.block_rows(5, 3) == 5           # never more rows than M
    assert blocked.block_rows(100, 1) == 100


def _random_mxfp4(rng, g, k, n, scale_lo=120, scale_hi=134):
    packed = rng.integers(0, 256, (g, k // 2, n), dtype=np.uint8)
    scale = rng.integers(scale_lo, scale_hi, (g, k // 32, n), dtype=np.uint8)
    return packed, scale


def _decode_gkn(packed, scale) -> np.ndarray:
    """float32 [G, K, N] through the codec (which decodes along the last axis)."""
    return np.swapaxes(dequant_numpy(np.swapaxes(packed, 1, 2), np.swapaxes(scale, 1, 2)),
                       1, 2)


def test_dequantize_expert_is_the_codec_bit_for_bit():
    """Every code in both nibbles, and every scale byte 0..255 (bf16/f32
    subnormal results flushed, the largest finite, overflow to inf, NaN)."""
    k, n = 64, 256
    # byte (j + col) mod 256 at [j, col]: every (low, high) code pair in every column
    packed = ((np.arange(k // 2)[:, None] + np.arange(n)[None, :]) % 256).astype(np.uint8)[None]
    scale = np.tile(np.arange(256, dtype=np.uint8)[None, :], (k // 32, 1))[None]  # [1, 2, 256]
    scale[0, 1] = np.roll(scale[0, 1], 7)
    want = _decode_gkn(packed, scale)[0]
    for dtype in (F32, BF16):
        got = jax.jit(lambda p, s, dtype=dtype: dequant(p, s, dtype, axis=0))(packed[0], scale[0])
        got32 = np.asarray(got.astype(F32))
        np.testing.assert_array_equal(np.isnan(got32), np.isnan(want))
        ok = ~np.isnan(want)
        np.testing.assert_array_equal(got32[ok].view(np.uint32), want[ok].view(np.uint32))
    assert np.isnan(want[:32, 255]).all() and np.isinf(want).any() and (want[:, :2] == 0).any()
    weights = kc.mxfp4_from_kn(packed, scale)
    assert weights.shape == (1, k, n)
    np.testing.assert_array_equal(np.asarray(weights.dequantize(F32)), _decode_gkn(packed, scale))


@pytest.mark.parametrize("backend,dtype", [("xla", F32), ("xla", BF16),
                                           tiers.slow("interpret", BF16)],
                         ids=["xla-f32", "xla-bf16", "interpret-bf16"])
def test_mxfp4_weights_match_float64_of_the_decoded_codes(dtype, backend):
    m, k, n, g = 37, 64, 48, 5
    rng = np.random.default_rng(7)
    (pg, sg), (pu, su) = _random_mxfp4(rng, g, k, n), _random_mxfp4(rng, g, k, n)
    x = kc.normal(jax.random.key(3), (m, k), dtype, scale=0.1)
    for pattern in ("zeros_skewed", "sum_lt_m"):
        sizes = kc.group_pattern(pattern, m, g)
        xp = kc.poison_tail(x, sizes)
        wg, wu = kc.mxfp4_from_kn(pg, sg), kc.mxfp4_from_kn(pu, su)
        dg, du = _decode_gkn(pg, sg), _decode_gkn(pu, su)
        tol = kc.TOL_F32 if dtype == F32 else kc.TOL_BF16
        y = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, backend=backend))(xp, wg, sizes)
        kc.assert_grouped_output(y, kc.np_grouped_matmul(xp, dg, sizes), sizes, tol, pattern)
        h = jax.jit(lambda x, a, b, s: grouped_situ_glu(x, a, b, s, backend=backend, **SITU))(
            xp, wg, wu, sizes)
        kc.assert_grouped_output(h, kc.np_grouped_situ_glu(xp, dg, du, sizes), sizes, tol, pattern)


def test_mxfp4_weights_are_validated():
    x = jnp.zeros((4, 64), F32)
    sizes = jnp.array([2, 2], jnp.int32)
    good_p, good_s = jnp.zeros((2, 8, 32), jnp.uint8), jnp.zeros((2, 2, 8), jnp.uint8)

    def w(p, s):
        return Mxfp4Weights(p, s, Mxfp4Dequant.EXACT)
    with pytest.raises(ValueError, match="w_GKN: MXFP4 packed_GNK and scale_GKN must be uint8"):
        grouped_matmul(x, w(good_p.astype(jnp.int8), good_s), sizes, backend="xla")
    with pytest.raises(ValueError, match=r"w_up_GKN: MXFP4 packed_GNK \(2, 8, 32\) needs"):
        grouped_situ_glu(x, w(good_p, good_s), w(good_p, good_s[:, :1]),
                         sizes, backend="xla", **SITU)
    with pytest.raises(ValueError, match="x_MK K=64 != w_GKN K=32"):
        grouped_matmul(x, w(good_p[:, :, :16], good_s[:, :1]), sizes, backend="xla")
    with pytest.raises(ValueError, match=r"packed_GNK \(2, 32, 8\) needs"):   # [G, K/2, N]
        grouped_matmul(x, w(jnp.zeros((2, 32, 8), jnp.uint8), good_s), sizes, backend="xla")


def test_no_dense_expansion():
    """ragged_dot on XLA expands to [M, G*K]; the blocked path's temporaries
    stay near its [M, N] output (CPU compile; the H200 compile behaves alike,
    see benchmarks/results/compiled_temporaries_k3_moe.md)."""
    m, k, n, g = 2048, 256, 128, 64
    args = (jax.ShapeDtypeStruct((m, k), BF16), jax.ShapeDtypeStruct((g, k, n), BF16),
            jax.ShapeDtypeStruct((g,), jnp.int32))
    dense_expansion = m * g * k * 2
    temp = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, backend="xla")).lower(
        *args).compile().memory_analysis().temp_size_in_bytes
    assert temp < dense_expansion / 16, (temp, dense_expansion)
    packed = Mxfp4Weights(jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8),
                          jax.ShapeDtypeStruct((g, k // 32, n), jnp.uint8), Mxfp4Dequant.FAST)
    temp4 = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, backend="xla")).lower(
        args[0], packed, args[2]).compile().memory_analysis().temp_size_in_bytes
    all_experts_bf16 = g * k * n * 2
    assert temp4 < all_experts_bf16 / 4, (temp4, all_experts_bf16)


def test_blocked_is_differentiable_like_ragged_dot():
    """Reverse mode through the scan / cond / optimization barrier gives
    ragged_dot's gradients (float32, fresh random inputs)."""
    x, (w,) = kc.grouped_inputs(11, 37, 16, 8, 4, F32, 1)
    sizes = jnp.array([5, 0, 20, 7], jnp.int32)
    got = jax.grad(lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, backend="xla") ** 2),
                   (0, 1))(x, w)
    want = jax.grad(lambda x, w: jnp.sum(reference.grouped_matmul(x, w, sizes) ** 2), (0, 1))(x, w)
    for g, r in zip(got, want, strict=True):
        kc.assert_close(g, r, kc.TOL_F32, "gradient")
