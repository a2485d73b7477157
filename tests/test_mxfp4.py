"""MXFP4 codec (pallas_kernels.mxfp4) against an independent bit-level decoder, and
the static dequant (Mxfp4Dequant) a packed weight carries."""

from __future__ import annotations

import math
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.mxfp4 import (
    E2M1_VALUES,
    Mxfp4Dequant,
    Mxfp4Weights,
    dequant,
    dequant_numpy,
    encode,
    k_order,
    k_order_index,
    validate_scales,
)
from pallas_kernels.mxfp4_fast import FAST_SCALES

F32_MAX = struct.unpack("<f", struct.pack("<I", 0x7F7FFFFF))[0]
F32_MIN_NORMAL = 2.0 ** -126


def bit_decode_element(code: int, scale_byte: int) -> float:
    """One E2M1 element times its UE8M0 scale, from the bits, as the float32
    value the codec promises (flush below 2**-126, inf beyond float32)."""
    sign = -1.0 if (code >> 3) & 1 else 1.0
    exponent = (code >> 1) & 0b11          # bits 1-2, bias 1
    mantissa = code & 0b1                  # bit 0
    if exponent == 0:                      # subnormal: 0 or 0.5
        magnitude = 0.5 * mantissa
    else:
        magnitude = 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa)
    if scale_byte == 255:
        return math.nan
    value = sign * magnitude * 2.0 ** (scale_byte - 127)   # exact in float64
    if abs(value) < F32_MIN_NORMAL:
        return math.copysign(0.0, sign)
    if abs(value) > F32_MAX:
        return math.copysign(math.inf, sign)
    return value


def bit_decode(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """Element-by-element pure-Python decoder: [R, n/2], [R, n/32] -> float32 [R, n]."""
    rows, half = packed.shape
    out = np.empty((rows, 2 * half), np.float32)
    for r in range(rows):
        for j in range(half):
            byte = int(packed[r, j])
            for nib, code in ((0, byte & 0xF), (1, byte >> 4)):
                i = 2 * j + nib
                out[r, i] = bit_decode_element(code, int(scales[r, i // 32]))
    return out


def bits_equal(a, b) -> bool:
    """Bitwise float32 equality (so -0.0 != 0.0), NaN matching NaN."""
    a = np.asarray(a, np.float32)
    b = np.asarray(b, np.float32)
    if a.shape != b.shape:
        return False
    nan = np.isnan(a)
    return bool(np.array_equal(nan, np.isnan(b))
                and np.array_equal(a.view(np.uint32)[~nan], b.view(np.uint32)[~nan]))


@pytest.fixture(scope="module")
def all_codes_all_scales():
    """packed [32, 256] with every byte value (so all 16 codes in both nibbles),
    scales [32, 16] covering every UE8M0 byte 0..255 twice."""
    rng = np.random.default_rng(1234)
    packed = rng.integers(0, 256, (32, 256), dtype=np.uint8)
    packed[0] = np.arange(256, dtype=np.uint8)
    packed[1] = rng.permutation(256).astype(np.uint8)
    scales = rng.permutation(np.tile(np.arange(256, dtype=np.uint8), 2)).reshape(32, 16)
    assert set(np.unique(packed & 0xF)) == set(range(16))
    assert set(np.unique(packed >> 4)) == set(range(16))
    return packed, scales


def test_table_matches_bits():
    assert E2M1_VALUES.dtype == np.float32 and E2M1_VALUES.shape == (16,)
    for code in range(16):
        assert bits_equal(E2M1_VALUES[code], bit_decode_element(code, 127)), code
    assert sorted(set(np.abs(E2M1_VALUES).tolist())) == [0, 0.5, 1, 1.5, 2, 3, 4, 6]


def test_decoders_match_bit_level(all_codes_all_scales):
    packed, scales = all_codes_all_scales
    want = bit_decode(packed, scales)
    assert np.isnan(want).any() and np.isinf(want).any()      # edge bytes are covered
    got_np = dequant_numpy(packed, scales)
    got_jax = dequant(packed, scales)
    got_jit = jax.jit(dequant)(jnp.asarray(packed), jnp.asarray(scales))
    assert got_np.dtype == np.float32 and got_jax.dtype == jnp.float32
    assert bits_equal(got_np, want)
    assert bits_equal(got_jax, want)
    assert bits_equal(got_jit, want)


def test_low_nibble_is_even_element():
    packed = np.zeros((1, 16), np.uint8)
    packed[0, 0] = 0x71                 # low nibble 1 (0.5), high nibble 7 (6.0)
    packed[0, 15] = 0x2F                # low nibble 15 (-6.0), high nibble 2 (1.0)
    scales = np.full((1, 1), 128, np.uint8)                   # scale 2
    out = dequant_numpy(packed, scales)[0]
    assert out[0] == 1.0 and out[1] == 12.0 and out[30] == -12.0 and out[31] == 2.0
    assert np.count_nonzero(out) == 4
    assert bits_equal(dequant(packed, scales)[0], out)


def test_decode_leading_dims_and_bf16():
    rng = np.random.default_rng(7)
    packed = rng.integers(0, 256, (3, 5, 32), dtype=np.uint8)
    scales = rng.integers(100, 160, (3, 5, 2), dtype=np.uint8)
    f32 = dequant_numpy(packed, scales)
    assert f32.shape == (3, 5, 64)
    want = bit_decode(packed.reshape(15, 32), scales.reshape(15, 2)).reshape(3, 5, 64)
    assert bits_equal(f32, want)
    bf16 = jax.jit(lambda p, s: dequant(p, s, dtype=jnp.bfloat16))(packed, scales)
    assert bf16.dtype == jnp.bfloat16 and bf16.shape == (3, 5, 64)
    assert bits_equal(np.asarray(bf16.astype(jnp.float32)), f32)    # lossless in bf16


def test_round_trip_representable():
    rng = np.random.default_rng(99)
    packed = rng.integers(0, 256, (64, 64), dtype=np.uint8)
    scales = rng.integers(0, 253, (64, 4), dtype=np.uint8)   # 253/254 can overflow float32
    # blocks whose largest magnitude is each of the 8 possible values
    for row in range(16):
        hi = row % 8
        packed[row] = (rng.integers(0, hi + 1, 64) | (rng.integers(0, hi + 1, 64) << 4)).astype(np.uint8)
    packed[16] = 0
    decoded = dequant_numpy(packed, scales)
    assert np.all(np.isfinite(decoded))
    p2, s2 = encode(decoded)
    assert p2.shape == packed.shape and s2.shape == scales.shape
    assert p2.dtype == np.uint8 and s2.dtype == np.uint8
    again = dequant_numpy(p2, s2)
    assert np.array_equal(again, decoded)
    assert bits_equal(dequant(p2, s2), again)
    # bf16 / jax inputs encode the same way
    p3, s3 = encode(jnp.asarray(decoded[:, :32], jnp.bfloat16))
    assert np.array_equal(dequant_numpy(p3, s3), decoded[:, :32])


def test_encode_rounding_rules():
    # amax 6 -> shared exponent floor(log2 6) - 2 = 0 -> scale byte 127
    x = np.zeros((1, 32))
    vals = [6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, -2.6, 5.1, 0.1, -0.2, -1.0]
    x[0, :len(vals)] = vals
    packed, scales = encode(x)
    assert scales[0, 0] == 127
    out = dequant_numpy(packed, scales)[0, :len(vals)]
    # ties go to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4
    assert out.tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.5, -3.0, 6.0, 0.0, 0.0, -1.0]
    assert not np.signbit(out[12])          # -0.2 rounds to +0 (canonical zero)
    # saturation: amax 7.5 keeps exponent 0, so 7.5 clamps to 6
    packed, scales = encode(np.full((1, 32), -7.5))
    assert scales[0, 0] == 127 and np.all(dequant_numpy(packed, scales) == -6.0)
    # an all-zero block
    packed, scales = encode(np.zeros((2, 64)))
    assert np.all(packed == 0) and np.all(dequant_numpy(packed, scales) == 0)


def test_encode_is_nearest_on_its_grid():
    """Brute force: each element is the nearest of the block's 15 grid values."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((8, 64)) * np.exp2(rng.integers(-20, 20, (8, 1)))
    packed, scales = encode(x)
    out = dequant_numpy(packed, scales).astype(np.float64)
    for r in range(8):
        for b in range(2):
            block = x[r, 32 * b:32 * (b + 1)]
            expo = math.frexp(np.max(np.abs(block)))[1] - 1 - 2
            assert int(scales[r, b]) == expo + 127
            grid = E2M1_VALUES.astype(np.float64) * 2.0 ** expo
            for i, v in enumerate(block):
                best = np.min(np.abs(grid - v))
                assert abs(out[r, 32 * b + i] - v) == best
    rel = np.linalg.norm(out - x) / np.linalg.norm(x)
    assert 0.02 < rel < 0.2                  # 4-bit quantization error, not zero


def test_scale_255_is_nan_and_validate_scales():
    packed = np.full((1, 16), 0x22, np.uint8)
    scales = np.array([[255]], np.uint8)
    assert np.all(np.isnan(dequant_numpy(packed, scales)))
    assert np.all(np.isnan(np.asarray(dequant(packed, scales))))
    with pytest.raises(ValueError, match="255"):
        validate_scales(np.array([[1, 2], [255, 7]], np.uint8))
    validate_scales(np.arange(255, dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        validate_scales(np.arange(4, dtype=np.int32))


@pytest.mark.parametrize("decode", [dequant, dequant_numpy, jax.jit(dequant)],
                         ids=["jnp", "numpy", "jit"])
def test_decode_shape_errors(decode):
    p = np.zeros((4, 16), np.uint8)
    s = np.zeros((4, 1), np.uint8)
    with pytest.raises(ValueError, match="packed codes must be uint8"):
        decode(p.astype(np.int8), s)
    with pytest.raises(ValueError, match="scales must be uint8"):
        decode(p, s.astype(np.float32))
    with pytest.raises(ValueError, match="n/32"):
        decode(p, np.zeros((4, 2), np.uint8))
    with pytest.raises(ValueError, match="multiple of 32"):
        decode(np.zeros((4, 8), np.uint8), np.zeros((4, 1), np.uint8))
    with pytest.raises(ValueError, match="leading dims"):
        decode(p, np.zeros((3, 1), np.uint8))
    with pytest.raises(ValueError, match="at least one dimension"):
        decode(np.zeros((), np.uint8), np.zeros((), np.uint8))


def test_encode_errors():
    with pytest.raises(ValueError, match="multiple of 32"):
        encode(np.ones((2, 48)))
    with pytest.raises(ValueError, match="NaN or inf"):
        encode(np.full((1, 32), np.inf))
    with pytest.raises(ValueError, match="floating"):
        encode(np.ones((1, 32), np.int32))


# -- the static dequant of a packed weight -------------------------------------------
def test_dequant_is_read_off_the_scale_bytes():
    """FAST exactly when every byte is in FAST_SCALES (2..128); combine is
    EXACT when any part is; bad input is named."""
    assert list(FAST_SCALES) == list(range(2, 129))
    for byte in range(256):
        want = Mxfp4Dequant.FAST if byte in FAST_SCALES else Mxfp4Dequant.EXACT
        s = np.full((2, 3), 100, np.uint8)
        s[1, 2] = byte
        assert Mxfp4Dequant.of_scales(s) is want, byte
        assert Mxfp4Dequant.of_scales(jnp.asarray(s)) is want, byte
    assert Mxfp4Dequant.of_scales(np.zeros((0, 4), np.uint8)) is Mxfp4Dequant.FAST
    F, X = Mxfp4Dequant.FAST, Mxfp4Dequant.EXACT
    assert Mxfp4Dequant.combine([F, F]) is F and Mxfp4Dequant.combine([F, X, F]) is X
    assert Mxfp4Dequant.combine([]) is F
    with pytest.raises(ValueError, match="must be uint8"):
        Mxfp4Dequant.of_scales(np.full(4, 100, np.int32))
    with pytest.raises(ValueError, match="takes Mxfp4Dequant values, got 'fast'"):
        Mxfp4Dequant.combine([F, "fast"])


def test_weights_carry_the_dequant_as_static_aux_data():
    """from_checkpoint reads the dequant off concrete scales; it is pytree aux
    data (not a leaf): a jitted function sees it as a Python value and
    retraces when it changes; a value that is not an Mxfp4Dequant is named."""
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 256, (2, 8, 16), dtype=np.uint8)
    scales = rng.integers(110, 129, (2, 1, 8), dtype=np.uint8)
    w = Mxfp4Weights.from_checkpoint(codes, scales)
    assert w.dequant is Mxfp4Dequant.FAST and isinstance(w.packed_GNK, np.ndarray)
    np.testing.assert_array_equal(np.asarray(w.checkpoint_codes()), codes)
    scales[1, 0, 7] = 0
    assert Mxfp4Weights.from_checkpoint(codes, scales).dequant is Mxfp4Dequant.EXACT
    assert len(jax.tree.leaves(w)) == 2
    traced = []

    @jax.jit
    def f(w):
        traced.append(w.dequant)
        return w.dequantize(jnp.float32)
    for d in (Mxfp4Dequant.FAST, Mxfp4Dequant.EXACT, Mxfp4Dequant.FAST):
        out = f(Mxfp4Weights(jnp.asarray(w.packed_GNK), jnp.asarray(scales), d))
        np.testing.assert_array_equal(np.asarray(out), np.swapaxes(
            dequant_numpy(codes, np.swapaxes(scales, 1, 2)), 1, 2))
    assert traced == [Mxfp4Dequant.FAST, Mxfp4Dequant.EXACT]
    with pytest.raises(ValueError, match="dequant must be an Mxfp4Dequant, got True"):
        Mxfp4Weights(w.packed_GNK, w.scale_GKN, True)


# -- the Mosaic kernels' K order (k_order, Mxfp4Weights.k_order_axis) ----------

def test_k_order_is_the_fragments_column_order_and_inverts():
    """Position 32b + 8j + 2l + L of each 128-chunk takes element
    32l + 8b + 2j + L, on any axis; inverse undoes it; the index is the
    same permutation."""
    idx = k_order_index(256)
    for c in range(256):
        b, j, l, lo = (c % 128) >> 5, (c >> 3) & 3, (c >> 1) & 3, c & 1
        assert idx[c] == 128 * (c // 128) + 32 * l + 8 * b + 2 * j + lo
    x = np.random.default_rng(0).normal(size=(3, 256, 5)).astype(np.float32)
    np.testing.assert_array_equal(k_order(x, 1), x[:, idx])
    np.testing.assert_array_equal(k_order(k_order(x, 1), 1, inverse=True), x)
    np.testing.assert_array_equal(np.asarray(k_order(jnp.asarray(x), 1)), x[:, idx])
    with pytest.raises(ValueError, match="multiple of 128"):
        k_order(np.zeros((3, 96)))


def test_k_ordered_weights_are_the_stored_ones_permuted():
    """k_order_axis 1 / 2: expert and dequantize give the stored weight in
    k_order along K / N, the blocked XLA path computes with it, and a
    weight whose axis is not whole 128-chunks is refused."""
    from pallas_kernels import grouped_matmul
    rng = np.random.default_rng(1)
    g, k, n = 2, 256, 128
    w = Mxfp4Weights.from_checkpoint(rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8),
                                     rng.integers(120, 130, (g, k // 32, n), dtype=np.uint8))
    w = Mxfp4Weights(jnp.asarray(w.packed_GNK), jnp.asarray(w.scale_GKN), w.dequant)
    dense = np.asarray(w.dequantize(jnp.float32))
    x = jnp.asarray(rng.normal(size=(6, k)), jnp.float32)
    sizes = jnp.array([4, 2], jnp.int32)
    want = np.asarray(grouped_matmul(x, w, sizes, backend="xla"))
    for axis in (1, 2):
        wk = Mxfp4Weights(w.packed_GNK, w.scale_GKN, w.dequant, axis)
        wk.validate("w")
        np.testing.assert_array_equal(np.asarray(wk.dequantize(jnp.float32)),
                                      np.take(dense, k_order_index(dense.shape[axis]), axis))
        np.testing.assert_array_equal(np.asarray(wk.expert(1, jnp.float32)),
                                      np.take(dense[1], k_order_index(dense.shape[axis]),
                                              axis - 1))
        xk = k_order(x, 1) if axis == 1 else x
        got = np.asarray(grouped_matmul(xk, wk, sizes, backend="xla"))
        np.testing.assert_allclose(got, want if axis == 1 else want[:, k_order_index(n)],
                                   rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="k_order_axis"):
        Mxfp4Weights(w.packed_GNK, w.scale_GKN, w.dequant, 0)
    narrow = Mxfp4Weights(w.packed_GNK[:, :64], w.scale_GKN[:, :, :64], w.dequant, 2)
    with pytest.raises(ValueError, match="multiple of 128"):
        narrow.validate("w2")


def test_triton_dispatch_reads_k_ordered_weights_as_stored(monkeypatch):
    """Triton's MXFP4 kernels read the codes as stored: the dispatch puts x
    out of k_order for k_order_axis 1 and y into it for 2. A stand-in for
    the kernels (the blocked XLA path on the stored weights) checks the
    permutations without Triton."""
    from pallas_kernels.backend import resolve
    from pallas_kernels.grouped_matmul import blocked, dispatch

    class StandIn:
        @staticmethod
        def grouped_matmul_mxfp4(x, packed, scale, sizes):
            return blocked.grouped_matmul(x, Mxfp4Weights(packed, scale, Mxfp4Dequant.EXACT), sizes)

        @staticmethod
        def grouped_situ_glu_mxfp4(x, pg, sg, pu, su, sizes, *, beta, linear_beta):
            return blocked.grouped_situ_glu(x, Mxfp4Weights(pg, sg, Mxfp4Dequant.EXACT),
                                            Mxfp4Weights(pu, su, Mxfp4Dequant.EXACT), sizes,
                                            beta=beta, linear_beta=linear_beta)
    monkeypatch.setattr(dispatch, "triton_kernels", lambda: StandIn)
    rng = np.random.default_rng(2)
    g, k, n = 2, 128, 256

    def weight(axis):
        w = Mxfp4Weights.from_checkpoint(rng.integers(0, 256, (g, n, k // 2), dtype=np.uint8),
                                         rng.integers(120, 130, (g, k // 32, n), dtype=np.uint8))
        return Mxfp4Weights(jnp.asarray(w.packed_GNK), jnp.asarray(w.scale_GKN), w.dequant, axis)
    x = jnp.asarray(rng.normal(size=(5, k)), jnp.float32)
    sizes = jnp.array([3, 2], jnp.int32)
    wg, wu = weight(2), weight(2)

    def both(backend):   # "xla": the blocked path on the logical weights
        kernels = dispatch.kernels(resolve(backend))
        return (kernels.matmul(x, wg, sizes), kernels.situ_glu(x, wg, wu, sizes, 1.0, None))
    for got, want in zip(both("triton"), both("xla")):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    w2 = weight(1)   # [G, K = 128, N = 256] read in K order: x comes in k_order
    x2 = jnp.asarray(rng.normal(size=(5, n)), jnp.float32)[:, :k]
    got = dispatch.kernels(resolve("triton")).matmul(k_order(x2, 1), w2, sizes)
    stored = Mxfp4Weights(w2.packed_GNK, w2.scale_GKN, w2.dequant)
    np.testing.assert_allclose(np.asarray(got),
                               np.asarray(blocked.grouped_matmul(x2, stored, sizes)),
                               rtol=1e-5, atol=1e-5)
