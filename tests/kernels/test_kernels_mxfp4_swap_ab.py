"""The MXFP4 swap-AB Mosaic kernel (mosaic_sm90_mxfp4_swap_ab.py): the fast
dequant into WGMMA's A operand, weight rows on M and tokens on N, in GPU
interpret mode against float64 products of the same decoded codes; its
fallback to the row-major exact kernel, its tile choice and its errors.

Interpret mode runs the fast sequence's jnp emulation and WGMMA from SMEM
(the kernel's docstring): it checks the products, the K order, the schedule
and the transposed output, not the register-A issue, which the sm_90a
compile (tests/kernels/test_mxfp4_mosaic_compile.py) checks lowers.
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
import tiers
from pallas_kernels import grouped_matmul, grouped_situ_glu
from pallas_kernels.grouped_matmul import dispatch
from pallas_kernels.grouped_matmul import mosaic_sm90_mxfp4 as mk
from pallas_kernels.grouped_matmul import mosaic_sm90_mxfp4_swap_ab as sw
from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights, k_order_index

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}


def _run_both(x, sizes, pairs, config):
    """(plain y, fused h) of this kernel's dispatchers in interpret mode, and
    the weights' dequant (Mxfp4Weights.from_checkpoint reads it off the bytes)."""
    wg, wu = (kc.mxfp4_from_kn(p, s) for p, s in pairs)
    dequant = {wg.dequant, wu.dequant}
    y = jax.jit(lambda x, w, s: sw.grouped_matmul_mxfp4(x, w, s, config=config,
                                                        interpret=True))(x, wg, sizes)
    h = jax.jit(lambda x, a, b, s: sw.grouped_situ_glu_mxfp4(
        x, a, b, s, config=config, interpret=True, **SITU))(x, wg, wu, sizes)
    return y, h, dequant


# (m, k, n, g, pattern, block_t): block_t None is block_t_for's choice; 8
# splits the larger groups over several work items (their rows gathered from
# several transposed tiles). N 200 spans two 128-row weight blocks (padded to
# 256); K 96 is padded to one 128-element K step; NaN rows past sum(sizes).
FAST_CASES = [(70, 256, 200, 4, "sum_lt_m", None), (37, 96, 40, 5, "zeros_skewed", 8),
              (5, 128, 64, 3, "uniform", None)]


@pytest.mark.parametrize("case, dtype", tiers.dtype_diagonal(
    FAST_CASES, [BF16, F32], lambda c: "{}x{}x{}_g{}_{}_t{}".format(*c)))
def test_fast_kernel_matches_float64_of_the_decoded_codes(case, dtype):
    """Every scale byte in FAST_SCALES (the smallest ones too): the swap-AB
    kernel runs, plain and fused, and matches the float64 products."""
    m, k, n, g, pattern, block_t = case
    rng = np.random.default_rng(m + n)
    pairs = [kc.random_mxfp4(rng, g, k, n, 112, 129) for _ in range(2)]
    pairs[0][1][..., ::5] = rng.integers(2, 8, pairs[0][1][..., ::5].shape)
    x = kc.normal(jax.random.key(m), (m, k), dtype, scale=0.1)
    sizes = kc.group_pattern(pattern, m, g)
    x = kc.poison_tail(x, sizes)
    config = None if block_t is None else sw.Mxfp4SwapABConfig(block_t=block_t)
    y, h, dequant = _run_both(x, sizes, pairs, config)
    assert dequant == {Mxfp4Dequant.FAST}
    assert y.dtype == dtype and y.shape == (m, n) and h.shape == (m, n)
    dg, du = (kc.decode_mxfp4_gkn(p, s) for p, s in pairs)
    tol = kc.kernel_tol(dtype)
    kc.assert_grouped_output(y, kc.np_grouped_matmul(x, dg, sizes), sizes, tol, "plain")
    kc.assert_grouped_output(h, kc.np_grouped_situ_glu(x, dg, du, sizes), sizes, tol, "fused")


def test_k_ordered_chain_matches_the_stored_order_with_its_gradient():
    """The MoE's experts with Mxfp4Format.k_order's weights (w1 / w3
    k_order_axis 2, w2 1) at decode sizes (the swap-AB kernels): h comes out
    of the gate/up in k_order and the down product, and x's gradient
    through both (mxfp4_vjp's blocked backward), are those of the weights in
    their stored order on "xla"."""
    m, k, f, n, g = 12, 128, 256, 128, 3
    rng = np.random.default_rng(9)
    ws = [kc.mxfp4_from_kn(*kc.random_mxfp4(rng, g, a, b, 112, 124))
          for a, b in ((k, f), (k, f), (f, n))]
    ws_k = [Mxfp4Weights(w.packed_GNK, w.scale_GKN, w.dequant, a) for w, a in zip(ws, (2, 2, 1))]
    x = kc.normal(jax.random.key(5), (m, k), F32, scale=0.1)
    t = kc.normal(jax.random.key(6), (m, n), F32)
    sizes = jnp.array([5, 0, 6], jnp.int32)
    assert sw.block_t_for(m, g, 2) is not None and sw.block_t_for(m, g, 1) is not None

    def chain(x, w1, w3, w2, backend):
        h = grouped_situ_glu(x, w1, w3, sizes, backend=backend, **SITU)
        return h, grouped_matmul(h, w2, sizes, backend=backend)

    def loss(x, ws, backend):
        return jnp.sum(t * chain(x, *ws, backend)[1])
    h_k, y_k = jax.jit(lambda x, *w: chain(x, *w, "interpret"))(x, *ws_k)
    h, y = jax.jit(lambda x, *w: chain(x, *w, "xla"))(x, *ws)
    perm = k_order_index(f)
    tol = kc.TOL_F32_KERNEL
    kc.assert_close(h_k, np.asarray(h)[:, perm], tol, "h in k_order")
    kc.assert_close(y_k, y, tol, "down")
    got = jax.jit(jax.grad(lambda x, *w: loss(x, w, "interpret")))(x, *ws_k)
    want = jax.jit(jax.grad(lambda x, *w: loss(x, w, "xla")))(x, *ws)
    kc.assert_close(got, want, tol, "dx")


def test_extreme_scales_take_the_exact_kernel():
    """Scale bytes outside FAST_SCALES (0, 1, 129..254) anywhere: the weights
    are EXACT, the launch runs mosaic_sm90_mxfp4's exact row-major kernel
    (on the word layout, in place) and still matches."""
    m, k, n, g = 24, 128, 64, 3
    rng = np.random.default_rng(7)
    pairs = [kc.random_mxfp4(rng, g, k, n, 118, 130) for _ in range(2)]
    pairs[0][1][..., ::7] = rng.integers(0, 4, pairs[0][1][..., ::7].shape)
    pairs[1][1][0, 0, 0] = 200
    x = kc.normal(jax.random.key(4), (m, k), BF16, scale=0.1)
    sizes = kc.group_pattern("sum_lt_m", m, g)
    x = kc.poison_tail(x, sizes)
    y, h, dequant = _run_both(x, sizes, pairs, None)
    assert dequant == {Mxfp4Dequant.EXACT}
    dg, du = (kc.decode_mxfp4_gkn(p, s) for p, s in pairs)
    tol = kc.kernel_tol(BF16)
    kc.assert_grouped_output(y, kc.np_grouped_matmul(x, dg, sizes), sizes, tol, "plain")
    kc.assert_grouped_output(h, kc.np_grouped_situ_glu(x, dg, du, sizes), sizes, tol, "fused")


def test_block_t_follows_the_expected_rows():
    """block_t: a group's expected rows (mean + 3 sigma) rounded up to 8, in
    [MIN_BLOCK_T, MAX_BLOCK_T] (16; 128 plain, 48 fused); the row-major kernel
    (None) where its 64-row tiles read a group's weights fewer times at the
    mean rows of a group."""
    assert sw.block_t_for(256, 112, 1) == 16         # K3 decode at EP 8: 16 tokens x top-16
    assert sw.block_t_for(4096, 112, 1) == 56        # 256 tokens: mean 36.6 + 3 x 6.0
    assert sw.block_t_for(4096, 112, 2) == 48        # capped: the fused tile's registers
    assert sw.block_t_for(8192, 112, 1) == 104
    assert sw.block_t_for(8192, 112, 2) == 48        # mean 73: two reads either way
    assert sw.block_t_for(65536, 112, 1) == 128      # prefill: 5 reads a group here, 10 there
    assert sw.block_t_for(65536, 112, 2) is None     # 13 reads here, 10 in the row-major tiles
    assert sw.block_t_for(16, 1, 1) == 16            # one group: all its rows
    assert sw.block_t_for(0, 4, 1) == 16


def test_dispatch_takes_the_kernel_with_fewer_weight_reads():
    """dispatch.mxfp4_module follows block_t_for: this kernel at decode and
    for the plain product at prefill, the row-major one for the fused
    product at prefill."""
    def w(g):
        return Mxfp4Weights(jax.ShapeDtypeStruct((g, 3072, 1792), jnp.uint8),
                            jax.ShapeDtypeStruct((g, 112, 3072), jnp.uint8), Mxfp4Dequant.FAST)
    decode, prefill = (jax.ShapeDtypeStruct((m, 3584), BF16) for m in (256, 65536))
    assert dispatch.mxfp4_module(decode, w(112), 2) is sw
    assert dispatch.mxfp4_module(prefill, w(112), 1) is sw
    assert dispatch.mxfp4_module(prefill, w(112), 2) is mk


def test_bad_input_is_named():
    """float16 x names the dtype; a block_t the tile cannot hold names it."""
    w = Mxfp4Weights(jax.ShapeDtypeStruct((2, 64, 32), jnp.uint8),
                     jax.ShapeDtypeStruct((2, 2, 64), jnp.uint8), Mxfp4Dequant.FAST)
    s = jax.ShapeDtypeStruct((2,), jnp.int32)
    with pytest.raises(ValueError, match="bfloat16 or float32 x, got float16"):
        jax.eval_shape(lambda x, w, s: sw.grouped_matmul_mxfp4(x, w, s, interpret=True),
                       jax.ShapeDtypeStruct((16, 64), jnp.float16), w, s)
    with pytest.raises(ValueError, match="block_t=128 is over 48 for 2 weights"):
        sw.plan_launch(16, 64, 64, 2, 2, BF16, sw.Mxfp4SwapABConfig(block_t=128))
    with pytest.raises(ValueError, match="block_t must be a multiple of 8"):
        sw.Mxfp4SwapABConfig(block_t=12)
    with pytest.raises(ValueError, match="row-major tiles read the weights fewer times"):
        sw.plan_launch(65536, 64, 64, 112, 2, BF16)


def test_plan_fits_smem_at_k3_decode_shapes():
    """K3's routed shapes at EP 8 at 16 and 256 tokens: two consumers (128
    weight rows a tile), K steps of 128, at least 4 stages, SMEM fits."""
    for m in (256, 4096):
        for k, n, num_w in ((3584, 3072, 2), (3072, 3584, 1)):
            plan = sw.plan_launch(m, k, n, 112, num_w, BF16)
            assert plan.k_pad == k and plan.n_pad == n and plan.cfg.block_w == 128
            assert plan.cfg.max_concurrent_steps >= 4, plan
            assert plan.cfg.smem_bytes(num_w, 1, 2) <= 227 * 1024 - 1024
