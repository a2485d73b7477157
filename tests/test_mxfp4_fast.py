"""pallas_kernels.mxfp4_fast and mxfp4_words: the fast dequant sequence's jnp
emulation, on words in the word layout, is the codec bit for bit on every
(code, scale byte) pair of FAST_SCALES, in every output and lane; the word
layout is a permutation of each word's bits that round-trips; the PTX is the
op list; the integer bf16x2 multiply is the float product on the domain it
is used on."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mxfp4, mxfp4_words
from pallas_kernels import mxfp4_fast as fast


def test_emulation_is_the_codec_on_every_fast_pair():
    """Every code in every one of the 8 positions of a word, under every fast
    scale byte: the 16 x 127 pairs, each position's code cycling against the
    others so that no two positions see the same neighbours."""
    code = np.repeat(np.arange(16), len(fast.FAST_SCALES))            # every code...
    scale = np.tile(np.array(fast.FAST_SCALES), 16).astype(np.uint8)  # ... under every scale
    codes = np.stack([(code * (2 * i + 1) + 5 * i) % 16 for i in range(8)], axis=1)   # [n, 8]
    assert all(sorted(set(zip(codes[:, i], scale))) == sorted(set(zip(code, scale)))
               for i in range(8))
    natural = (codes[:, 0::2] | codes[:, 1::2] << 4).astype(np.uint8)  # [n, 4] checkpoint bytes
    q = mxfp4_words.words_of(mxfp4_words.interleave_words(natural))[:, 0]   # [n]
    outs = [np.asarray(o) for o in fast.dequant_words(q, scale.astype(np.uint32))]
    got = np.stack([(o >> 16 * lane) & 0xFFFF for o in outs for lane in (0, 1)], axis=1)
    padded = np.zeros((len(q), 16), np.uint8)
    padded[:, :4] = natural
    want = np.asarray(mxfp4.dequant(padded, scale[:, None], jnp.bfloat16)).view(np.uint16)
    np.testing.assert_array_equal(got, want[:, :8])
    # the domain holds both ends: 0.5 * 2**-125 (the smallest normal) and 6 * 2
    finite = np.abs((want[:, :8].astype(np.uint32) << 16).view(np.float32))
    assert finite[finite > 0].min() == np.float32(2.0 ** -126) and finite.max() == 12.0


def test_word_layout_is_a_permutation_of_each_words_bits():
    assert sorted(fast.WORD_SOURCE_BITS) == list(range(32))
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (3, 5, 64), dtype=np.uint8)
    words = mxfp4_words.interleave_words(packed)
    assert words.shape == packed.shape and words.dtype == np.uint8
    np.testing.assert_array_equal(mxfp4_words.deinterleave_words(words), packed)
    np.testing.assert_array_equal(np.asarray(mxfp4_words.interleave_words(jnp.asarray(packed))),
                                  words)
    for p, src in enumerate(fast.WORD_SOURCE_BITS):   # one set bit moves where the table says
        natural = np.zeros((1, 4), np.uint8)
        natural[0, src // 8] = 1 << src % 8
        assert mxfp4_words.words_of(mxfp4_words.interleave_words(natural))[0, 0] == 1 << p
    assert not mxfp4_words.interleave_words(np.zeros((2, 8), np.uint8)).any()


def test_word_layout_refuses_what_is_not_words():
    with pytest.raises(ValueError, match=r"interleave_words takes uint8 codes .* got uint8 \(2, 6\)"):
        mxfp4_words.interleave_words(np.zeros((2, 6), np.uint8))
    with pytest.raises(ValueError, match=r"deinterleave_words .* got int32"):
        mxfp4_words.deinterleave_words(np.zeros((2, 8), np.int32))


def test_fast_scales_are_the_bytes_one_multiply_is_exact_for():
    """b in FAST_SCALES <=> 2**(b - 1) is a normal bf16 (exponent field
    b + 126 <= 254) and no product is below the codec's flush threshold
    (0.5 * 2**(b - 127) >= 2**-126); 255 is NaN."""
    for b in range(256):
        fits = b != mxfp4.SCALE_NAN and b + 126 <= 254 and 0.5 * 2.0 ** (b - 127) >= 2.0 ** -126
        assert fits == (b in fast.FAST_SCALES), b


def test_mul_emulation_is_the_float_product():
    """The integer bf16 x 2**e of the emulation against float32 products
    (exact there) for every bf16 E2M1 pattern x 2**-126 and every power of
    two whose product is a normal bf16."""
    v = np.array([(sign << 15) | (code << 6) for sign in (0, 1) for code in range(8)], np.uint32)
    vf = (v << 16).view(np.float32).astype(np.float64)
    for e in range(1, 128):
        s = np.full_like(v, (e + 127) << 7)
        got = np.asarray(fast._mul_bf16_pow2(jnp.asarray(v), jnp.asarray(s)))
        want = (vf * 2.0 ** e).astype(np.float32).view(np.uint32) >> 16
        normal = (np.abs(vf * 2.0 ** e) >= 2.0 ** -126) | (vf == 0)
        np.testing.assert_array_equal(got[normal], want[normal])


def test_ptx_is_the_op_list():
    body = fast.ptx(fast.SEQUENCE, fast.INPUTS["SEQUENCE"], fast.OUTPUTS["SEQUENCE"])
    lines = fast.ptx_lines(fast.SEQUENCE, fast.INPUTS["SEQUENCE"], fast.OUTPUTS["SEQUENCE"])
    assert len(lines) == len(fast.SEQUENCE) == 12   # 8 integer + 4 multiplies per 8 weights
    assert [line.split()[0] for line in lines] == [
        "and.b32", "shf.r.wrap.b32", "and.b32", "shf.r.wrap.b32", "and.b32", "and.b32",
        "mul.lo.u32", "and.b32"] + ["mul.rn.bf16x2"] * 4
    assert lines[0] == "and.b32 %c0_, $4, 0x81c081c0;"
    assert lines[1] == "shf.r.wrap.b32 %t1_, $4, $4, 3;"
    assert lines[-1] == "mul.rn.bf16x2 $3, %c3_, $5;"
    assert body.startswith("{\n.reg .b32 ") and body.endswith("\n}")


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="no emulation for op 'div'"):
        fast.emulate((fast.Op("div", "x", ("q",)),), q=np.uint32(1))
    with pytest.raises(ValueError, match="no PTX for op 'div'"):
        fast.ptx((fast.Op("div", "x", ("q",)),), ("q",), ("x",))
