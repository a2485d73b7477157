"""The fast in-register MXFP4 -> bf16 dequantization: one description of its
bit sequence, from which the Mosaic kernel's inline PTX (``ptx``) and the
bit-exact jnp emulation interpret mode runs (``emulate``) are both made.

Inputs, per 32-bit register (bf16x2 lane 0 = bits 0..15, lane 1 = bits 16..31):
  * ``q``: two adjacent code bytes (j, j+1) of one weight row in bits 0..15
    (byte j: K element 2j in the low nibble, 2j+1 in the high one);
  * ``s``: the bf16x2 scale 2**(b - 1) in both lanes, b the UE8M0 byte of
    the 32-element block both bytes lie in (``SCALE_SEQUENCE`` builds it
    from that byte).
Outputs: ``lo`` = K elements (2j, 2j+2) and ``hi`` = (2j+1, 2j+3), as bf16x2.

Each nibble (sign, e1 e0 m) becomes the bf16 bits sign << 15 | e1 e0 m << 6,
which is exactly the E2M1 value times 2**-126 (exponent field e, top mantissa
bit m; code 1, 0.5, lands on the bf16 subnormal 2**-127). One bf16x2 multiply
by 2**(b - 1) gives value * 2**(b - 127): exact, because for FAST_SCALES the
product is a normal bf16 (|v| in [2**-126, 12]) with at most two
significant bits. 9 PTX instructions per 4 weights (7 integer, 2 multiplies).

Scale bytes outside FAST_SCALES (0 and 1: results below 2**-126 that the
codec flushes to zero; 129..254: 2**(b - 1) is not a bf16; 255: NaN) are not
handled here: a K step whose scale tile holds one takes the exact path
(mosaic_sm90_mxfp4.dequant_nibbles) for the whole tile.

``emulate`` runs the same op list on uint32 jnp arrays. Its ``mul.bf16x2``
is exact integer arithmetic for what the sequence feeds it (a positive power
of two times a bf16, the product a normal bf16 or zero), so interpret mode
is not at the mercy of XLA:CPU's flush-to-zero on the subnormal 2**-127.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax

FAST_SCALES = range(2, 129)
"""UE8M0 bytes the fast sequence is exact for (2**(b - 1) a normal bf16, no
result below 2**-126)."""

CODE_MASK = 0x01C001C0    # e1 e0 m of each lane at bits 6..8
SIGN_MASK = 0x80008000    # each lane's sign
OR_MASKED = 0xEC          # lop3 table of (a & c) | b (a = 0xF0, b = 0xCC, c = 0xAA)
OR_AND = 0xA8             # lop3 table of (a | b) & c
SCALE_BIAS = 0x3F003F00   # (126 << 7) per lane: 2**(b - 1) has exponent field b + 126
SCALE_LANES = 0x00800080  # x b: b << 7 in each lane


@dataclasses.dataclass(frozen=True)
class Op:
    """One PTX instruction: ``dst = name(src..., imm)`` on .b32 registers."""

    name: str         # prmt | shr | shl | and | lop3 | mad | mul.bf16x2
    dst: str
    src: tuple[str, ...]
    imm: tuple[int, ...] = ()


SEQUENCE = (
    Op("prmt", "t", ("q", "zero"), (0x1404,)),        # bytes [0, q0, 0, q1]
    Op("shr", "a", ("t",), (6,)),                     # high nibbles' e1 e0 m -> bits 6..8
    Op("and", "a", ("a",), (CODE_MASK,)),
    Op("lop3", "h", ("t", "a"), (SIGN_MASK, OR_MASKED)),   # + their signs (bits 15 / 31)
    Op("shl", "u", ("t",), (4,)),                     # low nibbles' signs -> bits 15 / 31
    Op("shr", "b", ("t",), (2,)),                     # low nibbles' e1 e0 m -> bits 6..8
    Op("lop3", "l", ("u", "b"), (SIGN_MASK | CODE_MASK, OR_AND)),   # u, b clean there
    Op("mul.bf16x2", "lo", ("l", "s")),
    Op("mul.bf16x2", "hi", ("h", "s")),
)
"""(q, s) -> (lo, hi): the codes of one packed register to two bf16x2. The
zero bytes of t keep u's bits 6..8 / 22..24 and b's bits 15 / 31 clear, so
the low nibbles need no mask of their own; the high nibbles do (t's bit 8
is the low nibble's bit 0)."""

SCALE_SEQUENCE = (
    Op("mad", "s", ("sv",), (SCALE_LANES, SCALE_BIAS)),   # lane = (b + 126) << 7 = 2**(b - 1)
)
"""sv (the scale byte b in bits 0..7, bits 8..31 zero) -> s: one multiply
puts b << 7 in both lanes (b < 256, so the lanes do not overlap) and adds
the bias."""

INPUTS = {"SEQUENCE": ("q", "s"), "SCALE_SEQUENCE": ("sv",)}
OUTPUTS = {"SEQUENCE": ("lo", "hi"), "SCALE_SEQUENCE": ("s",)}


# -- PTX ----------------------------------------------------------------------

def _ptx_line(op: Op, reg) -> str:
    dst, src = reg(op.dst), [reg(s) for s in op.src]
    if op.name == "prmt":
        return f"prmt.b32 {dst}, {src[0]}, {src[1]}, {op.imm[0]:#x};"
    if op.name in ("shr", "shl"):
        kind = "shr.u32" if op.name == "shr" else "shl.b32"
        return f"{kind} {dst}, {src[0]}, {op.imm[0]};"
    if op.name == "and":
        return f"and.b32 {dst}, {src[0]}, {op.imm[0]:#x};"
    if op.name == "lop3":
        return f"lop3.b32 {dst}, {src[0]}, {src[1]}, {op.imm[0]:#x}, {op.imm[1]:#x};"
    if op.name == "mad":
        return f"mad.lo.u32 {dst}, {src[0]}, {op.imm[0]}, {op.imm[1]:#x};"
    if op.name == "mul.bf16x2":
        return f"mul.rn.bf16x2 {dst}, {src[0]}, {src[1]};"
    raise ValueError(f"no PTX for op {op.name!r}")


def ptx(sequence: tuple[Op, ...], inputs: tuple[str, ...], outputs: tuple[str, ...]) -> str:
    """The inline-asm body: outputs are $0.., inputs follow; the rest are
    scoped .b32 registers (constraints "=r" per output, "r" per input)."""
    operands = {name: f"${i}" for i, name in enumerate((*outputs, *inputs))} | {"zero": "0"}
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


def _prmt(a, b, sel: int):
    out = jnp.zeros_like(a)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        idx = nib & 7
        byte = ((a if idx < 4 else b) >> (8 * (idx % 4))) & 0xFF
        if nib & 8:   # sign-replicate mode
            byte = jnp.where((byte & 0x80) != 0, _u32(0xFF), _u32(0))
        out = out | (byte << (8 * i))
    return out


def _lop3(a, b, c, lut: int):
    out = jnp.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            term = ((a if i & 4 else ~a) & (b if i & 2 else ~b)
                    & (c if i & 1 else ~c))
            out = out | term
    return out


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


def emulate(sequence: tuple[Op, ...], **inputs) -> dict[str, jnp.ndarray]:
    """Run ``sequence`` on uint32 arrays (any shape); returns every register."""
    regs = {name: _u32(x) for name, x in inputs.items()}
    regs["zero"] = jnp.zeros_like(next(iter(regs.values())))
    for op in sequence:
        src = [regs[s] for s in op.src]
        if op.name == "prmt":
            out = _prmt(src[0], src[1], op.imm[0])
        elif op.name == "shr":
            out = src[0] >> op.imm[0]
        elif op.name == "shl":
            out = src[0] << op.imm[0]
        elif op.name == "and":
            out = src[0] & _u32(op.imm[0])
        elif op.name == "lop3":
            out = _lop3(src[0], src[1], _u32(op.imm[0]), op.imm[1])
        elif op.name == "mad":
            out = src[0] * _u32(op.imm[0]) + _u32(op.imm[1])
        elif op.name == "mul.bf16x2":
            out = _mul_bf16x2(src[0], src[1])
        else:
            raise ValueError(f"no emulation for op {op.name!r}")
        regs[op.dst] = out
    return regs


def dequant_words(q, sv) -> tuple[jnp.ndarray, jnp.ndarray]:
    """uint32 words of two code bytes (bits 0..15) and of their scale byte
    (bits 0..7, the rest zero) -> (lo, hi) uint32 bf16x2 words, by ``emulate``."""
    s = emulate(SCALE_SEQUENCE, sv=sv)["s"]
    regs = emulate(SEQUENCE, q=q, s=s)
    return regs["lo"], regs["hi"]


__all__ = ["FAST_SCALES", "INPUTS", "OUTPUTS", "Op", "SCALE_SEQUENCE", "SEQUENCE",
           "dequant_words", "emulate", "ptx", "ptx_lines"]
