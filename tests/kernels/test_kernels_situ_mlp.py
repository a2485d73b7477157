"""situ_mlp_up: Mosaic kernel (GPU interpret mode) vs XLA reference, reference
vs float64 numpy, sm_90 lowering at K3 dense shapes, dispatch and validation."""

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
from pallas_kernels import resolve_backend, situ_mlp_up
from pallas_kernels.grouped_matmul import mosaic_sm90 as grouped
from pallas_kernels.situ_mlp import mosaic_sm90, reference

pytestmark = pytest.mark.tiers(
    compile=["test_lowers_for_sm90_at_k3_shapes"])

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}


def _inputs(seed, t, d, f, dtype):
    kx, kg, ku = jax.random.split(jax.random.key(seed), 3)
    return (kc.normal(kx, (t, d), dtype), kc.normal(kg, (d, f), dtype, d ** -0.5),
            kc.normal(ku, (d, f), dtype, d ** -0.5))


# (T, D, F, dtype): D wide -> F narrower (the shared expert's 7168 -> 6144/tp at
# small scale); T = 130 takes the prefill tiles (2 consumer warpgroups, 128-row
# blocks, last block partial), T = 40 the decode tiles with f32 inputs (bf16x3
# split: float32 accuracy), T = 5 with F = 16 a tiny per-device shape (the
# shared expert at tp 8 in the TINY config: N padded up to one 32-wide block).
@pytest.mark.parametrize("t,d,f,dtype", [(130, 128, 96, BF16), (40, 96, 128, F32),
                                         (5, 96, 16, F32)])
def test_situ_mlp_up_interpret_matches_reference(t, d, f, dtype):
    x, gate, up = _inputs(t + d + f, t, d, f, dtype)
    out = jax.jit(lambda a, b, c: situ_mlp_up(a, b, c, backend="interpret", **SITU))(x, gate, up)
    assert out.shape == (t, f) and out.dtype == dtype
    ref = reference.situ_mlp_up(kc.f32(x), kc.f32(gate), kc.f32(up), **SITU)
    kc.assert_close(out, ref, kc.kernel_tol(dtype), f"interpret {t}x{d}x{f}")


# Split-K (f32 partials summed by XLA, SiTU after the sum): 16 K steps in 3
# ranges of 5 / 5 / 6 steps (two pipeline lengths), rows past one tile; each
# K range stores only its items' rows. One consumer with 64-wide N, and the
# two-consumer tile with 32-wide N (the tile table holds both at
# K3 sizes), 200 rows: the second item is moved back to end at row 200.
@pytest.mark.parametrize("case, dtype", tiers.dtype_diagonal(
    [(1, 64, 72), (2, 32, 200)], [BF16, F32], lambda c: f"{c[0]}wg"))
def test_split_k_interpret_matches_reference(case, dtype):
    (wgs, block_n, t), d, f = case, 1024, 128
    x, gate, up = _inputs(7, t, d, f, dtype)
    cfg = grouped.TileConfig(num_compute_wgs=wgs, block_n=block_n, max_concurrent_steps=2,
                             split_k=3)
    out = jax.jit(lambda a, b, c: mosaic_sm90.situ_mlp_up(a, b, c, config=cfg, interpret=True,
                                                          **SITU))(x, gate, up)
    assert out.shape == (t, f) and out.dtype == dtype
    ref = reference.situ_mlp_up(kc.f32(x), kc.f32(gate), kc.f32(up), **SITU)
    assert kc.rel_err(out, ref) <= kc.kernel_tol(dtype)


def test_split_k_needs_one_group_and_enough_k_steps():
    x = jax.ShapeDtypeStruct((64, 256), BF16)
    w = jax.ShapeDtypeStruct((2, 256, 128), BF16)
    cfg = grouped.TileConfig(split_k=2, max_concurrent_steps=2)
    with pytest.raises(ValueError, match="one group"):
        jax.eval_shape(lambda a, b, s: grouped.grouped_matmul(a, b, s, config=cfg, interpret=True),
                       x, w, jax.ShapeDtypeStruct((2,), jnp.int32))
    with pytest.raises(ValueError, match="fewer than the 4 pipeline stages"):
        grouped.plan_launch(64, 256, 128, 1, 1, BF16, BF16,
                            grouped.TileConfig(split_k=2, max_concurrent_steps=4))


def test_reference_matches_float64_numpy():
    x, gate, up = _inputs(3, 33, 40, 24, F32)
    out = reference.situ_mlp_up(x, gate, up, **SITU)
    x64, g64, u64 = (np.asarray(a, np.float64) for a in (x, gate, up))
    kc.assert_close(out, kc.np_situ_glu(x64 @ g64, x64 @ u64), kc.TOL_F32, "xla vs f64")
    out_none = reference.situ_mlp_up(x, gate, up, beta=1.5, linear_beta=None)
    kc.assert_close(out_none, kc.np_situ_glu(x64 @ g64, x64 @ u64, 1.5, None), kc.TOL_F32,
                    "linear_beta=None")


# Shared expert width unsharded (prefill-sized T) and at tp=8 (decode-sized T);
# float32 inputs stage two bf16 planes (the SMEM budget must still hold).
@pytest.mark.parametrize("dtype", [BF16, F32], ids=["bf16", "f32"])
@pytest.mark.parametrize("t,f", [(2048, 6144), (8, 768)])
def test_lowers_for_sm90_at_k3_shapes(t, f, dtype):
    S = jax.ShapeDtypeStruct
    text = kc.lower_for_sm90(lambda a, b, c: situ_mlp_up(a, b, c, backend="pallas", **SITU),
                             S((t, 7168), dtype), S((7168, f), dtype), S((7168, f), dtype))
    assert "mosaic_gpu" in text


def test_validation_and_dispatch(monkeypatch):
    x, gate, up = jnp.zeros((4, 8)), jnp.zeros((8, 6)), jnp.zeros((8, 6))
    with pytest.raises(ValueError, match="x_TD D=8 != gate_DF D=7"):
        situ_mlp_up(x, jnp.zeros((7, 6)), jnp.zeros((7, 6)), backend="xla", **SITU)
    with pytest.raises(ValueError, match="gate_DF shape .* != up_DF shape"):
        situ_mlp_up(x, gate, jnp.zeros((8, 5)), backend="xla", **SITU)
    with pytest.raises(ValueError, match="x_TD must be 2-D"):
        situ_mlp_up(x[None], gate, up, backend="xla", **SITU)
    with pytest.raises(ValueError, match="'gpu'"):
        situ_mlp_up(x, gate, up, backend="gpu", **SITU)
    if jax.default_backend() != "gpu":  # "auto" is the XLA path on the CPU
        assert resolve_backend("auto") == "xla"
    # Which implementation each backend name really calls (spies; the kernel is not run).
    calls = []
    original = reference.situ_mlp_up

    def xla_spy(*args, **kwargs):
        calls.append(("xla", None))
        return original(*args, **kwargs)

    def mosaic_spy(x_TD, gate_DF, up_DF, **kwargs):
        calls.append(("mosaic", kwargs["interpret"]))
        return jnp.zeros((x_TD.shape[0], gate_DF.shape[1]), x_TD.dtype)

    monkeypatch.setattr(reference, "situ_mlp_up", xla_spy)
    monkeypatch.setattr(mosaic_sm90, "situ_mlp_up", mosaic_spy)
    x, gate, up = _inputs(7, 9, 40, 24, F32)
    want = kc.np_situ_glu(np.asarray(x, np.float64) @ np.asarray(gate, np.float64),
                          np.asarray(x, np.float64) @ np.asarray(up, np.float64))
    auto = {"xla": ("xla", None), "pallas": ("mosaic", False)}[resolve_backend("auto")]
    for backend, expected in [("auto", auto), ("xla", ("xla", None)),
                              ("interpret", ("mosaic", True)), ("pallas", ("mosaic", False))]:
        calls.clear()
        out = situ_mlp_up(x, gate, up, backend=backend, **SITU)
        assert calls == [expected], (backend, calls)
        if expected[0] == "xla":  # random inputs: the dispatched result is the reference's
            kc.assert_close(out, want, kc.TOL_F32, backend)
