"""grouped_matmul_combine: a grouped matmul whose rows are weighted and
scatter-added into tokens (the routed experts' down projection and top-k
combine), and its one-scan backward on "xla"
(blocked_tgmm.grouped_matmul_combine_vjp), against float64 numpy on fresh
random inputs: ragged and empty groups, G = 1, many groups, tokens that
receive no row and tokens that receive several, rows past sum(group_sizes)
holding NaN in x (their weights are finite, as routing weights are). And
what the op exists for: the compiled backward holds no [M, N] cotangent of
the rows."""

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
from pallas_kernels.grouped_matmul import blocked
from pallas_kernels.grouped_matmul.combine import combine_rows, grouped_matmul_combine

BF16, F32 = jnp.bfloat16, jnp.float32

# (m, k, n, g, pattern, tokens): ragged groups crossing blocks with a tail,
# an empty first group and one big group, G = 1, more groups than blocks,
# every group empty, M below a block; tokens < m (several rows a token) or > m.
CASES = [(300, 32, 48, 4, "sum_lt_m", 40), (37, 64, 40, 5, "zeros_skewed", 50),
         (70, 16, 24, 1, "uniform", 9), (200, 16, 8, 64, "uniform", 64),
         (64, 32, 16, 6, "all_empty", 8), (5, 24, 16, 3, "uniform", 3)]


def _case_id(case):
    return "{}x{}x{}_g{}_{}_t{}".format(*case)


def _inputs(case, dtype, seed):
    m, k, n, g, pattern, tokens = case
    keys = jax.random.split(jax.random.key(seed + 31 * m + k + n + g), 3)
    sizes = kc.group_pattern(pattern, m, g)
    x = kc.poison_tail(kc.normal(keys[0], (m, k), dtype), sizes)
    _, (w,) = kc.grouped_inputs(seed + 1, 1, k, n, g, dtype)
    rng = np.random.default_rng(seed)
    token = jnp.asarray(rng.integers(0, tokens, m), jnp.int32)
    weight = jax.random.uniform(keys[1], (m,), F32, 0.1, 1.0)
    dr = kc.normal(keys[2], (tokens, n), F32)
    return x, w, sizes, token, weight, dr


def np_combine_grads(x, w, sizes, token, weight, dr):
    """float64 (r, dx, dw, dweight) of sum(r * dr), r[t] = sum over valid
    rows m with token m of weight[m] * (x[m] @ w[g(m)]); rows past
    sum(sizes) contribute nothing and get zero gradients."""
    total = int(np.sum(sizes))
    x64 = np.asarray(x, np.float64)[:total]
    w64 = np.asarray(w, np.float64)
    tok, wt = np.asarray(token)[:total], np.asarray(weight, np.float64)[:total]
    dr64 = np.asarray(dr, np.float64)
    y = kc.np_grouped_matmul(x64, w64, sizes)
    r = np.zeros_like(dr64)
    np.add.at(r, tok, wt[:, None] * y)
    dy = wt[:, None] * dr64[tok]
    dx = np.zeros(np.shape(x), np.float64)
    for g, rows in kc.group_rows(sizes):
        dx[rows] = dy[rows] @ w64[g].T
    dweight = np.zeros(np.shape(weight), np.float64)
    dweight[:total] = np.sum(y * dr64[tok], axis=1)
    return r, dx, kc.np_tgmm(x64, dy, sizes), dweight


def _grads(x, w, sizes, token, weight, dr, backend="xla"):
    num_tokens = dr.shape[0]

    def loss(x, w, weight):
        return jnp.sum(grouped_matmul_combine(x, w, sizes, token, weight, num_tokens,
                                              backend=backend) * dr)
    args = (x, w, weight)
    r = jax.jit(lambda *a: grouped_matmul_combine(a[0], a[1], sizes, token, a[2], num_tokens,
                                                  backend=backend))(*args)
    return r, jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)


@pytest.mark.parametrize("case, dtype", tiers.dtype_diagonal(CASES, [F32, BF16], _case_id))
def test_xla_grads_match_float64(case, dtype):
    """Forward: the composition (grouped matmul, then combine_rows) bit for
    bit. Backward (one scan): dx, dw and the weights' gradient against
    float64; no NaN from x's poisoned tail, whose dx and dweight are exact
    zeros, as are empty groups' dw."""
    x, w, sizes, token, weight, dr = _inputs(case, dtype, seed=1)
    s = jnp.asarray(sizes)
    r, (dx, dw, dweight) = _grads(x, w, s, token, weight, dr)
    composed = combine_rows(blocked.grouped_matmul(x, w, s), token, weight, dr.shape[0])
    np.testing.assert_array_equal(np.asarray(r), np.asarray(composed))
    want = np_combine_grads(x, w, sizes, token, weight, dr)
    total = int(sizes.sum())
    tol = kc.TOL_F32 if dtype == F32 else kc.TOL_BF16
    for what, got, ref, primal in (("r", r, want[0], dr), ("dx", dx, want[1], x),
                                   ("dw", dw, want[2], w), ("dweight", dweight, want[3], weight)):
        assert got.shape == primal.shape and got.dtype == (F32 if what == "r" else primal.dtype)
        got64 = np.asarray(got.astype(F32), np.float64)
        assert not np.isnan(got64).any(), f"{what}: NaN leaked"
        if total:
            kc.assert_close(got64, ref, tol, what)
        else:
            assert np.all(got64 == 0.0), what
    assert np.all(np.asarray(dx.astype(F32))[total:] == 0.0)
    assert np.all(np.asarray(dweight)[total:] == 0.0)
    assert np.all(np.asarray(dw.astype(F32))[sizes == 0] == 0.0)


def test_frozen_mxfp4_weights_take_the_composition():
    """Mxfp4Weights (frozen): the composition's forward and x / weight
    gradients (mxfp4_vjp), against float64 of the decoded codes."""
    m, k, n, g, tokens = 120, 64, 32, 3, 20
    codes_GKN, scales_GKN = kc.random_mxfp4(np.random.default_rng(5), g, k, n, hi=128)
    packed = kc.mxfp4_from_kn(codes_GKN, scales_GKN)
    decoded = kc.decode_mxfp4_gkn(codes_GKN, scales_GKN)
    x, _, sizes, token, weight, dr = _inputs((m, k, n, g, "sum_lt_m", tokens), F32, seed=6)
    s = jnp.asarray(sizes)

    def loss(x, weight):
        return jnp.sum(grouped_matmul_combine(x, packed, s, token, weight, tokens,
                                              backend="xla") * dr)
    dx, dweight = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, weight)
    _, want_dx, _, want_dweight = np_combine_grads(x, decoded, sizes, token, weight, dr)
    kc.assert_grouped_output(dx, want_dx, sizes, kc.TOL_F32, "dx")
    kc.assert_grouped_output(dweight[:, None], want_dweight[:, None], sizes, kc.TOL_F32,
                             "dweight")


@pytest.mark.parametrize("packed", [False, True], ids=["xla", "mxfp4"])
def test_pinned_values_pass_through_one_barrier(packed):
    """``pinned`` comes back unchanged beside the same r, its cotangent goes
    straight back, and the program holds it with the rows in an optimization
    barrier: on the fused "xla" op and on the composition (MXFP4)."""
    m, k, n, g, tokens = 64, 64, 32, 3, 12
    x, w, sizes, token, weight, dr = _inputs((m, k, n, g, "uniform", tokens), F32, seed=8)
    if packed:
        w = kc.mxfp4_from_kn(*kc.random_mxfp4(np.random.default_rng(9), g, k, n))
    s = jnp.asarray(sizes)
    pin = kc.normal(jax.random.key(10), (5, 7), F32)
    cot_pin = kc.normal(jax.random.key(11), (5, 7), F32)

    def op(x, weight, pin):
        return grouped_matmul_combine(x, w, s, token, weight, tokens, backend="xla", pinned=pin)

    def loss(x, weight, pin):
        r, pinned = op(x, weight, pin)
        return jnp.sum(r * dr) + jnp.sum(pinned * cot_pin)
    r, pinned = jax.jit(op)(x, weight, pin)
    plain = grouped_matmul_combine(x, w, s, token, weight, tokens, backend="xla")
    np.testing.assert_array_equal(np.asarray(r), np.asarray(plain))
    np.testing.assert_array_equal(np.asarray(pinned), np.asarray(pin))
    dx, dweight, d_pin = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, weight, pin)
    np.testing.assert_array_equal(np.asarray(d_pin), np.asarray(cot_pin))
    assert np.all(np.isfinite(np.asarray(dx))) and np.all(np.isfinite(np.asarray(dweight)))
    barriers = [line for line in jax.jit(op).lower(x, weight, pin).as_text().splitlines()
                if "optimization_barrier" in line]
    assert any(f"tensor<{m}x{n}xf32>" in line and "tensor<5x7xf32>" in line
               for line in barriers), barriers


@pytest.mark.parametrize("what, culprit", [("token", "token_M must be"),
                                           ("weight", "weight_M must be"),
                                           ("token_dtype", "token_M must be an integer"),
                                           ("weight_dtype", "weight_M must be a floating")])
def test_rejects_mismatched_rows(what, culprit):
    x, w, sizes, token, weight, dr = _inputs(CASES[0], F32, seed=2)
    args = {"token": token, "weight": weight}
    if what == "token":
        args["token"] = token[:-1]
    elif what == "weight":
        args["weight"] = weight[:-1]
    elif what == "token_dtype":
        args["token"] = token.astype(F32)
    else:
        args["weight"] = token
    with pytest.raises(ValueError, match=culprit):
        grouped_matmul_combine(x, w, jnp.asarray(sizes), args["token"], args["weight"],
                               dr.shape[0], backend="xla")


def test_the_backward_holds_no_row_cotangent():
    """Compiled forward + VJP on "xla", N wide (the latent: [M, N] rows are
    the largest buffers): the composition's autodiff holds the [M, N]
    cotangent of the rows (and keeps y for the weights' gradient); the one-scan
    backward gathers dr per block and holds neither."""
    m, k, n, g, tokens = 4096, 64, 1024, 8, 256
    x = jax.ShapeDtypeStruct((m, k), BF16)
    w = jax.ShapeDtypeStruct((g, k, n), BF16)
    s = jax.ShapeDtypeStruct((g,), jnp.int32)
    token = jax.ShapeDtypeStruct((m,), jnp.int32)
    weight = jax.ShapeDtypeStruct((m,), F32)
    rows_bytes = m * n * 2

    def grads(op):
        def fn(x, w, s, token, weight):
            def loss(x, w, weight):
                return jnp.sum(op(x, w, s, token, weight))
            return jax.grad(loss, argnums=(0, 1, 2))(x, w, weight)
        return jax.jit(fn).lower(x, w, s, token, weight).compile().memory_analysis()

    fused = grads(lambda *a: grouped_matmul_combine(*a, tokens, backend="xla"))
    composed = grads(lambda x, w, s, token, weight: combine_rows(
        blocked.grouped_matmul(x, w, s), token, weight, tokens))
    assert composed.temp_size_in_bytes >= rows_bytes, composed.temp_size_in_bytes
    assert fused.temp_size_in_bytes < rows_bytes / 2, fused.temp_size_in_bytes
