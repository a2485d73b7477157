"""Backward passes of the kernels (custom VJPs; pallas_kernels/*/vjp.py):
the SiTU-GLU derivative, the transposed grouped matmul (tgmm: XLA reference
and Mosaic kernel in GPU interpret mode), and jax.grad of grouped_matmul,
grouped_situ_glu and situ_mlp_up on "xla" and "interpret" against float64
numpy gradients (the SiTU derivative there by complex-step differentiation,
independent of the hand-written one) and against jax's autodiff of the XLA
references. Fresh random inputs and cotangents; ragged and empty groups, M
below one tile, NaN in x and in the cotangent past sum(group_sizes).

Measured on the shared 2-core CPU host (load ~13): this file, the compile
check and tests/test_ops_kernel_grads.py together 91 s of CPU, 4 min wall;
the interpret-mode cases dominate. The sm_90a compile check is in
test_kernels_vjp_compile.py.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_cases as kc
from pallas_kernels import grouped_matmul, grouped_situ_glu, situ_glu, situ_mlp_up
from pallas_kernels.grouped_matmul import mosaic_sm90_tgmm, schedule
from pallas_kernels.grouped_matmul import reference as grouped_reference
from pallas_kernels.situ import situ_glu_vjp_f32
from pallas_kernels.situ_mlp import reference as mlp_reference

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}


# ---------------------------------------------------------------- float64 numpy

def np_situ_complex(gate, up, beta, linear_beta):
    """SPEC's SiTU-GLU on complex128 (for complex-step derivatives)."""
    gate_act = beta * np.tanh(gate / beta) / (1.0 + np.exp(-gate))
    up_act = up if linear_beta is None else linear_beta * np.tanh(up / linear_beta)
    return gate_act * up_act


def np_situ_grads(gate, up, dout, beta=kc.BETA, linear_beta=kc.LINEAR_BETA):
    """(d_gate, d_up) float64 by complex-step: Im f(z + ih) / h is f'(z) to rounding."""
    gate, up, dout = (np.asarray(a, np.float64) for a in (gate, up, dout))
    h = 1e-30
    d_gate = np.imag(np_situ_complex(gate + 1j * h, up + 0j, beta, linear_beta)) / h
    d_up = np.imag(np_situ_complex(gate + 0j, up + 1j * h, beta, linear_beta)) / h
    return dout * d_gate, dout * d_up


def np_grouped_matmul_grads(x, w, sizes, dy):
    """(dx, dw) of sum(grouped_matmul(x, w) * dy) in float64; tail rows of dx 0."""
    w64, dy64 = np.asarray(w, np.float64), np.asarray(dy, np.float64)
    dx = np.zeros(np.shape(x))
    for g, rows in kc.group_rows(sizes):
        dx[rows] = dy64[rows] @ w64[g].T
    return dx, kc.np_tgmm(x, dy, sizes)


def np_grouped_situ_glu_grads(x, w_gate, w_up, sizes, dh, beta=kc.BETA,
                              linear_beta=kc.LINEAR_BETA):
    """(dx, dw_gate, dw_up) of sum(grouped_situ_glu(...) * dh) in float64."""
    gate = kc.np_grouped_matmul(x, w_gate, sizes)
    up = kc.np_grouped_matmul(x, w_up, sizes)
    total = int(np.sum(sizes))
    dh = np.where(np.arange(len(gate))[:, None] < total, np.asarray(dh, np.float64), 0.0)
    d_gate, d_up = np_situ_grads(gate, up, dh, beta, linear_beta)
    dx_gate, dw_gate = np_grouped_matmul_grads(x, w_gate, sizes, d_gate)
    dx_up, dw_up = np_grouped_matmul_grads(x, w_up, sizes, d_up)
    return dx_gate + dx_up, dw_gate, dw_up


# ------------------------------------------------------------------- SiTU-GLU

@pytest.mark.parametrize("linear_beta", [kc.LINEAR_BETA, None])
def test_situ_glu_vjp_matches_autodiff_and_float64(linear_beta):
    kg, ku, kd = jax.random.split(jax.random.key(21), 3)
    gate = kc.normal(kg, (64, 48), F32, scale=8.0)  # reaches the tanh / sigmoid saturation
    up = kc.normal(ku, (64, 48), F32, scale=40.0)
    dout = kc.normal(kd, (64, 48), F32)
    d_gate, d_up = situ_glu_vjp_f32(gate, up, dout, beta=kc.BETA, linear_beta=linear_beta)
    assert d_gate.dtype == d_up.dtype == F32
    _, vjp_fn = jax.vjp(lambda g, u: situ_glu(g, u, beta=kc.BETA, linear_beta=linear_beta),
                        gate, up)
    auto_gate, auto_up = vjp_fn(dout)
    np_gate, np_up = np_situ_grads(gate, up, dout, kc.BETA, linear_beta)
    for got, auto, ref, what in [(d_gate, auto_gate, np_gate, "d_gate"), (d_up, auto_up, np_up,
                                                                           "d_up")]:
        kc.assert_close(got, auto, kc.TOL_F32, f"{what} vs jax.vjp")
        kc.assert_close(got, ref, kc.TOL_F32, f"{what} vs float64 complex step")


def test_situ_glu_vjp_extremes_are_finite():
    gate = jnp.array([-1e30, -1e4, -100.0, 0.0, 100.0, 1e4, 1e30], F32)
    up = jnp.array([1e30, -1e4, 3.0, 1.0, -2.0, 1e4, -1e30], F32)
    d_gate, d_up = situ_glu_vjp_f32(gate, up, jnp.ones_like(gate), beta=kc.BETA,
                                    linear_beta=kc.LINEAR_BETA)
    assert np.all(np.isfinite(np.asarray(d_gate))) and np.all(np.isfinite(np.asarray(d_up)))
    # d/d gate at 0: (1 - 0) * 1/2 + 0 = 1/2, times up' = 25 tanh(1/25)
    assert float(d_gate[3]) == pytest.approx(0.5 * kc.LINEAR_BETA * np.tanh(1 / kc.LINEAR_BETA))


# ------------------------------------------------------------------------ tgmm

# (m, k, n, g, pattern, dtype, poison). Poisoned cases put NaN in x AND dy past sum(sizes).
TGMM_CASES = [
    (96, 64, 128, 4, "sum_lt_m", BF16, True),      # ragged groups crossing 64-row blocks
    (96, 64, 128, 4, "zeros_skewed", BF16, False),  # empty first / last / every other group
    (96, 64, 64, 3, "sum_lt_m", F32, True),         # bf16x3; a group spans two M-blocks
    (96, 64, 64, 3, "all_empty", F32, True),        # every group empty: zeros, no NaN
    (20, 64, 64, 5, "zeros_skewed", F32, False),    # M below one 64-row tile
]


def _case_id(case) -> str:
    m, k, n, g, pattern, dtype, poison = case
    return f"{m}x{k}x{n}_g{g}_{pattern}_{jnp.dtype(dtype).name}" + ("_nan" if poison else "")


def _tgmm_inputs(case):
    m, k, n, g, pattern, dtype, poison = case
    kx, kd = jax.random.split(jax.random.key(m * 7 + k + n + g))
    x, dy = kc.normal(kx, (m, k), dtype), kc.normal(kd, (m, n), dtype)
    sizes = kc.group_pattern(pattern, m, g)
    if poison:
        x, dy = kc.poison_tail(x, sizes), kc.poison_tail(dy, sizes)
    return x, dy, sizes


_tgmm_interpret = jax.jit(lambda x, dy, s: mosaic_sm90_tgmm.tgmm(x, dy, s, interpret=True))


@pytest.mark.parametrize("case", TGMM_CASES, ids=_case_id)
def test_tgmm_interpret_matches_float64(case):
    x, dy, sizes = _tgmm_inputs(case)
    out = _tgmm_interpret(x, dy, jnp.asarray(sizes))
    assert out.dtype == x.dtype and out.shape == (len(sizes), x.shape[1], dy.shape[1])
    out64 = np.asarray(out.astype(F32), np.float64)
    assert np.all(out64[np.asarray(sizes) == 0] == 0.0), "empty groups must be exact zeros"
    ref = kc.np_tgmm(x, dy, sizes)
    if np.any(sizes):
        kc.assert_close(out64, ref, kc.kernel_tol(x.dtype), _case_id(case))
    else:
        assert not np.isnan(out64).any()


@pytest.mark.parametrize("pattern", ["zeros_skewed", "sum_lt_m", "uniform", "all_empty"])
def test_tgmm_reference_matches_float64(pattern):
    x, dy, sizes = _tgmm_inputs((37, 24, 40, 5, pattern, F32, True))
    out = grouped_reference.tgmm(x, dy, jnp.asarray(sizes))
    assert out.dtype == F32 and not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(np.asarray(out)[sizes == 0], 0.0)
    if np.any(sizes):
        kc.assert_close(out, kc.np_tgmm(x, dy, sizes), kc.TOL_F32, pattern)


def test_tgmm_group_table():
    table = np.asarray(schedule.group_table_4G(jnp.array([0, 70, 0, 5, 60], jnp.int32),
                                                       num_rows=130, block_m=64))
    # starts, ends (clamped to 130), first row block, row blocks (0 for empty groups)
    np.testing.assert_array_equal(table, [[0, 0, 70, 70, 75], [0, 70, 70, 75, 130],
                                          [0, 0, 1, 1, 1], [0, 2, 0, 1, 2]])


# ------------------------------------------------------------------ jax.grad

def _grouped_case(case, num_weights):
    m, k, n, g, pattern, dtype, poison = case
    x, ws = kc.grouped_inputs(m + 3 * k + n + g, m, k, n, g, dtype, num_weights)
    sizes = kc.group_pattern(pattern, m, g)
    cot = kc.normal(jax.random.key(m + n), (m, n), dtype)
    if poison:  # NaN in x and in the cotangent of rows past sum(sizes)
        x, cot = kc.poison_tail(x, sizes), kc.poison_tail(cot, sizes)
    return x, ws, jnp.asarray(sizes), cot


def _grads(fn, cot, *args):
    """jax.grad of sum(fn(*args) * cot) (f32 sum) in every array argument."""
    def loss(*a):
        return jnp.sum(fn(*a).astype(F32) * cot.astype(F32))
    return jax.jit(jax.grad(loss, argnums=tuple(range(len(args)))))(*args)


def _check_grads(got, ref, dtype, what, args):
    f32 = jnp.dtype(dtype) == jnp.dtype(F32)
    tol = kc.TOL_F32 if what.startswith("xla") and f32 else kc.kernel_tol(dtype)
    for i, (g, r, a) in enumerate(zip(got, ref, args)):
        assert g.dtype == a.dtype and g.shape == a.shape, (what, i)
        kc.assert_close(g, r, tol, f"{what} grad {i}")


GRAD_PLAIN = [(70, 48, 64, 4, "sum_lt_m", F32, True), (70, 48, 64, 4, "zeros_skewed", BF16, False)]
GRAD_FUSED = [(70, 48, 64, 4, "sum_lt_m", F32, True), (70, 48, 64, 4, "sum_lt_m", BF16, True)]


# Interpret mode is slow (each kernel launch takes seconds on the CPU): it runs the
# float32 cases (float32-accurate, NaN tails); bf16 runs on "xla", and the bf16
# kernels themselves are the forward kernels and tgmm, tested in bf16 on their own.
def _backend_cases(cases):
    """Every case on "xla", the float32 ones on "interpret"."""
    pairs = [("xla", c) for c in cases] + [("interpret", c) for c in cases if c[5] == F32]
    return [pytest.param(b, c, id=f"{b}-{_case_id(c)}") for b, c in pairs]


@pytest.mark.parametrize("backend,case", _backend_cases(GRAD_PLAIN))
def test_grouped_matmul_grad(case, backend):
    x, (w,), sizes, cot = _grouped_case(case, 1)
    got = _grads(lambda a, b: grouped_matmul(a, b, sizes, backend=backend), cot, x, w)
    ref = np_grouped_matmul_grads(x, w, sizes, cot)
    assert not np.isnan(np.asarray(got[0].astype(F32))).any()
    assert np.all(np.asarray(got[0].astype(F32))[int(sizes.sum()):] == 0.0)
    _check_grads(got, ref, x.dtype, f"{backend} {_case_id(case)}", (x, w))
    if backend == "xla" and x.dtype == F32:  # the custom VJP vs autodiff of the reference
        auto = _grads(lambda a, b: grouped_reference.grouped_matmul(a, b, sizes),
                      jnp.nan_to_num(cot), jnp.nan_to_num(x), w)
        _check_grads(got, auto, x.dtype, "xla vs autodiff", (x, w))


@pytest.mark.parametrize("backend,case", _backend_cases(GRAD_FUSED))
def test_grouped_situ_glu_grad(case, backend):
    x, (wg, wu), sizes, cot = _grouped_case(case, 2)
    got = _grads(lambda a, b, c: grouped_situ_glu(a, b, c, sizes, backend=backend, **SITU),
                 cot, x, wg, wu)
    ref = np_grouped_situ_glu_grads(x, wg, wu, sizes, cot)
    assert np.all(np.asarray(got[0].astype(F32))[int(sizes.sum()):] == 0.0)
    _check_grads(got, ref, x.dtype, f"{backend} {_case_id(case)}", (x, wg, wu))
    if backend == "xla" and x.dtype == F32:
        auto = _grads(lambda a, b, c: grouped_reference.grouped_situ_glu(
            a, b, c, sizes, **SITU), jnp.nan_to_num(cot), jnp.nan_to_num(x), wg, wu)
        _check_grads(got, auto, x.dtype, "xla vs autodiff", (x, wg, wu))


# "xla" only: tests/test_ops_kernel_grads.py runs the same kernels through
# k3jax's situ_mlp on "interpret" and checks them against "xla".
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_situ_mlp_up_grad(dtype, backend="xla"):
    t, d, f = 9, 48, 64  # T below one tile
    x, (gate, up) = kc.grouped_inputs(5, t, d, f, 1, dtype, 2)
    gate, up = gate[0], up[0]
    cot = kc.normal(jax.random.key(6), (t, f), dtype)
    got = _grads(lambda a, b, c: situ_mlp_up(a, b, c, backend=backend, **SITU), cot, x, gate, up)
    ref = np_grouped_situ_glu_grads(x, gate[None], up[None], np.array([t]), cot)
    ref = (ref[0], ref[1][0], ref[2][0])
    _check_grads(got, ref, dtype, f"{backend} {jnp.dtype(dtype).name}", (x, gate, up))
    if backend == "xla" and dtype == F32:
        auto = _grads(lambda a, b, c: mlp_reference.situ_mlp_up(a, b, c, **SITU), cot, x, gate, up)
        _check_grads(got, auto, dtype, "xla vs autodiff", (x, gate, up))
