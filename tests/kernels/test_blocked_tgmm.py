"""The blocked backward of the "xla" backend: blocked_tgmm.tgmm (the weight
gradient, also Triton's), blocked.grouped_matmul_nt (dy @ w[g]^T, the
x-gradient, float and MXFP4 weights), blocked.grouped_situ_glu_dgate_up (the
fused pair's backward rows: gate/up recomputed per block), and jax.grad through the
custom VJPs on "xla" against
float64 numpy on fresh random inputs: empty groups, G = 1, many groups, rows
past sum(group_sizes) holding NaN in x and in the cotangent. And the memory
the formulation exists for: no [M, G*K] expansion, no dequantized copy of all
experts, in the compiled backward."""

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
from pallas_kernels.backend import resolve
from pallas_kernels.grouped_matmul import blocked, blocked_tgmm, dispatch, reference
from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}

# (m, k, n, g, pattern): ragged groups crossing blocks, empty groups, a tail,
# G = 1, many groups (more groups than blocks), every group empty, M below a block.
CASES = [(300, 32, 48, 4, "sum_lt_m"), (37, 64, 40, 5, "zeros_skewed"), (70, 16, 24, 1, "uniform"),
         (50, 16, 24, 1, "sum_lt_m"), (200, 16, 8, 64, "uniform"), (90, 16, 8, 40, "zeros_skewed"),
         (64, 32, 16, 6, "all_empty"), (5, 24, 16, 3, "uniform")]


def _case_id(case):
    return "{}x{}x{}_g{}_{}".format(*case)


def np_matmul_nt(dy, ws, sizes) -> np.ndarray:
    """float64 sum_i dy[:, i*N:(i+1)*N] @ w_i[g]^T; tail rows 0."""
    n = ws[0].shape[2]
    dy64 = np.asarray(dy, np.float64)
    out = np.zeros((dy64.shape[0], ws[0].shape[1]))
    for g, rows in kc.group_rows(sizes):
        for i, w in enumerate(ws):
            out[rows] += dy64[rows, i * n:(i + 1) * n] @ np.asarray(w, np.float64)[g].T
    return out


def _inputs(case, dtype, seed=0):
    m, k, n, g, pattern = case
    kx, kd = jax.random.split(jax.random.key(seed + m * 13 + k + n + g))
    sizes = kc.group_pattern(pattern, m, g)
    x = kc.poison_tail(kc.normal(kx, (m, k), dtype), sizes)
    dy = kc.poison_tail(kc.normal(kd, (m, n), dtype), sizes)
    return x, dy, sizes


def _tol(dtype):
    return kc.TOL_F32 if jnp.dtype(dtype) == jnp.dtype(F32) else kc.TOL_BF16


_tgmm = jax.jit(lambda x, dy, s: blocked_tgmm.tgmm(x, dy, s))


@pytest.mark.parametrize("case, dtype", tiers.dtype_diagonal(CASES, [F32, BF16], _case_id))
def test_tgmm_matches_float64_and_ragged_dot(case, dtype):
    x, dy, sizes = _inputs(case, dtype)
    out = _tgmm(x, dy, jnp.asarray(sizes))
    assert out.dtype == dtype and out.shape == (len(sizes), x.shape[1], dy.shape[1])
    out64 = np.asarray(out.astype(F32), np.float64)
    assert not np.isnan(out64).any(), "NaN past sum(group_sizes) leaked"
    assert np.all(out64[sizes == 0] == 0.0), "empty groups must be exact zeros"
    if np.any(sizes):
        kc.assert_close(out64, kc.np_tgmm(x, dy, sizes), _tol(dtype), "vs float64")
        kc.assert_close(out64, reference.tgmm(x, dy, jnp.asarray(sizes)).astype(F32),
                        _tol(dtype), "vs ragged_dot_general")


def test_tgmm_out_dtype_and_the_triton_dispatch():
    """float32 out from bf16 operands (one rounding of the f32 sum), and the
    Triton backend's dw is this scan (dispatch.py's tgmm; it needs no GPU)."""
    x, dy, sizes = _inputs((300, 32, 48, 4, "sum_lt_m"), BF16, seed=1)
    out = blocked_tgmm.tgmm(x, dy, jnp.asarray(sizes), out_dtype=F32)
    assert out.dtype == F32
    kc.assert_close(out, kc.np_tgmm(x, dy, sizes), kc.TOL_F32, "f32 out")
    for backend in ("xla", "triton"):
        got = dispatch.kernels(resolve(backend)).tgmm(x, dy, jnp.asarray(sizes), F32)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(out))
    with pytest.raises(ValueError, match="dy_MN rows 10 != x_MK rows 300"):
        blocked_tgmm.tgmm(x, dy[:10], jnp.asarray(sizes))


@pytest.mark.parametrize("num_weights", [1, 2])
@pytest.mark.parametrize("case", CASES[:6], ids=_case_id)
def test_grouped_matmul_nt_matches_float64(case, num_weights):
    m, k, n, g, _ = case
    _, dy, sizes = _inputs((m, k, n * num_weights, g, case[4]), F32, seed=2)
    _, ws = kc.grouped_inputs(m + 5, 1, k, n, g, F32, num_weights)
    out = jax.jit(lambda d, s, *w: blocked.grouped_matmul_nt(d, w, s))(dy, jnp.asarray(sizes), *ws)
    kc.assert_grouped_output(out, np_matmul_nt(dy, ws, sizes), sizes, kc.TOL_F32, "nt")
    with pytest.raises(ValueError, match="dy_MP width"):
        blocked.grouped_matmul_nt(dy[:, :-1], tuple(ws), jnp.asarray(sizes))


def test_grouped_situ_glu_dgate_up_matches_float64():
    """[d_gate | d_up] from one scan (gate/up recomputed per block in f32 from
    bf16 inputs): float64 reference, NaN in dh and x past sum(sizes) never read."""
    x, _, sizes = _inputs((300, 32, 48, 4, "sum_lt_m"), BF16, seed=3)
    _, (wg, wu) = kc.grouped_inputs(9, 1, 32, 48, 4, BF16, 2)
    dh = kc.poison_tail(kc.normal(jax.random.key(4), (300, 48), BF16), sizes)
    out = jax.jit(lambda *a: blocked.grouped_situ_glu_dgate_up(*a, **SITU))(
        x, wg, wu, dh, jnp.asarray(sizes))
    assert out.dtype == BF16 and out.shape == (300, 96)
    d_gate, d_up = np_dgate_up(x, wg, wu, sizes, dh)
    kc.assert_grouped_output(out.astype(F32), np.concatenate([d_gate, d_up], 1), sizes,
                             kc.TOL_BF16, "d_gate|d_up")


def test_tgmm_reads_a_column_range_in_place():
    x, dy, sizes = _inputs((90, 16, 40, 40, "zeros_skewed"), F32, seed=8)
    got = blocked_tgmm.tgmm(x, dy, jnp.asarray(sizes), columns=(8, 32))
    kc.assert_close(got, kc.np_tgmm(x, np.asarray(dy)[:, 8:32], sizes), kc.TOL_F32, "columns")
    with pytest.raises(ValueError, match="columns"):
        blocked_tgmm.tgmm(x, dy, jnp.asarray(sizes), columns=(8, 41))


def np_dgate_up(x, wg, wu, sizes, dh):
    """float64 (d_gate, d_up) of the fused pair for dh (tail dh dropped)."""
    gate, up = kc.np_grouped_matmul(x, wg, sizes), kc.np_grouped_matmul(x, wu, sizes)
    total = int(np.sum(sizes))
    dh = np.where(np.arange(len(gate))[:, None] < total, np.asarray(dh, np.float64), 0.0)
    s = 1.0 / (1.0 + np.exp(-gate))
    t = np.tanh(gate / kc.BETA)
    gate_act = kc.BETA * t * s
    dgate_act = (1 - t ** 2) * s + kc.BETA * t * s * (1 - s)
    lb = kc.LINEAR_BETA
    up_act = lb * np.tanh(up / lb)
    return dh * up_act * dgate_act, dh * gate_act * (1 - np.tanh(up / lb) ** 2)


def np_grads_fused(x, wg, wu, sizes, dh):
    """float64 (dx, dw_gate, dw_up) of sum(grouped_situ_glu * dh) (tail dh dropped)."""
    d_gate, d_up = np_dgate_up(x, wg, wu, sizes, dh)
    dx = np_matmul_nt(np.concatenate([d_gate, d_up], 1), (wg, wu), sizes)
    return dx, kc.np_tgmm(x, d_gate, sizes), kc.np_tgmm(x, d_up, sizes)


def _loss_grads(fn, cot, *args):
    """jax.grad of sum(fn(*args) * cot): a NaN in cot reaches the VJP as is."""
    def loss(*a):
        return jnp.sum(fn(*a).astype(F32) * cot.astype(F32))
    return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[3], CASES[4], CASES[5]], ids=_case_id)
def test_xla_grads_match_float64(case, dtype):
    """jax.grad on "xla" (the custom VJPs: grouped_matmul_nt + blocked tgmm;
    the fused pair recomputed in float32). x and the cotangent hold NaN in
    the rows past sum(group_sizes): no gradient may see it, dx there is 0."""
    m, k, n, g, pattern = case
    x, _, sizes = _inputs(case, dtype, seed=4)
    _, (wg, wu) = kc.grouped_inputs(m + 1, 1, k, n, g, dtype, 2)
    cot = kc.poison_tail(kc.normal(jax.random.key(m + 2), (m, n), dtype), sizes)
    s = jnp.asarray(sizes)
    total = int(sizes.sum())
    tol = _tol(dtype)
    got = _loss_grads(lambda a, b: grouped_matmul(a, b, s, backend="xla"), cot, x, wg)
    want = (np_matmul_nt(cot, (wg,), sizes), kc.np_tgmm(x, cot, sizes))
    got_f = _loss_grads(lambda a, b, c: grouped_situ_glu(a, b, c, s, backend="xla", **SITU),
                        cot, x, wg, wu)
    want_f = np_grads_fused(x, wg, wu, sizes, cot)
    for what, gs, ws, args in (("plain", got, want, (x, wg)), ("fused", got_f, want_f, (x, wg, wu))):
        dx = np.asarray(gs[0].astype(F32))
        assert not np.isnan(dx).any() and np.all(dx[total:] == 0.0), what
        for i, (a, b, p) in enumerate(zip(gs, ws, args, strict=True)):
            assert a.dtype == p.dtype and a.shape == p.shape, (what, i)
            assert not np.isnan(np.asarray(a.astype(F32))).any(), (what, i)
            if total:
                kc.assert_close(a.astype(F32), b, tol, f"{what} grad {i}")


def _random_mxfp4(rng, g, k, n):
    return Mxfp4Weights.from_checkpoint(
        jnp.asarray(rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8)),
        jnp.asarray(rng.integers(120, 132, (g, k // 32, n), dtype=np.uint8)))


@pytest.mark.parametrize("backend", ["xla"])
def test_mxfp4_x_gradient_matches_float64_of_the_decoded_codes(backend):
    m, k, n, g = 300, 64, 48, 5
    rng = np.random.default_rng(11)
    wg, wu = _random_mxfp4(rng, g, k, n), _random_mxfp4(rng, g, k, n)
    dg, du = np.asarray(wg.dequantize(F32)), np.asarray(wu.dequantize(F32))
    for pattern in ("zeros_skewed", "sum_lt_m"):
        x, _, sizes = _inputs((m, k, n, g, pattern), F32, seed=5)
        cot = kc.poison_tail(kc.normal(jax.random.key(6), (m, n), F32, scale=1e-2), sizes)
        s = jnp.asarray(sizes)
        (dx,) = _loss_grads(lambda a: grouped_matmul(a, wg, s, backend=backend), cot, x)
        kc.assert_grouped_output(dx, np_matmul_nt(cot, (dg,), sizes), sizes, kc.TOL_F32, pattern)
        (dx,) = _loss_grads(lambda a: grouped_situ_glu(a, wg, wu, s, backend=backend, **SITU),
                            cot, jnp.where(jnp.isnan(x), jnp.nan, x * 1e-2))
        want = np_grads_fused(np.asarray(x, np.float64) * 1e-2, dg, du, sizes, cot)[0]
        kc.assert_grouped_output(dx, want, sizes, kc.TOL_F32, f"fused {pattern}")


def _temp(fn, *args) -> int:
    return jax.jit(fn).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_the_backward_allocates_no_dense_expansion():
    """The compiled forward + VJP on "xla": dense ragged_dot's VJP would hold
    [M, G*K] (and the [G, M, K] broadcast); the blocked backward stays near
    its [M, .] and [G, K, N] outputs. MXFP4 (frozen): no dequantized copy of
    all experts."""
    m, k, n, g = 2048, 256, 128, 64
    x = jax.ShapeDtypeStruct((m, k), BF16)
    w = jax.ShapeDtypeStruct((g, k, n), BF16)
    s = jax.ShapeDtypeStruct((g,), jnp.int32)
    dense_expansion = m * g * k * 2

    def plain(x, w, s):
        return jax.grad(lambda a, b: jnp.sum(grouped_matmul(a, b, s, backend="xla")
                                             .astype(F32)), (0, 1))(x, w)

    def fused(x, w, s):
        return jax.grad(lambda a, b, c: jnp.sum(grouped_situ_glu(a, b, c, s, backend="xla", **SITU)
                                                .astype(F32)), (0, 1, 2))(x, w, w)

    assert _temp(plain, x, w, s) < dense_expansion / 8
    assert _temp(fused, x, w, s) < dense_expansion / 4
    text = jax.jit(fused).lower(x, w, s).as_text()
    assert "ragged" not in text
    # MXFP4, weights larger than the activations: jax's autodiff of the blocked
    # scan would keep one dequantized [K, N] per item as residuals (2x all experts).
    m, n = 256, 512
    x = jax.ShapeDtypeStruct((m, k), BF16)
    packed = Mxfp4Weights(jax.ShapeDtypeStruct((g, n, k // 2), jnp.uint8),
                          jax.ShapeDtypeStruct((g, k // 32, n), jnp.uint8), Mxfp4Dequant.FAST)

    def fused_x(x, w, s):
        return jax.grad(lambda a: jnp.sum(grouped_situ_glu(a, w, w, s, backend="xla", **SITU)
                                          .astype(F32)))(x)

    all_experts_bf16 = 2 * g * k * n * 2
    assert _temp(fused_x, x, packed, s) < all_experts_bf16 / 4
