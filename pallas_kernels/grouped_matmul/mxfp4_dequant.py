"""The MXFP4 Mosaic kernels' fast dequantization (pallas_kernels.mxfp4_fast's
sequence) into a WGMMA register fragment, on the GPU (inline PTX through
plgpu.inline_mgpu) and in interpret mode (the jnp emulation of the same ops),
and the exact kernel's code extraction from the same word layout.

    a = fast_chunk(codes_smem, scale_smem, interpret)
    bits = code_bits_piece(codes_smem, word, interpret)

Operands (SMEM refs). ``codes_smem`` is uint8 [64, 64]: 64 weight rows of a K
step's codes (weight columns n, the stored [out, in] orientation) by their 64
bytes (128 K elements) in the word layout (pallas_kernels.mxfp4_words: each
4 bytes one interleaved word of 8 codes). ``scale_smem`` is uint8 [4, 64]:
the UE8M0 bytes, scale block x row.

Per thread. In plgpu.Layout.WGMMA, warp w of the consumer warpgroup holds
rows 16w..16w+15, each thread two rows (r, r + 8) and, in register column
g (0..15), the two adjacent columns 8g + 2l, 8g + 2l + 1 (l = lane % 4).
The thread loads bytes 16l .. 16l + 15 of each of its rows (one 16-byte
load, 4 words, K elements 32l .. 32l + 31: scale block l alone), builds that
block's bf16x2 scale once per row, and runs the sequence on each word b:
its output j (K elements 32l + 8b + 2j, +1) is register column 4b + j.

Result. ``a`` is bf16 [64, 128] in plgpu.Layout.WGMMA whose column
c = 32b + 8j + 2l + L holds K element 32l + 8b + 2j + L of the step
(``k_order``, pallas_kernels.mxfp4's, puts x in the same order). It is
both what the row-major kernel stores as its weight tile and the register A
operand of the swap-AB kernel's WGMMA. Exact for scale bytes in mxfp4_fast.FAST_SCALES only:
weights with any other byte (Mxfp4Weights.dequant EXACT) run the exact
kernel instead.

Rows in K order. With ``n_chunk`` (0 or 1) the operands hold a 128-row N
block (codes [128, 64], scales [4, 128]) and fragment row i holds weight row
k_order_index(128)[64 n_chunk + i] (``source_row``): a tile of both chunks
is the block's rows in k_order, so the product's columns come out in it
(Mxfp4Weights.k_order_axis 2). Each thread computes its two source rows
by shifts, masks and ors of its row index; nothing else changes.

Exact kernel. ``code_bits_piece`` loads word ``word`` (bytes 16l + 4 word
.. + 3, one 4-byte load) of each of a thread's two rows and runs
``CODE_BITS_SEQUENCE`` on it: mxfp4_fast.INTEGER_SEQUENCE (the permutation
of the word's bits, no scale), then each output's two lanes moved to the
top half of a 32-bit register. The result is int32 [64, 32] in
plgpu.Layout.WGMMA whose column c = 8j + 2l + L holds K element
32l + 8 word + 2j + L of the step as ``code_bits`` would put its code
(magnitude e1 e0 m at bits 22..24, sign at 31): columns 32 word ..
32 word + 31 of ``fast_chunk``'s tile, the same K order. The exact kernel
decodes them in Pallas ops (mosaic_sm90_mxfp4.dequant_code_bits).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, vector

from pallas_kernels import mxfp4_fast as fast
from pallas_kernels.mxfp4 import K_ORDER_CHUNK, k_order, k_order_index
from pallas_kernels.mxfp4_words import words_of

WARPGROUP_THREADS = 128
ROWS = 64                  # weight rows a chunk holds (one WGMMA row tile)
BYTES = 64                 # code bytes a row of a K step holds (BLOCK_K / 2)
K_STEP = 2 * BYTES         # K elements of a step
if K_STEP != K_ORDER_CHUNK:   # the fragment's column order is mxfp4.k_order's chunk
    raise AssertionError(f"K step {K_STEP} != mxfp4.K_ORDER_CHUNK {K_ORDER_CHUNK}")
_THREAD_BYTES = 16         # code bytes of a row a thread loads (one scale block)
_WORDS = _THREAD_BYTES // 4
_OUTPUTS = len(fast.OUTPUTS["SEQUENCE"])   # bf16x2 registers a word becomes
_REGISTERS = (1, K_STEP // 8, 1, 1, 2, 1, 1, 1, 1)   # WGMMA registers of bf16 [64, 128]

_PIECE_COLS = K_STEP // _WORDS   # columns of one word's piece (8 codes x 4 threads)
_PIECE_REGISTERS = (1, _OUTPUTS, 1, 1, 2, 1, 1, 1, 1)   # WGMMA registers of [64, 32]

_WORD_ASM = fast.ptx(fast.SEQUENCE, fast.INPUTS["SEQUENCE"], fast.OUTPUTS["SEQUENCE"])

# code_bits_piece's registers: INTEGER_SEQUENCE's output cj holds two codes
# in bf16 bit positions (mxfp4_fast.LANE_TARGET: m, e0, e1 at 6..8, sign at
# 15, in each 16-bit lane); lane 0 moved up 16 (x 2**16) and lane 1 masked
# put each at magnitude bits 22..24, sign 31, as float32 bits (code_bits).
CODE_MAGNITUDE_SHIFT = fast.LANE_TARGET[0] + 16
if fast.LANE_TARGET != (6, 7, 8, 15):   # dequant_code_bits reads e1 e0 m at 22..24, sign at 31
    raise AssertionError(f"mxfp4_fast.LANE_TARGET {fast.LANE_TARGET} moved: update code_bits")
CODE_BITS_SEQUENCE = fast.INTEGER_SEQUENCE + tuple(
    op for j in range(_OUTPUTS)
    for op in (fast.Op("mul", f"l{j}", (f"c{j}",), (1 << 16,)),
               fast.Op("and", f"h{j}", (f"c{j}",), (0xFFFF0000,))))
"""q (one interleaved word) -> l0, h0, .., l3, h3: the word's 8 codes, K
elements 2j (lj) and 2j + 1 (hj), as code_bits puts them."""
_CODE_BITS_OUT = tuple(f"{x}{j}" for j in range(_OUTPUTS) for x in "lh")
_CODE_BITS_ASM = fast.ptx(CODE_BITS_SEQUENCE, ("q",), _CODE_BITS_OUT)
_SCALE_ASM = fast.ptx(fast.SCALE_SEQUENCE, fast.INPUTS["SCALE_SEQUENCE"],
                      fast.OUTPUTS["SCALE_SEQUENCE"])


def _i32(x: int):
    return mgpu_utils.c(x, ir.IntegerType.get_signless(32))


def _index(x):
    return arith.index_cast(ir.IndexType.get(), x)


def _asm(asm: str, n_out: int, *args):
    i32 = ir.IntegerType.get_signless(32)
    constraints = ",".join(["=r"] * n_out + ["r"] * len(args))
    if n_out == 1:
        return [llvm.inline_asm(i32, list(args), asm, constraints)]
    out = llvm.inline_asm(llvm.StructType.get_literal([i32] * n_out), list(args), asm,
                          constraints)
    return [llvm.extractvalue(i32, out, [i]) for i in range(n_out)]


# source_row's bit fields: row c = 32b + 8j + 2l + L reads 32l + 8b + 2j + L,
# as (shift of the field in c, its width mask, its shift in the source row)
_ROW_FIELDS = ((5, 3, 3), (3, 3, 1), (1, 3, 5), (0, 1, 0))


def source_row(c: int) -> int:
    """The weight row fragment row ``c`` (0..127 of a 128-row block) holds
    in K order: k_order_index(128)[c] (checked below)."""
    return sum(((c >> at) & mask) << to for at, mask, to in _ROW_FIELDS)


if [source_row(c) for c in range(K_ORDER_CHUNK)] != k_order_index(K_ORDER_CHUNK).tolist():
    raise AssertionError("source_row's bit fields are not mxfp4.k_order's")


def _source_row_mgpu(row):
    """source_row on an i32 value."""
    out = None
    for at, mask, to in _ROW_FIELDS:
        f = arith.andi(arith.shrui(row, _i32(at)) if at else row, _i32(mask))
        f = arith.shli(f, _i32(to)) if to else f
        out = f if out is None else arith.ori(out, f)
    return out


def _fast_chunk_mgpu(n_chunk: int | None):
    out_t = plgpu.ShapeDtypeStruct((ROWS, K_STEP), jnp.bfloat16, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType()), return_type=out_t)
    def chunk(_ctx, codes_ref, scale_ref):
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        tid = mgpu_utils.thread_idx()
        lane = arith.remui(tid, _i32(32))
        warp = arith.remui(arith.divui(tid, _i32(32)), _i32(WARPGROUP_THREADS // 32))
        quad = arith.remui(lane, _i32(4))                        # l: the thread's scale block
        row0 = arith.addi(arith.muli(warp, _i32(16)), arith.divui(lane, _i32(4)))
        col0 = _index(arith.muli(quad, _i32(_THREAD_BYTES)))
        regs = np.empty(_REGISTERS, dtype=object)
        for half in range(2):
            row = arith.addi(row0, _i32(8 * half + ROWS * (n_chunk or 0)))
            row = _index(row if n_chunk is None else _source_row_mgpu(row))
            sv = vector.load(ir.VectorType.get((1,), i8), scale_ref, [_index(quad), row])
            sv = arith.extui(i32, vector.extract(sv, [], [0]))
            s = _asm(_SCALE_ASM, 1, sv)[0]
            data = vector.load(ir.VectorType.get((_THREAD_BYTES,), i8), codes_ref, [row, col0])
            words = mgpu_utils.bitcast(data, ir.VectorType.get((_WORDS,), i32))
            for b in range(_WORDS):
                q = vector.extract(words, [], [b])
                for j, o in enumerate(_asm(_WORD_ASM, _OUTPUTS, q, s)):
                    regs[0, _OUTPUTS * b + j, 0, 0, half, 0, 0, 0, 0] = \
                        mgpu_utils.bitcast(o, bf16x2)
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT,
                                    _is_signed=None)

    return chunk


def _fast_chunk_emulated(codes_smem, scale_smem, n_chunk: int | None):
    codes, scales = codes_smem[...], scale_smem[...]
    if n_chunk is not None:   # reshapes, not a gather (no array constant in a kernel)
        rows = slice(ROWS * n_chunk, ROWS * (n_chunk + 1))
        codes, scales = k_order(codes, 0)[rows], k_order(scales, 1)[:, rows]
    q = words_of(codes)                                                        # [64, 16]
    sv = jnp.repeat(scales.T, _WORDS, axis=1).astype(jnp.uint32)               # word 4l + b
    outs = jnp.stack(fast.dequant_words(q, sv), axis=-1)                       # [64, 16, 4]
    lanes = jnp.stack([outs & 0xFFFF, outs >> 16], axis=-1)                    # [64, 16, 4, 2]
    lanes = lanes.reshape(ROWS, 4, _WORDS, _OUTPUTS, 2).transpose(0, 2, 3, 1, 4)  # (b, j, l, L)
    return lax.bitcast_convert_type(lanes.reshape(ROWS, K_STEP).astype(jnp.uint16),
                                    jnp.bfloat16)


def _code_bits_piece_mgpu(word: int):
    out_t = plgpu.ShapeDtypeStruct((ROWS, _PIECE_COLS), jnp.int32, layout=plgpu.Layout.WGMMA)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(),), return_type=out_t)
    def piece(_ctx, codes_ref):
        i8, i32 = ir.IntegerType.get_signless(8), ir.IntegerType.get_signless(32)
        tid = mgpu_utils.thread_idx()
        lane = arith.remui(tid, _i32(32))
        warp = arith.remui(arith.divui(tid, _i32(32)), _i32(WARPGROUP_THREADS // 32))
        quad = arith.remui(lane, _i32(4))
        row0 = arith.addi(arith.muli(warp, _i32(16)), arith.divui(lane, _i32(4)))
        col = _index(arith.addi(arith.muli(quad, _i32(_THREAD_BYTES)), _i32(4 * word)))
        regs = np.empty(_PIECE_REGISTERS, dtype=object)
        for half in range(2):
            row = _index(arith.addi(row0, _i32(8 * half)))
            data = vector.load(ir.VectorType.get((4,), i8), codes_ref, [row, col])
            q = vector.extract(mgpu_utils.bitcast(data, ir.VectorType.get((1,), i32)), [], [0])
            out = _asm(_CODE_BITS_ASM, len(_CODE_BITS_OUT), q)
            for j in range(_OUTPUTS):
                regs[0, j, 0, 0, half, 0, 0, 0, 0] = vector.from_elements(
                    ir.VectorType.get((2,), i32), out[2 * j: 2 * j + 2])
        return mgpu.FragmentedArray(_registers=regs, _layout=mgpu.WGMMA_LAYOUT, _is_signed=True)

    return piece


def _code_bits_piece_emulated(codes_smem, word: int):
    q = words_of(codes_smem[...])[:, word::_WORDS]                     # [64, 4]: thread quad l
    regs = fast.emulate(CODE_BITS_SEQUENCE, q=q)
    outs = jnp.stack([regs[o] for o in _CODE_BITS_OUT], axis=-1)       # [64, 4 (l), 8 (j, L)]
    outs = outs.reshape(ROWS, _WORDS, _OUTPUTS, 2).transpose(0, 2, 1, 3)   # (j, l, L)
    return lax.bitcast_convert_type(outs.reshape(ROWS, _PIECE_COLS), jnp.int32)


def code_bits_piece(codes_smem, word: int, interpret: bool):
    """uint8 [64, 64] codes (word layout) of 64 weight rows of a K step ->
    int32 [64, 32] (WGMMA layout): each code of word ``word`` (0..3) of every
    thread's 16 bytes as ``code_bits`` puts it, at columns 8j + 2l + L
    (module docstring): columns 32 word .. 32 word + 31 of ``fast_chunk``'s
    tile."""
    if tuple(codes_smem.shape) != (ROWS, BYTES) or word not in range(_WORDS):
        raise ValueError(f"code_bits_piece takes codes [{ROWS}, {BYTES}] and a word in "
                         f"0..{_WORDS - 1}, got {tuple(codes_smem.shape)} and word {word}")
    if interpret:
        return _code_bits_piece_emulated(codes_smem, word)
    return _code_bits_piece_mgpu(word)(codes_smem)


def code_bits(codes):
    """int32 E2M1 codes (0..15) -> the bits code_bits_piece holds them as:
    magnitude (e1 e0 m) at bits 22..24, sign at 31, the rest 0."""
    return ((codes & 7) << CODE_MAGNITUDE_SHIFT) | ((codes << 28) & jnp.int32(-(1 << 31)))


def fast_chunk(codes_smem, scale_smem, interpret: bool, n_chunk: int | None = None):
    """uint8 [64, 64] codes (word layout) of 64 weight rows of a K step and
    their uint8 [4, 64] scales (SMEM refs; scale block x row) -> bf16
    [64, 128] (WGMMA layout, ``k_order``'s columns).
    Exact for scale bytes in mxfp4_fast.FAST_SCALES (the caller checks).
    With ``n_chunk`` (0 or 1): codes [128, 64] and scales [4, 128] of a
    128-row block, fragment row i from weight row
    k_order_index(128)[64 n_chunk + i] (module docstring)."""
    rows = ROWS if n_chunk is None else 2 * ROWS
    if (tuple(codes_smem.shape) != (rows, BYTES) or tuple(scale_smem.shape) != (4, rows)
            or n_chunk not in (None, 0, 1)):
        raise ValueError(f"fast_chunk takes codes [{rows}, {BYTES}], scales [4, {rows}] and "
                         f"n_chunk None, 0 or 1, got {tuple(codes_smem.shape)}, "
                         f"{tuple(scale_smem.shape)} and {n_chunk!r}")
    if interpret:
        return _fast_chunk_emulated(codes_smem, scale_smem, n_chunk)
    return _fast_chunk_mgpu(n_chunk)(codes_smem, scale_smem)


__all__ = ["BYTES", "CODE_BITS_SEQUENCE", "CODE_MAGNITUDE_SHIFT", "K_STEP", "ROWS", "code_bits",
           "code_bits_piece", "fast_chunk", "k_order", "source_row"]
