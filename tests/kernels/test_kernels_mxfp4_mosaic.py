"""The Mosaic GPU MXFP4 kernel (mosaic_sm90_mxfp4.py): in-kernel decode of
packed E2M1 codes + UE8M0 scales, bf16 WGMMA, in GPU interpret mode against
float64 products of the same decoded codes, x's gradient, the dispatch, and
the sm_90a compile (deviceless, ptxas) at K3 shapes. Through the grouped
ops, the small launches here take the swap-AB kernel
(test_kernels_mxfp4_swap_ab.py) for FAST weights and this kernel's exact one
for EXACT weights (the static Mxfp4Weights.dequant).

Measured on the shared 2-core machine: the interpret tests ~10-20 s each
(most of it tracing/compiling the interpreted kernel), the four sm_90a
compiles 30-80 s each (marked ``slow`` by their cost; they still run by default).
"""

from __future__ import annotations

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kernel_cases as kc
import tiers
from pallas_kernels import (
    grouped_matmul,
    grouped_situ_glu,
    interpret_compat,
    mxfp4_fast,
    mxfp4_words,
)
from pallas_kernels.grouped_matmul import mosaic_sm90_mxfp4 as mk
from pallas_kernels.grouped_matmul import mxfp4_dequant
from pallas_kernels.mxfp4 import Mxfp4Dequant, Mxfp4Weights, dequant, k_order_index
from pallas_kernels.selfcheck import gate

pytestmark = pytest.mark.tiers(slow=["test_x_gradient_through_the_kernel_matches_float32"])

BF16, F32 = jnp.bfloat16, jnp.float32
SITU = {"beta": kc.BETA, "linear_beta": kc.LINEAR_BETA}


def _decode_kernel(n: int, path: str = "exact"):
    """A one-CTA kernel decoding one K step: packed [n, 64] (weight rows by
    code bytes, the word layout) and scales [4, n] (TMA to SMEM) -> the
    decoded bf16 [n, 128] tile (to HBM, mxfp4_dequant.k_order's columns), by
    mk.dequant_tile (path "exact") or mk.fast_dequant_tile ("fast"; "fast_k":
    its rows in k_order too)."""
    def body(p_gmem, s_gmem, o_gmem):
        @functools.partial(pl.run_scoped, p_smem=plgpu.SMEM((n, 64), jnp.uint8),
                           s_smem=plgpu.SMEM((4, n), jnp.uint8),
                           w_smem=plgpu.SMEM((n, 128), jnp.bfloat16),
                           p_bar=plgpu.Barrier(), s_bar=plgpu.Barrier())
        def _scope(p_smem, s_smem, w_smem, p_bar, s_bar):
            plgpu.copy_gmem_to_smem(p_gmem, p_smem, p_bar)
            plgpu.copy_gmem_to_smem(s_gmem, s_smem, s_bar)
            plgpu.barrier_wait(p_bar)
            plgpu.barrier_wait(s_bar)
            if path == "exact":
                mk.dequant_tile(p_smem, s_smem, w_smem, n, interpret=True)
            else:
                mk.fast_dequant_tile(p_smem, s_smem, w_smem, n, interpret=True,
                                     n_k_order=path == "fast_k")
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(w_smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)

    interpret_compat.install()
    return plgpu.kernel(
        body, out_type=jax.ShapeDtypeStruct((n, 128), BF16), grid=(1,), grid_names=("x",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        interpret=plgpu.InterpretGPUParams())


def test_in_kernel_decode_is_the_codec_bit_for_bit():
    """Every (low, high) code pair and every scale byte 0..255: bf16-subnormal
    results flushed to signed zeros, the largest finite values, overflow to
    inf, byte 255 to NaN. The codes go in in the word layout, as held; the
    tile comes out in mxfp4_dequant.k_order, the fast kernel's. (The exact
    kernel's dequant_tile: what EXACT weights run.)"""
    n = 256
    # byte (j + 3 col) mod 256 at [j, col]: all 256 bytes (every code pair) in each scale block
    packed = ((np.arange(64)[:, None] * 5 + 3 * np.arange(n)[None, :]) % 256).astype(np.uint8)
    scale = np.stack([np.roll(np.arange(256, dtype=np.uint8), 61 * r) for r in range(4)])
    words = mxfp4_words.interleave_words(np.ascontiguousarray(packed.T))       # [n, 64]
    got = np.asarray(jax.jit(_decode_kernel(n))(words, scale).astype(F32))     # [n, 128]
    want_kn = np.asarray(dequant(jnp.asarray(packed), jnp.asarray(scale), F32, axis=0))
    assert np.array_equal(want_kn, kc.decode_mxfp4_gkn(packed[None], scale[None])[0],
                          equal_nan=True)
    want = np.asarray(mxfp4_dequant.k_order(jnp.asarray(want_kn.T)))           # [n, 128]
    nan = np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), nan)
    np.testing.assert_array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))
    assert nan.sum() == 4 * 32 and np.isinf(want).any()
    assert (np.signbit(want) & (want == 0)).any()                  # flushed negatives
    assert np.abs(want[~nan & ~np.isinf(want)]).max() == np.float32(1.5 * 2.0 ** 127)


def test_code_bits_piece_holds_each_code_where_code_bits_puts_it():
    """mxfp4_dequant.code_bits_piece (the emulation interpret mode runs of
    CODE_BITS_SEQUENCE) on random words: column 8j + 2l + L of word w's
    piece is code_bits of K element 32l + 8w + 2j + L's checkpoint code."""
    rng = np.random.default_rng(3)
    packed = rng.integers(0, 256, (64, 64), dtype=np.uint8)                    # checkpoint bytes
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(64, 128).astype(np.int32)
    want_all = np.asarray(mxfp4_dequant.code_bits(jnp.asarray(mxfp4_dequant.k_order(
        jnp.asarray(codes)))))
    words = jnp.asarray(mxfp4_words.interleave_words(packed))

    class Ref:   # code_bits_piece reads ref[...]
        shape = words.shape

        def __getitem__(self, _):
            return words
    for w in range(4):
        got = np.asarray(mxfp4_dequant.code_bits_piece(Ref(), w, interpret=True))
        np.testing.assert_array_equal(got, want_all[:, 32 * w: 32 * w + 32], err_msg=f"word {w}")


def test_fast_decode_is_the_codec_on_every_fast_pair():
    """mk.fast_dequant_tile (the emulation interpret mode runs) on every code
    byte under every scale byte of FAST_SCALES: slot i = block * n + col
    takes scale FAST_SCALES[i % 127] and the 16 bytes 16 * (i // 127 % 16)
    + row, so each fast scale meets all 256 bytes; the codes go in in the
    word layout, and the bits equal the codec's in mxfp4_dequant.k_order."""
    n = 512
    fast_scales = np.array(mxfp4_fast.FAST_SCALES)
    slot = np.arange(4)[:, None] * n + np.arange(n)[None, :]                   # [4, n]
    scale = fast_scales[slot % len(fast_scales)].astype(np.uint8)
    packed = (16 * (np.repeat(slot, 16, axis=0) // len(fast_scales) % 16)
              + (np.arange(64) % 16)[:, None]).astype(np.uint8)              # [64, n]
    pairs = {(int(b), int(s)) for b, s in zip(packed.ravel(), np.repeat(scale, 16, axis=0).ravel())}
    assert len(pairs) == 256 * len(fast_scales)
    words = mxfp4_words.interleave_words(np.ascontiguousarray(packed.T))       # [n, 64]
    got = np.asarray(jax.jit(_decode_kernel(n, "fast"))(words, scale)).view(np.uint16)
    want = np.asarray(dequant(jnp.asarray(packed), jnp.asarray(scale), BF16, axis=0))  # [128, n]
    want = np.asarray(mxfp4_dequant.k_order(jnp.asarray(want.T))).view(np.uint16)    # [n, 128]
    np.testing.assert_array_equal(got, want)
    # rows in k_order (k_order_axis 2): tile row c of each 128-row block is
    # weight row k_order_index(128)[c] of it (mxfp4_dequant.source_row)
    got_k = np.asarray(jax.jit(_decode_kernel(n, "fast_k"))(words, scale)).view(np.uint16)
    np.testing.assert_array_equal(got_k, want[k_order_index(n)])
    assert [mxfp4_dequant.source_row(c) for c in range(128)] == k_order_index(128).tolist()


# (m, k, n, g, pattern): odd group sizes, empty groups, a NaN-poisoned tail,
# M below one 64-row tile, K not a multiple of the 128-element K step (padded),
# N not a multiple of the column block (padded).
CASES = [(37, 96, 40, 5, "zeros_skewed"), (70, 256, 72, 4, "sum_lt_m"), (5, 32, 24, 3, "uniform")]


@pytest.mark.parametrize("case, dtype", tiers.dtype_diagonal(
    CASES, [BF16, F32], lambda c: "{}x{}x{}_g{}_{}".format(*c)))
def test_kernel_matches_float64_of_the_decoded_codes(case, dtype):
    m, k, n, g, pattern = case
    rng = np.random.default_rng(m + k)
    # scale bytes 0..3 too: products of bf16-subnormal (flushed) weights
    (pg, sg), (pu, su) = kc.random_mxfp4(rng, g, k, n), kc.random_mxfp4(rng, g, k, n)
    sg[..., ::7] = rng.integers(0, 4, sg[..., ::7].shape)
    x = kc.normal(jax.random.key(m), (m, k), dtype, scale=0.1)
    sizes = kc.group_pattern(pattern, m, g)
    x = kc.poison_tail(x, sizes)                # NaN rows past sum(sizes) must not leak
    wg, wu = (kc.mxfp4_from_kn(p, s) for p, s in ((pg, sg), (pu, su)))
    assert wg.dequant is Mxfp4Dequant.EXACT     # the exact kernel
    dg, du = kc.decode_mxfp4_gkn(pg, sg), kc.decode_mxfp4_gkn(pu, su)
    tol = kc.kernel_tol(dtype)
    y = jax.jit(lambda x, w, s: grouped_matmul(x, w, s, backend="interpret"))(x, wg, sizes)
    assert y.dtype == dtype and y.shape == (m, n)
    kc.assert_grouped_output(y, kc.np_grouped_matmul(x, dg, sizes), sizes, tol, "plain")
    h = jax.jit(lambda x, a, b, s: grouped_situ_glu(x, a, b, s, backend="interpret", **SITU))(
        x, wg, wu, sizes)
    kc.assert_grouped_output(h, kc.np_grouped_situ_glu(x, dg, du, sizes), sizes, tol, "fused")


@pytest.mark.parametrize("dtype", [BF16, tiers.slow(F32)], ids=["bf16", "f32"])
def test_fast_kernel_matches_float64_of_the_decoded_codes(dtype):
    """Every scale byte in FAST_SCALES: the weights are FAST (from_checkpoint
    reads it off the bytes; one byte 129 would make them EXACT), the
    row-major launch (called directly: the dispatch takes the swap-AB
    kernel at this size) runs the fast kernel and matches the float64
    products."""
    m, k, n, g = 70, 256, 72, 4
    rng = np.random.default_rng(11)
    (pg, sg), (pu, su) = (kc.random_mxfp4(rng, g, k, n, lo=112, hi=129) for _ in range(2))
    sg[..., ::5] = rng.integers(2, 8, sg[..., ::5].shape)       # the smallest fast scales
    wg, wu = (kc.mxfp4_from_kn(p, s) for p, s in ((pg, sg), (pu, su)))
    assert wg.dequant is wu.dequant is Mxfp4Dequant.FAST and mk.all_fast([wg, wu])
    su_129 = su.copy()
    su_129[0, 0, 0] = 129
    assert kc.mxfp4_from_kn(pu, su_129).dequant is Mxfp4Dequant.EXACT
    x = kc.normal(jax.random.key(3), (m, k), dtype, scale=0.1)
    sizes = kc.group_pattern("sum_lt_m", m, g)
    x = kc.poison_tail(x, sizes)
    tol = kc.kernel_tol(dtype)
    y = jax.jit(lambda x, w, s: mk.grouped_matmul_mxfp4(x, w, s, interpret=True))(x, wg, sizes)
    kc.assert_grouped_output(y, kc.np_grouped_matmul(x, kc.decode_mxfp4_gkn(pg, sg), sizes), sizes, tol,
                             "plain")
    h = jax.jit(lambda x, a, b, s: mk.grouped_situ_glu_mxfp4(x, a, b, s, interpret=True, **SITU))(
        x, wg, wu, sizes)
    dg, du = kc.decode_mxfp4_gkn(pg, sg), kc.decode_mxfp4_gkn(pu, su)
    kc.assert_grouped_output(h, kc.np_grouped_situ_glu(x, dg, du, sizes), sizes, tol, "fused")


@pytest.mark.parametrize("lo", [112, 0], ids=["fast", "exact"])
def test_k_ordered_weights_give_h_in_the_down_kernels_order(lo):
    """Weights of k_order_axis 2 (w1 / w3): the row-major launch gives the
    products' columns in k_order (fast: the tile's rows dequantized in that
    order; exact: by XLA); of k_order_axis 1 (w2): it takes x in k_order as
    it comes. Chained, the down product of the gate/up's h in k_order is
    the float64 one of h."""
    m, k, n, g = 70, 128, 256, 3
    rng = np.random.default_rng(7)
    (pg, sg), (pu, su) = (kc.random_mxfp4(rng, g, k, n, lo=lo, hi=129) for _ in range(2))
    pd, sd = kc.random_mxfp4(rng, g, n, 64, lo=lo, hi=129)
    wg, wu, wd = (kc.mxfp4_from_kn(p, s) for p, s in ((pg, sg), (pu, su), (pd, sd)))
    assert wg.dequant is (Mxfp4Dequant.FAST if lo else Mxfp4Dequant.EXACT)
    wg_k, wu_k = (Mxfp4Weights(w.packed_GNK, w.scale_GKN, w.dequant, 2) for w in (wg, wu))
    wd_k = Mxfp4Weights(wd.packed_GNK, wd.scale_GKN, wd.dequant, 1)
    x = kc.normal(jax.random.key(4), (m, k), BF16, scale=0.1)
    sizes = kc.group_pattern("sum_lt_m", m, g)
    x = kc.poison_tail(x, sizes)
    dg, du, dd = (kc.decode_mxfp4_gkn(p, s) for p, s in ((pg, sg), (pu, su), (pd, sd)))
    tol, perm = kc.kernel_tol(BF16), k_order_index(n)
    h = jax.jit(lambda x, a, b, s: mk.grouped_situ_glu_mxfp4(x, a, b, s, interpret=True, **SITU))(
        x, wg_k, wu_k, sizes)
    h_ref = kc.np_grouped_situ_glu(x, dg, du, sizes)
    kc.assert_grouped_output(h, h_ref[:, perm], sizes, tol, "fused, N in k_order")
    y = jax.jit(lambda x, w, s: mk.grouped_matmul_mxfp4(x, w, s, interpret=True))(x, wg_k, sizes)
    kc.assert_grouped_output(y, kc.np_grouped_matmul(x, dg, sizes)[:, perm], sizes, tol,
                             "plain, N in k_order")
    out = jax.jit(lambda h, w, s: mk.grouped_matmul_mxfp4(h, w, s, interpret=True))(h, wd_k, sizes)
    h_nat = np.asarray(h.astype(F32))[:, np.argsort(perm)]
    kc.assert_grouped_output(out, kc.np_grouped_matmul(h_nat, dd, sizes), sizes, tol,
                             "down, K in k_order")


def test_nan_scale_reaches_only_its_group_and_columns():
    """Scale byte 255 (NaN) in one group's block: that group's rows of those
    columns are NaN, every other output is finite (NaN never passes silently)."""
    m, k, n, g = 12, 64, 64, 3
    rng = np.random.default_rng(5)
    packed, scale = kc.random_mxfp4(rng, g, k, n)
    scale[1, 0, 3] = 255
    sizes = np.array([4, 4, 4], np.int32)
    x = kc.normal(jax.random.key(1), (m, k), BF16)
    y = np.asarray(grouped_matmul(x, kc.mxfp4_from_kn(packed, scale), sizes,
                                  backend="interpret").astype(F32))
    nan = np.zeros((m, n), bool)
    nan[4:8, 3] = True
    np.testing.assert_array_equal(np.isnan(y), nan)


def test_x_gradient_through_the_kernel_matches_float32():
    """jax.grad wrt x through the kernel path (mxfp4_vjp's custom VJP), both
    products, vs jax.grad of a float32 dense reference on the decoded weights."""
    m, k, n, g = 20, 64, 48, 3
    rng = np.random.default_rng(11)
    # O(1) pre-activations (weights |w| <= 6 * 2**-4), so the SiTU derivative stays finite
    (pg, sg), (pu, su) = (kc.random_mxfp4(rng, g, k, n, 112, 124) for _ in range(2))
    wg, wu = (kc.mxfp4_from_kn(p, s) for p, s in ((pg, sg), (pu, su)))
    dg, du = (jnp.asarray(kc.decode_mxfp4_gkn(p, s), F32) for p, s in ((pg, sg), (pu, su)))
    sizes = jnp.array([7, 0, 10], jnp.int32)
    x = kc.normal(jax.random.key(2), (m, k), F32, scale=0.1)
    t = kc.normal(jax.random.key(3), (m, n), F32)
    seg = jnp.repeat(jnp.arange(g), np.asarray(sizes), total_repeat_length=m)
    valid = (jnp.arange(m) < jnp.sum(sizes))[:, None]

    def dense(x, w):   # per row: x @ w[group(row)], tail rows 0
        return jnp.where(valid, jnp.einsum("mk,mkn->mn", x, w[seg]), 0)

    from pallas_kernels.situ import situ_glu
    def plain(x):
        return jnp.sum(t * grouped_matmul(x, wg, sizes, backend="interpret"))
    def fused(x):
        return jnp.sum(t * grouped_situ_glu(x, wg, wu, sizes, backend="interpret", **SITU))
    def plain_ref(x):
        return jnp.sum(t * dense(x, dg))
    def fused_ref(x):
        return jnp.sum(t * jnp.where(valid, situ_glu(dense(x, dg), dense(x, du), **SITU), 0))
    for f, ref, what in ((plain, plain_ref, "plain"), (fused, fused_ref, "fused")):
        got, want = jax.jit(jax.grad(f))(x), jax.grad(ref)(x)
        assert not np.isnan(np.asarray(got)).any(), what
        kc.assert_close(got, want, kc.TOL_F32_KERNEL, what)


def _kernel_names(jaxpr) -> list[str]:
    """The Mosaic GPU kernels ``jaxpr`` launches (their names), sub-jaxprs
    included (cond branches, scan and custom_vjp bodies)."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "mpmd_map":   # one Mosaic GPU kernel
            names.append(eqn.params["name"])
            continue
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    names += _kernel_names(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    names += _kernel_names(sub)
    return names


def test_dispatch():
    """MXFP4 on "pallas" -> one Mosaic kernel a launch, chosen at trace time
    by the weights' static dequant (no branch holding two): FAST weights the
    swap-AB fast kernel, or the row-major fast one where its tiles read the
    weights fewer times (the fused product past 48 rows a group); EXACT
    weights, or a pair with one, the row-major exact kernel at every size.
    "xla" -> the blocked path; float16 x on the kernel is a clear error
    naming the dtype; a dequant that is not an Mxfp4Dequant is named."""
    fast, exact = (Mxfp4Weights(jax.ShapeDtypeStruct((2, 64, 32), jnp.uint8),
                                jax.ShapeDtypeStruct((2, 2, 64), jnp.uint8), d)
                   for d in (Mxfp4Dequant.FAST, Mxfp4Dequant.EXACT))
    s = jax.ShapeDtypeStruct((2,), jnp.int32)

    def kernels(w_gate, w_up, m, backend="pallas"):   # traced only: nothing runs
        x = jax.ShapeDtypeStruct((m, 64), BF16)
        with gate.collecting():
            plain = jax.make_jaxpr(lambda x, w, s: grouped_matmul(x, w, s, backend=backend))(
                x, w_gate, s)
            fused = jax.make_jaxpr(lambda x, a, b, s: grouped_situ_glu(
                x, a, b, s, backend=backend, **SITU))(x, w_gate, w_up, s)
        return _kernel_names(plain.jaxpr), _kernel_names(fused.jaxpr)

    # block_t_for: 24 rows a tile at 16 rows; at 1024: 128 plain, None (row-major) fused
    assert kernels(fast, fast, 16) == (["grouped_matmul_mxfp4_swap_ab_t24"],
                                       ["grouped_situ_glu_mxfp4_swap_ab_t24"])
    assert kernels(fast, fast, 1024) == (["grouped_matmul_mxfp4_swap_ab_t128"],
                                         ["grouped_situ_glu_mxfp4_m64"])
    for m in (16, 1024):
        assert kernels(exact, exact, m) == (["grouped_matmul_mxfp4_exact_m64"],
                                            ["grouped_situ_glu_mxfp4_exact_m64"])
        assert kernels(fast, exact, m)[1] == ["grouped_situ_glu_mxfp4_exact_m64"]
    assert kernels(exact, exact, 16, backend="xla") == ([], [])
    with pytest.raises(ValueError, match="bfloat16 or float32 x, got float16"):
        jax.eval_shape(lambda x, w, s: grouped_matmul(x, w, s, backend="interpret"),
                       jax.ShapeDtypeStruct((1024, 64), jnp.float16), fast, s)
    with pytest.raises(ValueError, match="dequant must be an Mxfp4Dequant, got 'fast'"):
        Mxfp4Weights(fast.packed_GNK, fast.scale_GKN, "fast")


def test_plan_fits_smem_at_k3_shapes():
    """K3's routed shapes at EP 8 (112 local experts), decode and prefill rows:
    128-wide N blocks (both products), K steps of 128, at least three
    pipeline stages, SMEM fits."""
    for m in (256, 65536):
        for k, n, num_w in ((3584, 3072, 2), (3072, 3584, 1)):
            plan = mk.plan_launch(m, k, n, 112, num_w, BF16)
            assert plan.k_pad == k and plan.n_pad == n and plan.cfg.block_k == mk.BLOCK_K
            assert plan.cfg.block_n == 128
            assert plan.cfg.max_concurrent_steps >= 3
            assert mk.smem_bytes(plan.cfg, num_w, 1, 2) <= 227 * 1024 - 1024
