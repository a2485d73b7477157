"""pallas_kernels.mxfp4_fast: the fast dequant sequence's jnp emulation is
the codec bit for bit on every (code, scale byte) pair of FAST_SCALES, in
both bf16x2 lanes and both nibbles; its PTX is the op list; its integer
bf16x2 multiply is the float product on the domain it is used on."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import mxfp4
from pallas_kernels import mxfp4_fast as fast


def _codec_bits(byte, scale):
    """bf16 bits of the codec's (low, high) nibble values of code bytes
    ``byte`` under UE8M0 bytes ``scale`` (1-D, equal length)."""
    n = len(byte)
    packed = np.zeros((n, 16), np.uint8)
    packed[:, 0] = byte
    out = np.asarray(mxfp4.dequant(packed, np.asarray(scale, np.uint8)[:, None], jnp.bfloat16))
    bits = out.view(np.uint16)
    return bits[:, 0], bits[:, 1]


def test_emulation_is_the_codec_on_every_fast_pair():
    byte0 = np.repeat(np.arange(256), len(fast.FAST_SCALES))       # every code pair...
    scale0 = np.tile(np.array(fast.FAST_SCALES), 256)               # ... under every fast scale
    byte1 = (byte0 * 7 + 3) % 256                                    # lane 1: another byte
    q = (byte0 | byte1 << 8).astype(np.uint32)
    sv = scale0.astype(np.uint32)                 # one scale byte, bits 8..31 zero
    lo, hi = (np.asarray(w) for w in fast.dequant_words(q, sv))
    for lane, (byte, scale) in enumerate(((byte0, scale0), (byte1, scale0))):
        want_lo, want_hi = _codec_bits(byte, scale)
        np.testing.assert_array_equal((lo >> 16 * lane) & 0xFFFF, want_lo)
        np.testing.assert_array_equal((hi >> 16 * lane) & 0xFFFF, want_hi)
    # the domain holds both ends: 0.5 * 2**-125 (the smallest normal) and 6 * 2
    values = np.concatenate(_codec_bits(byte0, scale0)).astype(np.uint32) << 16
    finite = np.abs(values.view(np.float32))
    assert finite[finite > 0].min() == np.float32(2.0 ** -126) and finite.max() == 12.0


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
    assert len(lines) == len(fast.SEQUENCE) == 9
    assert [line.split()[0] for line in lines] == [
        "prmt.b32", "shr.u32", "and.b32", "lop3.b32", "shl.b32", "shr.u32", "lop3.b32",
        "mul.rn.bf16x2", "mul.rn.bf16x2"]
    assert lines[0] == "prmt.b32 %t_, $2, 0, 0x1404;"
    assert lines[-2] == "mul.rn.bf16x2 $0, %l_, $3;" and lines[-1] == "mul.rn.bf16x2 $1, %h_, $3;"
    assert body.startswith("{\n.reg .b32 ") and body.endswith("\n}")


def test_unknown_op_is_refused():
    with pytest.raises(ValueError, match="no emulation for op 'div'"):
        fast.emulate((fast.Op("div", "x", ("q",)),), q=np.uint32(1))
    with pytest.raises(ValueError, match="no PTX for op 'div'"):
        fast.ptx((fast.Op("div", "x", ("q",)),), ("q",), ("x",))
