"""situ_glu (pallas_kernels/situ.py): the one SiTU-GLU definition vs the SPEC
formula evaluated in float64 numpy."""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_cases as kc
from pallas_kernels import situ_glu


@pytest.mark.parametrize("linear_beta", [kc.LINEAR_BETA, None])
def test_situ_glu_matches_float64_formula(linear_beta):
    kg, ku = jax.random.split(jax.random.key(0))
    gate = kc.normal(kg, (64, 48), jnp.float32, scale=8.0)  # reaches the tanh saturation
    up = kc.normal(ku, (64, 48), jnp.float32, scale=40.0)
    out = situ_glu(gate, up, beta=kc.BETA, linear_beta=linear_beta)
    assert out.dtype == jnp.float32
    kc.assert_close(out, kc.np_situ_glu(gate, up, kc.BETA, linear_beta), kc.TOL_F32, "f32")


def _ordered(a_bf16) -> np.ndarray:
    """bf16 values as integers in value order (+0 == -0; neighbours differ by 1)."""
    bits = np.asarray(a_bf16).view(np.int16).astype(np.int32)
    return np.where(bits < 0, -(bits & 0x7FFF), bits)


def test_situ_glu_bf16_computes_in_f32_and_casts_back():
    kg, ku = jax.random.split(jax.random.key(1))
    gate = kc.normal(kg, (32, 16), jnp.bfloat16, scale=3.0)
    up = kc.normal(ku, (32, 16), jnp.bfloat16, scale=3.0)
    out = situ_glu(gate, up, beta=kc.BETA, linear_beta=kc.LINEAR_BETA)
    assert out.dtype == jnp.bfloat16
    # float64 formula on the same bf16 inputs, then rounded to bf16: an f32
    # computation may round the other way, so allow at most 1 bf16 ulp per element.
    expected = kc.np_situ_glu(kc.f32(gate), kc.f32(up)).astype(jnp.bfloat16)
    ulps = np.abs(_ordered(out) - _ordered(expected))
    assert ulps.max() <= 1, f"{int(ulps.max())} bf16 ulps"
    assert np.mean(ulps == 0) > 0.9  # nearly all round identically (measured: all 512)


def test_situ_glu_extremes_are_finite_and_bounded():
    gate = jnp.array([-1e30, -1e4, -30.0, 0.0, 30.0, 1e4, 1e30], jnp.float32)
    up = jnp.full_like(gate, 1e30)
    out = np.asarray(situ_glu(gate, up, beta=kc.BETA, linear_beta=kc.LINEAR_BETA))
    assert np.all(np.isfinite(out))
    assert np.all(np.abs(out) <= kc.BETA * kc.LINEAR_BETA * (1 + 1e-6))
    assert out[3] == 0.0 and out[-1] == pytest.approx(kc.BETA * kc.LINEAR_BETA, rel=1e-6)


def test_situ_glu_validation():
    with pytest.raises(ValueError, match="gate shape"):
        situ_glu(jnp.zeros((2, 3)), jnp.zeros((2, 4)), beta=1.0, linear_beta=None)
    with pytest.raises(ValueError, match="linear_beta must be > 0"):
        situ_glu(jnp.zeros(3), jnp.zeros(3), beta=1.0, linear_beta=-1.0)
