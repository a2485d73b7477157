"""Approximate epilogue math in mosaic_sm90 (LaunchPlan.approx_math): kernels
whose output is bf16 / f16 compile with CompilerParams(approx_math=True).

Interpret mode runs exact math, so this file checks (1) in a deviceless sm_90a
compile that the bf16 fused kernel's PTX uses tanh.approx.f32 and the float32
one does not, and (2) on the CPU, the accuracy of the SiTU with the documented
worst-case errors of the PTX instructions the bf16 kernel runs, against float64.

Error bounds (PTX ISA 9.1, "Floating Point Instructions": the FP32
transcendentals' table and rcp; checked against a copy of that table in the
public code index):
  tanh.approx.f32      max relative error 2^-11 (the test uses 2^-10.987,
                       the f16 variant's absolute bound: slightly looser)
  ex2.approx.ftz.f32   max error 2 ulp (relative 2^-22), subnormal results -> 0
  rcp.approx.f32       max error 1 ulp (2^-23); Mosaic lowers 1 / x to it in both
                       the exact and the approximate kernels (see the PTX test)
Approximate exp(x) is ex2.approx.ftz(fl32(x * log2(e))) (Mosaic's
FragmentedArray.exp(approx=True)): the float32 product's rounding is emulated.

Measured on the shared 2-core machine: the compile test about 30-60 s (two
deviceless compiles), the CPU tests < 1 s.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kernel_cases as kc
from pallas_kernels.grouped_matmul import mosaic_sm90

pytestmark = pytest.mark.tiers(
    compile=["test_bf16_fused_kernel_ptx_uses_approximate_tanh_and_float32_does_not"])

TANH_REL = 2.0 ** -10.987
EX2_REL = 2.0 ** -22
RCP_REL = 2.0 ** -23
BF16_UNIT_ROUNDOFF = 2.0 ** -8  # bf16: 8 significand bits, round to nearest
LOG2E = np.float32(1.4426950408889634)


def approx_situ_glu(gate, up, *, beta, linear_beta, d_tanh_gate, d_tanh_up, d_ex2, d_rcp):
    """float32 emulation of the bf16 kernel's epilogue (pallas_kernels.situ.situ_glu_f32
    compiled with approx_math): each approximate instruction's result times (1 + d)."""
    gate, up = np.asarray(gate, np.float32), np.asarray(up, np.float32)
    arg = (-gate * LOG2E).astype(np.float32)  # the float32 product before ex2
    e = np.exp2(arg.astype(np.float64)) * (1 + d_ex2)
    e = np.where(e < np.finfo(np.float32).tiny, 0.0, e)  # .ftz
    sigmoid = (1.0 / (1.0 + e)) * (1 + d_rcp)
    gate_act = beta * np.tanh(np.float64(gate * np.float32(1.0 / beta))) * (1 + d_tanh_gate) * sigmoid
    if linear_beta is None:
        up_act = up.astype(np.float64)
    else:
        up_act = linear_beta * np.tanh(np.float64(up * np.float32(1.0 / linear_beta))) * (1 + d_tanh_up)
    return gate_act * up_act


def _worst_case_rel_err(gate, up, linear_beta):
    """Elementwise max over the 16 extreme sign combinations of the four errors
    of |approx / exact - 1| (exact: float64 SiTU of the same inputs)."""
    exact = kc.np_situ_glu(gate, up, kc.BETA, linear_beta)
    worst = np.zeros(np.shape(exact))
    for signs in itertools.product((-1.0, 1.0), repeat=4):
        got = approx_situ_glu(gate, up, beta=kc.BETA, linear_beta=linear_beta,
                              d_tanh_gate=signs[0] * TANH_REL, d_tanh_up=signs[1] * TANH_REL,
                              d_ex2=signs[2] * EX2_REL, d_rcp=signs[3] * RCP_REL)
        nonzero = exact != 0
        rel = np.where(nonzero, np.abs(got - exact) / np.where(nonzero, np.abs(exact), 1), 0)
        worst = np.maximum(worst, rel)
    return worst


@pytest.mark.parametrize("linear_beta", [kc.LINEAR_BETA, None])
def test_approx_situ_error_is_below_one_bf16_rounding(linear_beta):
    """On a grid over |gate| <= 80 (past 87, exp overflows float32 in the exact
    path too), |up| <= 200: every element's relative error from the PTX
    approximations is <= one tanh error per tanh plus 1e-5 (the float32
    argument of ex2, rounded to 2^-24 relative: <= 80 log2(e) 2^-24 ln 2 =
    80 x 2^-24 in exp(-gate), plus ex2's and rcp's own errors), below half of
    bf16's unit roundoff, so the bf16 output is off by < 1.5 bf16 roundings:
    within the kernels' bf16 tolerance (1e-2)."""
    gate = np.concatenate([np.linspace(-80, 80, 4001), np.geomspace(1e-6, 1, 200),
                           -np.geomspace(1e-6, 1, 200)]).astype(np.float32)
    up = np.concatenate([np.linspace(-200, 200, 401), np.geomspace(1e-6, 1, 20)]).astype(np.float32)
    g, u = np.meshgrid(gate, up, indexing="ij")
    worst = _worst_case_rel_err(g, u, linear_beta)
    bound = (2 if linear_beta is not None else 1) * TANH_REL + 1e-5
    assert worst.max() <= bound, (worst.max(), bound)
    assert bound < BF16_UNIT_ROUNDOFF / 2
    assert BF16_UNIT_ROUNDOFF + bound < kc.TOL_BF16


def test_approx_epilogue_on_kernel_products_meets_the_bf16_tolerance():
    """The fused kernel's products for a random bf16 case (x @ w_gate, x @ w_up
    in float32) through the emulated approximate epilogue, rounded to bf16, vs
    the float64 reference: the worst sign combination stays within TOL_BF16."""
    x, (wg, wu) = kc.grouped_inputs(3, 256, 512, 128, 1, jnp.bfloat16, 2)
    gate = kc.f32(x) @ kc.f32(wg[0])
    up = kc.f32(x) @ kc.f32(wu[0])
    ref = kc.np_situ_glu(gate, up)
    for signs in itertools.product((-1.0, 1.0), repeat=4):
        got = approx_situ_glu(gate, up, beta=kc.BETA, linear_beta=kc.LINEAR_BETA,
                              d_tanh_gate=signs[0] * TANH_REL, d_tanh_up=signs[1] * TANH_REL,
                              d_ex2=signs[2] * EX2_REL, d_rcp=signs[3] * RCP_REL)
        out = jnp.asarray(got, jnp.float32).astype(jnp.bfloat16)
        kc.assert_close(out, ref, kc.TOL_BF16, f"approx epilogue, error signs {signs}")


def test_plan_enables_approx_math_for_16_bit_outputs_only():
    plan = mosaic_sm90.plan_launch
    assert plan(256, 512, 256, 4, 2, jnp.bfloat16, jnp.bfloat16).approx_math
    assert plan(256, 512, 256, 4, 2, jnp.float16, jnp.float16).approx_math
    assert not plan(256, 512, 256, 4, 2, jnp.float32, jnp.float32).approx_math
    split = mosaic_sm90.TileConfig(block_n=64, max_concurrent_steps=4, split_k=2)
    assert not plan(8, 512, 256, 1, 2, jnp.bfloat16, jnp.bfloat16, split).approx_math  # f32 partials


def _fused_ptx(dtype) -> str:
    """PTX of the fused grouped SiTU kernel compiled deviceless for sm_90a."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from k3jax.layout import ParallelConfig
    from k3jax.tools.aot import h200_mesh, ptxas_dump
    mesh = h200_mesh(ParallelConfig())
    m, k, n, g = 64, 256, 128, 2
    specs = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P())) for s, d in
             [((m, k), dtype), ((g, k, n), dtype), ((g, k, n), dtype), ((g,), jnp.int32)]]
    cfg = mosaic_sm90.TileConfig(num_compute_wgs=1, block_n=64, max_concurrent_steps=4)

    def fused(x, wg, wu, s):
        return mosaic_sm90.grouped_situ_glu(x, wg, wu, s, beta=kc.BETA,
                                            linear_beta=kc.LINEAR_BETA, config=cfg)

    with ptxas_dump():  # the wheel's ptxas; MOSAIC_GPU_DUMP_TO is ours below
        folder = tempfile.mkdtemp(prefix="k3jax-approx-")
        saved = os.environ.get("MOSAIC_GPU_DUMP_TO")
        os.environ["MOSAIC_GPU_DUMP_TO"] = folder
        try:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), \
                    jax.default_device(mesh.devices.flat[0]):
                jax.jit(fused).lower(*specs).compile()
            [ptx] = Path(folder).glob("*.ptx")
            return ptx.read_text()
        finally:
            os.environ.pop("MOSAIC_GPU_DUMP_TO")
            if saved is not None:
                os.environ["MOSAIC_GPU_DUMP_TO"] = saved
            shutil.rmtree(folder, ignore_errors=True)


def test_bf16_fused_kernel_ptx_uses_approximate_tanh_and_float32_does_not():
    """bf16: every tanh is tanh.approx.f32 (two per element: gate and up) and
    each exp one ex2.approx.ftz.f32. float32: no tanh.approx (tanh expands to
    exp-based code, more ex2); both divide with rcp.approx.f32."""
    def counts(text):
        return {op: len(re.findall(re.escape(op) + r"\s", text))
                for op in ("tanh.approx.f32", "ex2.approx.ftz.f32", "rcp.approx.f32")}
    bf16, f32 = counts(_fused_ptx(jnp.bfloat16)), counts(_fused_ptx(jnp.float32))
    assert bf16["tanh.approx.f32"] > 0 and f32["tanh.approx.f32"] == 0, (bf16, f32)
    assert bf16["tanh.approx.f32"] == 2 * bf16["ex2.approx.ftz.f32"], bf16
    assert f32["ex2.approx.ftz.f32"] > bf16["ex2.approx.ftz.f32"], (bf16, f32)
    assert bf16["rcp.approx.f32"] > 0 and f32["rcp.approx.f32"] > 0, (bf16, f32)
