"""The MXFP4 Mosaic kernel's fast dequantization (pallas_kernels.mxfp4_fast's
sequence) in its WGMMA register layout, on the GPU (inline PTX through
plgpu.inline_mgpu) and in interpret mode (the jnp emulation of the same ops).

    a = fast_chunk(packed_RC, scale_smem, interpret)

Layout. ``packed_RC`` is uint8 [64, 64]: 64 rows of a K step's packed tile
(weight columns n, the stored [out, in] orientation) by its 64 code bytes
(128 K elements), in plgpu.Layout.WGMMA. Warp w of the consumer warpgroup
holds rows 16w..16w+15, each thread two rows (r, r + 8) x 8 registers of two
adjacent bytes (c, c+1) = one ``q``, c = 8g + 2 (lane % 4) in register
column g. Byte c lies in scale block c // 16, so register column g takes
block g // 2: which scale a register needs is static. The thread loads its
two rows' four scale bytes (``scale_smem`` uint8 [4, 64]: block x row) and
builds each bf16x2 scale once. lo / hi: bf16 [64, 64] in the same layout,
the low nibbles (even K of each byte) and the high ones (odd K). Exact for
scale bytes in mxfp4_fast.FAST_SCALES only: the launcher runs the exact
kernel when any byte is outside (mosaic_sm90_mxfp4.needs_exact).

Result. ``a`` is bf16 [64, 128] in plgpu.Layout.WGMMA: lo in columns 0..63
and hi in 64..127 (register columns 0..7 and 8..15, so putting the halves
side by side moves no data). That is the K order of mosaic_sm90_mxfp4.k_order,
and a is both what the row-major kernel stores as its weight tile and the
register A operand of the swap-AB kernel's WGMMA.
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

WARPGROUP_THREADS = 128
ROWS = 64                  # weight rows a chunk holds (one WGMMA row tile)
BYTES = 64                 # code bytes a row of a K step holds (BLOCK_K / 2)
_BLOCK_BYTES = 16          # code bytes per scale block
_NUM_BLOCKS = BYTES // _BLOCK_BYTES
_REGISTERS = (1, BYTES // 8, 1, 1, 2, 1, 1, 1, 1)   # WGMMA registers of [64, 64]: (g, row half)

_PAIR_ASM = fast.ptx(fast.SEQUENCE, fast.INPUTS["SEQUENCE"], fast.OUTPUTS["SEQUENCE"])
_SCALE_ASM = fast.ptx(fast.SCALE_SEQUENCE, fast.INPUTS["SCALE_SEQUENCE"],
                      fast.OUTPUTS["SCALE_SEQUENCE"])


def _i32(x: int):
    return mgpu_utils.c(x, ir.IntegerType.get_signless(32))


def _index(x):
    return arith.index_cast(ir.IndexType.get(), x)


def _word(v) -> ir.Value:
    """vector<N x i8> (N <= 4) -> i32, byte 0 in bits 0..7."""
    n = ir.VectorType(v.type).shape[0]
    as_int = mgpu_utils.bitcast(v, ir.IntegerType.get_signless(8 * n))
    return arith.extui(ir.IntegerType.get_signless(32), as_int) if n < 4 else as_int


def _asm(asm: str, n_out: int, *args):
    i32 = ir.IntegerType.get_signless(32)
    constraints = ",".join(["=r"] * n_out + ["r"] * len(args))
    if n_out == 1:
        return [llvm.inline_asm(i32, list(args), asm, constraints)]
    out = llvm.inline_asm(llvm.StructType.get_literal([i32] * n_out), list(args), asm,
                          constraints)
    return [llvm.extractvalue(i32, out, [i]) for i in range(n_out)]


def _fast_chunk_mgpu():
    wgmma = plgpu.Layout.WGMMA
    out_t = plgpu.ShapeDtypeStruct((ROWS, 2 * BYTES), jnp.bfloat16, layout=wgmma)

    @plgpu.inline_mgpu(arg_types=(wgmma, plgpu.RefType()), return_type=out_t)
    def chunk(_ctx, packed, scale_ref):
        i8 = ir.IntegerType.get_signless(8)
        bf16x2 = ir.VectorType.get((2,), ir.BF16Type.get())
        tid = mgpu_utils.thread_idx()
        warp = arith.remui(arith.divui(tid, _i32(32)), _i32(WARPGROUP_THREADS // 32))
        row0 = arith.addi(arith.muli(warp, _i32(16)),
                          arith.divui(arith.remui(tid, _i32(32)), _i32(4)))   # 16w + lane / 4
        regs = packed.registers
        if regs.shape != _REGISTERS:
            raise ValueError(f"unexpected WGMMA registers {regs.shape} for [{ROWS}, {BYTES}] "
                             f"(expected {_REGISTERS})")
        scales = {}   # (block, row half) -> bf16x2 scale
        for blk in range(_NUM_BLOCKS):
            for half in range(2):
                row = arith.addi(row0, _i32(8 * half))
                sv = vector.load(ir.VectorType.get((1,), i8), scale_ref, [_index(_i32(blk)),
                                                                          _index(row)])
                scales[blk, half] = _asm(_SCALE_ASM, 1, _word(sv))[0]
        lo, hi = np.empty_like(regs), np.empty_like(regs)
        for idx in np.ndindex(regs.shape):   # idx[1]: register column g, idx[4]: row half
            s = scales[idx[1] * 8 // _BLOCK_BYTES, idx[4]]
            lo_w, hi_w = _asm(_PAIR_ASM, 2, _word(regs[idx]), s)
            lo[idx] = mgpu_utils.bitcast(lo_w, bf16x2)
            hi[idx] = mgpu_utils.bitcast(hi_w, bf16x2)
        # register column g holds columns 8g..8g+7: hi's columns follow lo's
        return mgpu.FragmentedArray(_registers=np.concatenate([lo, hi], axis=1),
                                    _layout=packed.layout, _is_signed=None)

    return chunk


def _fast_chunk_emulated(packed_RC, scale_smem):
    p = packed_RC.astype(jnp.uint32)
    sv = jnp.repeat(scale_smem[...].T, _BLOCK_BYTES // 2, axis=1).astype(jnp.uint32)  # [64, 32]
    lo, hi = fast.dequant_words(p[:, 0::2] | (p[:, 1::2] << 8), sv)

    def unpair(w):   # [64, 32] bf16x2 words -> bf16 [64, 64]
        lanes = jnp.stack([w & 0xFFFF, w >> 16], axis=-1).reshape(ROWS, BYTES)
        return lax.bitcast_convert_type(lanes.astype(jnp.uint16), jnp.bfloat16)

    return jnp.concatenate([unpair(lo), unpair(hi)], axis=1)


def fast_chunk(packed_RC, scale_smem, interpret: bool):
    """uint8 [64, 64] codes (WGMMA layout) of 64 weight rows of a K step and
    their uint8 [4, 64] scales (an SMEM ref: block x row) -> bf16 [64, 128]
    (WGMMA layout): column c < 64 is K element 2c of the row, column 64 + c
    element 2c + 1.
    Exact for scale bytes in mxfp4_fast.FAST_SCALES (the caller checks)."""
    if packed_RC.shape != (ROWS, BYTES):
        raise ValueError(f"fast_chunk takes codes [{ROWS}, {BYTES}], got {packed_RC.shape}")
    if interpret:
        return _fast_chunk_emulated(packed_RC, scale_smem)
    return _fast_chunk_mgpu()(packed_RC, scale_smem)


__all__ = ["BYTES", "ROWS", "fast_chunk"]
