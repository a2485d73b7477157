"""The fast in-register MXFP4 -> bf16 dequantization: one description of its
bit sequence, from which the Mosaic kernels' inline PTX (``ptx``), the
bit-exact jnp emulation interpret mode runs (``emulate``) and the word
layout the codes are stored in (``WORD_SOURCE_BITS``, used by
pallas_kernels.mxfp4_words) are all made.

Inputs, per 32-bit register (bf16x2 lane 0 = bits 0..15, lane 1 = bits 16..31):
  * ``q``: one interleaved code word: the 8 E2M1 codes of 4 consecutive
    checkpoint bytes (K elements 8w .. 8w + 7 of a row), their 32 bits
    permuted by mxfp4_words.interleave_words so that the integer part below
    is 8 instructions;
  * ``s``: the bf16x2 scale 2**(b - 1) in both lanes, b the UE8M0 byte of
    the 32-element block the word lies in (``SCALE_SEQUENCE`` builds it
    from that byte).
Outputs: ``o0`` .. ``o3``, bf16x2: ``oj`` holds the word's K elements
(2j, 2j + 1) (byte j's low nibble in lane 0, its high nibble in lane 1).

Each code (sign, e1 e0 m) becomes the bf16 bits sign << 15 | e1 e0 m << 6
(TARGET_BITS), which is exactly the E2M1 value times 2**-126 (exponent field
e, top mantissa bit m; code 1, 0.5, lands on the bf16 subnormal 2**-127).
The interleaved word holds output j's 8 bits where one cheap operation moves
them onto TARGET_BITS: o0's in place (a mask), o1's and o2's rotated by 3 and
6 (a funnel shift and a mask), o3's in REST_BITS, which one multiply by
REST_MULTIPLIER (three shifted copies that do not overlap, so no carry) and a
mask put in place. One bf16x2 multiply by 2**(b - 1) then gives value *
2**(b - 127): exact, because for FAST_SCALES the product is a normal bf16
(|v| in [2**-126, 12]) with at most two significant bits. 12 PTX
instructions per 8 weights (8 integer, 4 multiplies).

Scale bytes outside FAST_SCALES (0 and 1: results below 2**-126 that the
codec flushes to zero; 129..254: 2**(b - 1) is not a bf16; 255: NaN) are not
handled here: weights that may hold one (Mxfp4Weights.dequant EXACT, read
off the stored bytes when they are loaded) run the exact kernel instead,
which reuses INTEGER_SEQUENCE's bit permutation and decodes exactly
(mosaic_sm90_mxfp4.dequant_code_bits).

``emulate`` runs the same op list on uint32 jnp arrays. Its ``mul.bf16x2``
is exact integer arithmetic for what the sequence feeds it (a positive power
of two times a bf16, the product a normal bf16 or zero), so interpret mode
is not at the mercy of XLA:CPU's flush-to-zero on the subnormal 2**-127.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
from jax import lax

FAST_SCALES = range(2, 129)
"""UE8M0 bytes the fast sequence is exact for (2**(b - 1) a normal bf16, no
result below 2**-126)."""

LANE_TARGET = (6, 7, 8, 15)    # bf16 bit of a code's m, e0, e1, sign (lane 0)
TARGET_BITS = sum(1 << (b + 16 * lane) for b in LANE_TARGET for lane in range(2))  # 0x81C081C0
REST_BITS = 0x001B001B         # o3's bits in the word: 0, 1, 3, 4 of each lane
REST_MULTIPLIER = (1 << 2) + (1 << 7) + (1 << 12)   # m: +2, e0 e1: +7, sign: +12
SCALE_BIAS = 0x3F003F00   # (126 << 7) per lane: 2**(b - 1) has exponent field b + 126
SCALE_LANES = 0x00800080  # x b: b << 7 in each lane


@dataclasses.dataclass(frozen=True)
class Op:
    """One PTX instruction: ``dst = name(src..., imm)`` on .b32 registers."""

    name: str         # and | rotr | mul | mad | mul.bf16x2
    dst: str
    src: tuple[str, ...]
    imm: tuple[int, ...] = ()


INTEGER_SEQUENCE = (
    Op("and", "c0", ("q",), (TARGET_BITS,)),          # o0's bits lie in place
    Op("rotr", "t1", ("q",), (3,)),
    Op("and", "c1", ("t1",), (TARGET_BITS,)),
    Op("rotr", "t2", ("q",), (6,)),
    Op("and", "c2", ("t2",), (TARGET_BITS,)),
    Op("and", "r3", ("q",), (REST_BITS,)),
    Op("mul", "t3", ("r3",), (REST_MULTIPLIER,)),     # r3 << 2 | r3 << 7 | r3 << 12
    Op("and", "c3", ("t3",), (TARGET_BITS,)),
)
"""q -> c0..c3: each output's codes as bf16 bits (value * 2**-126)."""

SEQUENCE = INTEGER_SEQUENCE + tuple(
    Op("mul.bf16x2", f"o{j}", (f"c{j}", "s")) for j in range(4))
"""(q, s) -> (o0, o1, o2, o3): one interleaved code word to four bf16x2."""

SCALE_SEQUENCE = (
    Op("mad", "s", ("sv",), (SCALE_LANES, SCALE_BIAS)),   # lane = (b + 126) << 7 = 2**(b - 1)
)
"""sv (the scale byte b in bits 0..7, bits 8..31 zero) -> s: one multiply
puts b << 7 in both lanes (b < 256, so the lanes do not overlap) and adds
the bias."""

INPUTS = {"SEQUENCE": ("q", "s"), "SCALE_SEQUENCE": ("sv",)}
OUTPUTS = {"SEQUENCE": ("o0", "o1", "o2", "o3"), "SCALE_SEQUENCE": ("s",)}


# -- PTX ----------------------------------------------------------------------

def _ptx_line(op: Op, reg) -> str:
    dst, src = reg(op.dst), [reg(s) for s in op.src]
    if op.name == "and":
        return f"and.b32 {dst}, {src[0]}, {op.imm[0]:#x};"
    if op.name == "rotr":
        return f"shf.r.wrap.b32 {dst}, {src[0]}, {src[0]}, {op.imm[0]};"
    if op.name == "mul":
        return f"mul.lo.u32 {dst}, {src[0]}, {op.imm[0]};"
    if op.name == "mad":
        return f"mad.lo.u32 {dst}, {src[0]}, {op.imm[0]}, {op.imm[1]:#x};"
    if op.name == "mul.bf16x2":
        return f"mul.rn.bf16x2 {dst}, {src[0]}, {src[1]};"
    raise ValueError(f"no PTX for op {op.name!r}")


def ptx(sequence: tuple[Op, ...], inputs: tuple[str, ...], outputs: tuple[str, ...]) -> str:
    """The inline-asm body: outputs are $0.., inputs follow; the rest are
    scoped .b32 registers (constraints "=r" per output, "r" per input)."""
    operands = {name: f"${i}" for i, name in enumerate((*outputs, *inputs))}
    temps = sorted({op.dst for op in sequence} - set(operands))
    reg = lambda name: operands.get(name, f"%{name}_")   # noqa: E731
    lines = [f".reg .b32 {', '.join(reg(t) for t in temps)};"] if temps else []
    lines += [_ptx_line(op, reg) for op in sequence]
    return "{\n" + "\n".join(lines) + "\n}"


def ptx_lines(sequence: tuple[Op, ...], inputs: tuple[str, ...],
              outputs: tuple[str, ...]) -> list[str]:
    """The instructions of ``ptx`` alone (no braces, no .reg line)."""
    return [line for line in ptx(sequence, inputs, outputs).splitlines()
            if line not in ("{", "}") and not line.startswith(".reg")]


# -- emulation ----------------------------------------------------------------

def _u32(x) -> jnp.ndarray:
    return jnp.asarray(x, jnp.uint32)


def _mul_bf16_pow2(v, s):
    """bf16 lane v (uint32, 16 bits) x s (a positive power of two): exact when
    the product is a normal bf16 or zero (the fast sequence's domain)."""
    sign = v & 0x8000
    ev, mv = (v >> 7) & 0xFF, v & 0x7F
    es = ((s >> 7) & 0xFF).astype(jnp.int32)
    normal = (((ev.astype(jnp.int32) + es - 127) << 7).astype(jnp.uint32)) | mv
    p = 31 - lax.clz(jnp.maximum(mv, 1).astype(jnp.int32))      # leading bit of a subnormal
    sub_exp = (p + es - 133).astype(jnp.uint32)
    sub = (sub_exp << 7) | ((mv << (7 - p).astype(jnp.uint32)) & 0x7F)
    mag = jnp.where(ev != 0, normal, jnp.where(mv != 0, sub, _u32(0)))
    return (sign | mag) & 0xFFFF


def _mul_bf16x2(a, b):
    lo = _mul_bf16_pow2(a & 0xFFFF, b & 0xFFFF)
    hi = _mul_bf16_pow2(a >> 16, b >> 16)
    return lo | (hi << 16)


def emulate(sequence: tuple[Op, ...], xp=jnp, **inputs) -> dict[str, jnp.ndarray]:
    """Run ``sequence`` on uint32 arrays (any shape; jnp, or numpy with
    ``xp=np`` for the integer ops); returns every register."""
    def u32(x):
        return xp.asarray(x, xp.uint32)
    regs = {name: u32(x) for name, x in inputs.items()}
    for op in sequence:
        src = [regs[s] for s in op.src]
        if op.name == "and":
            out = src[0] & u32(op.imm[0])
        elif op.name == "rotr":
            out = (src[0] >> op.imm[0]) | (src[0] << (32 - op.imm[0]))
        elif op.name == "mul":
            out = src[0] * u32(op.imm[0])
        elif op.name == "mad":
            out = src[0] * u32(op.imm[0]) + u32(op.imm[1])
        elif op.name == "mul.bf16x2":
            out = _mul_bf16x2(src[0], src[1])
        else:
            raise ValueError(f"no emulation for op {op.name!r}")
        regs[op.dst] = out
    return regs


def dequant_words(q, sv) -> tuple[jnp.ndarray, ...]:
    """uint32 interleaved code words and their scale bytes (bits 0..7, the
    rest zero) -> (o0, o1, o2, o3) uint32 bf16x2 words, by ``emulate``."""
    s = emulate(SCALE_SEQUENCE, sv=sv)["s"]
    regs = emulate(SEQUENCE, q=q, s=s)
    return tuple(regs[o] for o in OUTPUTS["SEQUENCE"])


def _word_source_bits() -> tuple[int, ...]:
    """For each bit p of an interleaved word, the bit of the checkpoint's
    word (4 bytes, little-endian: code c = byte c // 2's low / high nibble at
    bits 4c .. 4c + 3, sign at 4c + 3) it holds: read off INTEGER_SEQUENCE
    run on the 32 one-hot words, each of which must light exactly one
    output bit, and no two the same."""
    onehot = np.uint32(1) << np.arange(32, dtype=np.uint32)
    regs = emulate(INTEGER_SEQUENCE, xp=np, q=onehot)   # numpy: no backend at import
    source = {}
    for j in range(4):
        c = np.asarray(regs[f"c{j}"])
        for p in range(32):
            for t in range(32):
                if c[p] >> t & 1:
                    lane, role = divmod(t, 16)
                    source.setdefault(p, []).append(4 * (2 * j + lane) + LANE_TARGET.index(role))
    bits = tuple(source[p][0] if len(source.get(p, ())) == 1 else -1 for p in range(32))
    if sorted(bits) != list(range(32)):
        raise AssertionError(f"INTEGER_SEQUENCE is not a permutation of a word's bits: {bits}")
    return bits


WORD_SOURCE_BITS = _word_source_bits()
"""WORD_SOURCE_BITS[p]: the checkpoint word's bit that interleaved bit p holds."""

__all__ = ["FAST_SCALES", "INPUTS", "INTEGER_SEQUENCE", "OUTPUTS", "Op", "SCALE_SEQUENCE",
           "SEQUENCE", "TARGET_BITS", "WORD_SOURCE_BITS", "dequant_words", "emulate", "ptx",
           "ptx_lines"]
